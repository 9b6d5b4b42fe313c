"""The public API's clip arguments: ``max_norm`` and ``norm_type`` as the user passes them, and
``ClipRequest``, the clip as the passes take it (``grad_passes.clip_grads``).

``GradScaler.clip_grad_norm_``, ``LossScaleOptimizer``, the ``Updater`` and the integrations take
the same two arguments torch.nn.utils.clip_grad_norm_ takes; each is checked here, so a rule and
its error message are written once. Which norm types the kernels compute is the kernels' own
table (``kernels/supported.py``); ``kernels_compute`` routes the others to torch ops.

Both checks trace under ``torch.compile``, where a Python float argument can be a symbolic float
(``dynamic=True``, or one that changed between calls): they compare, and call nothing on the value
that Dynamo cannot trace (``math.isnan``). A comparison becomes a guard, so a compiled clip checks
a new ``max_norm`` without recompiling, and recompiles (then raises) only for a bad one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import host_reads
from ..kernels.supported import NORM_CODES
from ..policy.knob_validation import plain_number


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float: any number torch.nn.utils.clip_grad_norm_ takes (not NaN). The
    kernels compute 1, 2 and inf (``norm_code``); the others go through torch ops. Example:
    ``check_norm_type(2) == 2.0``."""
    norm_type = plain_number(norm_type)  # numpy scalars, as torch takes them
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or norm_type != norm_type:  # NaN
        raise ValueError(f"norm_type must be a number (1, 2 and inf run in the kernels){_got(norm_type)}")
    return float(norm_type)


def check_clip_args(
    max_norm: float | torch.Tensor, norm_type: float, error_if_nonfinite: bool = False, foreach: bool | None = None
) -> tuple[float | torch.Tensor, float]:
    """All of torch.nn.utils.clip_grad_norm_'s arguments but the parameters, checked: ``(max_norm,
    norm_type)`` as the clip takes them. Example: ``check_clip_args(1, 2) == (1.0, 2.0)``."""
    check_torch_clip_options(error_if_nonfinite, foreach)
    return check_max_norm(max_norm), check_norm_type(norm_type)


def check_torch_clip_options(error_if_nonfinite: bool, foreach: bool | None) -> None:
    """torch.nn.utils.clip_grad_norm_'s two other arguments, as a torch user passes them.

    ``foreach`` picks torch's implementation, never its result: any of None, True, False is taken
    (the clip here is one fused multi-tensor pass whatever it says). ``error_if_nonfinite=True``
    asks for an error on an inf/NaN norm, which under loss scaling is an overflow the scaler
    handles: ``step()`` skips and ``update()`` backs the scale off. Raising there would need a
    host read every step, so it is refused, naming what does the job. Example:
    ``check_torch_clip_options(False, True)`` returns; ``check_torch_clip_options(True, None)`` raises."""
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be None, True or False (as torch's clip_grad_norm_ takes it), got {foreach!r}")
    if error_if_nonfinite is False:  # torch's default; anything but a bool is refused below
        return
    if error_if_nonfinite is not True:
        raise TypeError(f"error_if_nonfinite must be True or False, got {error_if_nonfinite!r}")
    raise ValueError(
        "error_if_nonfinite=True is not taken by the scaler's clip_grad_norm_: an inf/NaN gradient norm "
        "under loss scaling is an overflow, which the scaler handles without a host read (step() skips the "
        "update, update() backs the scale off). To see it, read scaler.found_inf_for(optimizer) or "
        "scaler.last_skip_flag() (device tensors); to stop after repeated overflows, pass "
        "GradScaler(..., max_consecutive_skips=N), which raises once more than N steps in a row were skipped."
    )


def kernels_compute(norm_type: float) -> bool:
    """True for the norm types the kernels compute (1, 2, inf)."""
    return norm_type in NORM_CODES


def check_max_norm(max_norm: float | torch.Tensor) -> float | torch.Tensor:
    """``max_norm`` as a float: any number torch.nn.utils.clip_grad_norm_ clips sensibly by, from 0
    (every gradient zeroed) to inf (the norm alone, nothing clipped); negative and NaN refused. A
    one-element real tensor, which torch's clip takes too (it reads it with ``float()``, a host
    read), stays a tensor, detached: the clip reads it on the device, and a compiled clip at run
    time (no recompilation when it changes). Example: ``check_max_norm(1) == 1.0``."""
    if isinstance(max_norm, torch.Tensor):
        return _check_max_norm_tensor(max_norm)
    max_norm = plain_number(max_norm)  # numpy scalars, as torch takes them
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise ValueError(f"max_norm must be a float >= 0 (inf: only measure), got {max_norm!r}")
    try:
        value = float(max_norm)
    except OverflowError:  # an int beyond the float range, such as 10**400 (torch: a raw OverflowError)
        raise ValueError(f"max_norm must be a float >= 0, got an int of {max_norm.bit_length()} bits") from None
    if not value >= 0:  # negative would flip every gradient's sign; NaN would poison it
        raise ValueError(f"max_norm must be a float >= 0 (inf: only measure){_got(max_norm)}")
    return value


class ClipRequest(NamedTuple):
    """One clip as the passes take it (``grad_passes.clip_grads``): the checked ``max_norm`` and
    ``norm_type`` (``check_max_norm``, ``check_norm_type``); ``fold``: the clip folds into a fused
    optimizer's step (``result.grad_scale``, what it divides by) instead of being applied to the
    gradients; ``unscale_on_overflow``: a policy whose overflowed steps go ahead (the gradients are
    then unscaled, not clipped: ``base.unscaled_on_overflow``). ``max_norm`` inf: nothing clipped,
    the check and the unscale alone. ``limit_of``: a policy's adaptive clip (ZClip), the function
    from the norm (the ranks' combined norm) to the ``max_norm`` this step clips by, on the device.
    ``decision``: the step's skip, ZClip's max_norm included, to be decided by the clip's finalize
    where the clip runs as the kernels alone (``passes/step_decision.py``); None: the step decides.
    Example: ``ClipRequest(1.0, 2.0, fold=True)``."""

    max_norm: float | torch.Tensor
    norm_type: float = 2.0
    fold: bool = False
    unscale_on_overflow: bool = False
    limit_of: Callable[[torch.Tensor], torch.Tensor] | None = None
    decision: Any = None


def _got(value: object) -> str:
    """The message's ", got <value>"; none while Dynamo traces, where the value may be symbolic
    (a string cannot be made of it; fullgraph=True then shows the message as it is)."""
    return "" if torch.compiler.is_compiling() else f", got {value!r}"


def _check_max_norm_tensor(max_norm: torch.Tensor) -> torch.Tensor:
    """A tensor ``max_norm``: one element, real. Its value is checked where reading it costs
    nothing (a CPU tensor, eager). A GPU tensor, or one a compiled clip reads, is not read on the
    host (that would stall the stream, or break the graph): there it is used as given, as torch's
    clip uses the float it reads."""
    if max_norm.numel() != 1 or max_norm.dtype.is_complex or max_norm.dtype is torch.bool:
        raise ValueError(
            f"max_norm must be a float >= 0 or a one-element real tensor, got a {max_norm.dtype} tensor of "
            f"shape {tuple(max_norm.shape)}"
        )
    if host_reads.are_free(max_norm.device) and not max_norm.item() >= 0:
        raise ValueError(f"max_norm must be >= 0 (inf: only measure), got {max_norm!r}")
    return max_norm.detach()
