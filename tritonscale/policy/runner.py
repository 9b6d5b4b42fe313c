"""The end of an iteration: the optimizers' flags go into the policy's rule.

``PolicyRunner`` runs a ``LossScalePolicy``'s rule on the scaler's device state in one of its two
executors: on a GPU as one Triton launch whatever the policy (``kernel_form.py``); as the rule's
tensor ops everywhere else -- the CPU, while Dynamo traces a step (inductor fuses them), where the
kernel cannot launch -- compiled where each op would be a launch (CUDA without the kernels) or on
request (``compile_policy=True``). The only host read is the opt-in check of policies that must
stop or warn.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..flags import combine_flags, flags_on, moved_to
from ..kernels import TRITON_FOUND
from ..kernels.interfaces import CHECK_BITS, CHECK_CONSECUTIVE_SKIPS, CHECK_SCALE, CHECK_UPDATES, MAX_FLAGS
from .counters import CONSECUTIVE_SKIPS
from .stop_rules import HostCheck, HostCheckRead, UpdatesWithoutRead, act_on_host_checks, host_check_flags
from .kernel_form import kernel_rule, kernel_runs
from .loss_scale_policy import LossScalePolicy
from .spike_rules import zclip_max_norm
from .state import DeviceState

if TRITON_FOUND:  # a CPU install without triton runs the rule's tensor ops (kernel_form.kernel_runs)
    from ..kernels.policy_update import PreparedUpdates, update_policy_state_


class IterationOutcome(NamedTuple):
    """What an iteration's passes and steps left for the rule, in the order the optimizers ran:
    their found_inf flags (already the process group's), their steps' skip flags, their clips' norms
    (all 0-dim device tensors). Example: ``IterationOutcome([found_inf], [skip], [norm])``."""

    found_infs: list[torch.Tensor]
    skips: list[torch.Tensor]
    norms: list[torch.Tensor]


class PolicyRunner:
    """Calls a policy's ``skip_decision`` and ``update_``: one kernel, compiled or eager tensor ops.

    ``compile_policy``: True (the tensor ops compiled), False, or None: the kernel wherever it can
    launch (``kernel_form.kernel_runs``), else eager tensor ops. ``backend``: the scaler's backend
    name ("auto", "triton", "torch"), which decides where the kernel may launch.
    """

    def __init__(self, compile_policy: bool | None, backend: str = "auto") -> None:
        self.compile_policy = compile_policy
        self.backend = backend
        # A pure function of its key: each rule is bound to its policy, which it keeps alive, so the
        # id in the key names that policy as long as the entry exists. A knob set later still counts:
        # the eager rule reads it at each call, a compiled one recompiles on Dynamo's guards.
        self._made: dict[tuple[str, int, bool], Callable[..., Any]] = {}
        self._unread = UpdatesWithoutRead()  # the host check's reads the device may skip
        # The policy kernel's last launch, prepared: the next one like it skips the generic guard.
        self._prepared = PreparedUpdates() if TRITON_FOUND else None

    def _compiles(self, device: torch.device) -> bool:
        """The tensor-op rule is compiled: on request, or (None) on CUDA where the kernels cannot
        launch (``backend="torch"``): there each of the rule's ~10-40 tiny ops would be a launch.
        Where the kernels launch, what the kernels do not decide (a step's skip with no clip or
        check before it) stays eager: no Dynamo call, and no compile inside a CUDA-graph capture."""
        if self.compile_policy is not None:
            return self.compile_policy
        return device.type == "cuda" and not kernel_runs(device, self.backend)

    def uses_kernel(self, device: torch.device) -> bool:
        """The update runs as the one policy kernel on ``device``: wherever the kernel launches
        (``kernel_runs``: a GPU; the CPU under the interpreter with backend "triton"), not asked to
        be compiled, not while Dynamo traces (a compiled step keeps the tensor ops, which inductor fuses)."""
        return (
            self.compile_policy is not True
            and not torch.compiler.is_compiling()
            and kernel_runs(device, self.backend)
        )

    def rule(self, policy: LossScalePolicy, name: str, device: torch.device) -> Callable[..., Any]:
        """The policy method ``name`` as it runs on ``device``: the bound method, or compiled where
        that is on. Made once per policy object, not again on every call."""
        compiled = self._compiles(device)
        key = (name, id(policy), compiled)
        made = self._made.get(key)
        if made is None:
            # A new policy (load_state_dict) drops the rules made for the old one.
            self._made = {k: v for k, v in self._made.items() if k[1] == id(policy)}
            method = getattr(policy, name)
            made = self._made[key] = torch.compile(method, fullgraph=True, dynamic=False) if compiled else method
        return made

    def update_(
        self,
        policy: LossScalePolicy,
        state: DeviceState,
        outcome: IterationOutcome,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fold this iteration's outcome into ``state`` in place; return the combined found_inf
        and the norm that were used (the last clip_grad_norm_'s, or None)."""
        device = state.scale.device
        if not outcome.found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        if self.uses_kernel(device):
            return self._kernel_update_(policy, state, outcome, count_only=False)
        found_inf, skipped = self._flags(policy, state, outcome)
        norm = _last_norm(outcome, device)
        checks = policy.needs_host_check()
        if checks:
            self._host_check(policy, state, found_inf, skipped)
        tensors = (state.scale, state.growth_tracker, state.counters, state.norm_stats, found_inf, skipped, norm)
        self.rule(policy, "update_", device)(*tensors, spike_stats=state.spike_stats)
        self._seen(policy, state, checks)
        return found_inf, norm

    def _seen(self, policy: LossScalePolicy, state: DeviceState, checked: bool) -> None:
        if checked:
            self._unread.seen(policy, state)
        else:  # nothing checked now: a later check reads
            self._unread.forget()

    def _kernel_update_(
        self, policy: LossScalePolicy, state: DeviceState, outcome: IterationOutcome, count_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The update (or ``count_only``, record_iteration_) as one launch. The opt-in host checks:
        where one could fire, the kernel also writes the check bits and the values they name, and
        leaves the state untouched when a raising one fires; the one host read follows the launch."""
        device = state.scale.device
        found_infs, skips = _kernel_flags(outcome.found_infs, device), _kernel_flags(outcome.skips, device)
        norm = _last_norm(outcome, device)
        checks = not count_only and policy.needs_host_check()
        reads = checks and not self._unread.skips_read(policy, state)
        tensors = (state.scale, state.growth_tracker, state.counters, state.norm_stats, state.spike_stats)
        result = update_policy_state_(
            tensors, found_infs, skips, norm, kernel_rule(policy), count_only=count_only, checks=reads, hold=reads,
            prepared=self._prepared,
        )  # fmt: skip
        if reads:
            read = result.checks.tolist()  # the one host read
            scale, in_a_row = read[CHECK_SCALE], int(read[CHECK_CONSECUTIVE_SKIPS])
            self._unread.set(policy, scale, in_a_row)
            seen = HostCheckRead(scale, in_a_row, int(read[CHECK_UPDATES]))
            act_on_host_checks(policy, HostCheck(int(read[CHECK_BITS])), seen)
        if not count_only:
            self._seen(policy, state, checks)
        return result.found_inf, norm

    def _host_check(
        self, policy: LossScalePolicy, state: DeviceState, found_inf: torch.Tensor, skipped: torch.Tensor
    ) -> None:
        """The opt-in checks that must stop or warn, before anything changes: one read -- and none
        while ``UpdatesWithoutRead`` proves they cannot fire."""
        if self._unread.skips_read(policy, state):
            return
        flags = host_check_flags(policy, state.scale, state.counters, found_inf, skipped)
        values = torch.stack([flags.double(), state.scale.double(), state.counters[CONSECUTIVE_SKIPS].double()])
        flags, scale, in_a_row = values.tolist()  # the one host read
        self._unread.set(policy, scale, int(in_a_row))
        if flags:
            act_on_host_checks(policy, HostCheck(int(flags)), HostCheckRead.of(state.scale, state.counters))

    def clip_limit(self, policy: LossScalePolicy, state: DeviceState | None, max_norm: float) -> Any:
        """With ZClip's adaptive clip on (``clip_norm_z``): the function from this step's norm to the
        clip's ``max_norm`` (a float32 0-dim device tensor, spike_rules.py), else None. Example:
        ``runner.clip_limit(policy, state, 1.0)(norm)``."""
        if policy.clip_norm_z is None or state is None:
            return None
        return functools.partial(zclip_max_norm, policy, state.spike_stats, max_norm=max_norm)

    def count_only_(
        self, policy: LossScalePolicy, state: DeviceState, outcome: IterationOutcome
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``update(new_scale)``: the scale is set by hand, but the iteration counts as ``update_``
        counts it (the policy's ``record_iteration_``: stats(), last_step_skipped(), the norm
        rules' histories). Returns the found_inf and norm of the iteration, as ``update_`` does, so
        stats() describes the step it counted. Nothing recorded (torch allows that here): nothing
        counted, (None, None)."""
        if not outcome.found_infs:
            return None, None
        device = state.scale.device
        if self.uses_kernel(device):
            return self._kernel_update_(policy, state, outcome, count_only=True)
        found_inf, skipped = self._flags(policy, state, outcome)
        norm = _last_norm(outcome, device)
        self.rule(policy, "record_iteration_", device)(
            state.counters, state.norm_stats, skipped, norm, spike_stats=state.spike_stats
        )
        return found_inf, norm

    def _flags(
        self, policy: LossScalePolicy, state: DeviceState, outcome: IterationOutcome
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The iteration's combined found_inf and skip flag, from flags that are already the
        process group's (the passes combined them); at least one found_inf was recorded."""
        device = state.scale.device
        found_inf = _flag_on(device, outcome.found_infs)
        if outcome.skips:
            return found_inf, combine_flags(outcome.skips)
        # No optimizer stepped (unscale_ only): what overflowed counts as skipped.
        return found_inf, self.rule(policy, "skip_decision", device)(found_inf, None, state.norm_stats)

    def __getstate__(self) -> dict[str, Any]:
        return {"compile_policy": self.compile_policy, "backend": self.backend}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Rules (compiled ones too) are rebuilt on use; a copy reads its first host check.
        self.__init__(state["compile_policy"], state["backend"])


def _flag_on(device: torch.device, flags: list[torch.Tensor]) -> torch.Tensor:
    """``flags_on(device, flags)``, with the one 0-dim flag already on ``device`` (a single
    optimizer's every update) handed back as it is, as ``flags_on`` would, without its list."""
    if len(flags) == 1 and flags[0].dim() == 0 and flags[0].device == device:
        return flags[0]
    return flags_on(device, flags)


def _kernel_flags(flags: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``flags`` on ``device`` (``flags.moved_to``'s rule, inline: every update pays it), as they
    are, or summed into one when there are more than the kernel reads by pointer (more optimizers
    than ``MAX_FLAGS`` on one scaler: two launches more)."""
    moved = [f if f.device == device else f.to(device, non_blocking=True) for f in flags]
    return moved if len(moved) <= MAX_FLAGS else [combine_flags(moved)]


def _last_norm(outcome: IterationOutcome, device: torch.device) -> torch.Tensor | None:
    """The iteration's last clip_grad_norm_'s norm on ``device``; None if it clipped nothing."""
    return moved_to(outcome.norms[-1], device) if outcome.norms else None
