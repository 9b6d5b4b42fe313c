"""A training-step updater: nnabla's ``Updater`` / ``DynamicLossScalingUpdater`` over ``GradScaler``.

One :meth:`Updater.update` runs a whole training step::

    zero_grad -> accum_grad x (data feed -> forward -> scaled backward) -> [all_reduce over a group]
    -> fused unscale / inf-check / clip -> [overflow: retry or skip] -> [weight decay]
    -> optimizer step -> scale update

Every loss-scale decision is the :class:`~tritonscale.GradScaler`'s (its policy, on the device):
this module only orders the calls and adds what nnabla's updaters add around them -- callbacks,
gradient accumulation, the gradient all-reduce, weight decay and the bounded retry.

What it does where nnabla's originals differ (``nnabla/experimental/trainers/updater.py`` before
2024, ``nnabla/experimental/mixed_precision_training.py``):

* every ``*_on_start`` callback is paired with exactly one ``*_on_finish`` (nnabla's Updater calls
  ``forward_callback_on_finish`` before and after the forward and never ``forward_callback_on_start``,
  and its all-reduce branch reads an undefined name ``grads``, a NameError whenever ``comm`` is set);
* on an overflow it skips the step (default), or retries the *same* micro-batches with the backed-off
  scale, iteratively, at most ``max_retries`` times, then skips and reports the retries it spent
  (nnabla recurses into ``update()`` -- which also feeds new data -- up to a hard-coded 100 times);
* an error in any phase is raised as :class:`UpdaterError` naming the phase; up to the optimizer
  step, parameters, optimizer state and the scaler are left as they were before that ``update()``
  (an error in ``update_callback_on_finish`` comes after a complete update and says so).

GradScaler has no public accessor for a few things this layer needs; it reads them as frameworks
do: ``_per_optimizer_states`` (torch's member: the retry decision's found_inf, and dropping the
iteration's record on a rollback), ``_fold`` and ``_process_group`` (argument checks), ``_scale``
and ``_ranks`` (the scale and call sequence the all-reduce checks across ranks),
``_last_found_inf``/``_last_norm`` (restored with the state_dict on a rollback) and
``_disabled_skip`` (the skip flag of a disabled scaler, whose ``stats()`` raises).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .compile_boundary import runs_eagerly
from .fold import takes_amp_scaling, takes_grad_scaler_argument
from .grad_scaler import GradScaler
from .kernels.supported import check_max_norm, check_norm_type
from .optimizer_wrappers import unwrap_optimizer
from .rank_combine import GradAllReduce

__all__ = ["DataFeedExhausted", "UpdateResult", "Updater", "UpdaterError"]

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


class UpdaterError(RuntimeError):
    """A phase of :meth:`Updater.update` raised; the original exception is ``__cause__``.

    ``phase`` is the callback's name (``"forward_callback_on_start"``, ...) or the step's own
    phase (``"data_feed"``, ``"forward"``, ``"backward"``, ``"comm"``, ``"unscale_clip"``,
    ``"overflow_backoff"``, ``"update"``); ``attempt`` counts from 1 (2: the first retry),
    ``micro_batch`` from 0 (None outside the micro-batch loop). ``applied`` is False unless the error came from
    ``update_callback_on_finish``, after the step and the scale update: then that update() is
    complete. When False, the parameters, the optimizer's state and the scaler (scale, trackers,
    its per-optimizer stage) are what they were before the update() began; the gradients hold
    whatever the failed phase left (every update() zeroes them first).
    """

    def __init__(
        self,
        message: str,
        *,
        phase: str,
        iteration: int,
        attempt: int,
        micro_batch: int | None,
        applied: bool,
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.iteration = iteration
        self.attempt = attempt
        self.micro_batch = micro_batch
        self.applied = applied


class DataFeedExhausted(UpdaterError):
    """The data feed ran out (StopIteration) before ``accum_grad`` micro-batches were fed."""


@dataclass(frozen=True)
class UpdateResult:
    """What one :meth:`Updater.update` did. Tensors stay on the device (reading them syncs).

    ``loss``: the loss of the applied (or finally skipped) attempt, detached: the mean of its
    micro-batch losses (``grad_reduction="mean"``) or their sum (``"sum"``), this rank's.
    ``norm``: the unscaled gradient norm before clipping (inf/NaN on an overflow).
    ``skipped``: 0-dim bool, True where the optimizer step was skipped (overflow or a policy's
    norm-spike skip). ``retries``: how many times the batch was re-run after an overflow.
    """

    iteration: int
    loss: torch.Tensor
    norm: torch.Tensor
    skipped: torch.Tensor
    retries: int

    @property
    def step_applied(self) -> bool:
        """Whether the optimizer step was applied (a host read of ``skipped``)."""
        return not bool(self.skipped.item())


class _Phase(Exception):
    """Internal: carries the phase and position of an error to update()'s one handler."""

    def __init__(self, phase: str, micro_batch: int | None, error: BaseException) -> None:
        super().__init__(phase)
        self.phase, self.micro_batch, self.error = phase, micro_batch, error


def _callbacks(name: str, value: Callback | Sequence[Callback] | None) -> tuple[Callback, ...]:
    """A callback, a list/tuple of them, or None, as a tuple (nnabla accepts one or a list)."""
    if value is None:
        return ()
    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    for item in items:
        if not callable(item):
            raise TypeError(f"{name} must be a callable fn(iteration) or a list of them, got {type(item).__name__}")
    return items


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class Updater:
    """A whole mixed-precision training step per :meth:`update`, over a :class:`GradScaler`.

    ``model_or_loss_fn``: with ``loss_fn`` given, the model: each batch is ``(inputs, target)`` and
    the loss is ``loss_fn(model(inputs), target)``; without, a callable ``fn(batch) -> loss``.
    ``data_feed``: a callable returning the next batch, or an iterator (an iterable is turned into
    one iterator, once); running out raises :class:`DataFeedExhausted`.
    ``scaler``: a ``tritonscale.GradScaler`` (default: one for the parameters' device type, with
    torch's defaults, unfolded when ``weight_decay`` is set). The updater owns its iterations.

    Knobs:

    * ``accum_grad`` micro-batches per step, each fed, forwarded and backwarded once per attempt.
      ``grad_reduction="mean"`` (default) divides each micro-batch loss by ``accum_grad`` (and by the
      group's size with a ``process_group``): the gradient is that of the mean loss over everything
      the step saw, as one big batch or DDP would give. ``"sum"`` is nnabla's: no division.
    * ``process_group``: all-reduce (sum) the gradients over this torch.distributed group after the
      backwards and before the fused check, so every rank checks, clips and skips the same values.
      Each rank must produce gradients for the same parameters, and hold the same loss scale: the
      all-reduce carries both, and a mismatch raises on every rank (``rank_checks.py``: at once on
      the CPU; on a GPU the step is skipped and the error comes at the scaler's next host read,
      such as ``get_scale()``). Not with DDP (it all-reduces
      already) nor with a scaler that has its own ``process_group`` (that is for sharded gradients).
    * ``max_norm`` / ``norm_type``: clip by the global norm in the fused pass (None: measure only).
    * ``weight_decay``: nnabla's ``solver.weight_decay``: ``grad += weight_decay * param`` after
      the unscale and clip, before the step. This needs unscaled gradients in memory, so it refuses
      a scaler that folds into a fused optimizer (``GradScaler(..., fold_into_optimizer=False)``).
    * ``on_overflow="skip"``: an overflowed step is skipped on the device and the scale backs off.
      update() adds no host read of its own: with a fused optimizer (and a policy without the
      opt-in "warn"/"raise"/``max_consecutive_skips`` checks) it reads nothing at all; any other
      optimizer costs the one read GradScaler.step always makes. ``"retry"``: re-run the same
      micro-batches with the backed-off scale, at most ``max_retries`` times (default 3), then skip.
      Deciding costs one host read of the overflow flag per attempt that may still retry, plus one
      state_dict read before the first retry (to restore on an error); each retried attempt is one
      skipped scaler iteration (a backoff, counted in ``stats()["skipped_steps"]``). Module buffers
      (BatchNorm statistics) see every attempt's forward, as in nnabla.
    * ``autocast_dtype``: run each forward under ``torch.autocast`` of the parameters' device type.

    Callbacks (nnabla's names), each ``fn(iteration)`` or a list of them; every ``*_on_start`` is
    followed by exactly one ``*_on_finish`` unless its phase raises. Per update():
    forward/backward ones around each micro-batch's forward/backward, ``accum_grad x (1 + retries)``
    times; comm ones around each all-reduce, ``1 + retries`` times, only with a ``process_group``;
    update ones once, around weight decay + optimizer step + scale update (an attempt that is
    retried only backs the scale off). The fused check runs between comm and update, with no
    callbacks: in ``update_callback_on_start`` the gradients are as it left them (still scaled
    when it folds into a fused optimizer).

    Example::

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        updater = tritonscale.Updater(model, optimizer, iter(loader), loss_fn=F.cross_entropy, max_norm=1.0)
        for _ in range(steps):
            result = updater.update()          # result.loss, .norm, .skipped: device tensors
    """

    def __init__(
        self,
        model_or_loss_fn: Callable[..., Any],
        optimizer: torch.optim.Optimizer,
        data_feed: Callable[[], Any] | Iterable[Any],
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        scaler: GradScaler | None = None,
        accum_grad: int = 1,
        grad_reduction: Literal["mean", "sum"] = "mean",
        max_norm: float | None = None,
        norm_type: float = 2.0,
        weight_decay: float | None = None,
        process_group: Any = None,
        on_overflow: Literal["skip", "retry"] = "skip",
        max_retries: int | None = None,
        autocast_dtype: torch.dtype | None = None,
        set_to_none: bool = True,
        forward_callback_on_start: Callback | Sequence[Callback] | None = None,
        forward_callback_on_finish: Callback | Sequence[Callback] | None = None,
        backward_callback_on_start: Callback | Sequence[Callback] | None = None,
        backward_callback_on_finish: Callback | Sequence[Callback] | None = None,
        comm_callback_on_start: Callback | Sequence[Callback] | None = None,
        comm_callback_on_finish: Callback | Sequence[Callback] | None = None,
        update_callback_on_start: Callback | Sequence[Callback] | None = None,
        update_callback_on_finish: Callback | Sequence[Callback] | None = None,
    ) -> None:
        # Every argument is checked here, before anything runs: update() then only fails on what
        # the step itself does.
        if not callable(model_or_loss_fn):
            raise TypeError(f"model_or_loss_fn must be callable, got {type(model_or_loss_fn).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        self.model_or_loss_fn = model_or_loss_fn
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self._inner = unwrap_optimizer(optimizer)  # the scaler keys its records on the real optimizer
        self._next_batch = self._as_feed(data_feed)
        self.accum_grad = _check_int("accum_grad", accum_grad, 1)
        if grad_reduction not in ("mean", "sum"):
            raise ValueError(f'grad_reduction must be "mean" or "sum", got {grad_reduction!r}')
        self.grad_reduction = grad_reduction
        self.max_norm = math.inf if max_norm is None else check_max_norm(max_norm)
        self.norm_type = check_norm_type(norm_type)
        if weight_decay is not None:
            if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)):
                raise ValueError(f"weight_decay must be a float >= 0 or None, got {weight_decay!r}")
            if not (math.isfinite(weight_decay) and weight_decay >= 0):
                raise ValueError(f"weight_decay must be a finite float >= 0 or None, got {weight_decay!r}")
        self.weight_decay = weight_decay
        if on_overflow not in ("skip", "retry"):
            raise ValueError(f'on_overflow must be "skip" or "retry", got {on_overflow!r}')
        self.on_overflow = on_overflow
        if max_retries is not None:
            _check_int("max_retries", max_retries, 0)
            if on_overflow != "retry":
                raise ValueError('max_retries applies only with on_overflow="retry"')
        self.max_retries = 0 if on_overflow == "skip" else DEFAULT_MAX_RETRIES if max_retries is None else max_retries
        if autocast_dtype is not None and not isinstance(autocast_dtype, torch.dtype):
            raise TypeError(f"autocast_dtype must be a torch.dtype or None, got {autocast_dtype!r}")
        self.autocast_dtype = autocast_dtype
        self.set_to_none = bool(set_to_none)
        self.callbacks = {
            name: _callbacks(name, value)
            for name, value in zip(
                CALLBACK_NAMES,
                (
                    forward_callback_on_start,
                    forward_callback_on_finish,
                    backward_callback_on_start,
                    backward_callback_on_finish,
                    comm_callback_on_start,
                    comm_callback_on_finish,
                    update_callback_on_start,
                    update_callback_on_finish,
                ),
            )
        }

        params = self._params()
        if not params:
            raise ValueError("the optimizer holds no parameters")
        self._device_type = params[0].device.type
        folds = takes_amp_scaling(self._inner) and not takes_grad_scaler_argument(optimizer)
        if scaler is None:
            scaler = GradScaler(self._device_type, fold_into_optimizer=weight_decay is None)
        elif not isinstance(scaler, GradScaler):
            raise TypeError(f"scaler must be a tritonscale.GradScaler, got {type(scaler).__name__}")
        # GradScaler has no public accessor for these two settings: read its attributes.
        if weight_decay is not None and folds and getattr(scaler, "_fold", True):
            raise ValueError(
                "weight_decay needs the unscaled gradients in memory, but this scaler folds the unscale into "
                f"the fused {type(self._inner).__name__}: pass GradScaler(..., fold_into_optimizer=False), "
                "or use the optimizer's own weight_decay"
            )
        if process_group is not None:
            import torch.distributed as dist

            if not isinstance(process_group, dist.ProcessGroup):
                raise TypeError(f"process_group must be a torch.distributed ProcessGroup, got {process_group!r}")
            if getattr(scaler, "_process_group", None) is not None:
                raise ValueError(
                    "the updater all-reduces the gradients over process_group (they are then the same on every "
                    "rank); a scaler with its own process_group would count them once per rank"
                )
        self.process_group = process_group
        self._all_reduce = GradAllReduce()
        if on_overflow == "retry" and self.max_retries > 0:
            # A retry only helps if the overflow makes the scale smaller.
            if not scaler.is_enabled():
                raise ValueError('on_overflow="retry" needs an enabled scaler (a disabled one has no scale to lower)')
            if not scaler.state_dict()["policy"]["dynamic"]:
                raise ValueError('on_overflow="retry" needs a dynamic loss scale; this scaler\'s is fixed')
        self.scaler = scaler
        #: The iteration number the next update() passes to the callbacks (one more per applied
        #: or skipped update(); a failed one does not count).
        self.iteration = 0

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _as_feed(data_feed: Any) -> Callable[[], Any]:
        # A callable first: nnabla's data_feeder is one (and nn.Sequential is both).
        if callable(data_feed):
            return data_feed
        if isinstance(data_feed, Iterator):
            return data_feed.__next__
        if isinstance(data_feed, Iterable):
            return iter(data_feed).__next__
        kind = type(data_feed).__name__
        raise TypeError(f"data_feed must be a callable returning a batch, or an iterator, not {kind}")

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self._inner.param_groups for p in group["params"]]

    def _fire(self, name: str, iteration: int, micro_batch: int | None = None) -> None:
        for callback in self.callbacks[name]:
            try:
                callback(iteration)
            except Exception as error:
                raise _Phase(name, micro_batch, error) from error

    @contextlib.contextmanager
    def _phase(self, name: str, micro_batch: int | None = None) -> Iterator[None]:
        try:
            yield
        except _Phase:
            raise
        except Exception as error:
            raise _Phase(name, micro_batch, error) from error

    def _forward(self, batch: Any) -> torch.Tensor:
        autocast = (
            torch.autocast(self._device_type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            if self.loss_fn is None:
                loss = self.model_or_loss_fn(batch)
            else:
                if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                    raise TypeError(f"with loss_fn, each batch must be an (inputs, target) pair, got {type(batch)}")
                inputs, target = batch
                loss = self.loss_fn(self.model_or_loss_fn(inputs), target)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            raise TypeError(f"the forward must return a one-element floating-point loss tensor, got {loss!r}")
        return loss

    def _all_reduce_grads(self) -> None:
        """Sum the gradients over the group: one collective per (device, dtype) on a flat copy,
        the first carrying every rank's scale and gradient layout, which must agree (rank_combine)."""
        scale = self.scaler._scale if self.scaler.is_enabled() else None
        self._all_reduce(self._params(), self.process_group, scale, self.scaler._ranks)

    def _overflowed(self) -> bool:
        """The retry decision: did this attempt's fused check find inf/NaN? One host read.

        Read from the scaler's per-optimizer record (torch's ``found_inf_per_device``), as
        frameworks do: GradScaler has no public flag before update()."""
        record = self.scaler._per_optimizer_states.get(id(self._inner))
        flags = list(record["found_inf_per_device"].values()) if record is not None else []
        if not flags:
            return False
        device = flags[0].device
        return bool(torch.stack([f.reshape(()).to(device) for f in flags]).sum().item() > 0)

    def _skipped_flag(self) -> torch.Tensor:
        """The step's skip flag after update(), as a new 0-dim bool device tensor (no host read)."""
        if self.scaler.is_enabled():  # stats() hands views of state updated in place; a pending
            # mismatch between ranks (GPU paths) skipped the step and left that state as it was
            return self.scaler._ranks.skip(self.scaler.stats()["skipped"] > 0)
        skip = getattr(self.scaler, "_disabled_skip", None)  # a disabled scaler keeps it only there
        return skip > 0 if skip is not None else torch.zeros((), dtype=torch.bool, device=self._params()[0].device)

    def _snapshot_scaler(self) -> tuple[dict, Any, Any]:
        """The scaler as it was before a retry's backoff: its state_dict (one host read, only once
        an overflow already cost one) and the last update's diagnostics behind stats()."""
        return self.scaler.state_dict(), self.scaler._last_found_inf, self.scaler._last_norm

    def _rollback(self, snapshot: tuple[dict, Any, Any] | None) -> None:
        """Undo what this update() did to the scaler; params and optimizer state were not touched."""
        # The iteration's record (stage, flags, folded factor): torch's private member, as frameworks use it.
        self.scaler._per_optimizer_states.pop(id(self._inner), None)
        if snapshot is not None:
            state, last_found_inf, last_norm = snapshot
            self.scaler.load_state_dict(state)  # in place: the device tensors keep their addresses
            self.scaler._last_found_inf, self.scaler._last_norm = last_found_inf, last_norm

    # ------------------------------------------------------------------ step
    @runs_eagerly
    def update(self, iteration: int | None = None) -> UpdateResult:
        """Run one training step; return what it did.

        ``iteration`` (default: :attr:`iteration`) is what the callbacks get. Raises
        :class:`UpdaterError` naming the phase that failed; see there for what is left as it was.
        """
        i = self.iteration if iteration is None else _check_int("iteration", iteration, 0)
        if id(self._inner) in self.scaler._per_optimizer_states:
            raise RuntimeError(
                "the scaler is in the middle of an iteration for this optimizer (unscale_/clip_grad_norm_/step "
                "was called since its last update()); the Updater runs whole iterations"
            )
        world = 1
        if self.process_group is not None:
            import torch.distributed as dist

            world = dist.get_world_size(self.process_group)
        backward_divisor = self.accum_grad * world if self.grad_reduction == "mean" else 1
        loss_divisor = self.accum_grad if self.grad_reduction == "mean" else 1
        keep_batches = self.max_retries > 0  # only a retry needs the batches again
        batches: list[Any] = []
        snapshot = None
        attempt, committed, stepped = 0, False, False
        try:
            while True:
                self.optimizer.zero_grad(set_to_none=self.set_to_none)
                loss_sum: torch.Tensor | None = None
                for k in range(self.accum_grad):
                    if attempt == 0:
                        with self._phase("data_feed", k):
                            try:
                                batch = self._next_batch()
                            except StopIteration:
                                raise _Phase("data_feed", k, StopIteration()) from None
                        if keep_batches:
                            batches.append(batch)
                    else:
                        batch = batches[k]  # a retry re-runs the same batch, not the next one
                    self._fire("forward_callback_on_start", i, k)
                    with self._phase("forward", k):
                        loss = self._forward(batch)
                    self._fire("forward_callback_on_finish", i, k)
                    self._fire("backward_callback_on_start", i, k)
                    with self._phase("backward", k):
                        part = loss / backward_divisor if backward_divisor != 1 else loss
                        self.scaler.scale(part).backward()
                    self._fire("backward_callback_on_finish", i, k)
                    shown = loss.detach() / loss_divisor if loss_divisor != 1 else loss.detach()
                    loss_sum = shown if loss_sum is None else loss_sum + shown
                    del batch, loss, part
                if self.process_group is not None:
                    self._fire("comm_callback_on_start", i)
                    with self._phase("comm"):
                        self._all_reduce_grads()
                    self._fire("comm_callback_on_finish", i)
                with self._phase("unscale_clip"):
                    norm = self.scaler.clip_grad_norm_(self.optimizer, self.max_norm, self.norm_type)
                if attempt < self.max_retries and self._overflowed():
                    with self._phase("overflow_backoff"):
                        if snapshot is None:
                            snapshot = self._snapshot_scaler()
                        self.scaler.update()  # the policy backs the scale off (no step: counted as skipped)
                    attempt += 1
                    continue
                break

            self._fire("update_callback_on_start", i)
            with self._phase("update"):
                if self.weight_decay:
                    params = [p for p in self._params() if p.grad is not None]
                    torch._foreach_add_([p.grad for p in params], [p.detach() for p in params], alpha=self.weight_decay)
                self.scaler.step(self.optimizer)
                stepped = True
                self.scaler.update()
                skipped = self._skipped_flag()
            committed = True
            self.iteration = i + 1
            self._fire("update_callback_on_finish", i)
        except BaseException as error:
            if not committed:
                self._rollback(snapshot)
            if not isinstance(error, _Phase):  # KeyboardInterrupt and the like: rolled back, propagated as is
                raise
            phase, micro_batch, cause = error.phase, error.micro_batch, error.error
            where = f"iteration {i}, attempt {attempt + 1}" + (
                f", micro-batch {micro_batch + 1}/{self.accum_grad}" if micro_batch is not None else ""
            )
            if committed:
                state = "the update was applied (optimizer step and scale update) before it raised"
            elif stepped:  # only the policy's opt-in stops raise here, and those come with a skipped step
                state = "the optimizer step had run (skipped on the device on an overflow); the scaler was restored"
            else:
                state = "nothing was applied: parameters, optimizer state and the scaler are as before this update()"

            kind, what = UpdaterError, f"{type(cause).__name__}: {cause}"
            if isinstance(cause, StopIteration):
                kind, what = DataFeedExhausted, "the data feed ran out (StopIteration)"
            raise kind(
                f"{phase} raised at {where}: {what}; {state}",
                phase=phase,
                iteration=i,
                attempt=attempt + 1,
                micro_batch=micro_batch,
                applied=committed,
            ) from cause
        return UpdateResult(iteration=i, loss=loss_sum, norm=norm, skipped=skipped, retries=attempt)
