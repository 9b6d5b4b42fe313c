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
    """

    def __init__(self, delay: int = 1) -> None:
        self._log = StepLog(delay=delay)
        self._rows: list[dict] = []

    def record(self, scaler) -> None:
        self._log.record(scaler)
        self._rows += [values for _, values in self._log.ready()]

    def __len__(self) -> int:
        return len(self._rows) + len(self._log)

    def to_lists(self) -> dict[str, list[float]]:
        """All recorded statistics as Python lists, one entry per recorded step (waits for the last copies)."""
        self._rows += [values for _, values in self._log.flush()]
        return {name: [row[name] for row in self._rows] for name in STAT_NAMES}

    def plot(self, path: str | Path, title: str = "loss scale, gradient norm and skipped steps") -> Path:
        """Save a figure of scale, gradient norm (log axes) and skipped steps to ``path`` (PNG).

        Needs matplotlib (``pip install ".[plot]"`` from a clone, or ``pip install matplotlib``).
        """
        try:
            import matplotlib
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError("ScaleHistory.plot needs matplotlib: pip install 'tritonscale[plot]'") from e

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        data = self.to_lists()
        steps = list(range(len(data["scale"])))
        skipped = [s for s, flag in zip(steps, data["skipped"]) if flag > 0]
        fig, (ax_scale, ax_norm) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
        ax_scale.step(steps, data["scale"], where="post", label="loss scale")
        ax_scale.set_yscale("log", base=2)
        ax_scale.set_ylabel("loss scale")
        norms = [(s, n) for s, n in zip(steps, data["norm"]) if n == n and 0 < n < float("inf")]
        if norms:
            ax_norm.plot(*zip(*norms), label="grad norm (unscaled)")
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
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
