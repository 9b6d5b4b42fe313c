"""What the ranks must agree on travels in every combine's row: one rank changing one argument, one
call or its order raises on every rank, with nothing applied, and never aborts gloo in C++.

Real gloo ranks (``multiprocess.run_ranks``), one spawn running every scenario in a row: a mismatch
is found after a collective that went through on every rank, so the ranks stay paired for the next
scenario. ZeRO-style partitions: rank r holds parameter i where i % 2 == r. Oracles: one process
holding every gradient, with torch.amp.GradScaler + torch.nn.utils.clip_grad_norm_, and the same
two ranks without the perturbation.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from support.multiprocess import run_ranks
from oracles.scaler_twins import bits, same_bits
from oracles.tolerances import NORM_RTOL

import tritonscale
from tritonscale import RankMismatchError

pytestmark = pytest.mark.slow

SCALE = 2.0**10
SHAPES_A = [(5, 3), (7,), (4,)]
SHAPES_B = [(6,), (2, 3), (3,)]


def _grads(shapes, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in shapes]


def _partition(rank: int, shapes, seed: int, **settings):
    """This rank's parameters of a ZeRO-partitioned optimizer, with their scaled gradients set."""
    mine = [i for i in range(len(shapes)) if i % 2 == rank]
    params = [torch.nn.Parameter(torch.zeros(shapes[i])) for i in mine]
    for p, i in zip(params, mine):
        p.grad = _grads(shapes, seed)[i] * SCALE
    group = {"params": params, **settings.pop("group", {})}
    return params, torch.optim.SGD([group], lr=0.1, **settings)


def _scaler(**kwargs) -> tritonscale.GradScaler:
    scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, process_group=dist.group.WORLD, **kwargs)
    scaler.scale(torch.ones(()))
    return scaler


def _outcome(fn) -> str | None:
    """None if ``fn()`` ran through, else the error's class and message."""
    try:
        fn()
    except (RankMismatchError, ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _mismatch(rank: int, calls, *params) -> dict:
    """Run ``calls`` (a function of the rank); report the error and whether every tensor is as before."""
    before = [bits(t) for p in params for t in (p, p.grad)]
    error = _outcome(lambda: calls(rank))
    return {"error": error, "untouched": same_bits(before, [bits(t) for p in params for t in (p, p.grad)])}


def _two_optimizers(rank: int, same_settings: bool = False, named: bool = False, lrs=(0.1, 0.1)):
    """Two ZeRO-partitioned optimizers: distinct settings (a no-decay group, as usual for biases),
    or the same settings (but ``lrs``), optionally with a ``name`` key in their param groups."""
    a_settings = {} if same_settings else {"weight_decay": 0.01}
    pa, a = _partition(rank, SHAPES_A, 1, group={"name": "a", "lr": lrs[0]} if named else {"lr": lrs[0]}, **a_settings)
    pb, b = _partition(rank, SHAPES_B, 2, group={"name": "b", "lr": lrs[1]} if named else {"lr": lrs[1]})
    return pa + pb, a, b


def scenarios_worker(rank: int, world: int) -> dict:
    out = {}
    # Optimizers clipped in another order on rank 1.
    for case in ("distinct settings", "named groups"):
        params, a, b = _two_optimizers(rank, named=case == "named groups", same_settings=case == "named groups")
        scaler = _scaler()
        first, second = (a, b) if rank == 0 else (b, a)

        def clip_both(r, scaler=scaler, first=first, second=second):
            scaler.clip_grad_norm_(first, 0.5)
            scaler.clip_grad_norm_(second, 0.5)

        out["order", case] = _mismatch(rank, clip_both, *params)
    # Two optimizers that became alike (one's lr set to the other's) after an iteration in
    # agreement: their partners (every rank's part of each, from the last combine) tell them apart.
    params, a, b = _two_optimizers(rank, same_settings=True, lrs=(0.1, 0.2))
    scaler = _scaler()
    scaler.clip_grad_norm_(a, 0.5), scaler.clip_grad_norm_(b, 0.5), scaler.step(a), scaler.step(b), scaler.update()
    for p in params:
        p.grad.mul_(scaler.get_scale() / SCALE)
    a.param_groups[0]["lr"] = 0.2
    first, second = (a, b) if rank == 0 else (b, a)

    def clip_both_again(r, scaler=scaler, first=first, second=second):
        scaler.clip_grad_norm_(first, 0.5)
        scaler.clip_grad_norm_(second, 0.5)

    out["order", "became alike"] = _mismatch(rank, clip_both_again, *params)
    # Two optimizers alike in every setting, from their first combine: nothing tells them apart, so
    # the second one's first combine is refused on every rank, in either order.
    for case in ("same order", "another order"):
        params, a, b = _two_optimizers(rank, same_settings=True)
        scaler = _scaler()
        first, second = (b, a) if case == "another order" and rank == 1 else (a, b)
        scaler.clip_grad_norm_(first, 0.5)  # nothing to compare it with yet: it goes through
        clip_second = lambda r, scaler=scaler, second=second: scaler.clip_grad_norm_(second, 0.5)  # noqa: E731
        out["alike", case] = _mismatch(rank, clip_second, *params)
    # One argument changed on rank 1.
    for name, change in (("max_norm", {"max_norm": 0.7}), ("norm_type", {"norm_type": 1.0})):
        params, a, _ = _two_optimizers(rank)
        scaler = _scaler()
        kwargs = {"max_norm": 0.5, "norm_type": 2.0, **(change if rank == 1 else {})}
        out[name] = _mismatch(
            rank, lambda r, scaler=scaler, a=a, kwargs=kwargs: scaler.clip_grad_norm_(a, **kwargs), *params
        )
    # One call changed on rank 1: it unscales where rank 0 clips (rows of one width: no C++ abort).
    params, a, _ = _two_optimizers(rank)
    scaler = _scaler()
    out["clip vs unscale_"] = _mismatch(
        rank, lambda r: scaler.clip_grad_norm_(a, 0.5) if r == 0 else scaler.unscale_(a), *params
    )
    # Another policy on rank 1.
    params, a, _ = _two_optimizers(rank)
    scaler = _scaler(**({"hysteresis": 2} if rank == 1 else {}))
    out["policy"] = _mismatch(rank, lambda r: scaler.clip_grad_norm_(a, 0.5), *params)
    # Agreeing ranks: no error, and the norm is one process's.
    params, a, _ = _two_optimizers(rank)
    scaler = _scaler()
    out["agreeing norm"] = scaler.clip_grad_norm_(a, 0.5)
    # Norm orders where a norm of the ranks' norms is not the norm: 0 (counts add up), and -inf
    # with an empty partition (its 0 is no gradient's).
    for norm_type, shapes in ((0.0, SHAPES_A), (-math.inf, SHAPES_A[:1])):
        params, optimizer = _partition(rank, shapes, 1)
        out["norm", norm_type] = _scaler().clip_grad_norm_(optimizer, math.inf, norm_type)
    # A rank-0-only logger between unscale_ and step changes nothing.
    for read in (False, True):
        params, a, b = _two_optimizers(rank)
        b.param_groups[0]["params"][0].grad[0] = math.inf if rank == 1 else 0.0  # B overflows on rank 1
        scaler = _scaler()
        scaler.unscale_(a)
        scaler.unscale_(b)
        if read and rank == 0:  # every accessor a logger may call: none communicates
            scaler.found_inf_for(b), scaler.overflowed(b), scaler.stats(), scaler.overflowed(a)
            scaler.optimizer_stage(b), scaler.folded_grad_scale(b), scaler._found_inf_per_device(b)
            scaler.last_norm(), scaler.last_skip_flag(), scaler.get_scale(), scaler.state_dict()
        scaler.step(a)
        scaler.step(b)
        scaler.update()
        out["logger", read] = [p.detach().clone() for p in params] + [scaler.get_scale()]
    # A rank outside the group is told so.
    group = dist.new_group([0])
    out["non-member"] = _outcome(lambda: tritonscale.GradScaler("cpu", process_group=group))
    out["alike", "gpu"] = _alike_on_the_gpu_paths(rank)
    return out


def _alike_on_the_gpu_paths(rank: int) -> dict:
    """Two alike fused AdamW where reads are not free (last: it turns them off for the process): the
    step reads nothing on the host, nothing changes, and the next host read raises the refusal."""
    from support.host_reads import HostReadGuard

    import tritonscale.host_reads

    tritonscale.host_reads.are_free = lambda device: False
    pa, _ = _partition(rank, SHAPES_A, 1)
    pb, _ = _partition(rank, SHAPES_B, 2)
    a, b = (torch.optim.AdamW(ps, lr=0.1, fused=True) for ps in (pa, pb))
    scaler = _scaler()
    before = [bits(p) for p in pa + pb]
    with HostReadGuard().armed():
        scaler.clip_grad_norm_(a, 0.5), scaler.clip_grad_norm_(b, 0.5), scaler.step(a), scaler.step(b)
        scaler.update()
    untouched = same_bits(before, [bits(p) for p in pa + pb])
    return {"untouched": untouched, "error": _outcome(scaler.get_scale)}


def _one_process_norm(shapes, norm_type: float) -> torch.Tensor:
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler.scale(torch.ones(()))
    for p, g in zip(params, _grads(shapes, 1)):
        p.grad = g * SCALE
    scaler.unscale_(optimizer)
    return torch.nn.utils.clip_grad_norm_(params, math.inf, norm_type)


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(scenarios_worker, 2)


@pytest.mark.parametrize(
    "case, column",
    [
        (("order", "distinct settings"), "the optimizer"),
        (("order", "named groups"), "the optimizer"),
        (("order", "became alike"), "which optimizer each rank combined this one with before"),
        (("alike", "same order"), "an optimizer this scaler cannot tell apart"),
        (("alike", "another order"), "an optimizer this scaler cannot tell apart"),
        ("max_norm", "max_norm"),
        ("norm_type", "norm_type"),
        ("clip vs unscale_", "which call combined"),
        ("policy", "the loss-scale policy"),
    ],
    ids=[
        "order",
        "order-named-groups",
        "order-became-alike",
        "alike-same-order",
        "alike-another-order",
        "max_norm",
        "norm_type",
        "clip-vs-unscale_",
        "policy",
    ],  # fmt: skip
)
def test_one_rank_changing_one_argument_or_call_raises_on_every_rank_and_changes_nothing(ranks, case, column):
    for rank, out in enumerate(ranks):
        seen = out[case]
        assert seen["error"] is not None and seen["error"].startswith("RankMismatchError"), f"rank {rank}: {seen}"
        assert column in seen["error"], f"rank {rank}: {seen['error']}"
        assert seen["untouched"], f"rank {rank}: a gradient or parameter changed"


def test_alike_optimizers_are_refused_naming_the_fix_also_on_the_gpu_paths(ranks):
    for rank, out in enumerate(ranks):
        for case in ("same order", "another order"):
            assert '{"params": ..., "name": "decoder"}' in out["alike", case]["error"], f"rank {rank}: {case}"
        gpu = out["alike", "gpu"]
        assert gpu["untouched"], f"rank {rank}: the GPU path's refused step changed a parameter"
        assert gpu["error"] is not None and "cannot tell apart" in gpu["error"], f"rank {rank}: {gpu['error']}"


def test_agreeing_ranks_norm_is_one_processs(ranks):
    # Rank r's optimizer A holds A's parameters i % 2 == r: together, all of A.
    norms = [out["agreeing norm"] for out in ranks]
    assert torch.equal(norms[0], norms[1])
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES_A]
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    optimizer = torch.optim.SGD(params, lr=0.1, weight_decay=0.01)
    scaler.scale(torch.ones(()))
    for p, g in zip(params, _grads(SHAPES_A, 1)):
        p.grad = g * SCALE
    scaler.unscale_(optimizer)
    expected = torch.nn.utils.clip_grad_norm_(params, 0.5)
    torch.testing.assert_close(norms[0], expected, rtol=NORM_RTOL[torch.float32], atol=0)


@pytest.mark.parametrize("norm_type, shapes", [(0.0, SHAPES_A), (-math.inf, SHAPES_A[:1])], ids=["0", "-inf-empty"])
def test_norm_orders_that_do_not_compose_are_one_processs(ranks, norm_type, shapes):
    expected = _one_process_norm(shapes, norm_type)
    for out in ranks:
        torch.testing.assert_close(out["norm", norm_type], expected, rtol=NORM_RTOL[torch.float32], atol=0)


def test_a_rank_0_only_logger_changes_nothing(ranks):
    for rank, out in enumerate(ranks):
        assert same_bits(out["logger", False], out["logger", True]), f"rank {rank}: the read changed training"


def test_a_rank_outside_the_group_is_told_it_is_not_a_member(ranks):
    assert ranks[0]["non-member"] is None
    assert ranks[1]["non-member"].startswith("ValueError") and "not a member" in ranks[1]["non-member"]


def updater_worker(rank: int, world: int) -> dict:
    """The Updater sums replicated gradients: a bfloat16 replica, another max_norm or norm_type on
    rank 1 raises on every rank before anything is summed (buffers of different sizes used to abort
    gloo in C++)."""
    from tritonscale import GradScaler, Updater, UpdaterError

    out = {}
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(2, 3, generator=g) for _ in range(2)]
    for case, dtype, clip in (
        ("bfloat16 replica", torch.bfloat16 if rank == 1 else torch.float32, {}),
        ("max_norm", torch.float32, {"max_norm": 2.0 if rank == 1 else 1.0}),
        ("norm_type", torch.float32, {"max_norm": 1.0, "norm_type": 1.0 if rank == 1 else 2.0}),
    ):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2).to(dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scaler = GradScaler("cpu", init_scale=SCALE)
        updater = Updater(
            lambda x, model=model, dtype=dtype: model(x.to(dtype)).float().square().mean(),
            optimizer,
            iter(batches),
            scaler=scaler,
            process_group=dist.group.WORLD,
            **clip,
        )
        before = [bits(p) for p in model.parameters()]
        try:
            updater.update()
            out[case] = None
        except UpdaterError as error:
            out[case] = (type(error.__cause__).__name__, str(error))
        out[case, "untouched"] = same_bits(before, [bits(p) for p in model.parameters()])
    return out


def test_updater_ranks_that_disagree_raise_on_every_rank_before_summing():
    for rank, out in enumerate(run_ranks(updater_worker, 2)):
        for case, column in (("bfloat16 replica", "dtypes"), ("max_norm", "max_norm"), ("norm_type", "norm_type")):
            assert out[case] is not None and out[case][0] == "RankMismatchError", f"rank {rank}, {case}: {out[case]}"
            assert column in out[case][1], f"rank {rank}, {case}: {out[case][1]}"
            assert out[case, "untouched"], f"rank {rank}, {case}: parameters changed"
