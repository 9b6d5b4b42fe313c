"""What the ranks of a process group must agree on before a combined step goes ahead.

A collective pairs the calls of the ranks by order alone: nothing in it says that the ranks divide
by the same loss scale, that they are at the same call of the same iteration, that they clip the
same optimizer by the same ``max_norm``, or (for the ``Updater``'s all-reduce) that they sum the
same gradients. Each of these can differ without an error -- a scaler checkpoint loaded on one
rank, a ``clip_grad_norm_`` called twice on one rank, two optimizers clipped in another order, a
``max_norm`` schedule on one rank -- and the replicas then drift apart, silently.

**The row.** So every combine gathers one row per rank (``rank_combine``), always of the same
width, whatever the call: the rank's own results (``RESULTS``: norm, found_inf, whether it holds
gradients, a hash of its part of the optimizer) and then ``AGREED``, everything that changes the
combined result and must be the same on every rank, by construction rather than by a list of
past bugs:

* the **call**: the scaler's ``iteration`` and the combine's index in it (``call``), which entry
  point issued it (``kind``: the flags of unscale_/step, a clip, the Updater's gradient sum) and
  its arguments (``max_norm``, ``norm_type``);
* the **optimizer**: a hash of what every rank's copy of it shares (its class and every
  ``param_groups`` setting but the parameters themselves, which a ZeRO partition splits), a hash of
  the values of its tensor-valued settings (``settings``: a tensor lr, which the first hash counts
  by dtype and shape only), and its **partners**: a fingerprint of every rank's part of it at its
  last combine, so a rank that pairs it with another optimizer of the others (two optimizers called
  in another order) is caught;
* the **policy** (a hash of its class and every knob), the **loss scale** (its exact float32 value)
  and the **trackers** (a hash of the values of the rest of the scaler's device state: growth
  tracker, counters, norm and spike statistics), so a checkpoint loaded on one rank is caught even
  where it kept the scale;
* for the Updater, which sums replicated gradients, the **gradients** and their **layout** (each
  parameter's size, dtype and whether it has a gradient); a scaler's combine puts 0 there, since
  partitions legitimately differ;
* whether this combine is **ambiguous** (``REFUSED``: any rank that sets it refuses the combine on
  every rank, even where all agree), below.

The value hashes (``values_digest``) are made on the device, with no host read: each value's
float64 bits as 16-bit integers, weighted by position and summed in int64, exact in any order, so
ranks holding the same values hold bitwise the same hash.

Every rank compares all ranks' rows, so every rank that reaches a mismatched collective sees the
mismatch, and the row's fixed width means a mismatched call can never make the collective itself
fail in C++ (gloo aborts on buffers of different sizes).

**The sequence** (``RankChecks``, one per scaler; the one place that counts): ``iteration`` is the
number of iterations this scaler has ended -- its ``update()`` calls, and for a disabled scaler
(a bf16 loop may never call ``update()``) its ``step()`` calls -- and ``call`` is the number of
combines this scaler issued on that process group in the current iteration.

**Alike optimizers.** Two optimizers identical in class and every setting, each partitioned over
the ranks, look the same to every rank until each has combined once (their partners are unknown
before): a rank calling them in another order from their very first combine would combine one with
the other unseen. So the first combine of an optimizer whose hash equals that of another live
optimizer this scaler combined on the same group sets ``ambiguous``, and every rank raises (on a
GPU path: the pending flag below), in either order: no rank raises alone before the collective,
which would leave the others waiting. The fix, named in the error: give each one's param groups a
distinguishing key (``{"params": ..., "name": "decoder"}``; torch keeps extra keys).

**Where the error is raised.** Deciding to raise is a host read. On the CPU reads cost nothing
(``host_reads.py``): every rank raises :class:`RankMismatchError` right after the collective,
before anything is written, naming the ranks and their values. On a GPU the step reads nothing on
the host, and a collective across ranks must not make it start (it would stall every step to
catch a misuse). There the mismatch becomes a device flag that (1) counts as an overflow in the
combine, so the clip writes nothing and a fused optimizer skips, (2) forces the step's skip flag,
and (3) makes ``update()`` keep the scale and its trackers as they were (it saves and restores
them on the device: a few small ops per ``update()`` once a process group is in use); a
mismatched step changes nothing. The error is raised at the next call that reads the host anyway:
``get_scale()``, ``state_dict()``, ``last_step_skipped()``, or the ``step()`` of an optimizer
that does not take ``found_inf`` (which reads the skip flag). Until then every step is skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import weakref
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from .. import host_reads
from ..errors import RankMismatchError

_UNUSED = (
    "the ranks hold gradients for different parameters (a parameter unused in some rank's loss, or "
    "a model cast to another dtype on some ranks), and the all-reduce sums the same gradients on every "
    "rank: make each parameter take part in every rank's loss (times 0 will do), keep one dtype on "
    "every rank, or use DistributedDataParallel(find_unused_parameters=True)"
)
_SAME_CALLS = (
    "every rank must make the same scaler calls (unscale_/clip_grad_norm_/step) on the same optimizers, "
    "in the same order, with the same arguments"
)
#: Each agreed column: what it is, and what to do when the ranks disagree on it.
CHECKED = {
    "scale": (
        "the loss scale",
        "every rank must divide by the same scale (a scaler state_dict loaded on some ranks only, or "
        "per-rank checkpoints): load the same scaler state_dict on every rank",
    ),
    "iteration": (
        "the scaler's iteration",
        "every rank must call update() (and, when disabled, step()) the same number of times",
    ),
    "call": (
        "the combine's index in the iteration",
        "the ranks called unscale_/clip_grad_norm_/step on this process group a different number of "
        "times in an iteration: " + _SAME_CALLS,
    ),
    "kind": (
        "which call combined (0: unscale_/step's inf check, 1: clip_grad_norm_, 2: the Updater's gradient sum)",
        _SAME_CALLS,
    ),  # fmt: skip
    "max_norm": ("clip_grad_norm_'s max_norm", "every rank must clip by the same max_norm (a schedule on every rank)"),
    "norm_type": ("clip_grad_norm_'s norm_type", "every rank must clip with the same norm_type"),
    "optimizer": (
        "the optimizer (a hash of its class and param_groups settings)",
        _SAME_CALLS + "; the same optimizer must have the same settings on every rank",
    ),
    "policy": (
        "the loss-scale policy (a hash of its class and every knob)",
        "make every rank's GradScaler with the same arguments (the same policy= or preset)",
    ),
    "gradients": ("the number of gradients", _UNUSED),
    "layout": ("the gradients' sizes, dtypes and which parameters have one (a hash)", _UNUSED),
    "ambiguous": (
        "an optimizer this scaler cannot tell apart from another one it combined on this process group (the "
        "same class and param_groups settings: a rank calling the two in another order would combine one "
        "with the other unseen)",
        'give each optimizer\'s param groups a distinguishing key, e.g. {"params": ..., "name": "decoder"} '
        "(torch keeps extra keys), on every rank",
    ),
    "partners": (
        "which optimizer each rank combined this one with before (a hash of every rank's parameter "
        "layout of it, from its last combine)",
        _SAME_CALLS + " (the ranks paired this optimizer with another one: optimizers called in another order)",
    ),
    "settings": (
        "the optimizer's tensor-valued settings (a hash of their values: a tensor lr, betas)",
        "every rank must set the same values (a learning-rate schedule, or a SkipAwareLR, stepped on some "
        "ranks only): schedule every rank's optimizer alike",
    ),
    "trackers": (
        "the scaler's trackers besides the scale (a hash of the growth tracker, counters, norm and spike statistics)",
        "every rank's scaler must have the same history (a scaler state_dict loaded on some ranks only, or "
        "per-rank checkpoints): load the same scaler state_dict on every rank",
    ),
}
#: A rank's own results, first in its row; every rank may differ here.
RESULTS = ("norm", "found_inf", "holds_grads", "layout_here")
#: The columns of the row after ``RESULTS``: what every rank must agree on. Their order is
#: ``RankChecks.stamp``'s: the device values (scale, iteration), the host numbers (one copy), the
#: device digests.
AGREED = tuple(CHECKED)
#: Agreed columns that refuse the combine when any rank sets them, even where every rank agrees.
REFUSED = ("ambiguous",)


class CallKind(str, enum.Enum):
    """Which entry point made a combine (the ``kind`` column): the flags of unscale_/step, a clip,
    the Updater's gradient sum. A ``str`` enum: each member equals its word (``CallKind.CLIP ==
    "clip"``), so ``scaler.rank_agreement(optimizer, "gradient sum", ...)`` keeps taking the word."""

    FLAGS = "flags"
    CLIP = "clip"
    GRADIENT_SUM = "gradient sum"

    __str__ = str.__str__  # "clip", not "CallKind.CLIP", in messages and f-strings
    __format__ = str.__format__


#: The value of each kind in the ``kind`` column: its place in ``CallKind`` (a word looks up the same).
KINDS = {kind: code for code, kind in enumerate(CallKind)}


def digest(value: Any) -> int:
    """A 32-bit hash of ``value``'s repr, the same in every process (exact in a float64 column)."""
    return zlib.crc32(repr(value).encode())


def layout_digest(optimizer: Any) -> int:
    """A hash of this rank's part of ``optimizer``: per param group, how many parameters and the
    shape and dtype of the first and the last (cheap: no walk over every parameter). Ranks of a
    ZeRO partition hold different parts, so it differs between them; what they agree on is the
    vector of every rank's (``RankChecks.partners``). Example: ``layout_digest(opt)``."""
    if optimizer is None:
        return 0
    parts = []
    for group in getattr(optimizer, "param_groups", ()):
        params = group["params"]
        ends = [(tuple(p.shape), str(p.dtype)) for p in (params[:1] + params[-1:])]
        parts.append((len(params), ends))
    return digest(parts)


def optimizer_digest(optimizer: Any) -> int:
    """What every rank's copy of ``optimizer`` shares, hashed: its class and each param group's
    settings but ``params`` (a ZeRO partition holds other parameters on each rank). Tensors count
    by dtype and shape (reading their values would be a host read). Example: ``optimizer_digest(opt)``."""
    if optimizer is None:
        return 0
    groups = [
        sorted((key, _settled(value)) for key, value in group.items() if key != "params")
        for group in getattr(optimizer, "param_groups", ())
    ]
    return digest((type(optimizer).__module__, type(optimizer).__qualname__, groups))


def _settled(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_settled(v) for v in value)
    return type(value).__qualname__


def policy_digest(policy: Any) -> int:
    """A hash of a ``LossScalePolicy``: its class and every knob (``knobs()``: each of its fields; a
    peer's preset is a policy plus its initial scale, which the scale column carries).
    Example: ``policy_digest(LossScalePolicy())``."""
    return digest((type(policy).__qualname__, sorted(policy.knobs().items())))


def setting_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors among ``optimizer``'s param-group settings (a tensor lr, tensor betas), in the
    order ``optimizer_digest`` hashes their keys: what it counts only by dtype and shape, and
    ``values_digest`` counts by value. Example: ``setting_tensors(opt)``."""
    found: list[torch.Tensor] = []
    for group in getattr(optimizer, "param_groups", ()) if optimizer is not None else ():
        for key in sorted(key for key in group if key != "params"):
            _collect_tensors(group[key], found)
    return found


def _collect_tensors(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for each in value:
            _collect_tensors(each, found)


#: ``values_digest``'s sum is taken modulo this (an exact integer in a float64 column).
_DIGEST_MODULUS = 2**52


def values_digest(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-dim float64 hash of the tensors' values, made on ``device`` with no host read: each value's
    float64 bits as four 16-bit integers, weighted by fixed pseudo-random integers by position and
    summed in int64 (modulo 2**52). Integer sums are exact in any order, so ranks that hold the
    same values hold bitwise the same digest; any one differing value changes it. 0 for no tensors.
    Example: ``values_digest([state.growth_tracker, state.counters], device)``."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    flat = torch.cat([t.detach().reshape(-1).to(device, torch.float64, non_blocking=True) for t in tensors])
    parts = flat.view(torch.int16).long()  # a float64's 8 bytes as 4 signed 16-bit integers
    position = torch.arange(parts.numel(), dtype=torch.int64, device=device)
    weights = (position * 40503 + 12345) % 1_048_573 + 1  # below 2**20: each product below 2**36
    return ((parts * weights).sum() % _DIGEST_MODULUS).double()


def tracker_tensors(state: Any) -> list[torch.Tensor]:
    """The scaler's device state (a ``DeviceState``) but the scale, which has its own column: the
    trackers whose values change later steps (growth tracker, counters, norm and spike statistics)."""
    if state is None:
        return []
    return [getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "scale"]


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What one combine's row carries besides the rank's results, as every rank must make the call:
    the scaler's sequence (``ranks``), its loss scale (None: disabled, read as 1), which entry point
    (``kind``, a ``CallKind`` or its word), on which optimizer, under which policy (a ``LossScalePolicy``), with which
    clip arguments, for the Updater's sum the gradients' count and layout hash, and the scaler's
    device state (``state``, a ``DeviceState``: its trackers are hashed on the device; None before
    the first scale() or when disabled). The hashes are taken only when a row is made (a process
    group is in use). Example:
    ``Agreement(ranks, scale, "clip", optimizer, policy, max_norm=1.0, norm_type=2.0, state=tensors)``."""

    ranks: RankChecks
    loss_scale: torch.Tensor | None
    kind: str = CallKind.FLAGS
    optimizer: Any = None
    policy: Any = None
    max_norm: float = 0.0
    norm_type: float = 0.0
    gradients: int = 0
    layout: int = 0
    state: Any = None

    def columns(self) -> list[float]:
        """The host-made agreed columns after ``call``, in ``AGREED`` order: kind, max_norm,
        norm_type, optimizer, policy, gradients, layout."""
        policy = 0 if self.policy is None else policy_digest(self.policy)
        return [KINDS[self.kind], self.max_norm, self.norm_type, optimizer_digest(self.optimizer), policy,
                self.gradients, self.layout]  # fmt: skip


class RankChecks:
    """One scaler's call sequence on its process groups, and a mismatch not raised yet (GPU)."""

    def __init__(self) -> None:
        #: 0-dim int64 tensor, on the device of the scale once an update() ran there: a device
        #: value, so that a compiled update() counts without a guard on it (a Python int would be
        #: a constant of the graph, recompiled at every iteration) and without a host read.
        #: Read it through ``iteration``, which adds the eager iterations counted in ``_uncounted``.
        self._iteration = torch.zeros((), dtype=torch.int64)
        #: Iterations ended eagerly and not yet added to the tensor: a single process never makes a
        #: row, so it pays a Python ``+= 1`` per iteration, not a tensor op.
        self._uncounted = 0
        self._calls: dict[Any, int] = {}  # process group -> combines issued on it this iteration
        #: optimizer -> fingerprint of every rank's layout of it at its last combine (``partners``).
        self._partners: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()
        #: process group -> {optimizer: its ``optimizer_digest`` at its last combine there} (``ambiguous``).
        self._digests: dict[Any, weakref.WeakKeyDictionary[Any, int]] = {}
        #: 0-dim float32 device flag, 1 once a combine saw a mismatch not raised yet (GPU paths).
        self.pending: torch.Tensor | None = None
        self._seen: tuple[torch.Tensor, tuple[str, ...]] | None = None  # what the first one showed

    @property
    def iteration(self) -> torch.Tensor:
        """The number of iterations ended (0-dim int64 device tensor), read where a row is made (a
        process group is in use) and by checkpoints: the eager ones counted on the host are added
        first. Example: ``int(RankChecks().iteration) == 0``."""
        if self._uncounted and not torch.compiler.is_compiling():
            self._iteration.add_(self._uncounted)
            self._uncounted = 0
        return self._iteration

    def next_iteration(self, device: torch.device | None = None) -> None:
        """The scaler ended an iteration (update(); a disabled scaler's step()). ``device``: where
        the count is to live from now on (the scale's); None keeps it where it is. Eagerly, a
        Python count (``iteration`` adds it to the tensor when read); traced or captured in a CUDA graph,
        the tensor's own op."""
        if device is not None and self._iteration.device != device:
            self._iteration = self._iteration.to(device)
        if torch.compiler.is_compiling() or host_reads.capturing(self._iteration.device):
            self._iteration.add_(1)  # a Python count would not advance in a replay (nor in a compiled graph)
        else:
            self._uncounted += 1
        if self._calls:
            self._calls = {}

    def stamp(self, group: Any, scale: torch.Tensor, agreement: Agreement) -> torch.Tensor:
        """This rank's ``AGREED`` columns for the next combine on ``group`` (float64: a float32 scale,
        the iteration count, a 32-bit hash, a Python float and the device digests are exact in it),
        counting the combine. Nothing is read on the host: the device values stay on the device."""
        index = self._calls.get(group, 0)
        self._calls[group] = index + 1
        device = scale.device
        iteration = self.iteration.to(device, torch.float64, non_blocking=True).reshape(1)
        columns = agreement.columns()  # kind, max_norm, norm_type, optimizer, policy, gradients, layout
        ambiguous = self.ambiguous(group, agreement.optimizer, columns[3])
        host = on_device([index, *columns, float(ambiguous)], device)  # call ... ambiguous: one copy
        digests = [
            self.partners(agreement.optimizer, device),
            values_digest(setting_tensors(agreement.optimizer), device),
            values_digest(tracker_tensors(agreement.state), device),
        ]
        return torch.cat([scale.detach().reshape(1).double(), iteration, host, torch.stack(digests)])

    def ambiguous(self, group: Any, optimizer: Any, optimizer_hash: int) -> bool:
        """Whether ``optimizer``, at its first combine on ``group``, has the ``optimizer_digest``
        of another live optimizer this scaler combined there: nothing every rank computes then
        tells the two apart (their partners are unknown yet), so a rank calling them in another
        order would combine one with the other unseen. Such an optimizer is not remembered, so
        every combine of it is refused until the two differ (a ``name`` key in its param groups)."""
        if optimizer is None:
            return False
        known = self._digests.setdefault(group, weakref.WeakKeyDictionary())
        if optimizer not in known and optimizer_hash in known.values():
            return True
        known[optimizer] = optimizer_hash
        return False

    def partners(self, optimizer: Any, device: torch.device) -> torch.Tensor:
        """The ``partners`` column for ``optimizer``: a fingerprint of every rank's
        ``layout_digest`` of it at its last combine (0 before its first). Ranks that pair the
        same optimizers hold the same fingerprint; a rank that pairs this one with another
        optimizer of the others holds another (caught from the second combine of each on)."""
        seen = self._partners.get(optimizer) if optimizer is not None else None
        if seen is None:
            return torch.zeros((), dtype=torch.float64, device=device)
        return seen.to(device, non_blocking=True)

    def remember_partners(self, optimizer: Any, layouts: torch.Tensor) -> None:
        """After a combine the ranks agreed on: ``layouts`` ([world] float64, every rank's
        ``layout_digest``, the same on every rank) fingerprinted on the device, for ``partners``."""
        if optimizer is None:
            return
        weights = torch.arange(1, layouts.numel() + 1, dtype=torch.float64, device=layouts.device)
        self._partners[optimizer] = (layouts * weights).sum()

    def judge(self, checked: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor | None:
        """``checked``: [world, len(names)], every rank's values in rank order (the same on every
        rank). A mismatch: any column differs, or any rank set a ``REFUSED`` column. Where reads are
        free, raise on it; else return the device flag (1.0: mismatch) that the caller folds into the
        step's found_inf, also kept in ``pending``."""
        refused = [names.index(name) for name in REFUSED if name in names]
        if host_reads.are_free(checked.device):
            values = checked.tolist()
            if any(row != values[0] for row in values) or any(row[i] for row in values for i in refused):
                raise RankMismatchError(describe(values, names))
            return None
        flag = ((checked != checked[:1]).any() | (checked[:, refused] != 0).any()).float()
        if self.pending is None:
            self.pending, self._seen = flag, (checked, names)
        else:
            seen, seen_names = self._seen
            if seen_names == names and seen.shape == checked.shape:  # keep the first mismatch's values
                self._seen = (torch.where(self.pending > 0, seen, checked), names)
            self.pending = torch.maximum(self.pending, flag)
        return flag

    def raise_if_flagged(self) -> None:
        """Raise the mismatch a GPU-path combine flagged (a host read); called only where the
        scaler reads the host anyway. Clears it."""
        if self.pending is None:
            return
        pending, (checked, names) = self.pending, self._seen
        self.pending = self._seen = None
        if pending.item():
            raise RankMismatchError(describe(checked.tolist(), names))

    def read_skip(self, skip: torch.Tensor) -> bool:
        """Read a step's skip flag on the host (a step that reads it anyway); a skip that was a
        pending mismatch raises it."""
        if not skip.item():
            return False
        self.raise_if_flagged()
        return True

    def skip(self, skip: torch.Tensor) -> torch.Tensor:
        """A step's skip flag, forced on while a mismatch is pending."""
        if self.pending is None:
            return skip
        return torch.maximum(skip, self.pending.to(skip.device, non_blocking=True).to(skip.dtype))

    @contextlib.contextmanager
    def unchanged_if_mismatched(self, state: Any) -> Iterator[None]:
        """Around update(): where a mismatch is pending, the device state (a ``DeviceState``) ends
        as it began, on the device (no host read). Nothing to do without a pending flag."""
        if self.pending is None or state is None:
            yield
            return
        tensors = [getattr(state, f.name) for f in dataclasses.fields(state)]
        saved = [t.clone() for t in tensors]
        try:
            yield
        finally:
            keep = self.pending > 0
            for tensor, old in zip(tensors, saved):
                tensor.copy_(torch.where(keep.to(tensor.device), old, tensor))

    def __getstate__(self) -> dict[str, Any]:
        # Process groups and device flags do not travel; the count does (on the CPU).
        return {"_iteration": self.iteration.cpu(), "_uncounted": 0, "_calls": {}, "pending": None, "_seen": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Partners and digests name optimizers and groups of this process: none travel.
        self.__dict__.update(state, _partners=weakref.WeakKeyDictionary(), _digests={})


#: The context update() runs its rule in while no mismatch is pending (a single process never has
#: one): nothing to undo. A ``nullcontext`` keeps no state, so one serves every update().
NOTHING_TO_UNDO = contextlib.nullcontext()


def on_device(values: list[float], device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Host numbers as a tensor on ``device``, copied without waiting for the device's queue (a
    ``torch.tensor(..., device=cuda)`` copy waits for the stream)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def describe(values: list[list[float]], names: tuple[str, ...]) -> str:
    """The error message: each column the ranks disagree on, every rank's value, what to do; and
    each ``REFUSED`` column a rank set: what is ambiguous, and what works instead. Where the ranks
    agree on every value but a refused column, the message says so: nothing differs between them."""
    world, differing, refused, everywhere = len(values), [], [], True
    for column, name in enumerate(names):
        seen = [row[column] for row in values]
        label, advice = CHECKED[name]
        if name in REFUSED and any(seen):
            everywhere = everywhere and all(seen)
            where = "" if all(seen) else " (seen on rank " + ", ".join(str(r) for r, v in enumerate(seen) if v) + ")"
            refused.append(f"ambiguous{where}: {label}. What works instead: {advice}")
        elif any(v != seen[0] for v in seen):
            shown = ", ".join(f"rank {r}: {_shown(name, v)}" for r, v in enumerate(seen))
            differing.append(f"{label} differs between the ranks ({shown}); {advice}")
    if not differing:
        return (
            f"tritonscale: the combined step is refused on all {world} ranks of the process group. The ranks do "
            f"not disagree ({'every' if everywhere else 'every other'} value they compared is the same on each); "
            "the combine is ambiguous, so every rank refuses it alike, and nothing of this step was applied. "
            + ". ".join(refused)
        )
    return (
        f"tritonscale: the {world} ranks of the process group disagree, so the combined step "
        "would be wrong on some of them; nothing of this step was applied. " + ". ".join(differing + refused)
    )


def _shown(name: str, value: float) -> str:
    if name in ("scale", "max_norm", "norm_type"):
        return repr(value)
    if name in ("layout", "optimizer", "policy"):
        return f"{int(value):08x}"
    if name in ("settings", "trackers"):
        return f"{int(value):013x}"
    return str(int(value))
