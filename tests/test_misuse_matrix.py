"""The misuse matrix: every public method x wrong call orders, bad arguments and bad tensors.

Each case runs on ours (both backends) and, where torch has an equivalent, on
torch.amp.GradScaler("cpu") as the oracle (clip_grad_norm_'s oracle: torch's unscale_ +
torch.nn.utils.clip_grad_norm_). Ours must raise what torch raises (same type, torch's key phrase)
or, where torch has no equivalent or we differ on purpose (README, "Differences from torch, on
purpose"), the documented clear error. Whenever ours raises, parameters, gradients (and the .grad
objects), optimizer state, the scaler's state_dict and its per-optimizer stage/found_inf must be
bitwise unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from oracles.scaler_twins import Snapshot, clip, make_params, scaled_backward
from oracles.tolerances import NORM_RTOL

import tritonscale
from tritonscale import LossScalePolicy, ScalerConfigError
from tritonscale.passes.backends import BACKENDS

CONCRETE_BACKENDS = tuple(name for name in BACKENDS if name != "auto")

INIT_SCALE = 2.0**10
LR = 0.1


@dataclass
class Ctx:
    """One side of a case: a scaler (ours or torch's), its model and two optimizers."""

    scaler: Any
    params: list
    opt: torch.optim.Optimizer
    other_params: list  # owned by `other`, a second optimizer
    other: torch.optim.Optimizer

    def backward(self, inject=None):
        scaled_backward(self.params, self.scaler, inject)

    def clip(self, max_norm=0.5, norm_type=2.0):
        return clip(self.scaler, self.opt, max_norm, norm_type)

    def state(self):
        return self.scaler.state_dict()

    def snapshot(self) -> Snapshot:
        return Snapshot.take(self.params + self.other_params, [self.opt, self.other], self.scaler)


@dataclass
class Case:
    id: str
    act: Callable[[Ctx], Any]
    arrange: Callable[[Ctx], Any] = lambda c: None
    fused: bool = False  # the main optimizer is torch.optim.AdamW(fused=True): the fold path
    other_fused: bool = False
    dtype: torch.dtype = torch.float32
    scaler_kw: dict = field(default_factory=dict)
    # Either torch's outcome (like_torch; `phrase` is torch's key phrase when it raises) ...
    like_torch: bool = True
    phrase: str | None = None
    # ... or ours' documented one: raise `error` matching `match`, or pass `check`.
    error: type | tuple | None = None
    match: str | None = None
    check: Callable[[Ctx], None] | None = None


def like(id, arrange, act, phrase=None, **kw) -> Case:
    return Case(id, act, arrange, phrase=phrase, **kw)


def ours(id, arrange, act, error=None, match=None, check=None, **kw) -> Case:
    return Case(id, act, arrange, like_torch=False, error=error, match=match, check=check, **kw)


def steps(*actions):
    """Several calls in a row (the arrange part, or an act that must end in a comparison)."""

    def run(c):
        result = None
        for a in actions:
            result = a(c)
        return result

    return run


backward = lambda c: c.backward()
unscale = lambda c: c.scaler.unscale_(c.opt)
clip_ = lambda c: c.clip()
step = lambda c: c.scaler.step(c.opt)
update = lambda c: c.scaler.update()
pickled = lambda c: pickle.loads(pickle.dumps(c.scaler)).get_scale()


def plain_backward(c):
    # Gradients without any scale(): the scaler has no _scale yet.
    sum(((i + 1) * p**2).sum() for i, p in enumerate(c.params)).backward()


def backward_other(inject=None):
    return lambda c: scaled_backward(c.other_params, c.scaler, inject)


def set_grad(index, make):
    def run(c):
        p = c.params[index]
        p.grad_dtype = None  # let the float32 parameter hold a gradient of another dtype or layout
        p.grad = make(p.grad)

    return run


def load(patch):
    """load_state_dict of this scaler's own state_dict with `patch` applied (a function of it)."""
    return lambda c: c.scaler.load_state_dict(patch(c.state()))


def with_counters(**values):
    return lambda sd: {**sd, "counters": {**sd["counters"], **values}}


AFTER_ONE_ITERATION = steps(backward, step, update)

# ------------------------------------------------------------------ wrong call orders
NO_SCALE = "but _scale is None"
ALREADY_UNSCALED = "unscale_() has already been called on this optimizer since the last update()"
AFTER_STEP = "is being called after step()"
STEPPED = "step() has already been called since the last update()"
NO_CHECKS_FOR_UPDATE = "No inf checks were recorded prior to update."
PICKLE = "may only be pickled at the beginning of an iteration"
NEW_SCALE = "new_scale should be a float or a 1-element"

ORDER_CASES = [
    like("unscale_before_scale", plain_backward, unscale, NO_SCALE),
    like("clip_before_scale", plain_backward, clip_, NO_SCALE),
    like("step_before_scale", plain_backward, step, NO_SCALE),
    like("update_before_scale", plain_backward, update, NO_SCALE),
    like("unscale_twice", steps(backward, unscale), unscale, ALREADY_UNSCALED),
    like("unscale_after_step", steps(backward, step), unscale, AFTER_STEP),
    like("clip_after_step", steps(backward, step), clip_, AFTER_STEP),
    like("step_twice", steps(backward, step), step, STEPPED),
    like("step_with_closure", backward, lambda c: c.scaler.step(c.opt, closure=lambda: 0.0), "Closure use"),
    like("update_with_no_step_and_no_unscale", backward, update, NO_CHECKS_FOR_UPDATE),
    like("update_twice", steps(backward, step, update), update, NO_CHECKS_FOR_UPDATE),
    like("pickle_after_unscale", steps(backward, unscale), pickled, PICKLE),
    like("pickle_after_clip", steps(backward, clip_), pickled, PICKLE),
    like("pickle_after_step", steps(backward, step), pickled, PICKLE),
    like("load_empty_state_dict", AFTER_ONE_ITERATION, lambda c: c.scaler.load_state_dict({}), "state dict is empty"),
    # Right orders around the wrong ones: both accept, and the results must agree.
    like("unscale_then_clip_only_clips", steps(backward, unscale), steps(clip_, step, update)),
    like("clip_twice_is_idempotent", backward, lambda c: [c.clip(), c.clip(), step(c), update(c)][1]),
    like("update_after_unscale_without_step_backs_off", steps(lambda c: c.backward(math.inf), unscale), update),
    like("pickle_before_scale", lambda c: None, pickled),
    like("pickle_after_update", AFTER_ONE_ITERATION, pickled),
    like("state_dict_mid_iteration", steps(backward, unscale), lambda c: c.state()["scale"]),
    # torch counts the found_inf of every optimizer that was unscaled, stepped or not.
    like(
        "second_optimizer_unscaled_with_inf_never_stepped",
        steps(backward, backward_other(math.inf), lambda c: c.scaler.unscale_(c.other), step),
        update,
    ),
    like(
        "second_optimizer_without_gradients_steps",
        backward,
        lambda c: c.scaler.step(c.other),
        "No inf checks were recorded for this optimizer.",
    ),
    like(
        "second_fused_optimizer_without_gradients_then_update",
        steps(backward, lambda c: c.scaler.step(c.other)),
        update,
        NO_CHECKS_FOR_UPDATE,
        other_fused=True,
    ),
]
for _case in list(ORDER_CASES):  # the same orders with a fused optimizer (the fold path)
    if _case.id in {"step_with_closure"} or "second" in _case.id or "before_scale" in _case.id:
        continue
    ORDER_CASES.append(Case(**{**_case.__dict__, "id": _case.id + "-fused", "fused": True}))

# -------------------------------------------------------------------- bad arguments
# torch.nn.utils.clip_grad_norm_ does not validate max_norm (-1 flips every gradient's sign): ours
# refuses before anything changes. Every norm type torch computes, ours computes too (1, 2 and inf
# in the kernels, the rest with torch ops; norm_type=0 counts nonzeros, as in torch).
ARGUMENT_CASES = [
    ours(f"clip_max_norm_{name}", backward, lambda c, v=value: c.clip(v), ValueError, "max_norm")
    for name, value in [("-1", -1), ("nan", math.nan), ("True", True), ("str", "1")]
]
# max_norm=inf measures without clipping (the Hugging Face Trainer's call when it only logs the
# norm), 0 zeroes every gradient: torch takes both, so do we.
ARGUMENT_CASES += [
    like(f"clip_max_norm_{name}", backward, lambda c, v=value: [c.clip(v), step(c), update(c)][0])
    for name, value in [("0", 0.0), ("inf", math.inf)]
]
ARGUMENT_CASES += [
    ours("clip_max_norm_-1-fused", backward, lambda c: c.clip(-1.0), ValueError, "max_norm", fused=True),
    ours(
        "clip_max_norm_10**400",
        backward,
        lambda c: c.clip(10**400),
        ValueError,
        "max_norm",
    ),
]
ARGUMENT_CASES += [
    like(f"clip_norm_type_{value!r}", backward, lambda c, v=value: [c.clip(0.5, v), step(c), update(c)][0])
    for value in (3, 0, 0.5, -math.inf)
]
ARGUMENT_CASES += [
    like("clip_norm_type_3-fused", backward, lambda c: [c.clip(0.5, 3), step(c), update(c)][0], fused=True),
    # torch's float("2") takes a string; ours wants a number.
    ours("clip_norm_type_'2'", backward, lambda c: c.clip(1.0, "2"), ValueError, "norm_type"),
]


def new_scale(value):
    return lambda c: c.scaler.update(value)


def scale_is(expected):
    def check(c):
        assert c.scaler.get_scale() == expected

    return check


BEFORE_UPDATE = steps(backward, step)
ARGUMENT_CASES += [
    like("update_new_scale_two_elements", BEFORE_UPDATE, new_scale(torch.tensor([1.0, 2.0])), NEW_SCALE),
    like("update_new_scale_requires_grad", BEFORE_UPDATE, new_scale(torch.tensor(2.0, requires_grad=True)), NEW_SCALE),
    like("update_new_scale_other_device", BEFORE_UPDATE, new_scale(torch.tensor(2.0, device="meta")), NEW_SCALE),
    like("update_new_scale_float", BEFORE_UPDATE, steps(new_scale(256.0), lambda c: c.scaler.get_scale())),
    like("update_new_scale_float64_tensor", BEFORE_UPDATE, new_scale(torch.tensor(8.0, dtype=torch.float64))),
    # torch only special-cases float and then reads .device: a bool or str dies with AttributeError.
    # Ours gives torch's own documented message, as an AssertionError like torch's other refusals.
    ours("update_new_scale_bool", BEFORE_UPDATE, new_scale(True), AssertionError, NEW_SCALE),
    ours("update_new_scale_str", BEFORE_UPDATE, new_scale("2"), AssertionError, NEW_SCALE),
    # ... and an int, or the 1-element 1-d tensor torch's message promises, is simply accepted.
    ours("update_new_scale_int", BEFORE_UPDATE, new_scale(4), check=scale_is(4.0)),
    ours("update_new_scale_1d_tensor", BEFORE_UPDATE, new_scale(torch.tensor([2.0])), check=scale_is(2.0)),
]
# torch stores any float (a negative or NaN scale corrupts every later step); ours refuses.
ARGUMENT_CASES += [
    ours(f"update_new_scale_{v}", BEFORE_UPDATE, new_scale(v), ScalerConfigError, "new_scale")
    for v in (-1.0, 0.0, math.nan, math.inf)
]
ARGUMENT_CASES += [
    ours(
        "update_new_scale_10**400",
        BEFORE_UPDATE,
        new_scale(10**400),
        ScalerConfigError,
        "new_scale",
    ),
]

# ---------------------------------------------------------------- load_state_dict
GROWN = {"growth_interval": 7}  # a knob change that must not survive a rejected load
ARGUMENT_CASES += [
    # torch raises a bare KeyError('growth_factor'); ours names every missing key.
    ours(
        "load_missing_keys",
        AFTER_ONE_ITERATION,
        lambda c: c.scaler.load_state_dict({"scale": 2.0}),
        ScalerConfigError,
        "missing",
    ),
    # torch loads a negative scale as it is.
    ours(
        "load_negative_scale", AFTER_ONE_ITERATION, load(lambda sd: {**sd, "scale": -1.0}), ScalerConfigError, "scale"
    ),
]
ARGUMENT_CASES += [
    ours(f"load_overflowing_{name}", AFTER_ONE_ITERATION, load(patch), (ValueError, RuntimeError))
    for name, patch in [
        ("scale_1e39", lambda sd: {**sd, **GROWN, "scale": 1e39}),
        ("growth_tracker_2**31", lambda sd: {**sd, **GROWN, "_growth_tracker": 2**31}),
        ("counter_2**31", lambda sd: with_counters(updates=2**31)({**sd, **GROWN})),
    ]
]
ARGUMENT_CASES += [
    ours(f"load_invalid_{name}", AFTER_ONE_ITERATION, load(patch), ScalerConfigError, scaler_kw=kw)
    for name, patch, kw in [
        ("hysteresis_left_above_hysteresis", with_counters(hysteresis_left=5), {}),
        ("last_skipped_2", with_counters(last_skipped=2), {}),
        ("nan_norm_average", lambda sd: {**sd, "norm_stats": {"average": math.nan, "count": 1.0}}, {}),
        ("negative_norm_count", lambda sd: {**sd, "norm_stats": {"average": 1.0, "count": -1.0}}, {}),
        ("scale_below_min_scale", lambda sd: {**sd, "scale": 0.5}, {"min_scale": 1.0}),
        ("counters_as_list", lambda sd: {**sd, "counters": [1, 0, 0, 0, 0]}, {}),
    ]
]
ARGUMENT_CASES += [
    ours(
        f"load_{key}_as_{kind}",
        AFTER_ONE_ITERATION,
        load(lambda sd, k=key, v=value: {**sd, k: v}),
        ScalerConfigError,
        key,
    )
    for key in ("policy", "counters", "norm_stats")
    for kind, value in [("list", [1]), ("str", "updates")]
    if (key, kind) != ("counters", "list")  # a list of counters is item 8's case above
]


# --------------------------------------------------------------------- odd tensors
# What torch's unscale_/step accept, ours accepts and computes the same (float64, strided and
# sparse gradients go through torch ops beside the kernels). torch's clip_grad_norm_ has no sparse
# support; ours clips sparse gradients by the norm of their values (README). A fused optimizer
# cannot step with a sparse gradient: ours refuses before anything changes. int gradients fail in
# torch's kernel; ours names the parameter.
def strided_like(g):
    """``g``'s values in a non-dense view (every other element of a wider buffer)."""
    view = torch.zeros(*g.shape[:-1], 2 * g.shape[-1], dtype=g.dtype)[..., ::2]
    view.copy_(g)
    return view


ODD_GRADS = [("float64", lambda g: g.double()), ("strided", strided_like), ("sparse", lambda g: g.to_sparse())]
ENTRY_POINTS = [("unscale_", unscale, False), ("clip", clip_, False), ("step", step, False)]
ENTRY_POINTS += [("clip", clip_, True), ("step", step, True)]
TENSOR_CASES = [
    like(
        f"{entry}_with_{name}_grad" + ("-fused" if fused else ""),
        steps(backward, set_grad(1, make)),
        steps(act, step, update) if entry != "step" else steps(act, update),
        fused=fused,
    )
    for name, make in ODD_GRADS
    for entry, act, fused in ENTRY_POINTS
    # Not here: torch's fused AdamW itself fails on a float64 gradient beside float32 ones, in its
    # step, after updating the float32 group: the optimizer's doing, the same with either scaler.
    if not (name == "sparse" and (fused or entry == "clip")) and not (name == "float64" and fused)
]
TENSOR_CASES += [
    ours(
        f"{entry}_with_sparse_grad-fused",
        steps(backward, set_grad(1, lambda g: g.to_sparse())),
        act,
        TypeError,
        "sparse gradient",
        fused=True,
    )
    for entry, act, fused in ENTRY_POINTS[3:]
]
TENSOR_CASES += [
    ours(
        f"{entry}_with_int32_grad" + ("-fused" if fused else ""),
        steps(backward, set_grad(1, lambda g: g.to(torch.int32))),
        act,
        TypeError,
        "non-floating",
        fused=fused,
    )
    for entry, act, fused in ENTRY_POINTS
]
# float16 gradients: torch refuses to write unscaled values into them; so do ours' unscale_ and the
# in-place clip ...
FP16 = "Attempting to unscale FP16 gradients."
TENSOR_CASES += [
    like(f"{entry}_with_float16_grad", steps(backward, set_grad(1, lambda g: g.half())), act, FP16)
    for entry, act, _ in ENTRY_POINTS[:3]
]


def fold_matches_float32_torch(c):
    # ... but with a fused optimizer the fold never writes them (README), so clip + step works: the
    # float16 parameters end where torch's float32 run of the same values ends, to float16 precision.
    grads = [p.grad.clone() for p in c.params]
    c.clip(1.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(c.params, grads)), "the fold must not write gradients"
    c.scaler.step(c.opt)
    ref = [torch.nn.Parameter(p.detach().float()) for p in make_params(torch.float16)]
    for r, g in zip(ref, grads):
        r.grad = g.float()
    theirs = torch.amp.GradScaler("cpu", init_scale=16.0)
    theirs.scale(torch.ones(()))
    ref_opt = torch.optim.AdamW(ref, lr=LR, eps=0.1, fused=True)
    clip(theirs, ref_opt, 1.0)
    theirs.step(ref_opt)
    for p, r in zip(c.params, ref):
        torch.testing.assert_close(p, r.half(), rtol=2e-3, atol=2e-3)


TENSOR_CASES += [
    ours(
        "clip_with_float16_grads-fused",
        backward,
        fold_matches_float32_torch,
        check=lambda c: None,
        fused=True,
        dtype=torch.float16,
        scaler_kw={"init_scale": 16.0},  # float16 gradients of a few units times 2**10 would overflow
    ),
]


def alias_same_tensor(c):
    c.params[2].grad = c.params[1].grad


def alias_overlapping_views(c):
    buffer = c.params[1].grad.new_zeros(5)
    c.params[1].grad, c.params[0].grad = buffer[:4].view(2, 2), buffer[2:5]


TENSOR_CASES += [
    ours(f"{entry}_with_{name}", steps(backward, alias), act, (ValueError, RuntimeError))
    for name, alias in [("one_tensor_as_two_grads", alias_same_tensor), ("overlapping_grads", alias_overlapping_views)]
    for entry, act, _ in ENTRY_POINTS[:2]
]

# ------------------------------------------------------------ policies and modes
# The norm of the *scaled* gradients: 3e19 squared overflows float32. torch (unscale_ first) sees a
# finite gradient and steps; so must both backends.
POLICY_CASES = [
    like(
        "large_finite_gradient_is_not_an_overflow",
        lambda c: c.backward(3e19),
        steps(clip_, step, update),
    ),
]


def disabled_step_after_unrecorded_skip(c):
    before = [p.detach().clone() for p in c.params]
    c.scaler.step(c.opt)
    # A good step of a disabled scaler is torch's plain optimizer.step().
    assert not any(torch.equal(p, b) for p, b in zip(c.params, before)), "the good step was skipped"


POLICY_CASES += [
    ours(
        "disabled_scaler_forgets_clip_skip_without_update",
        # README: a disabled scaler's clip_grad_norm_ still skips the following step on inf/NaN.
        # The next iteration (no update() call: a disabled scaler's update is a no-op) must step.
        steps(lambda c: c.backward(math.inf), clip_, step, lambda c: c.opt.zero_grad(), backward),
        disabled_step_after_unrecorded_skip,
        check=lambda c: None,
        scaler_kw={"enabled": False},
    ),
]


def skip_off_steps_like_unscale(c):
    # skip_on_overflow=False: the overflowed step goes ahead. clip_grad_norm_ must hand the step the
    # same unscaled finite gradients the unscale_ path does (params[1:] hold no inf/NaN).
    c.clip(1e9)
    c.scaler.step(c.opt)
    ref_params = make_params()
    ref_opt = torch.optim.SGD(ref_params, lr=LR, momentum=0.9)
    ref = tritonscale.GradScaler("cpu", init_scale=INIT_SCALE, policy=LossScalePolicy.fixed(skip_on_overflow=False))
    scaled_backward(ref_params, ref, math.nan)
    ref.unscale_(ref_opt)
    ref.step(ref_opt)
    for p, r in zip(c.params[1:], ref_params[1:]):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


POLICY_CASES += [
    ours(
        "skip_on_overflow_false_clip_steps_unscaled",
        lambda c: c.backward(math.nan),
        skip_off_steps_like_unscale,
        check=lambda c: None,
        scaler_kw={"policy": LossScalePolicy.fixed(skip_on_overflow=False)},
    ),
]

ALL_CASES = ORDER_CASES + ARGUMENT_CASES + TENSOR_CASES + POLICY_CASES


# ------------------------------------------------------------------------ runner
def build(case: Case, scaler) -> Ctx:
    params = make_params(case.dtype)
    if case.fused:
        # eps of the gradients' order: without it Adam's first steps are blind to the gradients' scale.
        opt = torch.optim.AdamW(params, lr=LR, eps=0.1, fused=True)
    else:
        opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    other_params = make_params(seed=1)
    other = torch.optim.AdamW(other_params, lr=LR, fused=True) if case.other_fused else torch.optim.SGD(other_params)
    return Ctx(scaler, params, opt, other_params, other)


def run(fn, ctx):
    try:
        return fn(ctx), None
    except Exception as e:  # noqa: BLE001 - the outcome, raised or not, is what is compared
        return None, e


def stage(ctx, opt):
    record = ctx.scaler._per_optimizer_states.get(id(opt))
    return None if record is None else record["stage"].name


def assert_same_result(a, b, fused):
    if isinstance(b, torch.Tensor):
        a, b = float(a), float(b)
    if isinstance(b, float) and math.isfinite(b):
        assert a == pytest.approx(b, rel=NORM_RTOL[torch.float32])
    elif isinstance(b, float):
        assert not math.isfinite(a)
    else:
        assert a == b


def assert_same_afterwards(mine: Ctx, theirs: Ctx, fused: bool):
    assert mine.scaler.get_scale() == theirs.scaler.get_scale()
    assert mine.scaler._get_growth_tracker() == theirs.scaler._get_growth_tracker()
    for opt_pair in ((mine.opt, theirs.opt), (mine.other, theirs.other)):
        assert stage(mine, opt_pair[0]) == stage(theirs, opt_pair[1])
    # The fold divides by scale/clip_coef instead of unscale-then-clip: ~1 ulp in the gradient.
    tol = {"rtol": 1e-5, "atol": 1e-6} if fused else {"rtol": 1e-6, "atol": 1e-7}
    for p, q in zip(mine.params + mine.other_params, theirs.params + theirs.other_params):
        torch.testing.assert_close(p.detach(), q.detach(), **tol)
        if not fused and q.grad is not None:  # the fold leaves ours' gradients scaled, on purpose
            torch.testing.assert_close(p.grad, q.grad, equal_nan=True, **tol)


def params_for_matrix():
    out = []
    for case in ALL_CASES:
        for backend in CONCRETE_BACKENDS:
            out.append(pytest.param(backend, case, id=f"{backend}-{case.id}"))
    return out


@pytest.mark.parametrize("backend, case", params_for_matrix())
def test_misuse_matrix(backend, case):
    kw = {"init_scale": INIT_SCALE, "growth_interval": 1, **case.scaler_kw}
    if "policy" in kw:  # the policy carries the growth knobs itself
        del kw["growth_interval"]
    mine = build(case, tritonscale.GradScaler("cpu", backend=backend, **kw))
    case.arrange(mine)
    before = mine.snapshot()
    result, error = run(case.act, mine)

    if case.like_torch:
        theirs = build(case, torch.amp.GradScaler("cpu", **kw))
        case.arrange(theirs)
        their_result, their_error = run(case.act, theirs)
        if their_error is None:
            assert error is None, f"torch accepts this, ours raised {error!r}"
            assert_same_result(result, their_result, case.fused)
            assert_same_afterwards(mine, theirs, case.fused)
        else:
            # A subclass is fine (ScalerConfigError is an AssertionError): torch-era `except` still catches it.
            assert isinstance(error, type(their_error)), f"torch raised {their_error!r}, ours {error!r}"
            assert case.phrase in str(their_error), f"not torch's phrase: {their_error}"
            assert case.phrase in str(error)
    elif case.error is not None:
        assert isinstance(error, case.error), f"expected {case.error}, got {error!r}"
        if case.match:
            assert re.search(case.match, str(error)), str(error)
    else:
        assert error is None, repr(error)
        case.check(mine)

    if error is not None:
        after = mine.snapshot()
        if case.like_torch:
            # Where torch's own error comes after a stage moved (step() raises after its unscale_),
            # torch's stages are the oracle; everything else must be as it was.
            for ours_opt, torch_opt in ((mine.opt, theirs.opt), (mine.other, theirs.other)):
                assert stage(mine, ours_opt) == stage(theirs, torch_opt)
            after = dataclasses.replace(after, stages=before.stages)
        after.assert_same(before)


# ------------------------------------------------------------------ construction
# Nothing exists yet to stay unchanged: the outcome is the whole contract.
def construct_ours(init_scale, **kw):
    return tritonscale.GradScaler("cpu", init_scale=init_scale, **kw)


def construct_torch(init_scale):
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    scaler.scale(torch.ones(()))  # torch only uses init_scale here
    return scaler


@pytest.mark.parametrize("value", ["2", None], ids=["str", "None"])
def test_init_scale_not_a_number_is_refused_at_construction(value):
    with pytest.raises(TypeError):
        construct_torch(value)  # torch only notices at the first scale(), inside torch.full
    with pytest.raises(ScalerConfigError, match="init_scale"):
        construct_ours(value)


@pytest.mark.parametrize("value", [True, -1.0, 0.0, math.nan], ids=["True", "-1", "0", "nan"])
def test_init_scale_that_torch_stores_blindly_is_refused(value):
    # torch keeps a bool (as 1.0), a negative, zero or NaN scale; README: hyperparameter errors are
    # ScalerConfigError (a ValueError and torch's AssertionError), raised before anything exists.
    construct_torch(value)
    with pytest.raises(ScalerConfigError, match="init_scale"):
        construct_ours(value)


def test_init_scale_too_big_for_a_float_is_a_clear_error():
    # torch fails inside torch.full with a raw OverflowError; ours names the argument.
    with pytest.raises(OverflowError):
        construct_torch(10**400)
    with pytest.raises(ScalerConfigError, match="init_scale"):
        construct_ours(10**400)


def test_init_scale_as_a_tensor_like_torch():
    theirs = construct_torch(torch.tensor(512.0))
    mine = construct_ours(torch.tensor(512.0))
    mine.scale(torch.ones(()))
    assert mine.get_scale() == theirs.get_scale() == 512.0


@pytest.mark.parametrize(
    "value, kw",
    [(1e39, {}), (1e-50, {}), (0.5, {"min_scale": 1.0}), (4.0, {"max_scale": 2.0})],
    ids=["inf-in-float32", "zero-in-float32", "below-min_scale", "above-max_scale"],
)
def test_init_scale_unusable_on_the_device_is_refused(value, kw):
    with pytest.raises(ScalerConfigError, match="init_scale"):
        construct_ours(value, **kw)
