"""Training curves as a PNG, for the examples' ``--plot PATH`` (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# One panel: (title, x label, y label, {line label: (xs, ys)}); a label starting with "test"
# is drawn with markers, as it is measured at a few points only.
Panel = tuple[str, str, str, dict[str, tuple[Sequence[float], Sequence[float]]]]


def save_curves(path: str | Path, title: str, panels: list[Panel]) -> Path:
    """Draw ``panels`` side by side under ``title`` into the PNG ``path``; returns its absolute
    path (parent folders are made)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display, in workers and CI
    import matplotlib.pyplot as plt

    out = Path(path).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.4, 4.2 * len(panels)), 3.2), squeeze=False)
    for ax, (name, xlabel, ylabel, lines) in zip(axes[0], panels, strict=True):
        for label, (xs, ys) in lines.items():
            style = {"marker": "o", "markersize": 3} if label.startswith("test") else {}
            ax.plot(list(xs), list(ys), label=label, linewidth=1.5, **style)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
