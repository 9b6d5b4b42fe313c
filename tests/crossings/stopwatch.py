"""The stopwatch column: the Triton kernels' autotuners timing every launch configuration, as on a
GPU, with a stopwatch of our choosing.

Under the interpreter the autotuners are pruned to their first configuration (nothing can be
timed there). Here they see all of them, and ``Autotuner._bench`` (the timing) is replaced by a
stopwatch that finds configuration number ``favourite`` fastest: what a GPU under another load,
another rank or a resumed run may measure. Each run starts from empty autotune caches, as a new
process does. Whatever the stopwatch says, the numbers must come out the same bits.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from triton.runtime.autotuner import Autotuner


def autotuners() -> list[Autotuner]:
    """Every autotuned kernel of tritonscale.kernels (imported so far)."""
    found = []
    for name, module in list(sys.modules.items()):
        if name.startswith("tritonscale.kernels.") and module is not None:
            found += [v for v in vars(module).values() if isinstance(v, Autotuner) and v not in found]
    return found


@contextlib.contextmanager
def stopwatch(favourite: int, monkeypatch) -> Iterator[None]:
    """Autotune every configuration, timing configuration number ``favourite`` fastest."""
    from tritonscale.kernels import launch_config

    def timed(self, *args, config, **kwargs):
        return 0.0 if self.configs.index(config) == favourite else 1.0 + self.configs.index(config)

    tuners = autotuners()
    caches = [dict(tuner.cache) for tuner in tuners]
    with monkeypatch.context() as patch:
        patch.setattr(launch_config, "autotune_enabled", lambda: True, raising=False)
        patch.setattr(Autotuner, "_bench", timed)
        for tuner in tuners:
            tuner.cache.clear()
        try:
            yield
        finally:
            for tuner, cache in zip(tuners, caches):
                tuner.cache.clear()
                tuner.cache.update(cache)
