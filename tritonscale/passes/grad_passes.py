"""The gradient passes of one step, per device, through the chosen backend.

``collect_grads`` (grads/groups.py) hands over the gradients sorted into the kernels' groups and the
rest (float64, non-dense, sparse values: ``Grads.other``); these functions run check pass ->
finalize (-> apply pass) on each device, the rest with torch ops in the same step, and return the
device-side results (found_inf, norm, clip coefficient) combined on the device. Off the CPU
nothing here reads a device value on the host (host_reads.py), and nothing knows about optimizers
or stages: that is the controller's (grad_scaler.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import torch

from .. import host_reads
from ..flags import moved_to
from ..grads.groups import Grads
from .backends import Backend, CheckResult, clip_coefficient, gradient_factor, inverse_scale, resolve_backend
from .backends.base import unscaled_on_overflow, with_clip
from .backends.custom_ops import disjoint_at_run_time
from .backends.torch_backend import wide_norms
from .backends.triton_backend import TritonBackend
from .clip_args import ClipRequest
from .rank_validation import Agreement
from .rank_combine import combine_check, combine_rank_flags
from .step_decision import StepDecision, finalize_step

#: The backend each (name, device) resolved to (``resolve_backend``): the choice depends on nothing
#: else (the device's type, and whether Triton runs interpreted, fixed at import), and the backends
#: hold no state, so a step looks it up instead of deciding again.
_BACKENDS: dict[tuple[str, torch.device], Backend] = {}


def _backend(name: str, device: torch.device) -> Backend:
    """``resolve_backend(name, device)``, decided once per (name, device) in eager code; decided
    anew while Dynamo traces (a traced step must not write module state). Example:
    ``_backend("auto", torch.device("cpu"))``."""
    if torch.compiler.is_compiling():
        return resolve_backend(name, device)
    runner = _BACKENDS.get((name, device))
    if runner is None:  # resolve_backend raises for a backend the device cannot run: nothing kept
        runner = _BACKENDS[(name, device)] = resolve_backend(name, device)
    return runner


class PerDevice:
    """Copies of one device tensor (the scale, a flag), made on demand, non-blocking, once for each
    device that asks: a pass over gradients on several devices needs the scale on each of them.
    Example: ``PerDevice(scale).get(torch.device("cuda", 1))``."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self._copies: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        if device not in self._copies:
            self._copies[device] = self.master.to(device=device, non_blocking=True, copy=True)
        return self._copies[device]


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.dtype].append(t)
    return list(groups.values())


def torch_unscale_(tensors: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """torch's own unscale_, op for op: ``g *= inv_scale`` in place, found_inf set on inf/NaN."""
    for same_dtype in _by_dtype(tensors):
        torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, inv_scale)


def _other_found_inf(tensors: list[torch.Tensor], found_inf: torch.Tensor) -> torch.Tensor:
    """found_inf raised to 1 where one of ``tensors`` holds inf/NaN. The max-abs cannot overflow
    and NaN propagates into it; torch-op path only (float64, non-dense, sparse), so one extra read."""
    nonempty = [t for t in tensors if t.numel()]
    if not nonempty:
        return found_inf
    peaks = torch.stack([n.double() for n in torch._foreach_norm(nonempty, math.inf)])
    return torch.maximum(found_inf, (~torch.isfinite(peaks).all()).float())


def unscale_and_check_(
    grads: Grads,
    scale: torch.Tensor,
    backend: str,
    group: Any = None,
    agreement: Agreement | None = None,
    skip_on_overflow: bool = True,
) -> dict[torch.device, torch.Tensor]:
    """g <- g / scale in place, one fused read+check+write pass per group; found_inf per device.
    Gradients with no entry (none at all) record nothing: torch's step() then raises.

    With a process ``group`` (one collective, its row carrying ``agreement``): found_inf is the
    group's, and the gradients of one device are read, combined and only then written (check pass,
    combine, apply pass, as the clip without clipping), so ranks that disagree raise before a
    gradient is written. An overflow leaves them as they came, unless the policy lets overflowed
    steps go ahead (not ``skip_on_overflow``)."""
    if group is not None and len(grads.devices) <= 1:
        request = ClipRequest(math.inf, unscale_on_overflow=not skip_on_overflow)
        device, result = clip_grads(grads, scale, request, backend=backend, group=group, agreement=agreement)
        return {device: result.found_inf}
    found_infs = _unscale_each_device_(grads, scale, backend)
    if group is None:
        return found_infs
    return combine_rank_flags(found_infs, group, agreement, scale.device)  # gradients on several devices


def _unscale_each_device_(grads: Grads, scale: torch.Tensor, backend: str) -> dict[torch.device, torch.Tensor]:
    found_infs = {d: torch.zeros((), dtype=torch.float32, device=d) for d in grads.devices}
    for device, device_groups in grads.by_dtype.items():  # the passes only read the scale: no copy on its device
        _backend(backend, device).unscale_(device_groups, moved_to(scale, device), found_infs[device])
    for device, tensors in grads.other.items():
        torch_unscale_(tensors, found_infs[device], inverse_scale(moved_to(scale, device)))
    return found_infs


def check_grads(
    grads: Grads,
    scale: torch.Tensor,
    backend: str,
    group: Any = None,
    agreement: Agreement | None = None,
    decision: StepDecision | None = None,
) -> tuple[dict[torch.device, torch.Tensor], torch.Tensor | None]:
    """Read-only inf/NaN check of the still-scaled gradients (a fused optimizer divides them
    itself): found_inf per device, and the step's skip flag where the check's finalize decided it
    by ``decision`` (else None: the step decides). No cross-device reduction is needed for
    found_inf. With a process ``group``: the group's found_inf (one collective, its row carrying
    ``agreement``)."""
    found_infs, skip = {}, None
    for device in grads.devices:
        others = grads.other.get(device, [])
        if device in grads.by_dtype:
            runner = _backend(backend, device)
            step, decides = _check_decides(runner, decision, device, others, group)
            result = runner.check(grads.by_dtype[device], moved_to(scale, device), 2.0, None, *step)
            found, skip = result.found_inf, (result.skip if decides else skip)
        else:
            found = torch.zeros((), dtype=torch.float32, device=device)
        found_infs[device] = _other_found_inf(others, found)
    if group is not None:
        return combine_rank_flags(found_infs, group, agreement, scale.device), None
    return found_infs, skip if len(found_infs) == 1 else None


def _check_decides(
    runner: Any, decision: StepDecision | None, device: torch.device, others: list, group: Any
) -> tuple[tuple, bool]:
    """(the check's extra arguments, whether its finalize decides the step's skip): where the clip's
    finalize would (``_finalize_decides``: Triton, no process group, no torch-op gradients, eager),
    the skip rule with no norm (``skip_decision``'s, without a clip)."""
    if (
        decision is None
        or not isinstance(runner, TritonBackend)
        or others
        or group is not None
        or torch.compiler.is_compiling()
    ):
        return (), False
    step, decides = finalize_step(
        decision, device, fold=False, unfit_overflows=False, unscale_on_overflow=False, with_norm=False
    )
    return (step,), decides


def clip_grads(
    grads: Grads,
    scale: torch.Tensor | None,
    request: ClipRequest,
    *,
    backend: str,
    group: Any = None,
    agreement: Agreement | None = None,
) -> tuple[torch.device, CheckResult]:
    """Check pass -> finalize -> combine across ``group`` -> apply pass (or, with ``request.fold``,
    the fold's divisor) on the one device holding this rank's gradients; ``request``: the clip's
    arguments (``clip_args.ClipRequest``).

    ``scale``: what the gradients still have to be divided by (None: nothing to unscale, clip
    only). On inf/NaN the gradients are left as they came (the step is skipped); with
    ``request.unscale_on_overflow`` they are unscaled, not clipped (``base.unscaled_on_overflow``).
    With ``request.fold`` the result's ``grad_scale`` is what a fused optimizer divides by
    (``_fold_divisor``). ``group``: the process group whose ranks hold the other parts of the
    gradients (rank_combine: one collective, its row carrying ``agreement``, what the ranks must
    agree on: rank_validation.py); None: no rank code runs. Returns the device and its results.
    Example: ``clip_grads(grads, scale, ClipRequest(1.0), backend="auto")``.
    """
    device = _clip_device(grads, scale, group)
    scale = torch.ones((), dtype=torch.float32, device=device) if scale is None else moved_to(scale, device)
    runner = _backend(backend, device)
    if _finalize_decides(runner, grads, device, request, group):
        return device, _clip_in_finalize(runner, grads, device, scale, request)
    norm_type, max_norm = request.norm_type, request.max_norm
    result = _check_on(runner, grads, device, scale, norm_type, max_norm)
    replicas = grads.replicas
    if replicas is not None:  # checked for inf/NaN and clipped here, counted in the norm elsewhere
        replica_result = _check_on(runner, replicas, device, scale, norm_type, max_norm)
        result.found_inf = torch.maximum(result.found_inf, replica_result.found_inf)
    if grads.unchecked is not None:  # a traced step proves the memory disjoint at run time, first
        result.found_inf, result.factor = disjoint_at_run_time(grads, [result.found_inf, result.factor])
    if group is not None:  # no group: no rank code runs
        result = combine_check(result, scale, norm_type, max_norm, group, agreement, holds_grads(grads))
    if request.limit_of is not None:  # an adaptive clip (ZClip): its max_norm from the group's norm
        result = with_clip(result, scale, request.limit_of(result.norm))
    if request.unscale_on_overflow:
        result = unscaled_on_overflow(result, scale)
    if request.fold:  # the fused optimizer divides by it: no apply pass
        result.grad_scale = _fold_divisor(result, scale)
        return device, result
    _apply_on(runner, grads, device, result)
    if replicas is not None:
        _apply_on(runner, replicas, device, dataclasses.replace(result, plan=replica_result.plan))
    return device, result


def _finalize_decides(runner: Any, grads: Grads, device: torch.device, request: ClipRequest, group: Any) -> bool:
    """Whether the clip runs as the kernels alone, its finalize deciding the fold's divisor, ZClip's
    max_norm and the step's skip (``_clip_in_finalize``): eager, on the Triton backend, one device
    with no process group, replicas or torch-op gradients, a number for ``max_norm``. Elsewhere
    the torch ops below combine, clip and fold."""
    return (
        isinstance(runner, TritonBackend)
        and bool(grads.by_dtype.get(device))
        and group is None
        and grads.replicas is None
        and grads.unchecked is None
        and not grads.other.get(device)
        and not isinstance(request.max_norm, torch.Tensor)
        and (request.limit_of is None or request.decision is not None)
        and not torch.compiler.is_compiling()
    )


def _clip_in_finalize(
    runner: TritonBackend, grads: Grads, device: torch.device, scale: torch.Tensor, request: ClipRequest
) -> CheckResult:
    """Check pass -> finalize (-> apply pass): the finalize gives the clip, the fold's divisor and
    the step's skip (``passes/step_decision.py``); an unfit divisor counts as an overflow, as
    ``_fold_divisor`` has it."""
    step, decides = finalize_step(
        request.decision,
        device,
        fold=request.fold,
        unfit_overflows=request.fold,
        unscale_on_overflow=request.unscale_on_overflow,
    )
    result = runner.check(grads.by_dtype[device], scale, request.norm_type, request.max_norm, step)
    if not decides:
        result.skip = None
    if not request.fold:
        result.grad_scale = None
        runner.apply_(result)
    return result


def _clip_device(grads: Grads, scale: torch.Tensor | None, group: Any) -> torch.device:
    """The one device a clip runs on; several devices, or replicas marked with no group to
    combine them, are refused before anything is read."""
    replicas = grads.replicas
    devices = grads.devices if replicas is None else list(dict.fromkeys([*grads.devices, *replicas.devices]))
    if len(devices) > 1:
        raise NotImplementedError(
            f"clip_grad_norm_() over gradients on several devices ({', '.join(map(str, devices))})"
        )
    if grads.marked_replicas and group is None:  # on every rank, not only where replicas are left out
        raise ValueError(
            "some gradients are marked replicated over a process group (mark_replicated), but no "
            "process_group combines the norm: pass the group spanning every rank's gradients"
        )
    return devices[0] if devices else (scale.device if scale is not None else torch.device("cpu"))


def _fold_divisor(result: CheckResult, scale: torch.Tensor) -> torch.Tensor:
    """What a fused optimizer divides the gradients by when the clip folds into its step:
    ``scale / clip_coef``. Where it is unfit (``unfit_divisor``: it overflowed float32, which
    happens only near the top of its range, the scaled gradients' norm above float32's max times
    max_norm), an optimizer dividing by it would apply zeros where the clip keeps tiny gradients.
    Nothing is read and no pass is added: the step counts as an overflow instead (``found_inf``
    raised: skipped, the scale backed off), never a silent step of zeros. Example:
    ``_fold_divisor(result, scale)``."""
    clip_coef = moved_to(result.clip_coef, scale.device)
    divisor = scale / clip_coef
    unfit = unfit_divisor(divisor, clip_coef).to(result.found_inf.dtype).reshape(())
    result.found_inf = torch.maximum(result.found_inf, unfit.to(result.found_inf.device, non_blocking=True))
    return divisor


def unfit_divisor(divisor: torch.Tensor, clip_coef: torch.Tensor) -> torch.Tensor:
    """The fold's rule: whether ``divisor`` (``scale / clip_coef``) cannot stand for the unscale
    and the clip, i.e. it is not finite and ``clip_coef`` is not 0. A clip coefficient of 0
    (``max_norm=0``: torch's clip multiplies the gradients by 0) gives scale / 0 = inf, which
    stands for it exactly: a finite gradient divided by +inf is the signed zero that ``g * 0``
    is, so that divisor is handed over and the step goes ahead, as torch's does. The one home of
    the rule in tensor ops (0-dim tensors); the clip's finalize computes the same in the kernels
    (kernels/finalize.py, held to it by tests/kernels/test_skip_rule.py). Example:
    ``unfit_divisor(torch.tensor(math.inf), torch.tensor(0.0))`` is False."""
    return ~torch.isfinite(divisor) & (clip_coef != 0)


def holds_grads(grads: Grads) -> bool:
    """Whether any gradient this rank counts in the norm holds an element (an empty ZeRO partition:
    none)."""
    groups = [g for device_groups in grads.by_dtype.values() for g in device_groups] + list(grads.other.values())
    return any(t.numel() for group in groups for t in group)


def _check_on(
    runner: Any, grads: Grads, device: torch.device, scale: torch.Tensor, norm_type: float, max_norm: Any
) -> CheckResult:
    """Check pass + finalize over the kernels' gradients, the torch-op ones folded in."""
    kernel_groups = grads.by_dtype.get(device, [])
    if kernel_groups:
        # A tensor max_norm, or any while Dynamo traces, is clipped by with_clip (base.py).
        on_device = max_norm is not None and (isinstance(max_norm, torch.Tensor) or torch.compiler.is_compiling())
        result = runner.check(kernel_groups, scale, norm_type, None if on_device else max_norm)
        result = with_clip(result, scale, max_norm) if on_device else result
    else:  # nothing for the kernels (none at all, or a norm type only torch computes)
        zero = torch.zeros((), dtype=torch.float32, device=device)
        result = CheckResult(zero, zero, torch.ones_like(zero), inverse_scale(scale).reshape(()), plan=[])
    others = grads.other.get(device, [])
    return _with_others(result, others, grads.for_norm(others), scale, norm_type, max_norm) if others else result


def _apply_on(runner: Any, grads: Grads, device: torch.device, result: CheckResult) -> None:
    runner.apply_(result)
    for same_dtype in _by_dtype(grads.other.get(device, [])):
        torch._foreach_mul_(same_dtype, result.factor)


def _with_others(
    kernel: CheckResult,
    others: list[torch.Tensor],
    for_norm: list[torch.Tensor],
    scale: torch.Tensor,
    norm_type: float,
    max_norm: float,
) -> CheckResult:
    """The kernels' result with the torch-op gradients folded in: one norm, one found_inf, one
    factor for both. The total is torch's: the ``norm_type`` norm of the per-tensor norms, taken
    over ``for_norm`` (``others`` as the norm reads them: ``Grads.for_norm``)."""
    inv_scale32 = inverse_scale(scale)  # once: the per-tensor norms and the factor share it
    inv_scale = inv_scale32.double()
    norms = [kernel.norm.double().reshape(1)] if kernel.plan else []  # no kernel gradients: nothing
    for same_dtype in _by_dtype([t for t in for_norm if t.numel()]):
        norms.append(_torch_op_norms(same_dtype, norm_type) * inv_scale)
    total = torch.linalg.vector_norm(torch.cat(norms), norm_type) if norms else torch.zeros((), dtype=torch.float64)
    found_inf = _other_found_inf(others, kernel.found_inf)
    norm = total.float().reshape(())
    clip_coef = clip_coefficient(norm, max_norm)
    factor = gradient_factor(found_inf, inv_scale32, clip_coef)
    return CheckResult(found_inf=found_inf, norm=norm, clip_coef=clip_coef, factor=factor, plan=kernel.plan)


def _torch_op_norms(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """float64 [T] norms of same-dtype torch-op gradients, still scaled. On the CPU the others in
    float32 as torch takes them, and in float64 where their float32 terms overflowed or underflowed
    (``wide_norms``: at a loss scale of 2**-80 every square of an ordinary gradient underflows
    float32, and the norm would read 0); float64 gradients, and any off the CPU (where the
    reduction is bandwidth-bound and a read-back would stall), in float64 in one pass."""
    if tensors[0].dtype is torch.float64 or not host_reads.are_free(tensors[0].device):
        return torch.stack(torch._foreach_norm(tensors, norm_type, dtype=torch.float64))
    return wide_norms(tensors, norm_type, torch.stack(torch._foreach_norm(tensors, norm_type, dtype=torch.float32)))
