"""The triton-free half of the kernels' interfaces: the records and constants their callers build
and read, importable where triton is not installed (a CPU install runs the torch backend; the
modules that launch a kernel import its launcher only where ``TRITON_FOUND``, kernels/__init__.py).
The kernel modules take these from here, so each lives once; the policy's state layouts live here
too (``policy/counters.py`` and ``policy/spike_rules.py`` import them).

The kernels read no module-level global: Triton's JIT path checks every ``tl.constexpr`` global a
kernel reads (3.9: and its callees read) on every launch, ~9k instructions each. The constants they
need arrive as ``KernelConstants``, one constexpr parameter defaulted to ``KERNEL_CONSTANTS``
(``K: tl.constexpr = KERNEL_CONSTANTS``, which no caller passes): bound with the arguments, part
of Triton's cache key in memory and on disk, and checked by nothing. (A module attribute read in a
kernel, ``interfaces.UPDATES``, is checked by nothing either, but it is in no cache key: a changed
value would reuse a stale compiled kernel from Triton's disk cache.)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

# ------------------------------------------------- the check pass's partials (check_pass.py)
#: Rows of the float32 partials buffer the check pass writes (one column per program) and finalize
#: reads: the max |g| over the finite elements, the sum of (|g| / its power-of-two max)^k, the sum
#: of |g| over the non-finite elements (check_pass.py's docstring).
PARTIAL_ROWS = 3

# ----------------------------------------------------------------- finalize (finalize.py)
#: The four results every finalize writes, in order.
RESULT_FIELDS = ("found_inf", "norm", "clip_coef", "factor")
#: With ``step``: two more results after RESULT_FIELDS.
STEP_FIELDS = ("grad_scale", "skip")
#: The step constexprs and their values when ``step`` is None (every rule off); HAS_EARLIER follows
#: ``FinalizeStep.earlier``.
STEP_OFF = {
    "UNFIT_OVERFLOWS": False,
    "UNSCALE_ON_OVERFLOW": False,
    "FOLD": False,
    "DECIDE": False,
    "SKIP_ON_OVERFLOW": True,
    "NORM_ABOVE": None,
    "NORM_FACTOR": None,
    "NORM_WARMUP": 0,
    "SIGMA": None,
    "WINDOW": 0,
    "MIN_SEEN": 0,
    "BLOCK_W": 1,
    "ZCLIP_Z": None,
    "ZCLIP_WARMUP": 0,
    "ZCLIP_PERCENTILE": False,
    "ZCLIP_TO_MEAN": False,
    "ZCLIP_EPS": 0.0,
    "ZCLIP_FACTOR": 1.0,
}


class FinalizeStep(NamedTuple):
    """What ``finalize`` decides for the step besides the clip: ``constexprs`` (STEP_OFF's names,
    the policy's rule as ``passes/step_decision.py`` maps it), the flag recorded ``earlier`` in the
    iteration (fp32 [1] or 0-dim, or None), and the policy's state the rules read (``norm_stats``
    fp32 [2], ``spike_stats`` fp64; None where no rule reads them), all on the partials' device.
    Example: ``FinalizeStep({**STEP_OFF, "FOLD": True})``."""

    constexprs: Mapping[str, Any] = MappingProxyType(STEP_OFF)
    earlier: torch.Tensor | None = None
    norm_stats: torch.Tensor | None = None
    spike_stats: torch.Tensor | None = None
    #: A number naming ``constexprs`` (equal numbers: equal constexprs, never changed in place), or
    #: None: ``finalize`` then compares the constexprs themselves.
    key: int | None = None


# ----------------------------------------- the policy's state (policy/counters.py, policy/spike_rules.py)
#: The int32 counters tensor's slots by name, in order (``state_dict()["counters"]`` names them so;
#: ``policy/counters.py`` says what each counts), and each slot's index, named as its name in capitals.
COUNTER_NAMES = (
    "hysteresis_left",
    "consecutive_skips",
    "skipped_steps",
    "last_skipped",
    "updates",
    "overflows_since_backoff",
    "updates_since_rescale",
)
(
    HYSTERESIS_LEFT,
    CONSECUTIVE_SKIPS,
    SKIPPED_STEPS,
    LAST_SKIPPED,
    UPDATES,
    OVERFLOWS_SINCE_BACKOFF,
    UPDATES_SINCE_RESCALE,
) = range(len(COUNTER_NAMES))
#: Slots of the float32 norm statistics tensor (skip_norm_factor's running average).
NORM_AVERAGE, NORM_COUNT = range(2)
#: Slots of the float64 spike_stats header; the z-score window, then ZClip's warm-up norms, follow it.
Z_SEEN, EMA_MEAN, EMA_VAR, EMA_SEEN = range(4)
SPIKE_HEADER = 4
#: The lowest loss scale a backoff leaves (``LossScalePolicy.backoff_floor``): 2**-126, the smallest
#: normal float32. torch's backoff can round the scale to 0 (``backoff_factor=1e-20``, a tiny
#: scale), and there it stays: every later gradient is 0, or 0 * inf. The floor must keep 1/scale
#: usable: 2**126 is finite and exact, and flush-to-zero arithmetic (``torch.set_flush_denormal``,
#: GPU kernels) keeps 2**-126. A subnormal floor would not: 1/2**-149 overflows float32 (torch's
#: inverse scale, a float64 reciprocal rounded to float32, is inf from 2**-128 down).
SCALE_FLOOR = 2.0**-126
#: Window slots the update shifts per block (kernels/policy_update.py).
WINDOW_BLOCK = 1024

# ------------------------------------------------------------ the update (policy_update.py)
#: Optimizers' flags the update reads by pointer in its one launch (more are summed first).
MAX_FLAGS = 4
#: HostCheck bits (policy/stop_rules.py), as the kernel writes them.
AT_MIN_SCALE, TOO_MANY_SKIPS, AT_RAISE_SCALE = 1, 2, 4
#: Slots of the float64 host-check output the kernel writes where a check could fire, and the runner
#: reads in its one host read: the bits, then the values they name (before the update).
CHECK_BITS, CHECK_SCALE, CHECK_CONSECUTIVE_SKIPS, CHECK_UPDATES = range(4)
CHECK_SLOTS = 4
#: ZClip's modes and options as codes.
ZCLIP_ZSCORE, ZCLIP_PERCENTILE = 0, 1
ZCLIP_ADAPTIVE, ZCLIP_MEAN = 0, 1


class UpdateRule(NamedTuple):
    """A policy's knobs as the kernel's constexprs (``policy/kernel_form.py`` builds it). Floats
    are the values the rule's tensor ops compute with: float64 factors, float32-rounded limits."""

    DYNAMIC: bool
    SKIP_ON_OVERFLOW: bool
    GROWTH_FACTOR: float  # float64, as torch's update takes it
    BACKOFF_FACTOR: float
    GROWTH_INTERVAL: int
    HYSTERESIS: int
    CONSECUTIVE_HYSTERESIS: bool
    REFILL_ON_BACKOFF: bool
    TOLERANCE: float  # float64 share; 0: off
    RAISE_FLOOR: bool  # the floor after a backoff is SCALE_FLOOR (else min_scale clamps)
    BACKOFF_FLOOR: float  # float64: max(SCALE_FLOOR, min_scale)
    HAS_MIN: bool
    MIN_SCALE: float
    HAS_MAX: bool
    MAX_SCALE: float
    GROWTH_DELAY: int
    AVERAGE_NORM: bool  # skip_norm_factor's running average
    NORM_DECAY: float  # float32-rounded
    Z_WINDOW: int  # the z-score window's slots; 0: off
    ZCLIP_WARMUP: int  # ZClip's warm-up slots; 0: off
    ZCLIP_Z: float
    ZCLIP_ALPHA: float
    ZCLIP_ONE_MINUS_ALPHA: float  # 1 - alpha in float64, as the host computes it
    ZCLIP_MODE: int
    ZCLIP_OPTION: int
    ZCLIP_FACTOR: float
    ZCLIP_EPS: float
    ZCLIP_SKIP_ON_SPIKE: bool
    CHECK_MIN_SCALE: bool  # on_min_scale "warn"/"raise" at min_scale
    SKIP_LIMIT: int  # max_consecutive_skips; 0: off
    CHECK_RAISE_AT: bool  # raise_at_scale
    RAISE_AT: float
    HOLD_MASK: int  # the check bits that raise: with ``hold`` they leave the state untouched


# ------------------------------------------------------------ the constants the kernels read
class KernelConstants(NamedTuple):
    """The module constants the kernels read, as one ``tl.constexpr`` parameter (the module
    docstring says why): ``K.UPDATES`` in a kernel is ``UPDATES`` here. Each kernel that reads one
    declares ``K: tl.constexpr = KERNEL_CONSTANTS`` and hands ``K`` to the helpers that read them."""

    HYSTERESIS_LEFT: int
    CONSECUTIVE_SKIPS: int
    SKIPPED_STEPS: int
    LAST_SKIPPED: int
    UPDATES: int
    OVERFLOWS_SINCE_BACKOFF: int
    UPDATES_SINCE_RESCALE: int
    NORM_AVERAGE: int
    NORM_COUNT: int
    Z_SEEN: int
    EMA_MEAN: int
    EMA_VAR: int
    EMA_SEEN: int
    SPIKE_HEADER: int
    SCALE_FLOOR: float
    WINDOW_BLOCK: int
    AT_MIN_SCALE: int
    TOO_MANY_SKIPS: int
    AT_RAISE_SCALE: int
    CHECK_BITS: int
    CHECK_SCALE: int
    CHECK_CONSECUTIVE_SKIPS: int
    CHECK_UPDATES: int
    ZCLIP_PERCENTILE: int
    ZCLIP_MEAN: int


#: The constants, from the definitions above (each has its one home there).
KERNEL_CONSTANTS = KernelConstants(**{name: globals()[name] for name in KernelConstants._fields})

# ------------------------------------------------------------ stats() (loop_state.py)
#: Bytes per value in the stats buffer: every dtype of a stat fits (float32/64, int32/64).
SLOT_BYTES = 8
