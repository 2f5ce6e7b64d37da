"""One look for every generated figure of the site: size, fonts, saving.

Where it sits: under docs/hooks/figures_pages.py and figures_results.py, which draw the
pictures; matplotlib with the Agg backend (docs/hooks/figures.py selects it before anything
draws). A figure is as wide as the page's column at 1280 px and saved at 110 dpi."""

from __future__ import annotations

from pathlib import Path

WIDTH = 9.0  # inches: 990 px at 110 dpi, the content column at 1280 px
DPI = 110
COLORS = ("#3f51b5", "#ef6c00", "#2e7d32", "#8e24aa", "#c62828", "#00838f", "#6d4c41", "#546e7a")


def new(height: float, ncols: int = 1, **kwargs):
    """(figure, axes): one row of `ncols` axes, the page's width."""
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "axes.spines.top": False, "axes.spines.right": False})
    return plt.subplots(1, ncols, figsize=(WIDTH, height), **kwargs)


def save(fig, out: Path) -> None:
    """Lay out, write the PNG, free the figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
