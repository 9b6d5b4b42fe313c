"""The one warning the integrations give on CPU: they keep float16 where the framework would not.

On a CPU, Lightning runs ``"16-mixed"`` as bfloat16 and Accelerate (and the HF Trainer) run
``mixed_precision="fp16"`` as float32, both without a loss scale. The integrations keep float16
autocast and the scaler there, as on a GPU, so that a CPU run exercises what a GPU run does. That
changes the run's precision and speed: float16 matmuls on a CPU without AVX512-FP16 or AMX can be
many times slower than float32. So the first such set-up in a process says so, once.
"""

from __future__ import annotations

import warnings


class CPUFloat16Warning(UserWarning):
    """An integration kept float16 autocast with a loss scale on CPU, where the framework would not."""


_warned: set[str] = set()


def warn_float16_on_cpu(
    framework: str, setting: str, framework_default: str, instead: str, *, calls_to_user: int = 1
) -> None:
    """Warn once per process and framework that ``setting`` runs as float16 with a loss scale on
    CPU, where ``framework`` alone runs ``framework_default``; ``instead``: the setting for a CPU
    run. ``calls_to_user``: how many calls up from the caller the user's line is (the warning
    points there). Example: ``warn_float16_on_cpu("Lightning", '"16-mixed"', "bfloat16", '"bf16-mixed"')``.

    Args:
        framework: the framework's name ("Lightning"); the warning is given once per name.
        setting: the user's precision setting, as the message shows it ('"16-mixed"').
        framework_default: what the framework alone runs that setting as on CPU ("bfloat16").
        instead: the setting the message recommends for a CPU run ('"bf16-mixed"').
        calls_to_user: how many calls up from the caller the user's line is (1).
    """
    if framework in _warned:
        return
    _warned.add(framework)
    warnings.warn(
        f"{framework} runs {setting} on CPU as {framework_default} without a loss scale; tritonscale keeps "
        "float16 autocast and its GradScaler there, as on a GPU. float16 matmuls can be many times slower "
        f"than float32 on a CPU without AVX512-FP16 or AMX: for a CPU run use {instead} (filter "
        "tritonscale.integrations.cpu_precision.CPUFloat16Warning to keep float16 quietly)",
        CPUFloat16Warning,
        stacklevel=2 + calls_to_user,
    )


__all__ = ["CPUFloat16Warning", "warn_float16_on_cpu"]
