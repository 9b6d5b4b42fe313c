"""tritonscale.Updater: nnabla's Updater / DynamicLossScalingUpdater as a layer over GradScaler.

Oracles: a plain-Python restatement of nnabla's DynamicLossScalingUpdater.update
(python/src/nnabla/experimental/mixed_precision_training.py, update() at lines 86-143: backward
with the scale per micro-batch, ``scale /= scaling_factor`` and a recursive ``self.update()`` on
inf/NaN up to ``_max_recursive_count`` = 100, then a skip; growth when ``_counter > N``), and
the same training loop written by hand with our GradScaler (bitwise equal). Bad input and raising
callbacks must leave parameters, optimizer state and the scaler bitwise as they were.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support.multiprocess import run_ranks
from oracles.scaler_twins import Snapshot, bits, same_bits

import tritonscale
from tritonscale import DataFeedExhausted, GradScaler, LossScalePolicy, Updater, UpdaterError
from tritonscale.peer_apis.step_updater import CALLBACK_NAMES

# Batches with an inf make inf * 0 inside the interpreter's check pass, as the subtract that
# pyproject.toml already silences; numpy warns about both.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")

# ---------------------------------------------------------------------------------------- helpers


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def tiny_batches(n: int, seed: int = 1, poison: set[int] = frozenset()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (x, y) micro-batches of 2 rows; those in ``poison`` carry an inf (the step overflows)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        x, y = torch.randn(2, 3, generator=g), torch.randn(2, 2, generator=g)
        if k in poison:
            x[0, 0] = math.inf
        out.append((x, y))
    return out


def make_optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    return torch.optim.AdamW(model.parameters(), lr=0.05, fused=kind == "fused", foreach=kind == "foreach")


def state_of(model, optimizer, scaler) -> Snapshot:
    return Snapshot.take(list(model.parameters()), [optimizer], scaler)


def assert_untouched(before: Snapshot, after: Snapshot) -> None:
    """Parameters, optimizer state, scaler state and per-optimizer stage as before (not the
    gradients: every update() zeroes them first, and a failed one leaves partial sums)."""
    for i, (a, b) in enumerate(zip(before.params, after.params)):
        assert same_bits(a, b), f"parameter {i} changed"
    assert same_bits(before.optimizer_state, after.optimizer_state), "optimizer state changed"
    assert before.optimizer_attributes == after.optimizer_attributes, "grad_scale/found_inf left on the optimizer"
    assert same_bits(before.scaler_state, after.scaler_state), "scaler state changed"
    assert same_bits(before.stages, after.stages), "the scaler's per-optimizer stage changed"


def stats_bits(scaler: GradScaler) -> dict:
    return {k: bits(v) for k, v in scaler.stats().items()}


def manual_loop(model, optimizer, scaler, batches, steps, accum, max_norm, divide=True, weight_decay=None) -> list:
    """The same step written by hand with GradScaler: what Updater must reproduce bit for bit."""
    out, it = [], iter(batches)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_sum = None
        for _ in range(accum):
            x, y = next(it)
            loss = F.mse_loss(model(x), y)
            scaler.scale(loss / accum if divide else loss).backward()
            part = loss.detach() / accum if divide else loss.detach()
            loss_sum = part if loss_sum is None else loss_sum + part
        norm = scaler.clip_grad_norm_(optimizer, math.inf if max_norm is None else max_norm)
        if weight_decay is not None:
            for p in model.parameters():
                p.grad.add_(p.detach(), alpha=weight_decay)
        scaler.step(optimizer)
        scaler.update()
        out.append((loss_sum, norm, scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
    return out


# --------------------------------------------------------------- worked example: nnabla's rule


class NnablaDynamicLossScaling:
    """Restatement of nnabla's DynamicLossScalingUpdater.update (mixed_precision_training.py,
    lines 86-143 at sony/nnabla 2814df0): the same control flow, with the network replaced by
    ``overflows(update, scale)`` and counters of what the real one would call."""

    def __init__(self, scale, scaling_factor, N, accum_grad, overflows, max_recursive_count=100):
        self.scale, self.scaling_factor, self.N, self.accum_grad = scale, scaling_factor, N, accum_grad
        self.overflows = overflows
        self._counter = 0
        self._recursive_count = 0
        self._max_recursive_count = max_recursive_count  # hard-coded 100 in nnabla (line 84)
        self.feeds = self.forwards = self.backwards = 0
        self.attempt_scales: list[float] = []
        self.applied = False

    def update(self, u: int) -> None:
        self.attempt_scales.append(self.scale)
        for _ in range(self.accum_grad):  # zero_grad, then per micro-batch: feed, forward, backward(scale)
            self.feeds += 1
            self.forwards += 1
            self.backwards += 1
        if self.overflows(u, self.scale):  # solver.check_inf_or_nan_grad()
            self.scale /= self.scaling_factor
            self._counter = 0
            self._recursive_count += 1
            if self._recursive_count > self._max_recursive_count:
                self._recursive_count = 0
                self.applied = False
                return  # skip
            return self.update(u)  # the recursion (line 128)
        self._recursive_count = 0
        self.applied = True  # scale_grad(1/scale), weight_decay, solver.update()
        if self._counter > self.N:
            self.scale *= self.scaling_factor
            self._counter = 0
        self._counter += 1


#: log2 of the one large input element per update: the gradient is scale * 2**m, which overflows
#: float32 exactly when log2(scale) + m >= 128. The last two overflow at every scale the retries
#: reach (retries run out) and then fit again.
MAGNITUDES = (0, 125, 0, 126, 127, 131, 0)


def big_input_loss(batch):
    w, x = batch
    return (w * x).sum()


def test_worked_example_scale_sequence_and_call_counts_match_nnabla(backend):
    """The scale of every attempt, the retries, which updates apply, and the forward/backward/feed
    counts, with accumulation, against the restatement (retry bound 2 for both)."""
    accum, bound = 2, 2

    def overflows(u, scale):
        return math.log2(scale) + MAGNITUDES[u] >= 128

    nnabla = NnablaDynamicLossScaling(8.0, 2.0, 2000, accum, overflows, max_recursive_count=bound)
    w = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([w], lr=0.0)  # the gradients do not depend on w: nothing to learn here

    def feed():
        # Micro-batch 0 carries the large element, micro-batch 1 a small one (sum reduction, like nnabla).
        u, k = divmod(feed.calls, accum)
        feed.calls += 1
        return w, torch.tensor([2.0 ** MAGNITUDES[u] if k == 0 else 1.0, 1.0])

    feed.calls = 0
    counts = {"forward": 0, "backward": 0}
    attempt_scales: list[float] = []

    def on_forward(i):
        counts["forward"] += 1
        if counts["forward"] % accum == 1:  # the first micro-batch of an attempt
            attempt_scales.append(scaler.get_scale())

    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=2000, backend=backend)
    updater = Updater(
        big_input_loss,
        optimizer,
        feed,
        scaler=scaler,
        accum_grad=accum,
        grad_reduction="sum",
        on_overflow="retry",
        max_retries=bound,
        forward_callback_on_start=on_forward,
        backward_callback_on_finish=lambda i: counts.__setitem__("backward", counts["backward"] + 1),
    )
    ours, theirs = [], []
    for u in range(len(MAGNITUDES)):
        nnabla.attempt_scales = []
        nnabla.update(u)
        attempt_scales.clear()
        result = updater.update()
        ours.append((attempt_scales.copy(), result.retries, result.step_applied, scaler.get_scale()))
        theirs.append((nnabla.attempt_scales, len(nnabla.attempt_scales) - 1, nnabla.applied, nnabla.scale))
    assert ours == theirs
    assert [t[0] for t in ours] == [[8], [8, 4], [4], [4, 2], [2, 1], [1, 0.5, 0.25], [0.125]]
    assert [t[2] for t in ours] == [True] * 5 + [False, True]  # update 5 ran out of retries: skipped
    assert counts["forward"] == counts["backward"] == nnabla.forwards == nnabla.backwards == accum * 12
    # nnabla feeds again on every retry; ours re-runs the micro-batches it already has.
    assert nnabla.feeds == counts["forward"] and feed.calls == accum * len(MAGNITUDES)


def test_growth_follows_growth_interval_where_nnabla_source_is_one_late():
    """Growth: nnabla documents "N: the number of iterations ... for increasing loss scale"; its
    source grows when ``_counter > N`` (line 140): after N+2 good updates the first time, N+1 after.
    Ours is GradScaler's rule (torch's): every ``growth_interval`` good steps."""
    n = 3
    nnabla = NnablaDynamicLossScaling(8.0, 2.0, n, 1, lambda u, s: False)
    w = torch.nn.Parameter(torch.ones(2))
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=n, backend="torch")
    updater = Updater(big_input_loss, torch.optim.SGD([w], lr=0.0), lambda: (w, torch.ones(2)), scaler=scaler)
    ours, theirs = [], []
    for u in range(10):
        updater.update()
        nnabla.update(u)
        ours.append(scaler.get_scale())
        theirs.append(nnabla.scale)
    assert ours == [8, 8, 16, 16, 16, 32, 32, 32, 64, 64]
    assert theirs == [8, 8, 8, 8, 16, 16, 16, 16, 32, 32]


def test_callbacks_order_and_arguments_with_accumulation_and_a_retry():
    log: list[tuple[str, int]] = []
    callbacks = {name: (lambda i, name=name: log.append((name, i))) for name in CALLBACK_NAMES}
    model = tiny_model()
    poisoned = {"left": 1}

    def loss_fn(out, y):  # the first attempt of the first update overflows, its retry does not
        if poisoned["left"]:
            poisoned["left"] -= 1
            return (out * math.inf).sum()
        return F.mse_loss(out, y)

    # Two callbacks for one name: both are called, in order (nnabla takes a list too).
    callbacks["update_callback_on_finish"] = [callbacks["update_callback_on_finish"], lambda i: log.append(("2nd", i))]
    updater = Updater(
        model,
        make_optimizer(model, "foreach"),
        tiny_batches(4),
        loss_fn=loss_fn,
        scaler=GradScaler("cpu", backend="torch"),
        accum_grad=2,
        on_overflow="retry",
        **callbacks,
    )
    first = updater.update()
    second = updater.update(iteration=7)
    micro = [
        "forward_callback_on_start",
        "forward_callback_on_finish",
        "backward_callback_on_start",
        "backward_callback_on_finish",
    ]
    update = ["update_callback_on_start", "update_callback_on_finish", "2nd"]
    # Update 0: two attempts of two micro-batches (comm callbacks only run with a process_group).
    assert log == [(n, 0) for n in micro * 4 + update] + [(n, 7) for n in micro * 2 + update]
    assert (first.retries, second.retries) == (1, 0)
    assert first.step_applied and second.step_applied
    assert updater.iteration == 8 and (first.iteration, second.iteration) == (0, 7)


# ------------------------------------------------------------------- end to end against GradScaler


@pytest.mark.parametrize("kind", ["fused", "sgd"])
@pytest.mark.parametrize("max_norm", [0.3, None])
def test_training_run_matches_gradscaler_bitwise(backend, kind, max_norm):
    """4 steps, 2 micro-batches each, an inf in step 2: Updater against the loop by hand."""
    steps, accum = 4, 2
    batches = tiny_batches(steps * accum, poison={2 * accum + 1})
    runs = []
    for use_updater in (True, False):
        model = tiny_model()
        optimizer = make_optimizer(model, kind)
        scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2, backend=backend)
        if use_updater:
            updater = Updater(
                model, optimizer, batches, loss_fn=F.mse_loss, scaler=scaler, accum_grad=accum, max_norm=max_norm
            )
            run = []
            for _ in range(steps):
                result = updater.update()
                params = [p.detach().clone() for p in model.parameters()]
                run.append((result.loss, result.norm, scaler.get_scale(), params, result.step_applied))
        else:
            run = manual_loop(model, optimizer, scaler, batches, steps, accum, max_norm)
        runs.append((run, optimizer.state_dict(), scaler.state_dict()))
    (ours, our_opt, our_scaler), (hand, hand_opt, hand_scaler) = runs

    def as_bits(step):  # loss, norm, scale, parameters
        return [bits(step[0]), bits(step[1]), step[2], [bits(p) for p in step[3]]]

    for step, (a, b) in enumerate(zip(ours, hand)):
        assert same_bits(as_bits(a), as_bits(b)), step
    assert [r[4] for r in ours] == [True, True, False, True]
    assert same_bits(our_scaler, hand_scaler)
    opt_bits = [{k: {n: bits(v) for n, v in s.items()} for k, s in o["state"].items()} for o in (our_opt, hand_opt)]
    assert same_bits(*opt_bits)


def test_sum_reduction_and_weight_decay_match_the_loop_by_hand():
    """nnabla's sum over micro-batches (no division) and its solver.weight_decay (grad += wd *
    param after the unscale and clip, before the step), on an unfolded scaler."""
    steps, accum, wd = 3, 2, 0.01
    batches = tiny_batches(steps * accum)
    runs = []
    for use_updater in (True, False):
        model = tiny_model()
        optimizer = make_optimizer(model, "fused")
        scaler = GradScaler("cpu", init_scale=2.0**10, backend="torch", fold_into_optimizer=False)
        if use_updater:
            updater = Updater(
                model,
                optimizer,
                iter(batches),
                loss_fn=F.mse_loss,
                scaler=scaler,
                accum_grad=accum,
                max_norm=0.5,
                grad_reduction="sum",
                weight_decay=wd,
            )
            losses = [updater.update().loss for _ in range(steps)]
        else:
            losses = [r[0] for r in manual_loop(model, optimizer, scaler, batches, steps, accum, 0.5, False, wd)]
        runs.append(([bits(p) for p in model.parameters()], [bits(v) for v in losses]))
    assert same_bits(runs[0], runs[1])


def test_numpy_numbers_run_as_the_python_numbers_they_hold():
    # torch takes numpy scalars wherever it takes numbers; so does the Updater (its int and float
    # arguments), with the run of the Python numbers they hold.
    import numpy as np

    runs = []
    for accum, wd, max_norm, norm_type in (
        (2, 0.01, 0.5, 2.0),
        (np.int64(2), np.float32(0.01), np.float32(0.5), np.int32(2)),
    ):
        model = tiny_model()
        scaler = GradScaler("cpu", init_scale=2.0**10, backend="torch", fold_into_optimizer=False)
        updater = Updater(
            model,
            make_optimizer(model, "fused"),
            iter(tiny_batches(4)),
            loss_fn=F.mse_loss,
            scaler=scaler,
            accum_grad=accum,
            max_norm=max_norm,
            norm_type=norm_type,
            weight_decay=wd,
        )
        norms = [updater.update().norm for _ in range(2)]
        runs.append(([bits(p) for p in model.parameters()], [bits(n) for n in norms]))
    assert same_bits(runs[0], runs[1])


def test_weight_decay_refuses_a_scaler_that_folds_into_a_fused_optimizer():
    model = tiny_model()
    optimizer = make_optimizer(model, "fused")
    with pytest.raises(ValueError, match="fold_into_optimizer=False"):
        Updater(model, optimizer, [], loss_fn=F.mse_loss, scaler=GradScaler("cpu"), weight_decay=0.1)
    updater = Updater(model, optimizer, [], loss_fn=F.mse_loss, weight_decay=0.1)  # the default scaler is unfolded
    assert updater.scaler.is_enabled()


def test_skip_mode_reads_nothing_on_the_host(backend, forbid_host_reads):
    """With on_overflow="skip" and a fused optimizer, a whole update() -- feed, forwards, scaled
    backwards, fused clip, step, scale update -- never reads a device value; an overflow included."""
    model = tiny_model()
    scaler = GradScaler("cpu", init_scale=2.0**10, backend=backend)
    batches = tiny_batches(6, poison={3})
    updater = Updater(model, make_optimizer(model, "fused"), batches, loss_fn=F.mse_loss, scaler=scaler, accum_grad=2)
    results = []
    for _ in range(3):
        with forbid_host_reads.armed():
            results.append(updater.update())
    assert [r.step_applied for r in results] == [True, False, True]
    assert scaler.get_scale() == 2.0**9


def test_retry_reruns_the_same_micro_batches_and_reports_the_retries():
    model = tiny_model()
    seen: list[int] = []
    calls = {"feed": 0}
    batches = tiny_batches(2)

    def feed():
        calls["feed"] += 1
        return batches[calls["feed"] - 1]

    def loss_fn(out, y):
        seen.append(id(y))
        # Overflows while the scale is above 2**8: two retries from 2**10.
        return F.mse_loss(out, y) * (math.inf if scaler.get_scale() > 2.0**8 else 1.0)

    scaler = GradScaler("cpu", init_scale=2.0**10, backend="torch")
    updater = Updater(
        model, make_optimizer(model, "sgd"), feed, loss_fn=loss_fn, scaler=scaler, accum_grad=2, on_overflow="retry"
    )
    result = updater.update()
    assert result.retries == 2 and result.step_applied and scaler.get_scale() == 2.0**8
    assert calls["feed"] == 2 and seen == [id(batches[0][1]), id(batches[1][1])] * 3
    assert scaler.stats()["skipped_steps"].item() == 2  # each retried attempt is one skipped iteration


def test_retries_run_out_then_the_step_is_skipped():
    model = tiny_model()
    scaler = GradScaler("cpu", init_scale=2.0**10, backend="torch")
    updater = Updater(
        model,
        make_optimizer(model, "fused"),
        tiny_batches(4, poison={0, 1, 2, 3}),  # inf at every scale
        loss_fn=F.mse_loss,
        scaler=scaler,
        on_overflow="retry",
        max_retries=2,
    )
    before = state_of(model, updater.optimizer, scaler)
    result = updater.update()
    assert result.retries == 2 and not result.step_applied
    assert scaler.get_scale() == 2.0**7  # three attempts, three backoffs
    for a, b in zip(before.params, state_of(model, updater.optimizer, scaler).params):
        assert same_bits(a, b)
    assert updater.update().retries == 2  # bounded again, on the next batch (it was the 1st of 4)


# ----------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"accum_grad": 0}, ValueError, "accum_grad must be an int >= 1"),
        ({"accum_grad": -2}, ValueError, "accum_grad"),
        ({"accum_grad": 1.5}, ValueError, "accum_grad"),
        ({"accum_grad": True}, ValueError, "accum_grad"),
        ({"on_overflow": "retry", "max_retries": -1}, ValueError, "max_retries must be an int >= 0"),
        ({"max_retries": 2}, ValueError, 'only with on_overflow="retry"'),
        ({"on_overflow": "recurse"}, ValueError, "on_overflow"),
        ({"grad_reduction": "avg"}, ValueError, "grad_reduction"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay"),
        ({"weight_decay": math.nan}, ValueError, "weight_decay"),
        ({"max_norm": -1.0}, ValueError, "max_norm"),
        ({"forward_callback_on_start": "log"}, TypeError, "forward_callback_on_start"),
        ({"update_callback_on_finish": [print, 3]}, TypeError, "update_callback_on_finish"),
        ({"scaler": torch.amp.GradScaler("cpu")}, TypeError, "tritonscale.GradScaler"),
        ({"on_overflow": "retry", "scaler": GradScaler("cpu", policy=LossScalePolicy.fixed())}, ValueError, "fixed"),
        ({"on_overflow": "retry", "scaler": GradScaler("cpu", enabled=False)}, ValueError, "enabled scaler"),
        ({"autocast_dtype": "float16"}, TypeError, "autocast_dtype"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, error, match):
    model = tiny_model()
    with pytest.raises(error, match=match):
        Updater(model, make_optimizer(model, "sgd"), [], loss_fn=F.mse_loss, **kwargs)


def test_a_data_feed_that_is_neither_callable_nor_iterable_is_refused():
    model = tiny_model()
    with pytest.raises(TypeError, match="data_feed"):
        Updater(model, make_optimizer(model, "sgd"), 5, loss_fn=F.mse_loss)


@pytest.mark.parametrize("feed_kind", ["iterator", "callable"])
def test_a_data_feed_that_runs_out_names_it_and_applies_nothing(feed_kind):
    model = tiny_model()
    batches = tiny_batches(3)
    it = iter(batches)
    feed = it if feed_kind == "iterator" else (lambda: next(it))
    scaler = GradScaler("cpu", backend="torch")
    updater = Updater(model, make_optimizer(model, "fused"), feed, loss_fn=F.mse_loss, scaler=scaler, accum_grad=2)
    updater.update()
    before = state_of(model, updater.optimizer, scaler)
    with pytest.raises(DataFeedExhausted, match=r"data_feed raised at iteration 1, attempt 1, micro-batch 2/2") as info:
        updater.update()
    assert "ran out" in str(info.value) and "nothing was applied" in str(info.value)
    assert (info.value.phase, info.value.micro_batch, info.value.applied) == ("data_feed", 1, False)
    assert_untouched(before, state_of(model, updater.optimizer, scaler))
    assert updater.iteration == 1


RAISING = [name for name in CALLBACK_NAMES if not name.startswith("comm")] + ["forward", "data_feed"]


@pytest.mark.parametrize("where", RAISING)
def test_a_raising_phase_is_named_and_nothing_is_half_applied(where):
    class Boom(Exception):
        pass

    def boom(i):
        raise Boom(f"from {where}")

    model = tiny_model()
    batches = iter(tiny_batches(6))
    armed = {"on": False}

    def feed():
        if where == "data_feed" and armed["on"]:
            raise Boom("no data")
        return next(batches)

    def loss_fn(out, y):
        if where == "forward" and armed["on"]:
            raise Boom("bad forward")
        return F.mse_loss(out, y)

    callbacks = {where: lambda i: boom(i) if armed["on"] else None} if where in CALLBACK_NAMES else {}
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=1, backend="torch")
    optimizer = make_optimizer(model, "fused")
    updater = Updater(model, optimizer, feed, loss_fn=loss_fn, scaler=scaler, accum_grad=2, **callbacks)
    updater.update()  # the optimizer has state, the scaler has grown once
    before, before_stats = state_of(model, optimizer, scaler), stats_bits(scaler)
    armed["on"] = True
    with pytest.raises(UpdaterError, match=f"{where} raised at iteration 1") as info:
        updater.update()
    assert isinstance(info.value.__cause__, Boom) and info.value.phase == where
    if where == "update_callback_on_finish":  # after the commit point: the update is whole
        assert info.value.applied and "was applied" in str(info.value)
        assert updater.iteration == 2 and scaler.get_scale() == 2.0**12
        assert not same_bits(before.params, state_of(model, optimizer, scaler).params)
        return
    assert not info.value.applied and "nothing was applied" in str(info.value)
    assert_untouched(before, state_of(model, optimizer, scaler))
    assert same_bits(before_stats, stats_bits(scaler))
    assert updater.iteration == 1
    armed["on"] = False
    assert updater.update().step_applied  # the updater and the scaler carry on normally


@pytest.mark.parametrize("error", [ValueError("late"), KeyboardInterrupt()])
def test_a_raise_after_retried_attempts_restores_the_backed_off_scale(error):
    """Two overflowed attempts backed the scale off twice; the third attempt's forward callback
    raises: the scale, trackers and stats() are the ones from before update(). A KeyboardInterrupt
    propagates as it is, after the same rollback."""
    model = tiny_model()
    scaler = GradScaler("cpu", init_scale=2.0**10, backend="torch")
    forwards = {"n": 0}

    def on_forward(i):
        forwards["n"] += 1
        if forwards["n"] == 4:  # accum 1: update 0 is forward 1; update 1's attempts are 2, 3, 4
            raise error

    def loss_fn(out, y):
        return F.mse_loss(out, y) * (math.inf if forwards["n"] in (2, 3) else 1.0)

    optimizer = make_optimizer(model, "fused")
    updater = Updater(
        model,
        optimizer,
        tiny_batches(4),
        loss_fn=loss_fn,
        scaler=scaler,
        on_overflow="retry",
        forward_callback_on_start=on_forward,
    )
    assert updater.update().step_applied
    before, before_stats = state_of(model, optimizer, scaler), stats_bits(scaler)
    with pytest.raises(UpdaterError if isinstance(error, Exception) else KeyboardInterrupt) as info:
        updater.update()
    if isinstance(error, Exception):
        assert info.value.__cause__ is error
        assert info.value.phase == "forward_callback_on_start" and info.value.attempt == 3
    assert_untouched(before, state_of(model, optimizer, scaler))
    assert same_bits(before_stats, stats_bits(scaler))
    assert scaler.get_scale() == 2.0**10 and updater.iteration == 1


def test_an_updater_refuses_a_scaler_in_the_middle_of_an_iteration():
    model = tiny_model()
    optimizer = make_optimizer(model, "sgd")
    scaler = GradScaler("cpu", backend="torch")
    updater = Updater(model, optimizer, tiny_batches(2), loss_fn=F.mse_loss, scaler=scaler)
    x, y = tiny_batches(1)[0]
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="middle of an iteration"):
        updater.update()


def test_autocast_and_a_loss_function_of_the_batch():
    model = tiny_model()
    batches = tiny_batches(2)

    def compute_loss(batch):
        x, y = batch
        out = model(x)
        assert out.dtype == torch.bfloat16  # the forward ran under autocast
        return F.mse_loss(out.float(), y)

    updater = Updater(compute_loss, make_optimizer(model, "sgd"), batches, autocast_dtype=torch.bfloat16)
    assert updater.scaler.is_enabled() and updater.update().step_applied


def test_the_loss_must_be_a_one_element_tensor():
    model = tiny_model()
    updater = Updater(lambda batch: model(batch[0]), make_optimizer(model, "sgd"), tiny_batches(2))
    with pytest.raises(UpdaterError, match="forward raised .* one-element floating-point loss"):
        updater.update()


# ------------------------------------------------------------------------ two processes (gloo)


def _two_rank_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    model = tiny_model()
    optimizer = make_optimizer(model, "sgd")
    scaler = GradScaler("cpu", init_scale=2.0**10, backend="torch")
    batches = [(x[rank : rank + 1], y[rank : rank + 1]) for x, y in tiny_batches(8, poison={2})]
    log: list[str] = []
    armed = {"on": False}

    def comm_finish(i):
        log.append(f"comm finish {i}")
        if armed["on"]:
            raise ValueError("comm callback")

    updater = Updater(
        model,
        optimizer,
        batches,
        loss_fn=F.mse_loss,
        scaler=scaler,
        accum_grad=2,
        max_norm=0.5,
        process_group=dist.group.WORLD,
        comm_callback_on_start=lambda i: log.append(f"comm start {i}"),
        comm_callback_on_finish=comm_finish,
    )
    skipped = [not updater.update().step_applied for _ in range(3)]
    params = [p.detach().clone() for p in model.parameters()]
    # A raising comm callback (after the all-reduce, on both ranks): named, nothing applied.
    armed["on"] = True
    before = state_of(model, optimizer, scaler)
    try:
        updater.update()
        phase = None
    except UpdaterError as error:
        phase = error.phase
    after = state_of(model, optimizer, scaler)
    untouched = same_bits(before.params, after.params) and same_bits(before.scaler_state, after.scaler_state)
    return {"skipped": skipped, "log": log[:6], "params": params, "phase": phase, "untouched": untouched}


def test_two_gloo_ranks_all_reduce_before_the_check_like_one_process_on_the_whole_batch():
    """Each rank holds one row of every 2-row micro-batch; the all-reduce (mean) makes the step
    that of one process on both rows. Rank 0 alone sees the inf of micro-batch 2 (step 1): both
    skip. The comm callbacks run once per update(), around the all-reduce."""
    ranks = run_ranks(_two_rank_worker, 2, deadline_s=120)
    model = tiny_model()
    updater = Updater(
        model,
        make_optimizer(model, "sgd"),
        tiny_batches(6, poison={2}),
        loss_fn=F.mse_loss,
        scaler=GradScaler("cpu", init_scale=2.0**10, backend="torch"),
        accum_grad=2,
        max_norm=0.5,
    )
    skipped = [not updater.update().step_applied for _ in range(3)]
    for rank in ranks:
        assert rank["skipped"] == skipped == [False, True, False]
        assert rank["log"] == [f"comm {w} {i}" for i in range(3) for w in ("start", "finish")]
        assert rank["phase"] == "comm_callback_on_finish" and rank["untouched"]
        for ours, one in zip(rank["params"], model.parameters()):
            torch.testing.assert_close(ours, one.detach(), rtol=1e-6, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))


def test_the_gradient_sum_runs_on_the_scalers_public_api_alone():
    """The Updater's all-reduce is its own (passes' GradAllReduce with the scaler's public
    ``rank_agreement`` row), not a scaler method kept for it (``all_reduce_grads_`` is gone): a
    one-rank gloo group gives the bits of the same run without a group."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    assert not hasattr(GradScaler, "all_reduce_grads_"), "the controller keeps plumbing for an adapter"
    runs = []
    for group in (None, "world"):
        model = tiny_model()
        scaler = GradScaler("cpu", init_scale=2.0**10, backend="torch")
        if group is not None:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            updater = Updater(
                model,
                make_optimizer(model, "sgd"),
                tiny_batches(6, poison={2}),
                loss_fn=F.mse_loss,
                scaler=scaler,
                accum_grad=2,
                max_norm=0.5,
                process_group=None if group is None else dist.group.WORLD,
            )
            applied = [updater.update().step_applied for _ in range(3)]
        finally:
            if group is not None:
                dist.destroy_process_group()
        runs.append((applied, [bits(p.detach()) for p in model.parameters()], scaler.state_dict()))
    assert runs[0][0] == [True, False, True]  # the inf of micro-batch 2 skips step 1 in both runs
    assert same_bits(runs[0], runs[1])


def test_exports():
    assert tritonscale.Updater is Updater and issubclass(DataFeedExhausted, UpdaterError)
    assert issubclass(UpdaterError, RuntimeError)


def test_a_disabled_scaler_still_skips_an_inf_step():
    """A bf16 run: no loss scale, but the fused check's inf/NaN still skips the step."""
    model = tiny_model()
    scaler = GradScaler("cpu", enabled=False, backend="torch")
    batches = tiny_batches(3, poison={1})
    updater = Updater(model, make_optimizer(model, "fused"), batches, loss_fn=F.mse_loss, scaler=scaler)
    assert [updater.update().step_applied for _ in range(3)] == [True, False, True]
