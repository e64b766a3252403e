"""What the plot tests check of a PNG: a real image with something drawn on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def assert_png(path: Path, *, min_bytes: int = 5000) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert len(data) > min_bytes, f"{path} is only {len(data)} bytes"
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 200
    assert float(np.std(img[..., :3])) > 0.05  # not a blank canvas
