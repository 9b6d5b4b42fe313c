"""The library's own steps on the GPU paths, on CPU tensors: what the launch-path tier launches.

Each scenario builds a small model, optimizer and ``tritonscale.GradScaler(backend="triton")`` and
runs a few iterations through the public calls. ``gpu_paths_on_cpu()`` makes the library take the
paths a GPU takes with compiled Triton: the host-read switch off (tests/crossings/gpu_paths.py's
column, with its guard refusing any undocumented host read inside the step), and the two places
that ask whether Triton can run on this device answering yes (``TritonBackend.supports``, the policy
kernel's ``kernel_form``), as they answer on a GPU. The kernels do not run (the driver is a fake or
a stub): the tensors the kernels would write keep whatever they held, which no step reads on the
host but the documented reads (a plain optimizer's skip flag).

Together the scenarios launch every per-step kernel: the check pass (FLAT, TABLE), finalize (plain,
folded into a fused optimizer, with the skip rules), the apply pass (TABLE; FLAT through its
autotuner, every candidate benchmarked), the policy update (the default policy and
``hysteresis=2, skip_norm_factor=5.0``) and the loop's gathers (``stats()``, ``SkipAwareLR.step``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch

import tritonscale


@contextlib.contextmanager
def gpu_paths_on_cpu() -> Iterator[None]:
    """The GPU paths with compiled Triton on CPU tensors, for the length of the block."""
    from crossings.gpu_paths import gpu_paths

    from tritonscale.passes.backends import triton_backend
    from tritonscale.policy import kernel_form

    saved = triton_backend.TritonBackend.supports, kernel_form._kernel_runs
    triton_backend.TritonBackend.supports = staticmethod(lambda device: True)
    kernel_form._kernel_runs = lambda device_type, backend: backend != "torch"
    kernel_form._RUNS.clear()
    try:
        with gpu_paths():
            yield
    finally:
        triton_backend.TritonBackend.supports, kernel_form._kernel_runs = saved
        kernel_form._RUNS.clear()


def _model(dtypes: tuple[torch.dtype, ...], width: int = 48) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width).to(dtype) for dtype in dtypes]
    return torch.nn.ModuleList(layers)


def _loss(model: torch.nn.Module) -> torch.Tensor:
    return sum((p.float() * p.float()).sum() for p in model.parameters())


def fused_flat_default() -> None:
    """Fused AdamW (the fold), one flat fp16 buffer, the default policy; SkipAwareLR and stats()."""
    model = _model((torch.float16,))
    tritonscale.flatten_grads_(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), fused=True)
    scaler = tritonscale.GradScaler("cpu", backend="triton")
    schedule = tritonscale.SkipAwareLR(torch.optim.lr_scheduler.StepLR(optimizer, step_size=2), scaler, total_steps=2)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        scaler.scale(_loss(model)).backward()
        scaler.clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)
        scaler.update()
        schedule.step()
        scaler.stats()


def plain_table_rules() -> None:
    """SGD, bf16 and fp32 gradients through the pointer table, ``hysteresis=2, skip_norm_factor=5.0``:
    an ``unscale_`` step, then a ``clip_grad_norm_`` step."""
    model = _model((torch.bfloat16, torch.float32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = tritonscale.GradScaler("cpu", backend="triton", hysteresis=2, skip_norm_factor=5.0)
    for clip in (False, True):
        optimizer.zero_grad()
        scaler.scale(_loss(model)).backward()
        if clip:
            scaler.clip_grad_norm_(optimizer, 1.0, norm_type=float("inf"))
        else:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()


def plain_flat_autotuned() -> None:
    """SGD, one flat fp32 buffer: the FLAT apply pass through its autotuner, both of its keys
    (``unscale_``'s CHECK, ``clip_grad_norm_``'s plain multiply); an ``update(new_scale)`` (the
    policy kernel's COUNT_ONLY form)."""
    model = _model((torch.float32,), width=40)
    tritonscale.flatten_grads_(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = tritonscale.GradScaler("cpu", backend="triton")
    previous = os.environ.pop("TRITONSCALE_AUTOTUNE", None)
    try:
        # The last clip takes its config from the autotuner's cache: no benchmark.
        for step, clip in enumerate((False, True, True)):
            optimizer.zero_grad(set_to_none=False)
            scaler.scale(_loss(model)).backward()
            if clip:
                scaler.clip_grad_norm_(optimizer, 1.0, norm_type=1.0)
            else:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update(2.0**14 if step == 2 else None)
    finally:
        if previous is not None:
            os.environ["TRITONSCALE_AUTOTUNE"] = previous


SCENARIOS: dict[str, Callable[[], None]] = {
    "fused_flat_default": fused_flat_default,
    "plain_table_rules": plain_table_rules,
    "plain_flat_autotuned": plain_flat_autotuned,
}
