"""Triton backend: the fused kernels, a constant number of launches per step.

A step being traced by Dynamo goes through the same kernels registered as custom ops
(``custom_ops.py``): the plan is then the gradient groups themselves, laid out at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels import apply_factor_
from ...kernels.jit_helpers import INTERPRETING
from . import custom_ops
from .base import CheckResult


@dataclass
class TracedPlan:
    """A traced check's plan: the groups, flat, for ``torch.ops.tritonscale.apply_factor_``."""

    grads: list[torch.Tensor]
    sizes: list[int]


class TritonBackend:
    name = "triton"

    @staticmethod
    def supports(device: torch.device) -> bool:
        if device.type == "cpu":
            return INTERPRETING
        return device.type == "cuda" and not INTERPRETING

    def unscale_(self, groups: list[list[torch.Tensor]], scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        for layout in custom_ops.layouts(groups):  # one fused read+check+write launch per dtype group
            apply_factor_(layout, scale, invert=True, found_inf=found_inf)

    def check(
        self, groups: list[list[torch.Tensor]], scale: torch.Tensor, norm_type: float, max_norm: float | None
    ) -> CheckResult:
        if torch.compiler.is_compiling():
            plan = TracedPlan([g for grads in groups for g in grads], [len(grads) for grads in groups])
            found_inf, norm, clip_coef, factor = torch.ops.tritonscale.check(
                plan.grads, plan.sizes, scale, float(norm_type), max_norm
            )
            return CheckResult(found_inf=found_inf, norm=norm, clip_coef=clip_coef, factor=factor, plan=plan)
        layouts = custom_ops.layouts(groups)
        found_inf, norm, clip_coef, factor = custom_ops.check_layouts(layouts, scale, norm_type, max_norm)
        return CheckResult(found_inf=found_inf, norm=norm, clip_coef=clip_coef, factor=factor, plan=layouts)

    def apply_(self, result: CheckResult) -> None:
        if isinstance(result.plan, TracedPlan):
            torch.ops.tritonscale.apply_factor_(result.plan.grads, result.plan.sizes, result.factor)
            return
        for layout in result.plan:
            apply_factor_(layout, result.factor)
