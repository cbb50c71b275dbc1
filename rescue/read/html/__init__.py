"""The parts of `rescue report`: the plain reading of the statistics, plots, videos and the page (read-side only)."""
