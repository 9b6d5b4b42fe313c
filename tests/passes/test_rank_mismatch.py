"""Ranks that disagree must raise on every rank, and an empty ZeRO partition must step like the others.

Real gloo ranks (``multiprocess.run_ranks``). A collective pairs the ranks' calls by order alone, so
a scale loaded on one rank, an extra ``clip_grad_norm_`` on one rank or a parameter unused on one
rank used to go through silently (or abort gloo in C++); each must now raise
``RankMismatchError`` on every rank with nothing applied. On the CPU the error comes at the
collective; on the GPU paths (``host_reads.are_free`` off) the step reads nothing, is skipped with
nothing changed, and the error comes at the next host read. Oracles: single-process training on
the whole model with torch.amp.GradScaler + torch.nn.utils.clip_grad_norm_.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from support.host_reads import HostReadGuard
from support.multiprocess import CollectiveCounter, run_ranks
from oracles.scaler_twins import bits, same_bits

import tritonscale
from tritonscale import RankMismatchError

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")

SCALE = 2.0**12
MAX_NORM = 0.5
SHAPES = [(5, 3), (7,), (4,)]


def _grads(step: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11 + step)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def _partitioned(rank: int, fused: bool, scale: float):
    """ZeRO-style: rank r holds parameter i where i % 2 == r. One step in agreement, then a scaler
    checkpoint of scale ``scale`` loaded (on the ranks where it differs), then the gradients set to
    their scaled values."""
    params = [torch.nn.Parameter(torch.zeros(SHAPES[i])) for i in range(len(SHAPES)) if i % 2 == rank]
    optimizer = torch.optim.AdamW(params, lr=0.1, fused=True) if fused else torch.optim.SGD(params, lr=0.1)
    scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, backend="torch", process_group=dist.group.WORLD)
    mine = [g for i, g in enumerate(_grads()) if i % 2 == rank]
    scaler.scale(torch.ones(()))
    for p, g in zip(params, mine):
        p.grad = g * SCALE
    scaler.clip_grad_norm_(optimizer, MAX_NORM)
    scaler.step(optimizer)
    scaler.update()
    if scale != SCALE:  # a checkpoint loaded on this rank only
        scaler.load_state_dict(tritonscale.GradScaler("cpu", init_scale=scale).state_dict())
    for p, g in zip(params, mine):
        p.grad = g * scale
    return params, optimizer, scaler


def _state(params, optimizer, scaler=None) -> tuple:
    """Parameters, gradients, optimizer state and the scaler's state_dict (None: its device state,
    read without state_dict, which raises a flagged mismatch), bit for bit."""
    scaler_state = scaler.state_dict() if scaler is not None else None
    return (
        [bits(p) for p in params],
        [bits(p.grad) for p in params],
        copy.deepcopy(optimizer.state_dict()),
        copy.deepcopy(scaler_state),
    )


def _device_state(scaler) -> list:
    t = scaler._tensors
    return [bits(x) for x in (t.scale, t.growth_tracker, t.counters, t.norm_stats)]


def _caught(fn) -> str | None:
    try:
        fn()
    except RankMismatchError as error:
        return str(error)
    return None


# ------------------------------------------------------------------ GradScaler(process_group=)
def scaler_mismatch_worker(rank: int, world: int) -> dict:
    out = {}
    # 1. Different scales (CPU: raised at the collective, on every rank, nothing applied).
    for flow in ("clip+step", "unscale+step", "fused clip+step", "fused step"):
        params, optimizer, scaler = _partitioned(rank, "fused" in flow, SCALE if rank == 0 else 2 * SCALE)
        before = _state(params, optimizer, scaler)

        def step(flow=flow, scaler=scaler, optimizer=optimizer):
            if flow.startswith("unscale"):  # its collective raises before it writes a gradient
                scaler.unscale_(optimizer)
            if "clip" in flow:
                scaler.clip_grad_norm_(optimizer, MAX_NORM)
            scaler.step(optimizer)
            scaler.update()

        out["scale", flow] = _caught(step)
        out["scale", flow, "untouched"] = same_bits(before, _state(params, optimizer, scaler))

    # 2. An extra clip_grad_norm_ on rank 0 in iteration 0: raised at the first mismatched call.
    params, optimizer, scaler = _partitioned(rank, False, SCALE)
    where = None
    for iteration in range(3):
        for call in range(2 if rank == 0 and iteration == 0 else 1):
            if (message := _caught(lambda: scaler.clip_grad_norm_(optimizer, MAX_NORM))) is not None:
                where = (iteration, call, message)
                break
        if where is not None:
            break
        scaler.step(optimizer)
        scaler.update()
    out["sequence"] = where

    # 3. The same calls on every rank, two clips an iteration: no error, the same norms.
    params, optimizer, scaler = _partitioned(rank, False, SCALE)
    norms = []
    for _ in range(2):
        norms += [scaler.clip_grad_norm_(optimizer, MAX_NORM), scaler.clip_grad_norm_(optimizer, MAX_NORM)]
        scaler.step(optimizer)
        scaler.update()
    out["agreeing norms"] = torch.stack(norms)

    # 4. GPU paths: no host read in the step; skipped, nothing changed; raised at the next host read.
    import tritonscale.host_reads

    tritonscale.host_reads.are_free = lambda device: False
    guard, counter = HostReadGuard(), CollectiveCounter()
    for flow in ("fused clip+step", "fused step"):
        params, optimizer, scaler = _partitioned(rank, True, SCALE if rank == 0 else 2 * SCALE)
        before, state = _state(params, optimizer), _device_state(scaler)
        counter.take()
        with guard.armed():
            if "clip" in flow:
                scaler.clip_grad_norm_(optimizer, MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
        out["gpu", flow, "collectives"] = counter.take()
        untouched = same_bits(before, _state(params, optimizer)) and same_bits(state, _device_state(scaler))
        out["gpu", flow, "untouched"] = untouched
        out["gpu", flow] = _caught(scaler.get_scale)
        out["gpu", flow, "cleared"] = scaler.get_scale()  # raised once; the state is what it was
    params, optimizer, scaler = _partitioned(rank, False, SCALE if rank == 0 else 2 * SCALE)
    before = [bits(p) for p in params]
    scaler.clip_grad_norm_(optimizer, MAX_NORM)
    out["gpu", "sgd step"] = _caught(lambda: scaler.step(optimizer))  # reads the skip flag anyway
    out["gpu", "sgd step", "untouched"] = same_bits(before, [bits(p) for p in params])
    return out


@pytest.fixture(scope="module")
def scaler_run():
    return run_ranks(scaler_mismatch_worker, 2)


@pytest.mark.parametrize("flow", ["clip+step", "unscale+step", "fused clip+step", "fused step"])
def test_different_scales_raise_on_every_rank_and_apply_nothing(scaler_run, flow):
    for rank, out in enumerate(scaler_run):
        message = out["scale", flow]
        assert message is not None, f"rank {rank} went on with scales {SCALE} and {2 * SCALE}"
        assert f"the loss scale differs between the ranks (rank 0: {SCALE!r}, rank 1: {2 * SCALE!r})" in message
        assert "state_dict on every rank" in message
        assert out["scale", flow, "untouched"], f"rank {rank}: the rejected step changed something"


def test_an_extra_clip_on_one_rank_raises_at_the_first_mismatched_call_on_every_rank(scaler_run):
    # Rank 0's second clip of iteration 0 pairs with rank 1's first clip of iteration 1 (the
    # scaler's iterations 1 and 2: _partitioned ran one already).
    assert scaler_run[0]["sequence"][:2] == (0, 1)
    assert scaler_run[1]["sequence"][:2] == (1, 0)
    for out in scaler_run:
        message = out["sequence"][2]
        assert "the scaler's iteration differs between the ranks (rank 0: 1, rank 1: 2)" in message
        assert "the combine's index in the iteration differs between the ranks (rank 0: 1, rank 1: 0)" in message


def test_the_same_calls_on_every_rank_raise_nothing(scaler_run):
    norms = [out["agreeing norms"] for out in scaler_run]
    assert torch.equal(norms[0], norms[1])
    params = [torch.nn.Parameter(g.clone()) for g in _grads()]
    for p, g in zip(params, _grads()):
        p.grad = g.clone()
    oracle = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    torch.testing.assert_close(norms[0][0], oracle, rtol=1e-5, atol=0)


@pytest.mark.parametrize("flow", ["fused clip+step", "fused step"])
def test_on_the_gpu_paths_a_mismatch_skips_reads_nothing_and_raises_at_the_next_read(scaler_run, flow):
    for rank, out in enumerate(scaler_run):
        assert out["gpu", flow, "collectives"] == 1, "the check must ride in the step's one collective"
        assert out["gpu", flow, "untouched"], f"rank {rank}: parameters, optimizer or scaler state changed"
        assert out["gpu", flow] is not None and "the loss scale differs between the ranks" in out["gpu", flow]
        assert out["gpu", flow, "cleared"] == (SCALE if rank == 0 else 2 * SCALE)


def test_on_the_gpu_paths_a_plain_optimizers_step_raises_where_it_reads_the_skip_flag(scaler_run):
    for out in scaler_run:
        assert out["gpu", "sgd step"] is not None and "the loss scale differs" in out["gpu", "sgd step"]
        assert out["gpu", "sgd step", "untouched"]


# ------------------------------------------------------------- an empty ZeRO partition
STEPS = 3  # step 1 overflows on rank 0
CASES = [
    (backend, fused, flow, empty)
    for backend, fused, flow in [("torch", False, "clip+step"), ("torch", False, "unscale+step")]
    + [("torch", True, flow) for flow in ("clip+step", "unscale+step", "step")]
    + [("triton", False, "clip+step"), ("triton", True, "clip+step")]
    for empty in ("no grads", "no params")
]


def _train(rank: int, backend: str, fused: bool, flow: str, empty: str) -> dict:
    """Rank 0 holds every parameter that gets a gradient; rank 1 one that never does, or none."""
    if rank == 0:
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    else:
        params = [torch.nn.Parameter(torch.ones(3))] if empty == "no grads" else []
    groups = [{"params": params}]  # an empty group is a valid optimizer
    optimizer = torch.optim.AdamW(groups, lr=0.1, fused=True) if fused else torch.optim.SGD(groups, lr=0.1)
    scaler = tritonscale.GradScaler(
        "cpu", init_scale=SCALE, growth_interval=1, backend=backend, process_group=dist.group.WORLD
    )
    norms, scales = [], []
    for step in range(STEPS):
        scale = scaler.get_scale()
        scaler.scale(torch.ones(()))
        if rank == 0:
            for p, g in zip(params, _grads(step)):
                p.grad = g * scale
            if step == 1:
                params[1].grad[0] = math.inf
        if flow.startswith("unscale"):
            scaler.unscale_(optimizer)
        if "clip" in flow:
            norms.append(scaler.clip_grad_norm_(optimizer, MAX_NORM))
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"params": [p.detach().clone() for p in params], "norms": norms, "scales": scales}


def empty_partition_worker(rank: int, world: int) -> dict:
    return {case: _train(rank, *case) for case in CASES}


def _single_process(fused: bool, flow: str) -> dict:
    """The whole model in one process (the unused parameter included): torch's GradScaler."""
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES] + [torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.AdamW(params, lr=0.1, fused=True) if fused else torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
    norms, scales = [], []
    for step in range(STEPS):
        scale = scaler.get_scale()
        scaler.scale(torch.ones(()))
        for p, g in zip(params, _grads(step)):
            p.grad = g * scale
        if step == 1:
            params[1].grad[0] = math.inf
        if flow != "step":
            scaler.unscale_(optimizer)
        if "clip" in flow:
            norms.append(torch.nn.utils.clip_grad_norm_(params[: len(SHAPES)], MAX_NORM))
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"params": [p.detach().clone() for p in params], "norms": norms, "scales": scales}


@pytest.fixture(scope="module")
def empty_run():
    return run_ranks(empty_partition_worker, 2)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)).replace(" ", "_") for c in CASES])
def test_an_empty_partition_steps_with_the_others_like_one_process(empty_run, case):
    _, fused, flow, empty = case
    oracle = _single_process(fused, flow)
    for rank, ranks in enumerate(empty_run):
        out = ranks[case]
        assert out["scales"] == oracle["scales"], f"rank {rank}"  # grown, backed off at step 1, grown
        for ours, theirs in zip(out["norms"], oracle["norms"]):
            if math.isfinite(theirs):
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
            else:
                assert not math.isfinite(ours)
    for ours, theirs in zip(empty_run[0][case]["params"], oracle["params"]):
        torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=1e-7)
    if empty == "no grads":  # no gradient: the optimizer leaves it alone, as in the one process
        assert torch.equal(empty_run[1][case]["params"][0], oracle["params"][-1])


# ------------------------------------------------------------- Updater(process_group=)
class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)


ODD_SCALES = (1234.5678, 1234.57)  # two float32 values with full mantissas


def updater_mismatch_worker(rank: int, world: int) -> dict:
    from tritonscale import GradScaler, Updater, UpdaterError

    out = {}
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(2, 3, generator=g) for _ in range(4)]

    def make(scale: float, uses_b: bool, fused: bool = False, dtype: torch.dtype = torch.float32):
        model = _TwoLayers().to(dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)

        def loss(x):
            x = x.to(dtype)
            return (model.a(x).square().mean() + (model.b(x).square().mean() if uses_b else 0.0)).float()

        scaler = GradScaler("cpu", init_scale=scale, backend="torch")
        updater = Updater(loss, optimizer, iter(batches), scaler=scaler, max_norm=1.0, process_group=dist.group.WORLD)
        return model, optimizer, scaler, updater

    counter = CollectiveCounter()
    model, optimizer, scaler, updater = make(SCALE, True)
    counter.take()
    updater.update()  # the ranks agree: the check's gather, then the all-reduce
    out["agreeing collectives"] = counter.take()
    cases = (
        ("scale", SCALE * (1 + rank), True, torch.float32),
        ("unused", SCALE, rank == 0, torch.float32),
        ("bfloat16 scale", ODD_SCALES[rank], True, torch.bfloat16),  # the header's bytes, exact in bf16
    )
    for case, scale, uses_b, dtype in cases:
        model, optimizer, scaler, updater = make(scale, uses_b, dtype=dtype)
        params = list(model.parameters())
        state = _state(params, optimizer, scaler)
        before = (state[0], state[2], state[3])  # not the gradients: every update() zeroes them first
        try:
            updater.update()
            out[case] = None
        except UpdaterError as error:
            out[case] = (error.phase, type(error.__cause__).__name__, str(error))
        after = _state(params, optimizer, scaler)
        out[case, "untouched"] = same_bits(before, (after[0], after[2], after[3]))

    # The GPU paths: update() reads nothing, the step is skipped, get_scale() raises.
    import tritonscale.host_reads

    tritonscale.host_reads.are_free = lambda device: False
    model, optimizer, scaler, updater = make(SCALE * (1 + rank), True, fused=True)
    before = [bits(p) for p in model.parameters()]
    guard = HostReadGuard()
    with guard.armed():
        result = updater.update()
    out["gpu", "skipped"] = bool(result.skipped)
    out["gpu", "untouched"] = same_bits(before, [bits(p) for p in model.parameters()])
    out["gpu"] = _caught(scaler.get_scale)
    return out


@pytest.fixture(scope="module")
def updater_run():
    return run_ranks(updater_mismatch_worker, 2)


def test_updater_with_different_scales_raises_on_every_rank_and_applies_nothing(updater_run):
    for rank, out in enumerate(updater_run):
        assert out["scale"] is not None, f"rank {rank} summed gradients of scales {SCALE} and {2 * SCALE}"
        phase, cause, message = out["scale"]
        assert (phase, cause) == ("comm", "RankMismatchError")
        assert f"the loss scale differs between the ranks (rank 0: {SCALE!r}, rank 1: {2 * SCALE!r})" in message
        assert out["scale", "untouched"]


def test_updater_checks_before_its_all_reduce_and_carries_any_float32_scale_exactly(updater_run):
    exact = [float(torch.tensor(s, dtype=torch.float32)) for s in ODD_SCALES]
    for out in updater_run:
        # The fixed-width row first (ranks that disagree raise before any gradient is summed),
        # then the sum: buffers of different sizes would abort gloo in C++.
        assert out["agreeing collectives"] == 2
        phase, cause, message = out["bfloat16 scale"]
        assert (phase, cause) == ("comm", "RankMismatchError")
        assert f"the loss scale differs between the ranks (rank 0: {exact[0]!r}, rank 1: {exact[1]!r})" in message


def test_updater_with_a_parameter_unused_on_one_rank_raises_on_every_rank(updater_run):
    # Before: the ranks all-reduced buffers of different sizes and gloo aborted the process in C++.
    for out in updater_run:
        phase, cause, message = out["unused"]
        assert (phase, cause) == ("comm", "RankMismatchError")
        assert "the number of gradients differs between the ranks (rank 0: 4, rank 1: 2)" in message
        assert "find_unused_parameters=True" in message
        assert out["unused", "untouched"]


def test_updater_on_the_gpu_paths_skips_reads_nothing_and_raises_at_the_next_read(updater_run):
    for out in updater_run:
        assert out["gpu", "skipped"] and out["gpu", "untouched"]
        assert out["gpu"] is not None and "the loss scale differs between the ranks" in out["gpu"]
