"""The parts of `rescue report` (read-side only): the page and its figures (page, plots, significance), what
produced the study (provenance), the case list loaded on demand (app, cases), the end-effector paths (paths),
videos (video), and several studies of one manifest side by side (side_by_side)."""
