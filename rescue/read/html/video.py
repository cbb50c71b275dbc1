"""An mp4 per arm from the frames a study stored (imageio with its ffmpeg wheel, imported when asked)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def frames_video(pngs: Sequence[Path], out: Path, fps: float = 1.0) -> Path:
    """Write the PNGs, in order, as an H.264 mp4 that browsers play (yuv420p, sides padded to 16)."""
    import imageio.v2 as imageio
    import numpy as np

    frames = [np.asarray(imageio.imread(p))[..., :3] for p in pngs]
    if not frames:
        raise ValueError("no frames to make a video of")
    h = max(f.shape[0] for f in frames)
    w = max(f.shape[1] for f in frames)
    h16, w16 = -(-h // 16) * 16, -(-w // 16) * 16
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = imageio.get_writer(
        out, fps=fps, codec="libx264", macro_block_size=1, pixelformat="yuv420p", ffmpeg_log_level="error"
    )
    try:
        for f in frames:
            # Pad (not resize) to one size: every frame is shown as it was stored.
            canvas = np.zeros((h16, w16, 3), np.uint8)
            canvas[: f.shape[0], : f.shape[1]] = f
            writer.append_data(canvas)
    finally:
        writer.close()
    return out
