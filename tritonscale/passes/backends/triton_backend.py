"""Triton backend: the fused kernels, a constant number of launches per step."""

from __future__ import annotations

import torch

from ...kernels import apply_factor_, check_pass, describe_grads, finalize, norm_code
from ...kernels.check_pass import PARTIAL_ROWS
from ...kernels.jit_helpers import INTERPRETING
from .base import CheckResult


def _layouts(groups: list[list[torch.Tensor]]) -> list:
    # The controller validated every gradient (grad_groups.collect_grads) before any launch.
    layouts = (describe_grads(grads, validate=False) for grads in groups)
    return [layout for layout in layouts if layout is not None]


class TritonBackend:
    name = "triton"

    @staticmethod
    def supports(device: torch.device) -> bool:
        if device.type == "cpu":
            return INTERPRETING
        return device.type == "cuda" and not INTERPRETING

    def unscale_(self, groups: list[list[torch.Tensor]], scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        layouts = _layouts(groups)
        for layout in layouts:  # one fused read+check+write launch per dtype group
            apply_factor_(layout, scale, invert=True, found_inf=found_inf)

    def check(
        self, groups: list[list[torch.Tensor]], scale: torch.Tensor, norm_type: float, max_norm: float | None
    ) -> CheckResult:
        code = norm_code(norm_type)
        layouts = _layouts(groups)
        # Every group of the device writes its own columns of one partials buffer, so a single
        # finalize sees them all. An empty device still gets one all-zero column.
        columns = max(1, sum(layout.programs for layout in layouts))
        partials = torch.zeros(PARTIAL_ROWS, columns, dtype=torch.float32, device=scale.device)
        start = 0
        for layout in layouts:
            check_pass(layout, partials[:, start:], code)
            start += layout.programs
        result = finalize(partials, columns, scale, code, max_norm)
        return CheckResult(found_inf=result[0], norm=result[1], clip_coef=result[2], factor=result[3], plan=layouts)

    def apply_(self, result: CheckResult) -> None:
        for layout in result.plan:
            apply_factor_(layout, result.factor)
