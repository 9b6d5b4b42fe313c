"""The ``Updater``'s arguments, checked before anything runs (so update() fails only on what the
step itself does), and the scaler it runs on: one it is given, checked for what the updater needs,
or one it makes."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ..passes.clip_args import check_max_norm, check_norm_type
from ..policy.knob_validation import is_count, is_number, plain_number
from ..process_groups import check_process_group
from ..scaler.grad_scaler import GradScaler

#: nnabla's callback names, in the order their phases run.
CALLBACK_NAMES = (
    "forward_callback_on_start",
    "forward_callback_on_finish",
    "backward_callback_on_start",
    "backward_callback_on_finish",
    "comm_callback_on_start",
    "comm_callback_on_finish",
    "update_callback_on_start",
    "update_callback_on_finish",
)
#: ``max_retries`` when ``on_overflow="retry"`` and none is given: a real overflow is gone after one
#: backoff; an inf/NaN the model makes at any scale is not, and every retry costs a forward+backward.
DEFAULT_MAX_RETRIES = 3

Callback = Callable[[int], Any]


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as a Python int (numpy ints too, as torch takes them) if it is one >= ``minimum``."""
    if not is_count(value, minimum):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_step_callables(model_or_loss_fn: Any, loss_fn: Any) -> tuple[Callable[..., Any], Callable | None]:
    """The forward (a model, or a loss function of the batch) and the optional ``loss_fn``, both callable."""
    if not callable(model_or_loss_fn):
        raise TypeError(f"model_or_loss_fn must be callable, got {type(model_or_loss_fn).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    return model_or_loss_fn, loss_fn


def check_grad_reduction(grad_reduction: Any) -> str:
    """``"mean"`` (the gradient of the mean loss, as DDP gives) or ``"sum"`` (nnabla's)."""
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f'grad_reduction must be "mean" or "sum", got {grad_reduction!r}')
    return grad_reduction


def check_clip(max_norm: Any, norm_type: Any) -> tuple[float, float]:
    """The clip of the fused pass: ``max_norm`` (None: measure only, as an infinite bound) and
    ``norm_type``, checked as ``GradScaler.clip_grad_norm_`` checks them."""
    return math.inf if max_norm is None else check_max_norm(max_norm), check_norm_type(norm_type)


def check_autocast_dtype(autocast_dtype: Any) -> torch.dtype | None:
    """The dtype each forward runs under ``torch.autocast`` with, or None for no autocast."""
    if autocast_dtype is not None and not isinstance(autocast_dtype, torch.dtype):
        raise TypeError(f"autocast_dtype must be a torch.dtype or None, got {autocast_dtype!r}")
    return autocast_dtype


def params_device_type(params: list[torch.Tensor]) -> str:
    """The device type the step runs on: that of the optimizer's first parameter (it needs one)."""
    if not params:
        raise ValueError("the optimizer holds no parameters")
    return params[0].device.type


def callbacks_by_name(values: Sequence[Callback | Sequence[Callback] | None]) -> dict[str, tuple[Callback, ...]]:
    """Each of nnabla's callback arguments (in ``CALLBACK_NAMES`` order) as a tuple: one callable,
    a list/tuple of them, or None (nnabla accepts one or a list)."""
    callbacks = {}
    for name, value in zip(CALLBACK_NAMES, values, strict=True):
        items = () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if not callable(item):
                raise TypeError(f"{name} must be a callable fn(iteration) or a list of them, got {type(item).__name__}")
        callbacks[name] = items
    return callbacks


def as_feed(data_feed: Any) -> Callable[[], Any]:
    """The data feed as a callable returning the next batch."""
    if callable(data_feed):  # a callable first: nnabla's data_feeder is one (and nn.Sequential is both)
        return data_feed
    if isinstance(data_feed, Iterator):
        return data_feed.__next__
    if isinstance(data_feed, Iterable):
        return iter(data_feed).__next__
    kind = type(data_feed).__name__
    raise TypeError(f"data_feed must be a callable returning a batch, or an iterator, not {kind}")


def check_weight_decay(weight_decay: Any) -> float | None:
    if weight_decay is None:
        return None
    if not is_number(weight_decay):
        raise ValueError(f"weight_decay must be a float >= 0 or None, got {weight_decay!r}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a finite float >= 0 or None, got {weight_decay!r}")
    return plain_number(weight_decay)


def retries_for(on_overflow: Any, max_retries: Any) -> int:
    """How many times an overflowed batch is re-run: 0 for "skip"; ``max_retries`` (default
    ``DEFAULT_MAX_RETRIES``) for "retry"."""
    if on_overflow not in ("skip", "retry"):
        raise ValueError(f'on_overflow must be "skip" or "retry", got {on_overflow!r}')
    if max_retries is not None:
        check_int("max_retries", max_retries, 0)
        if on_overflow != "retry":
            raise ValueError('max_retries applies only with on_overflow="retry"')
    return 0 if on_overflow == "skip" else DEFAULT_MAX_RETRIES if max_retries is None else max_retries


def checked_scaler(
    scaler: GradScaler | None,
    device_type: str,
    inner: torch.optim.Optimizer,
    optimizer: Any,
    weight_decay: float | None,
    process_group: Any,
    max_retries: int,
) -> GradScaler:
    """The updater's scaler (default: one for the parameters' device type, unfolded when
    ``weight_decay`` is set), refused where it cannot do what the other arguments ask."""
    if scaler is None:
        scaler = GradScaler(device_type, fold_into_optimizer=weight_decay is None)
    elif not isinstance(scaler, GradScaler):
        raise TypeError(f"scaler must be a tritonscale.GradScaler, got {type(scaler).__name__}")
    if weight_decay is not None and scaler.folds_clip_into(optimizer):
        raise ValueError(
            "weight_decay needs the unscaled gradients in memory, but this scaler folds the unscale into "
            f"the fused {type(inner).__name__}: pass GradScaler(..., fold_into_optimizer=False), "
            "or use the optimizer's own weight_decay"
        )
    if check_process_group(process_group) is not None and scaler.process_group is not None:
        raise ValueError(
            "the updater all-reduces the gradients over process_group (they are then the same on every "
            "rank); a scaler with its own process_group would count them once per rank"
        )
    if max_retries > 0:  # a retry only helps if the overflow makes the scale smaller
        if not scaler.is_enabled():
            raise ValueError('on_overflow="retry" needs an enabled scaler (a disabled one has no scale to lower)')
        if not scaler.get_policy().dynamic:
            raise ValueError('on_overflow="retry" needs a dynamic loss scale; this scaler\'s is fixed')
    return scaler
