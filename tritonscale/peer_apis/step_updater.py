"""A training-step updater: nnabla's ``Updater`` / ``DynamicLossScalingUpdater`` over ``GradScaler``.

One :meth:`Updater.update` runs a whole training step::

    zero_grad -> accum_grad x (data feed -> forward -> scaled backward) -> [all_reduce over a group]
    -> fused unscale / inf-check / clip -> [overflow: retry or skip] -> [weight decay]
    -> optimizer step -> scale update

Every loss-scale decision is the :class:`~tritonscale.GradScaler`'s (its policy, on the device):
this module only orders the calls, through the scaler's public API, and adds what nnabla's
updaters add around them -- callbacks, gradient accumulation, the gradient all-reduce, weight
decay and the bounded retry. Its arguments are checked in ``updater_config.py``; its result and
errors are ``updater_errors.py``'s.

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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import torch

from ..passes.rank_combine import GradAllReduce
from ..scaler.step_protocols import unwrap_optimizer
from ..scaler.checkpoint_codec import ScalerSnapshot
from ..scaler.compile_boundary import runs_eagerly
from ..scaler.grad_scaler import GradScaler
from .updater_config import (
    CALLBACK_NAMES,  # noqa: F401  (read here by users and tests)
    Callback,
    as_feed,
    callbacks_by_name,
    check_autocast_dtype,
    check_clip,
    check_grad_reduction,
    check_int,
    check_step_callables,
    check_weight_decay,
    checked_scaler,
    params_device_type,
    retries_for,
)
from .updater_errors import DataFeedExhausted, PhaseFailed, UpdaterError, UpdateResult, updater_error

__all__ = ["DataFeedExhausted", "UpdateResult", "Updater", "UpdaterError"]


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
      all-reduce carries both, and a mismatch raises on every rank (``rank_validation.py``: at once on
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

    Args:
        model_or_loss_fn: the model (with ``loss_fn``), or a callable ``fn(batch) -> loss`` (without).
        optimizer: the torch optimizer (or a wrapper of one) to step.
        data_feed: a callable returning the next batch, an iterator, or an iterable (made one iterator).
        loss_fn: ``loss_fn(model(inputs), target)`` for each ``(inputs, target)`` batch; None (the
            default): ``model_or_loss_fn(batch)`` is the loss.
        scaler: the ``GradScaler``; None (the default) for one with torch's defaults.
        accum_grad: the micro-batches per step (1).
        grad_reduction: "mean" (the default) or "sum", how micro-batch (and rank) gradients combine.
        max_norm: clip by the global norm; None (the default): measure only.
        norm_type: the norm's order (2.0).
        weight_decay: ``grad += weight_decay * param`` before the step; None (the default): none.
        process_group: a torch.distributed group to all-reduce the gradients over; None: no all-reduce.
        on_overflow: "skip" (the default) or "retry".
        max_retries: the retries with ``on_overflow="retry"``; None for 3.
        autocast_dtype: run each forward under ``torch.autocast`` of this dtype; None (the default): no autocast.
        set_to_none: ``zero_grad(set_to_none=...)`` before each attempt (True).
        forward_callback_on_start: ``fn(iteration)`` (or a list) before each micro-batch's forward.
        forward_callback_on_finish: ``fn(iteration)`` (or a list) after each micro-batch's forward.
        backward_callback_on_start: ``fn(iteration)`` (or a list) before each micro-batch's scaled backward.
        backward_callback_on_finish: ``fn(iteration)`` (or a list) after each micro-batch's scaled backward.
        comm_callback_on_start: ``fn(iteration)`` (or a list) before each all-reduce.
        comm_callback_on_finish: ``fn(iteration)`` (or a list) after each all-reduce.
        update_callback_on_start: ``fn(iteration)`` (or a list) before weight decay, step and scale update.
        update_callback_on_finish: ``fn(iteration)`` (or a list) after weight decay, step and scale update.

    Raises:
        TypeError: a non-callable ``model_or_loss_fn``, ``loss_fn`` or callback, a ``data_feed`` that is
            neither callable nor iterable, an ``autocast_dtype`` that is not a dtype, or a ``scaler`` that
            is not a ``GradScaler``.
        ValueError: an invalid knob (``accum_grad``, ``grad_reduction``, ``max_norm``, ``norm_type``,
            ``weight_decay``, ``on_overflow``, ``max_retries``), an optimizer with no parameters, or a
            scaler these knobs cannot run with.

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
        self.model_or_loss_fn, self.loss_fn = check_step_callables(model_or_loss_fn, loss_fn)
        self.optimizer, self._inner = optimizer, unwrap_optimizer(optimizer)  # the scaler keys on the inner one
        self._next_batch = as_feed(data_feed)
        self.accum_grad = check_int("accum_grad", accum_grad, 1)
        self.grad_reduction = check_grad_reduction(grad_reduction)
        self.max_norm, self.norm_type = check_clip(max_norm, norm_type)
        self.weight_decay = check_weight_decay(weight_decay)
        self.max_retries = retries_for(on_overflow, max_retries)
        self.on_overflow = on_overflow
        self.autocast_dtype = check_autocast_dtype(autocast_dtype)
        self.set_to_none = bool(set_to_none)
        self.callbacks = callbacks_by_name(
            (
                forward_callback_on_start,
                forward_callback_on_finish,
                backward_callback_on_start,
                backward_callback_on_finish,
                comm_callback_on_start,
                comm_callback_on_finish,
                update_callback_on_start,
                update_callback_on_finish,
            )
        )
        self._device_type = params_device_type(self._params())
        self.scaler = checked_scaler(
            scaler, self._device_type, self._inner, optimizer, weight_decay, process_group, self.max_retries
        )
        self.process_group = process_group
        self._all_reduce = GradAllReduce()  # keeps the buffer plan between steps
        #: The iteration number the next update() passes to the callbacks (one more per applied
        #: or skipped update(); a failed one does not count).
        self.iteration = 0

    # ---------------------------------------------------------------- helpers
    def _params(self) -> list[torch.Tensor]:
        return [p for group in self._inner.param_groups for p in group["params"]]

    def _fire(self, name: str, iteration: int, micro_batch: int | None = None) -> None:
        for callback in self.callbacks[name]:
            try:
                callback(iteration)
            except Exception as error:
                raise PhaseFailed(name, micro_batch, error) from error

    @contextlib.contextmanager
    def _phase(self, name: str, micro_batch: int | None = None) -> Iterator[None]:
        try:
            yield
        except PhaseFailed:
            raise
        except Exception as error:
            raise PhaseFailed(name, micro_batch, error) from error

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

    def _feed(self, k: int) -> Any:
        with self._phase("data_feed", k):
            try:
                return self._next_batch()
            except StopIteration:
                raise PhaseFailed("data_feed", k, StopIteration()) from None

    def _skipped_flag(self) -> torch.Tensor:
        """The step's skip flag after update(), as a 0-dim bool device tensor (no host read)."""
        skipped = self.scaler.last_skip_flag()
        return skipped if skipped is not None else torch.zeros((), dtype=torch.bool, device=self._params()[0].device)

    # ------------------------------------------------------------------ step
    def _attempt(self, i: int, batches: list[Any], first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One attempt: ``accum_grad`` micro-batches fed (the first attempt; a retry re-runs
        ``batches``), forwarded and scaled-backwarded, the all-reduce, and the fused clip. Returns
        the loss to report and the norm."""
        world = 1
        if self.process_group is not None:
            import torch.distributed as dist

            world = dist.get_world_size(self.process_group)
        backward_divisor = self.accum_grad * world if self.grad_reduction == "mean" else 1
        loss_divisor = self.accum_grad if self.grad_reduction == "mean" else 1
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        loss_sum: torch.Tensor | None = None
        for k in range(self.accum_grad):
            if first:
                batch = self._feed(k)
                if self.max_retries > 0:  # only a retry needs the batches again
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
        return loss_sum, norm

    def _all_reduce_grads(self) -> None:
        """Sum the gradients over ``process_group`` in place, after the one collective that checks
        the ranks agree on the scale, the call sequence, the optimizer, the clip that follows and the
        gradients (``passes/rank_combine.py``'s GradAllReduce, with the scaler's public agreement row)."""
        agreement = self.scaler.rank_agreement(
            self._inner, "gradient sum", max_norm=self.max_norm, norm_type=self.norm_type
        )
        self._all_reduce(self._params(), self.process_group, agreement)

    def _add_weight_decay(self) -> None:
        """nnabla's ``solver.weight_decay``: ``grad += weight_decay * param``, on the unscaled gradients."""
        params = [p for p in self._params() if p.grad is not None]
        torch._foreach_add_([p.grad for p in params], [p.detach() for p in params], alpha=self.weight_decay)

    @runs_eagerly
    def update(self, iteration: int | None = None) -> UpdateResult:
        """Run one training step; return what it did.

        ``iteration`` (default: :attr:`iteration`) is what the callbacks get. Raises
        :class:`UpdaterError` naming the phase that failed; see there for what is left as it was.

        Args:
            iteration: the iteration number the callbacks get; None (the default) for :attr:`iteration`.

        Returns:
            an :class:`UpdateResult`: the iteration, the loss, the norm, the skip flag and the retries.

        Raises:
            UpdaterError: a phase failed (:class:`DataFeedExhausted` where the data feed ran out).
            RuntimeError: the scaler is in the middle of an iteration for this optimizer.
            ValueError: an ``iteration`` that is not an int >= 0.
        """
        i = self.iteration if iteration is None else check_int("iteration", iteration, 0)
        if self.scaler.optimizer_stage(self._inner) is not None:
            raise RuntimeError(
                "the scaler is in the middle of an iteration for this optimizer (unscale_/clip_grad_norm_/step "
                "was called since its last update()); the Updater runs whole iterations"
            )
        batches: list[Any] = []
        snapshot: ScalerSnapshot | None = None
        attempt, committed, stepped = 0, False, False
        try:
            loss, norm = self._attempt(i, batches, first=True)
            while attempt < self.max_retries and self.scaler.overflowed(self._inner):  # one host read
                with self._phase("overflow_backoff"):
                    if snapshot is None:  # to restore on an error: one state_dict read, after an overflow
                        snapshot = self.scaler.snapshot()
                    self.scaler.update()  # the policy backs the scale off (no step: counted as skipped)
                attempt += 1
                loss, norm = self._attempt(i, batches, first=False)
            self._fire("update_callback_on_start", i)
            with self._phase("update"):
                if self.weight_decay:
                    self._add_weight_decay()
                self.scaler.step(self.optimizer)
                stepped = True
                self.scaler.update()
                skipped = self._skipped_flag()
            committed = True
            self.iteration = i + 1
            self._fire("update_callback_on_finish", i)
        except BaseException as error:
            if not committed:  # params and optimizer state were not touched; the scaler is put back
                self.scaler.abandon_iteration(self._inner, snapshot)
            if not isinstance(error, PhaseFailed):  # KeyboardInterrupt and the like: rolled back, propagated as is
                raise
            raise updater_error(error, i, attempt, self.accum_grad, committed, stepped) from error.error
        return UpdateResult(iteration=i, loss=loss, norm=norm, skipped=skipped, retries=attempt)
