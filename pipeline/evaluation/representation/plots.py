"""PNG figures of the representation analysis (matplotlib, Agg backend: no display needed).

Each function takes plain numbers (from pipeline.evaluation.representation.report's metrics) and a path, writes one
PNG and returns the path. Shape legend: L tokens of the heatmap sentence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

_DPI = 100
# CJK fonts are used when installed (matplotlib falls back glyph by glyph along this list); a token
# that no installed font can draw is labelled by its code points instead of empty boxes.
_FONTS = ["DejaVu Sans", "Noto Sans CJK SC", "Noto Sans SC", "WenQuanYi Zen Hei", "SimHei", "Microsoft YaHei"]
_fonts: tuple[list[str], set[int]] | None = None


def _installed_fonts() -> tuple[list[str], set[int]]:
    """(the families of _FONTS that are installed, every code point they can draw); cached."""
    global _fonts
    if _fonts is None:
        from matplotlib import font_manager
        from matplotlib.ft2font import FT2Font

        families, chars = [], set()
        for family in _FONTS:
            try:
                path = font_manager.findfont(font_manager.FontProperties(family=family), fallback_to_default=False)
            except ValueError:
                continue
            families.append(family)
            chars |= set(FT2Font(path).get_charmap())
        _fonts = (families or ["sans-serif"], chars)
    return _fonts


def tick_label(token: str) -> str:
    """The token itself, or its code points (U+4E2D) when no installed font can draw it."""
    chars = _installed_fonts()[1]
    return token if all(ord(c) in chars for c in token) else " ".join(f"U+{ord(c):04X}" for c in token)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_layerwise(curves: Mapping[str, Sequence[Mapping[str, float]]], *, path: Path) -> Path:
    """Layer-wise curves, one line per model, three panels: intra-sentence self-similarity (TaCL),
    intra-context (solid) and inter-context (dashed) similarity (TACO), and their gap.

    curves: model label -> per-layer dicts with keys layer, intra_sentence, intra_context,
    inter_context, gap (layer 0 is the embedding output).
    """
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (label, layers) in enumerate(curves.items()):
        c = colors[k % len(colors)]
        x = [row["layer"] for row in layers]
        axes[0].plot(x, [row["intra_sentence"] for row in layers], marker="o", ms=3, color=c, label=label)
        axes[1].plot(x, [row["intra_context"] for row in layers], marker="o", ms=3, color=c, label=f"{label} intra")
        axes[1].plot(x, [row["inter_context"] for row in layers], ls="--", color=c, label=f"{label} inter")
        axes[2].plot(x, [row["gap"] for row in layers], marker="o", ms=3, color=c, label=label)
    titles = ("intra-sentence self-similarity", "intra- (solid) / inter-context (dashed)", "intra - inter context gap")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("layer (0 = embeddings)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean cosine")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=7, ncol=1)
    return _save(fig, path)


def plot_heatmaps(
    panels: Sequence[tuple[str, Sequence[str], np.ndarray]], *, path: Path, layer_name: str = "last layer"
) -> Path:
    """Token-by-token cosine heatmap of one sentence, one panel per model.

    panels: (model label, tokens_L, sim_LL) per model; the colour scale is shared so panels compare.
    """
    n = len(panels)
    if n == 0:
        raise ValueError("plot_heatmaps needs at least one model")
    size = max(3.5, 0.22 * max(len(t) for _, t, _ in panels))
    fig, axes = plt.subplots(1, n, figsize=(size * n + 1.0, size), squeeze=False)
    lo = min(float(np.min(sim)) for _, _, sim in panels)
    image = None
    for ax, (label, tokens, sim_LL) in zip(axes[0], panels):
        off_LL = sim_LL[~np.eye(len(tokens), dtype=bool)] if len(tokens) > 1 else sim_LL.ravel()
        image = ax.imshow(sim_LL, vmin=min(lo, 0.0), vmax=1.0, cmap="viridis")
        labels = [tick_label(t) for t in tokens]
        families = _installed_fonts()[0]
        ax.set_xticks(range(len(tokens)), labels, rotation=90, fontsize=7, family=families)
        ax.set_yticks(range(len(tokens)), labels, fontsize=7, family=families)
        ax.set_title(f"{label}\nmean off-diagonal {float(np.mean(off_LL)):.3f}", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label=f"cosine ({layer_name})")
    return _save(fig, path)


def plot_training_gap(points: Sequence[Mapping[str, float]], *, path: Path, title: str) -> Path:
    """Intra-context, inter-context similarity and their gap over training steps (last layer).

    points: dicts with keys step, intra_context, inter_context, gap, intra_sentence, in step order.
    """
    if not points:
        raise ValueError("plot_training_gap needs at least one checkpoint")
    steps = [p["step"] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    axes[0].plot(steps, [p["intra_context"] for p in points], marker="o", ms=3, label="intra-context")
    axes[0].plot(steps, [p["inter_context"] for p in points], marker="o", ms=3, ls="--", label="inter-context")
    axes[0].plot(steps, [p["intra_sentence"] for p in points], marker=".", ms=3, ls=":", label="intra-sentence")
    axes[0].set_ylabel("mean cosine (last layer)")
    axes[0].legend(fontsize=8)
    axes[1].plot(steps, [p["gap"] for p in points], marker="o", ms=3, color="C3")
    axes[1].set_ylabel("intra - inter context gap")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
