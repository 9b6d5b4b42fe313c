"""The rank column's scenarios, run on two gloo ranks (tests/support/multiprocess.py) one after another.

ZeRO-style: two optimizers, A and B, each over half of the model's parameters on each rank (rank
r holds parameter i of each where i % 2 == r), one GradScaler with ``process_group=`` a group of
both ranks. A's and B's param groups carry a ``name`` (alike otherwise, the scaler refuses them:
the scenario alike_optimizers_in_another_order). Each scenario builds everything afresh, in a
group of its own (so that a scenario that leaves its collectives out of step cannot pair them
with the next one's, and a hang ends at SCENARIO_TIMEOUT), and saves each rank's outcome to a
file as soon as it has one: a rank that dies in C++ leaves the outcomes before it, and the test
starts the remaining scenarios again.

A control scenario returns norms, scales and parameters for the one-process oracle; a perturbed
one returns, per rank, the error raised (or None) and whether parameters, gradients and optimizer
state are bitwise what they were before the mismatched iteration.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from oracles.scaler_twins import bits, same_bits

import tritonscale

SCALE = 2.0**10
MAX_NORM = 0.5
LR = 0.1
# Optimizer A's parameters and B's: two of A's on each rank (a norm of order 0 counts tensors).
SHAPES = {"a": [(5, 3), (7,), (2, 2), (6,)], "b": [(4,), (3, 3)]}
STEPS = 3
OVERFLOW = 1  # rank 1's part of B gets an inf at this iteration: every rank must skip
SCENARIO_TIMEOUT = datetime.timedelta(seconds=10)


def full_grads(step: int) -> dict[str, list[torch.Tensor]]:
    """Every parameter's (unscaled) gradient at ``step``: the one process holds all of them."""
    g = torch.Generator().manual_seed(50 + step)
    return {name: [torch.randn(shape, generator=g) for shape in shapes] for name, shapes in SHAPES.items()}


def held(rank: int, layout: str, shapes: list) -> list[int]:
    """Which of an optimizer's parameters ``rank`` holds: "split" (i % 2 == rank), or
    "rank1_empty" (rank 0 holds them all; rank 1's optimizers are empty)."""
    if layout == "rank1_empty":
        return list(range(len(shapes))) if rank == 0 else []
    return [i for i in range(len(shapes)) if i % 2 == rank]


class Zero:
    """One rank's partitions of A and B, their optimizers and the scaler. ``named``: A's and B's
    param groups carry a ``name`` (else nothing tells the two alike optimizers apart: the scaler
    refuses them); ``tensor_lr``: each optimizer's lr a tensor of its own; ``knobs``: the
    GradScaler's further arguments (a policy knob, ``policy=``)."""

    def __init__(
        self,
        rank: int,
        group,
        backend: str = "torch",
        layout: str = "split",
        *,
        named: bool = True,
        tensor_lr: bool = False,
        **knobs,
    ) -> None:
        self.rank = rank
        self.held = {name: held(rank, layout, shapes) for name, shapes in SHAPES.items()}
        self.params = {
            name: [torch.nn.Parameter(torch.zeros(shapes[i])) for i in self.held[name]]
            for name, shapes in SHAPES.items()
        }
        self.opt = {
            name: torch.optim.SGD(
                [{"params": ps, **({"name": name} if named else {})}], lr=torch.tensor(LR) if tensor_lr else LR
            )
            for name, ps in self.params.items()
        }
        args = knobs if "policy" in knobs else {"growth_interval": 1, **knobs}  # a preset brings its own
        self.scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, backend=backend, process_group=group, **args)

    def set_grads(self, step: int) -> None:
        scale = self.scaler.get_scale()
        self.scaler.scale(torch.ones(()))  # the scale's device state, as a scaled backward makes it
        grads = full_grads(step)
        for name, params in self.params.items():
            for i, p in zip(self.held[name], params):
                p.grad = grads[name][i] * scale
                if name == "b" and i == 1 and step == OVERFLOW:
                    p.grad.view(-1)[0] = math.inf

    def clip(self, name: str, max_norm: float = MAX_NORM, norm_type: float = 2.0) -> torch.Tensor:
        self.before_call = self.state()  # what a refused call must leave as it was
        return self.scaler.clip_grad_norm_(self.opt[name], max_norm, norm_type)

    def step_and_update(self) -> None:
        self.scaler.step(self.opt["a"])
        self.scaler.step(self.opt["b"])
        self.scaler.update()

    def state(self) -> list:
        """Parameters, gradients and optimizer state, bit for bit."""
        params = [p for ps in self.params.values() for p in ps]
        return [[bits(p) for p in params], [bits(p.grad) for p in params], [o.state_dict() for o in self.opt.values()]]

    def result(self, norms: list) -> dict:
        return {
            "norms": [bits(n) for n in norms],
            "scale": self.scaler.get_scale(),
            "params": {name: [p.detach().clone() for p in ps] for name, ps in self.params.items()},
        }


def describe(error: BaseException) -> tuple:
    cause = error.__cause__
    return type(error).__name__, type(cause).__name__ if cause is not None else None, str(error)[:600]


# ------------------------------------------------------------------------------ controls
def control(backend: str = "torch", layout: str = "split", norm_type: float = 2.0) -> Callable:
    """No rank perturbed: clip A, clip B, step both, update, STEPS times (overflow included)."""

    def scenario(rank: int, group) -> dict:
        zero, norms = Zero(rank, group, backend, layout), []
        for step in range(STEPS):
            zero.set_grads(step)
            norms += [zero.clip("a", norm_type=norm_type), zero.clip("b", norm_type=norm_type)]
            zero.step_and_update()
        return zero.result(norms)

    return scenario


# ---------------------------------------------------------------------- one rank perturbed
def perturbed(
    iteration: Callable[[Zero], None], before: Callable[[Zero], None] | None = None, **zero_kwargs
) -> Callable:
    """One agreeing iteration, ``before`` (a set-up one rank may change), the gradients of the next
    step, then ``iteration(zero)`` in which one rank differs: which error each rank raises, and
    whether anything changed. ``zero_kwargs``: Zero's arguments, the same on every rank."""

    def scenario(rank: int, group) -> dict:
        zero = Zero(rank, group, **zero_kwargs)
        zero.set_grads(0)
        zero.clip("a"), zero.clip("b")
        zero.step_and_update()
        if before is not None:
            before(zero)
        zero.set_grads(2)
        return outcome(zero, iteration)

    return scenario


def built_apart(iteration: Callable[[Zero], None], rank1: dict, **both) -> Callable:
    """Zero built with ``both`` on every rank and ``rank1`` on rank 1 only, then ``iteration``
    from the first step: the first combine the ranks cannot agree on must raise on every rank."""

    def scenario(rank: int, group) -> dict:
        zero = Zero(rank, group, **both, **(rank1 if rank == 1 else {}))
        zero.set_grads(0)
        return outcome(zero, iteration)

    return scenario


def outcome(zero: Zero, iteration: Callable[[Zero], None]) -> dict:
    """``iteration(zero)``: the error it raised (or None), and whether the call that raised changed
    nothing (an earlier call the ranks agreed on, such as the first clip before an extra one, did
    its work)."""
    zero.before_call = zero.state()
    try:
        iteration(zero)
        error = None
    except Exception as caught:  # noqa: BLE001 - which error, on which rank, is the outcome
        error = describe(caught)
    return {"error": error, "unchanged": same_bits(zero.before_call, zero.state())}


def clips_in_order(zero: Zero) -> None:
    for name in ("a", "b") if zero.rank == 0 else ("b", "a"):
        zero.clip(name)
    zero.step_and_update()


def another_max_norm(zero: Zero) -> None:
    max_norm = MAX_NORM * (1 + zero.rank)
    zero.clip("a", max_norm), zero.clip("b", max_norm)
    zero.step_and_update()


def another_norm_type(zero: Zero) -> None:
    norm_type = 2.0 if zero.rank == 0 else math.inf
    zero.clip("a", norm_type=norm_type), zero.clip("b", norm_type=norm_type)
    zero.step_and_update()


def clip_or_unscale(zero: Zero) -> None:
    for name in ("a", "b"):
        zero.clip(name) if zero.rank == 0 else zero.scaler.unscale_(zero.opt[name])
    zero.step_and_update()


def extra_clip(zero: Zero) -> None:
    for name in ("a", "a", "b") if zero.rank == 0 else ("a", "b"):
        zero.clip(name)
    zero.step_and_update()


def load_another_scale(zero: Zero) -> None:
    if zero.rank == 1:  # a checkpoint of another run, loaded on this rank only
        zero.scaler.load_state_dict(tritonscale.GradScaler("cpu", init_scale=SCALE * 8).state_dict())


def load_a_fresh_state(zero: Zero) -> None:
    """A checkpoint of another run at the same scale, loaded on rank 1 only: the scale agrees, the
    trackers (the update count, the norm statistics) do not."""
    if zero.rank == 1:
        fresh = tritonscale.GradScaler("cpu", init_scale=zero.scaler.get_scale(), growth_interval=1)
        zero.scaler.load_state_dict(fresh.state_dict())


def schedule_on_rank_0(zero: Zero) -> None:
    """A's tensor lr halved on rank 0 only (its StepLR stepped there alone)."""
    scheduler = torch.optim.lr_scheduler.StepLR(zero.opt["a"], step_size=1, gamma=0.5)
    if zero.rank == 0:
        scheduler.step()


def skip_aware_lr_on_rank_0(zero: Zero) -> None:
    """Both ranks build A's StepLR; rank 0 alone wraps it in SkipAwareLR and steps that."""
    scheduler = torch.optim.lr_scheduler.StepLR(zero.opt["a"], step_size=1, gamma=0.5)
    if zero.rank == 0:
        tritonscale.SkipAwareLR(scheduler, zero.scaler, total_steps=2).step()


def clips_in_order_from_the_start(zero: Zero) -> None:
    for name in ("a", "b") if zero.rank == 0 else ("b", "a"):
        zero.clip(name)
    zero.step_and_update()


def agreeing_iteration(zero: Zero) -> None:
    zero.clip("a"), zero.clip("b")
    zero.step_and_update()


def updater_bf16_replica(rank: int, group) -> dict:
    """Updater(process_group=) replicas (DDP-style), rank 1's in bfloat16."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16 if rank == 1 else torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(2, 3, generator=g) for _ in range(2)]

    def loss(x: torch.Tensor) -> torch.Tensor:
        return model(x.to(model.weight.dtype)).float().square().mean()

    scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, backend="torch")
    updater = tritonscale.Updater(loss, optimizer, iter(batches), scaler=scaler, max_norm=1.0, process_group=group)
    state = [[bits(p) for p in model.parameters()], optimizer.state_dict()]
    try:
        updater.update()
        error = None
    except Exception as caught:  # noqa: BLE001
        error = describe(caught)
    return {
        "error": error,
        "unchanged": same_bits(state, [[bits(p) for p in model.parameters()], optimizer.state_dict()]),
    }


def not_a_member(rank: int, group) -> dict:
    """A group of rank 0 only: rank 0 clips in it; rank 1, outside it, must be told so."""
    solo = dist.new_group([0])
    try:
        zero = Zero(rank, solo)
        zero.set_grads(0)
        zero.clip("a")
        error = None
    except Exception as caught:  # noqa: BLE001
        error = describe(caught)
    return {"error": error}


# -------------------------------------------------------------- rank 0 alone reads a result
READS = {
    "found_inf_for": lambda zero: zero.scaler.found_inf_for(zero.opt["b"]),
    "overflowed": lambda zero: zero.scaler.overflowed(zero.opt["b"]),
    "stats": lambda zero: zero.scaler.stats(),
}


def read_between_unscale_and_step(read: str) -> Callable:
    """unscale_ A and B, rank 0 alone reads (a logger), step A and B: the parameters must be those
    of the same run without the read, on every rank, and nothing raises."""

    def run(rank: int, group, reads: bool) -> list:
        zero = Zero(rank, group)
        for step in range(STEPS):
            zero.set_grads(step)
            zero.scaler.unscale_(zero.opt["a"])
            zero.scaler.unscale_(zero.opt["b"])
            if reads and rank == 0:
                READS[read](zero)
            zero.step_and_update()
        return zero.state()[0]

    def scenario(rank: int, group) -> dict:
        without = run(rank, group, reads=False)
        try:
            with_read, error = run(rank, group, reads=True), None
        except Exception as caught:  # noqa: BLE001
            with_read, error = None, describe(caught)
        return {"error": error, "same": with_read is not None and same_bits(without, with_read)}

    return scenario


SCENARIOS: dict[str, Callable] = {
    "control": control(),
    "control_triton": control(backend="triton"),
    "norm_type_0": control(norm_type=0.0),
    "norm_type_-inf_empty_partition": control(layout="rank1_empty", norm_type=-math.inf),
    **{f"rank0_reads_{read}": read_between_unscale_and_step(read) for read in READS},
    "optimizers_in_another_order": perturbed(clips_in_order),
    "another_max_norm": perturbed(another_max_norm),
    "another_norm_type": perturbed(another_norm_type),
    "extra_clip": perturbed(extra_clip),
    "another_scale": perturbed(agreeing_iteration, before=load_another_scale),
    "another_state_same_scale": perturbed(agreeing_iteration, before=load_a_fresh_state),
    "another_knob": built_apart(agreeing_iteration, {"hysteresis": 2}),
    "another_preset": built_apart(agreeing_iteration, {"policy": "megatron"}),
    "another_spike_rule": built_apart(agreeing_iteration, {"skip_norm_sigma": 3.0}),
    "tensor_lr_on_one_rank": built_apart(agreeing_iteration, {"tensor_lr": True}),
    "tensor_lr_scheduled_on_one_rank": perturbed(agreeing_iteration, before=schedule_on_rank_0, tensor_lr=True),
    "skip_aware_lr_on_one_rank": perturbed(agreeing_iteration, before=skip_aware_lr_on_rank_0, tensor_lr=True),
    "alike_optimizers_in_another_order": built_apart(clips_in_order_from_the_start, {}, named=False),
    # Every rank alike, in the same order: refused all the same (nothing tells the two apart), and
    # the message says so, not that the ranks disagree.
    "alike_optimizers_in_the_same_order": built_apart(agreeing_iteration, {}, named=False),
    "not_a_member": not_a_member,
    # Last: on the code before issue 26 these abort a process in C++ (the test starts again after).
    "clip_on_one_rank_unscale_on_the_other": perturbed(clip_or_unscale),
    "updater_bf16_replica": updater_bf16_replica,
}


def scenario_worker(rank: int, world: int, names: list[str], out_dir: str) -> str:
    """Run ``names`` in order, each in a fresh group of both ranks; save each outcome at once."""
    for name in names:
        group = dist.new_group([0, 1], timeout=SCENARIO_TIMEOUT)
        try:
            outcome = SCENARIOS[name](rank, group)
        except Exception as error:  # noqa: BLE001 - the scenario's own set-up failed
            outcome = {"crashed": describe(error)}
        path = os.path.join(out_dir, f"{name}.rank{rank}.pt")
        torch.save(outcome, path + ".partial")
        os.replace(path + ".partial", path)
    return "done"
