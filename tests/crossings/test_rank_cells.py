"""The rank column: two gloo ranks where exactly one rank changes one argument, one call or its
order, next to controls that must equal one process holding every gradient (torch.amp.GradScaler
+ torch.nn.utils.clip_grad_norm_). Scenarios: rank_scenarios.py.

A perturbation must raise on every rank (RankMismatchError, or a ValueError/TypeError naming the
problem), with no hang and no process dying in C++, and leave parameters, gradients and optimizer
state as they were. All scenarios run in one spawn; where a rank dies (gloo aborts in C++), the
scenario it died in is reported with the rank's stderr and the rest run in a new spawn.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.multiprocess import RanksFailed, run_ranks
from oracles.tolerances import NORM_RTOL

from .rank_scenarios import MAX_NORM, OVERFLOW, SCALE, SCENARIOS, SHAPES, STEPS, full_grads, held, scenario_worker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning"),
]

ACCEPTED = ("RankMismatchError", "ValueError", "TypeError")  # a clear error; an UpdaterError's cause counts
CONTROLS = {"control": 2.0, "control_triton": 2.0, "norm_type_0": 0.0, "norm_type_-inf_empty_partition": -math.inf}
PERTURBED = [name for name in SCENARIOS if name not in CONTROLS and not name.startswith("rank0_reads")]
#: The column a perturbation must be named by (the start of its label in rank_validation.CHECKED).
COLUMN = {
    "another_state_same_scale": "the scaler's trackers",
    "another_knob": "the loss-scale policy",
    "another_preset": "the loss-scale policy",
    "another_spike_rule": "the loss-scale policy",
    "tensor_lr_on_one_rank": "the optimizer (a hash",
    "tensor_lr_scheduled_on_one_rank": "the optimizer's tensor-valued settings",
    "skip_aware_lr_on_one_rank": "the optimizer's tensor-valued settings",
    "alike_optimizers_in_another_order": "an optimizer this scaler cannot tell apart",
    "alike_optimizers_in_the_same_order": "an optimizer this scaler cannot tell apart",
}
#: Scenarios where every rank's row agrees but for a refused column: ambiguous, not a disagreement.
AMBIGUOUS = ("alike_optimizers_in_another_order", "alike_optimizers_in_the_same_order")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """Each scenario's outcome per rank, or the failure of the spawn in which a rank died in it."""
    out = tmp_path_factory.mktemp("rank_cells")
    results: dict = {}
    remaining = list(SCENARIOS)
    while remaining:
        try:
            run_ranks(scenario_worker, 2, remaining, str(out), deadline_s=60.0 + 15.0 * len(remaining))
            failure = None
        except RanksFailed as error:
            failure = error
        for name in list(remaining):
            paths = [out / f"{name}.rank{rank}.pt" for rank in (0, 1)]
            if not all(path.exists() for path in paths):
                break
            results[name] = [torch.load(path, weights_only=False) for path in paths]
            remaining.remove(name)
        if remaining:  # the spawn ended inside remaining[0]
            results[remaining.pop(0)] = f"a rank died or hung in this scenario: {failure}"
    return results


def outcome_of(outcomes: dict, name: str) -> list:
    outcome = outcomes[name]
    assert not isinstance(outcome, str), outcome
    for rank, result in enumerate(outcome):
        assert "crashed" not in result, f"rank {rank}: the scenario itself raised {result['crashed']}"
    return outcome


# --------------------------------------------------------------------------- one process
def single_process(norm_type: float) -> dict:
    """Every parameter in one process: torch's scaler, unscale_ + clip_grad_norm_ per optimizer."""
    params = {name: [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes] for name, shapes in SHAPES.items()}
    opts = {name: torch.optim.SGD(ps, lr=0.1) for name, ps in params.items()}
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
    norms = []
    for step in range(STEPS):
        scale = scaler.get_scale()
        scaler.scale(torch.ones(()))
        for name, grads in full_grads(step).items():
            for p, g in zip(params[name], grads):
                p.grad = g * scale
        if step == OVERFLOW:
            params["b"][1].grad.view(-1)[0] = math.inf
        for name, opt in opts.items():
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(params[name], MAX_NORM, norm_type))
        for opt in opts.values():
            scaler.step(opt)
        scaler.update()
    return {"norms": norms, "scale": scaler.get_scale(), "params": params}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_unperturbed_ranks_equal_one_process(outcomes, name):
    layout = "rank1_empty" if "empty" in name else "split"
    oracle = single_process(CONTROLS[name])
    for rank, result in enumerate(outcome_of(outcomes, name)):
        norms = [saved[1].view(torch.float32).reshape(()) for saved in result["norms"]]
        for i, (ours, theirs) in enumerate(zip(norms, oracle["norms"])):
            where = f"rank {rank}, step {i // 2}, optimizer {'ab'[i % 2]}"
            if math.isfinite(theirs):
                close = float(ours) == pytest.approx(float(theirs), rel=NORM_RTOL[torch.float32])
                assert close, f"{where}: norm {float(ours)} where one process has {float(theirs)}"
            else:
                assert not math.isfinite(ours), f"{where}: {float(ours)} where one process has {float(theirs)}"
        assert result["scale"] == oracle["scale"], f"rank {rank}"
        for name_, ps in result["params"].items():
            for i, p in zip(held(rank, layout, SHAPES[name_]), ps):
                torch.testing.assert_close(p, oracle["params"][name_][i].detach(), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("name", PERTURBED)
def test_one_rank_perturbed_raises_on_every_rank_and_changes_nothing(outcomes, name):
    outcome = outcome_of(outcomes, name)
    for rank, result in enumerate(outcome):
        if name == "not_a_member" and rank == 0:
            assert result["error"] is None, f"rank 0, the group's member, raised {result['error']}"
            continue
        assert result["error"] is not None, f"rank {rank} went on without an error"
        kind, cause, message = result["error"]
        assert kind in ACCEPTED or cause in ACCEPTED, f"rank {rank} raised {kind} ({cause}): {message}"
        if name == "not_a_member":
            assert "member" in message, f"rank 1 is not told it is not a member: {message}"
        else:
            assert result["unchanged"], f"rank {rank}: the refused call changed something"
        if name in COLUMN:
            assert COLUMN[name] in message, f"rank {rank}: {message}"


@pytest.mark.parametrize("name", AMBIGUOUS)
def test_alike_optimizers_are_refused_as_ambiguous_not_as_ranks_that_disagree(outcomes, name):
    """Two optimizers of one class and settings: every rank's row is the same, so the message says
    the combine is ambiguous and what works (a distinguishing key), not that the ranks disagree."""
    for rank, result in enumerate(outcome_of(outcomes, name)):
        _, _, message = result["error"]
        assert "do not disagree" in message and "disagree, so" not in message, f"rank {rank}: {message}"
        assert "What works instead: give each optimizer's param groups a distinguishing key" in message, message


@pytest.mark.parametrize("name", [name for name in SCENARIOS if name.startswith("rank0_reads")])
def test_a_read_on_rank_0_alone_changes_nothing(outcomes, name):
    for rank, result in enumerate(outcome_of(outcomes, name)):
        assert result["error"] is None, f"rank {rank} raised {result['error']}"
        assert result["same"], f"rank {rank}: the parameters differ from the same run without the read"
