"""``ScaleHistory``: a run's loss scale, gradient norm and skips, recorded each step without a sync
(through a ``StepLog``) and plotted at the end."""

from __future__ import annotations

from pathlib import Path

from ..scaler.diagnostics import STAT_NAMES
from .step_log import StepLog


class ScaleHistory:
    """Records ``GradScaler.stats()`` every step (through a ``StepLog``: no sync, no wait) and plots them.

    ``record`` keeps the rows the log hands out as Python numbers; ``to_lists`` and ``plot`` take
    the rows still in flight too (they may wait for the last copies, at the end of the run).

    Example::

        history = tritonscale.ScaleHistory()
        for batch in loader:
            ...
            scaler.update()
            history.record(scaler)
        history.plot("out/scale_history.png")

    Args:
        delay: the ``StepLog``'s delay: how many later records a row waits for before ``record`` keeps
            it (1).

    Raises:
        TypeError: a ``delay`` that is not an int.
        ValueError: a ``delay`` below 0.
    """

    def __init__(self, delay: int = 1) -> None:
        self._log = StepLog(delay=delay)
        self._rows: list[dict] = []

    def record(self, scaler) -> None:
        """Record ``scaler.stats()`` of this step (no sync) and keep the rows the log hands out.

        Args:
            scaler: the ``GradScaler`` whose ``stats()`` are recorded, after its ``update()``.

        Raises:
            TypeError: a scaler without ``stats()``.
            RuntimeError: a disabled scaler, or a call during a CUDA graph capture.
        """
        self._log.record(scaler)
        self._rows += [values for _, values in self._log.ready()]

    def __len__(self) -> int:
        return len(self._rows) + len(self._log)

    def to_lists(self) -> dict[str, list[float]]:
        """All recorded statistics as Python lists, one entry per recorded step (waits for the last copies).

        Returns:
            a dict from each ``stats()`` name to its list of values, one per recorded step.
        """
        self._rows += [values for _, values in self._log.flush()]
        return {name: [row[name] for row in self._rows] for name in STAT_NAMES}

    def plot(self, path: str | Path, title: str = "loss scale, gradient norm and skipped steps") -> Path:
        """Save ``figure(title)`` to ``path`` (PNG).

        Needs matplotlib (``pip install ".[plot]"`` from a clone, or ``pip install matplotlib``).

        Args:
            path: the PNG file to write; its parent folders are made.
            title: the figure's title.

        Returns:
            ``path``, as a ``Path``.

        Raises:
            ModuleNotFoundError: matplotlib is not installed.
        """
        fig = self.figure(title)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        _pyplot().close(fig)
        return path

    def figure(self, title: str = "loss scale, gradient norm and skipped steps"):
        """The matplotlib Figure of scale and gradient norm (log axes) with the skipped steps marked.

        The norm line breaks at every skipped step (a NaN there: a skipped step applied no norm, and a
        line drawn through it would show one); a finite norm of a skipped step (a norm-spike skip) is
        an ``x`` of its own. The caller closes the figure (``matplotlib.pyplot.close(fig)``).

            fig = history.figure()

        Args:
            title: the figure's title.

        Returns:
            the matplotlib ``Figure``, two axes: the loss scale and the gradient norm.

        Raises:
            ModuleNotFoundError: matplotlib is not installed.
        """
        plt = _pyplot()
        data = self.to_lists()
        steps = list(range(len(data["scale"])))
        skipped = [s for s, flag in zip(steps, data["skipped"]) if flag > 0]
        fig, (ax_scale, ax_norm) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
        ax_scale.step(steps, data["scale"], where="post", label="loss scale")
        ax_scale.set_yscale("log", base=2)
        ax_scale.set_ylabel("loss scale")
        applied = [n if _on_log_axis(n) and not flag else float("nan")
                   for n, flag in zip(data["norm"], data["skipped"])]  # fmt: skip
        # Markers too: an applied step between two skips has no line of its own.
        ax_norm.plot(steps, applied, marker=".", ms=4, label="grad norm (unscaled)")
        spikes = [(s, n) for s, n in zip(steps, data["norm"]) if s in skipped and _on_log_axis(n)]
        if spikes:
            ax_norm.plot(*zip(*spikes), "x", color="tab:red", label="norm of a skipped step")
            ax_norm.legend(loc="best")
        if any(_on_log_axis(n) for n in data["norm"]):
            ax_norm.set_yscale("log")
        ax_norm.set_ylabel("gradient norm")
        ax_norm.set_xlabel("step")
        for ax in (ax_scale, ax_norm):
            for s in skipped:
                ax.axvline(s, color="tab:red", alpha=0.3, linewidth=1)
            ax.grid(True, which="both", alpha=0.3)
        ax_scale.plot([], [], color="tab:red", alpha=0.5, label=f"skipped step ({len(skipped)})")
        ax_scale.legend(loc="best")
        fig.suptitle(title)
        fig.tight_layout()
        return fig


def _on_log_axis(norm: float) -> bool:
    """A norm a log axis can show: finite and above 0 (not NaN, not inf)."""
    return 0 < norm < float("inf")


def _pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or an error naming the install that brings it."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("ScaleHistory.plot needs matplotlib: pip install 'tritonscale[plot]'") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
