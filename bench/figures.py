"""Matplotlib set-up shared by the benchmark plots: headless backend, one way to save."""

from __future__ import annotations

import textwrap
from pathlib import Path

TITLE_MIN_FONTSIZE = 7  # a title's words shrink no further: wrapped lines take the rest


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
    fit_title(fig, title)
    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    pyplot().close(fig)
    return path


def fit_title(fig, title: str):
    """``fig.suptitle(title)`` within the figure's width: each line wrapped at the characters that fit
    (a GPU's name and versions ran off a figure of three variants), then the font shrunk while a
    word is still too wide (down to ``TITLE_MIN_FONTSIZE``). Returns the title's Text."""
    text = fig.suptitle(title)
    renderer = fig.canvas.get_renderer()
    room = 0.98 * fig.bbox.width
    width = text.get_window_extent(renderer).width
    if width > room:
        longest = max(len(line) for line in title.splitlines())
        chars = max(1, int(longest * room / width))
        text.set_text("\n".join(textwrap.fill(line, chars) for line in title.splitlines()))
    while text.get_window_extent(renderer).width > room and text.get_fontsize() > TITLE_MIN_FONTSIZE:
        text.set_fontsize(text.get_fontsize() - 1)
    return text
