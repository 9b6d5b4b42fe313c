"""Matplotlib set-up shared by the benchmark plots: headless backend, one way to save."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed); imported on first use,
    so the scripts run their measurements without matplotlib installed until they plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, title: str, rect: tuple[float, float, float, float] | None = None) -> Path:
    """Title, tighten (into ``rect`` of the figure, leaving room for a legend outside the panels) and
    write ``fig`` to ``path`` (PNG), creating its folder; returns the path."""
    fig.suptitle(title)
    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    pyplot().close(fig)
    return path
