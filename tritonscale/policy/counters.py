"""The policy's trackers beside the scale: an int32 counter vector and the float32 norm statistics.

The counters are one small device tensor, so that a step updates them in place at a fixed address
(a CUDA graph can capture it) and ``state_dict()`` names each slot (``COUNTER_NAMES``):

* ``hysteresis_left``: overflows the hysteresis budget still absorbs (Megatron-LM, DeepSpeed, apex);
* ``consecutive_skips``, ``skipped_steps``, ``last_skipped``, ``updates``: what ``stats()`` reports
  and what ``max_consecutive_skips`` (MindSpore's ``bad_step_max``) counts;
* ``overflows_since_backoff``, ``updates_since_rescale``: fairseq's overflow tolerance (the share of
  overflowed updates since the scale last changed); they stay 0 unless ``overflow_tolerance`` is set.

Example: ``counters[SKIPPED_STEPS]`` is the number of optimizer steps skipped so far.
"""

from __future__ import annotations

import torch

from ..kernels.interfaces import (  # the slots' one home, shared with the kernels
    CONSECUTIVE_SKIPS,
    COUNTER_NAMES,
    HYSTERESIS_LEFT,
    LAST_SKIPPED,
    NORM_AVERAGE,
    NORM_COUNT,
    OVERFLOWS_SINCE_BACKOFF,
    SKIPPED_STEPS,
    UPDATES,
    UPDATES_SINCE_RESCALE,
)


def _ones_at(*slots: int) -> tuple[int, ...]:
    """A vector over the counters' slots: 1 at ``slots``, 0 elsewhere."""
    return tuple(int(slot in slots) for slot in range(len(COUNTER_NAMES)))


# count_step_ as counters * keep + add: consecutive_skips +1 on a skip and 0 after a step;
# skipped_steps +1 on a skip; last_skipped the flag; updates +1; the hysteresis budget and the
# tolerance's counts kept (the rule updates them).
_KEEP_STEPPED = tuple(1 - v for v in _ones_at(CONSECUTIVE_SKIPS, LAST_SKIPPED))
_KEEP_SKIPPED = tuple(1 - v for v in _ones_at(LAST_SKIPPED))
_ADD_STEPPED = _ones_at(UPDATES)
_ADD_SKIPPED = _ones_at(CONSECUTIVE_SKIPS, SKIPPED_STEPS, LAST_SKIPPED, UPDATES)
# Constants per device, never written: a pure function of the key.
_count_vector_cache: dict[torch.device, tuple[torch.Tensor, ...]] = {}

# The float32 norm statistics tensor's slots: NORM_AVERAGE, NORM_COUNT (kernels/interfaces.py).


def _count_vectors(device: torch.device) -> tuple[torch.Tensor, ...]:
    """(keep if stepped, keep if skipped, add if stepped, add if skipped) as int32 tensors on ``device``."""
    if device not in _count_vector_cache:
        _count_vector_cache[device] = tuple(
            torch.tensor(v, dtype=torch.int32, device=device)
            for v in (_KEEP_STEPPED, _KEEP_SKIPPED, _ADD_STEPPED, _ADD_SKIPPED)
        )
    return _count_vector_cache[device]


def count_step_(counters: torch.Tensor, skipped: torch.Tensor) -> None:
    """The skip counters of one finished iteration, in place (also when the scale was set by hand).

    ``skipped``: a bool 0-dim tensor. ``counters <- counters * keep + add``, the operands picked by
    the flag: two vector ops.
    """
    keep_stepped, keep_skipped, add_stepped, add_skipped = _count_vectors(counters.device)
    keep, add = torch.where(skipped, keep_skipped, keep_stepped), torch.where(skipped, add_skipped, add_stepped)
    counters.mul_(keep).add_(add)
