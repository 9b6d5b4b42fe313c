"""What an ``Updater.update()`` returns, and what it raises when one of its phases fails."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DataFeedExhausted", "UpdateResult", "UpdaterError"]


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

    Args:
        iteration: the iteration number the callbacks got.
        loss: the loss of the applied (or finally skipped) attempt, detached.
        norm: the unscaled gradient norm before clipping.
        skipped: a 0-dim bool tensor, True where the optimizer step was skipped.
        retries: the re-runs after an overflow.
    """

    iteration: int
    loss: torch.Tensor
    norm: torch.Tensor
    skipped: torch.Tensor
    retries: int

    @property
    def step_applied(self) -> bool:
        """Whether the optimizer step was applied (a host read of ``skipped``).

        Returns:
            True if the optimizer step was applied, False if it was skipped.
        """
        return not bool(self.skipped.item())


class PhaseFailed(Exception):
    """Internal: carries the phase and position of an error to update()'s one handler."""

    def __init__(self, phase: str, micro_batch: int | None, error: BaseException) -> None:
        super().__init__(phase)
        self.phase, self.micro_batch, self.error = phase, micro_batch, error


def updater_error(
    failed: PhaseFailed, iteration: int, attempt: int, accum_grad: int, committed: bool, stepped: bool
) -> UpdaterError:
    """The :class:`UpdaterError` for a failed phase: where it failed, the cause, and what was applied."""
    phase, micro_batch, cause = failed.phase, failed.micro_batch, failed.error
    where = f"iteration {iteration}, attempt {attempt + 1}" + (
        f", micro-batch {micro_batch + 1}/{accum_grad}" if micro_batch is not None else ""
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
    return kind(
        f"{phase} raised at {where}: {what}; {state}",
        phase=phase,
        iteration=iteration,
        attempt=attempt + 1,
        micro_batch=micro_batch,
        applied=committed,
    )
