"""Triton backend: the fused kernels, a constant number of launches per step.

A step being traced by Dynamo goes through the same kernels registered as custom ops
(``custom_ops.py``, registered when the package ``backends`` is imported, so before any trace):
the plan is then the gradient groups themselves, laid out at run time. The layout and the check
below are shared by both: an eager step never enters ``custom_ops.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...grads.flat_runs import one_run
from ...kernels import TRITON_FOUND, norm_code, triton_missing
from .base import CheckResult

if TRITON_FOUND:
    from ...kernels import apply_factor_, check_pass, describe_grads, finalize
    from ...kernels.interfaces import PARTIAL_ROWS, FinalizeStep
    from ...kernels.jit_helpers import INTERPRETING
else:  # no triton installed: supports() says so, and resolve_backend names the install

    def apply_factor_(*args, **kwargs):
        raise triton_missing()

    INTERPRETING = False


def layouts(groups: list[list[torch.Tensor]]) -> list:
    """Each group's launch layout: FLAT over its one run (a flatten_grads_ buffer, a bucket) where
    it has one, else the pointer table; empty groups have none."""
    # The controller validated every gradient (grads.groups.collect_grads) before any launch.
    described = (describe_grads(grads, validate=False, run=one_run(grads)) for grads in groups)
    return [layout for layout in described if layout is not None]


def check_layouts(
    described: list, scale: torch.Tensor, norm_type: float, max_norm: float | None, step: FinalizeStep | None = None
) -> tuple[torch.Tensor, ...]:
    """The check pass over every layout of the device, then the finalize: found_inf, norm,
    clip_coef and factor as 0-dim float32 tensors (and grad_scale, skip with ``step``:
    ``kernels/finalize.py``). Every group writes its own columns of one partials buffer, so the
    single finalize sees them all; every column is written, so the buffer needs no fill, except
    on an empty device, which gets one all-zero column."""
    code = norm_code(norm_type)
    columns = sum(layout.programs for layout in described)
    make = torch.empty if columns else torch.zeros
    partials = make(PARTIAL_ROWS, max(1, columns), dtype=torch.float32, device=scale.device)
    start = 0
    for layout in described:
        # The first group writes from column 0: the buffer itself, no view made (a dispatch each step).
        check_pass(layout, partials[:, start:] if start else partials, code)
        start += layout.programs
    return tuple(finalize(partials, max(1, columns), scale, code, max_norm, step).unbind())


@dataclass
class TracedPlan:
    """A traced check's plan: the groups, flat, for ``torch.ops.tritonscale.apply_factor_``."""

    grads: list[torch.Tensor]
    sizes: list[int]


class TritonBackend:
    name = "triton"

    @staticmethod
    def supports(device: torch.device) -> bool:
        if not TRITON_FOUND:
            return False
        if device.type == "cpu":
            return INTERPRETING
        return device.type == "cuda" and not INTERPRETING

    def unscale_(self, groups: list[list[torch.Tensor]], scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        for layout in layouts(groups):  # one fused read+check+write launch per dtype group
            apply_factor_(layout, scale, invert=True, found_inf=found_inf)

    def check(
        self,
        groups: list[list[torch.Tensor]],
        scale: torch.Tensor,
        norm_type: float,
        max_norm: float | None,
        step: FinalizeStep | None = None,
    ) -> CheckResult:
        """The check pass and finalize; with ``step`` (eager only: the traced op takes none) the
        finalize also gives the fold's divisor (``grad_scale``) and the step's ``skip`` flag."""
        if torch.compiler.is_compiling():
            plan = TracedPlan([g for grads in groups for g in grads], [len(grads) for grads in groups])
            found_inf, norm, clip_coef, factor = torch.ops.tritonscale.check(
                plan.grads, plan.sizes, scale, float(norm_type), max_norm
            )
            return CheckResult(found_inf=found_inf, norm=norm, clip_coef=clip_coef, factor=factor, plan=plan)
        described = layouts(groups)
        found_inf, norm, clip_coef, factor, *decided = check_layouts(described, scale, norm_type, max_norm, step)
        result = CheckResult(found_inf=found_inf, norm=norm, clip_coef=clip_coef, factor=factor, plan=described)
        if decided:
            result.grad_scale, result.skip = decided
        return result

    def apply_(self, result: CheckResult) -> None:
        if isinstance(result.plan, TracedPlan):
            torch.ops.tritonscale.apply_factor_(result.plan.grads, result.plan.sizes, result.factor)
            return
        for layout in result.plan:
            apply_factor_(layout, result.factor)
