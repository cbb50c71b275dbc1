"""The images of a VLM call, as bytes: the fixed views, PNG encoding, the contact sheet (pure)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

# The three views sent to the VLM at the query point, in this fixed order (every request and
# every contact-sheet row).
VLM_VIEWS = ("agentview", "frontview", "robot0_eye_in_hand")


def encode_png(pixels: np.ndarray) -> bytes:
    """PNG bytes of an RGB array (what is sent and what receipts hash)."""
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def contact_sheet(rows: list[list[np.ndarray]]) -> np.ndarray:
    """One image: a row per case, its views side by side in fixed order, cells padded black."""
    cell_h = max(v.shape[0] for row in rows for v in row)
    cell_w = max(v.shape[1] for row in rows for v in row)
    cols = max(len(row) for row in rows)
    sheet = np.zeros((cell_h * len(rows), cell_w * cols, 3), dtype=np.uint8)
    for r, row in enumerate(rows):
        for c, view in enumerate(row):
            h, w = view.shape[:2]
            sheet[r * cell_h : r * cell_h + h, c * cell_w : c * cell_w + w] = view
    return sheet


def view_digests(views: dict[str, np.ndarray]) -> dict[str, str]:
    """Camera -> digest of each rendered view (shape, dtype and pixels): what render proofs compare."""
    from rescue.core.digest import digest_array

    return {camera: digest_array(np.asarray(pixels)) for camera, pixels in sorted(views.items())}
