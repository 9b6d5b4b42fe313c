"""Random call sequences, ours against torch.amp.GradScaler step by step.

Two twins (ours on a backend, torch's) start from the same tiny model and run the same list of
operations: scaled backward (optionally with an inf/NaN injected into one gradient), unscale_,
clip_grad_norm_ (torch's oracle: unscale_ unless already unscaled, then
torch.nn.utils.clip_grad_norm_), step, update, a state_dict round trip into a new scaler, a pickle
round trip, zero_grad, and arming an optimizer step pre-hook that raises once. After every
operation both must agree on raised-or-not (and the exception type), get_scale(),
_get_growth_tracker(), the parameters and whether each optimizer step was taken; when a call
raises on both, both go on from there.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles.scaler_twins import is_torch_scaler, make_params, scaled_backward, torch_clip
from oracles.tolerances import NORM_RTOL

import tritonscale

INIT = {"init_scale": 2.0**8, "growth_interval": 2}  # small interval: sequences both grow and back off

# "iteration" is a whole well-ordered iteration (backward, clip when max_norm is 0.5, step, update):
# it keeps the scale moving so that the single, often misplaced, calls around it meet every stage.
# Repeats weight the draw.
OP_NAMES = ["iteration"] * 4 + ["backward"] * 3 + ["step"] * 2 + ["update"] * 2 + ["unscale_", "clip", "clip"]
OP_NAMES += ["zero_grad", "zero_grad", "round_trip", "pickle", "arm_raising_hook", "arm_raising_hook"]
OPS = st.tuples(
    st.sampled_from(OP_NAMES),
    st.sampled_from([None, None, math.inf, -math.inf, math.nan]),  # injected into one gradient
    st.integers(0, 2),  # ... of this parameter
    st.sampled_from([0.5, 100.0]),  # max_norm: clips, or does not
)
SEQUENCES = st.lists(OPS, min_size=3, max_size=16)


def expand(ops):
    out = []
    for name, inject, where, max_norm in ops:
        if name == "iteration":
            out.append(("backward", inject, where, max_norm))
            out += [("clip", None, 0, max_norm)] if max_norm == 0.5 else []
            out += [("step", None, 0, max_norm), ("update", None, 0, max_norm)]
        else:
            out.append((name, inject, where, max_norm))
    return out


SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class InjectedStepError(RuntimeError):
    pass


class Twin:
    """A scaler, its model and optimizer, and the bookkeeping to compare skip decisions."""

    def __init__(self, make_scaler, fused: bool):
        self.make_scaler = make_scaler
        self.scaler = make_scaler()
        self.params = make_params()
        if fused:
            # eps of the gradients' order makes Adam sensitive to the gradients' scale (with the default
            # 1e-8 a wrongly scaled gradient would give nearly the same update).
            self.opt = torch.optim.AdamW(self.params, lr=0.05, eps=0.1, fused=True)
        else:
            self.opt = torch.optim.SGD(self.params, lr=0.1, momentum=0.9)
        self.fused = fused
        self.armed = False
        self.stepped = 0
        self.opt.register_step_pre_hook(self._pre_hook)
        self.opt.register_step_post_hook(self._post_hook)

    def _pre_hook(self, *_):
        if self.armed:
            self.armed = False
            raise InjectedStepError("step pre-hook raised")

    def _post_hook(self, *_):
        self.stepped += 1

    def steps_taken(self) -> int:
        if self.fused:  # a fused optimizer is always called and skips on the device: step stays put
            state = self.opt.state.get(self.params[0])
            return 0 if not state else int(state["step"])
        return self.stepped

    def do(self, name, inject, where, max_norm):
        s = self.scaler
        if name == "backward":
            scaled_backward(self.params, s, inject, where)
        elif name == "unscale_":
            s.unscale_(self.opt)
        elif name == "clip":
            if is_torch_scaler(s):
                return torch_clip(s, self.opt, max_norm)
            return s.clip_grad_norm_(self.opt, max_norm)
        elif name == "step":
            try:
                s.step(self.opt)
            finally:
                if is_torch_scaler(s):
                    # torch leaves grad_scale/found_inf on the optimizer when its step raises, and the
                    # retry then multiplies the leftover grad_scale into the new one (scale**2).
                    # Ours removes them; clean torch's up so the oracle stays a correct one.
                    for attr in ("grad_scale", "found_inf"):
                        if hasattr(self.opt, attr):
                            delattr(self.opt, attr)
        elif name == "update":
            s.update()
        elif name == "round_trip":
            saved = s.state_dict()
            self.scaler = self.make_scaler()
            self.scaler.load_state_dict(saved)
        elif name == "pickle":
            self.scaler = pickle.loads(pickle.dumps(s))
        elif name == "zero_grad":
            # set_to_none=False: an optimizer left without gradients is issue 10 item 6 (torch's step
            # raises, ours steps), covered in test_misuse_matrix.py.
            self.opt.zero_grad(set_to_none=False)
        elif name == "arm_raising_hook":
            self.armed = True
        return None


def stage(twin) -> str:
    record = twin.scaler._per_optimizer_states.get(id(twin.opt))
    return "READY" if record is None else record["stage"].name


def attempt(twin, op):
    try:
        return twin.do(*op), None
    except Exception as e:  # noqa: BLE001 - raised-or-not and the type are compared
        return None, e


def run_sequence(backend, fused, ops):
    mine = Twin(lambda: tritonscale.GradScaler("cpu", backend=backend, **INIT), fused)
    theirs = Twin(lambda: torch.amp.GradScaler("cpu", **INIT), fused)
    # SGD path: unscale-then-clip on both sides, only the norm's summation order differs (~1e-7).
    # Fold path: the fused optimizer divides by scale/clip_coef instead: ~1 ulp in each gradient.
    tol = {"rtol": 1e-5, "atol": 1e-6} if fused else {"rtol": 1e-6, "atol": 1e-7}
    unconsumed = False  # ours' clip_grad_norm_ folded, and no step has divided the gradients it left scaled
    ops = expand(ops)
    for i, op in enumerate(ops):
        where = f"op {i} {op[0]} in {[o[0] for o in ops[: i + 1]]}"
        if op[0] == "backward" and stage(theirs) == "UNSCALED":
            # torch requires unscale_ after all of an iteration's gradients are accumulated. Past that
            # contract the two differ on purpose: ours' clip_grad_norm_ after unscale_ still checks the
            # new gradients for inf/NaN and skips the step; torch's clip_grad_norm_ checks nothing.
            continue
        result, error = attempt(mine, op)
        their_result, their_error = attempt(theirs, op)
        if their_error is None:
            assert error is None, f"{where}: torch accepts, ours raised {error!r}"
        else:
            assert isinstance(error, type(their_error)), f"{where}: torch raised {their_error!r}, ours {error!r}"
        if fused and op[0] == "clip" and error is None:
            unconsumed = True
        if op[0] in ("step", "zero_grad") and error is None:
            unconsumed = False
        if op[0] in ("update", "round_trip", "pickle") and error is None:
            if unconsumed:
                # The fold leaves the gradients scaled until the optimizer's step divides them
                # (README, on purpose); a step that raised or never came leaves them so, where torch's
                # oracle holds unscaled, clipped ones. Reusing them in the next iteration compares
                # two different inputs: that iteration starts from zeroed gradients on both sides.
                mine.opt.zero_grad(set_to_none=False)
                theirs.opt.zero_grad(set_to_none=False)
                unconsumed = False
        if op[0] == "clip" and error is None:
            a, b = float(result), float(their_result)
            assert math.isfinite(a) == math.isfinite(b), f"{where}: norms {a} vs {b}"
            if math.isfinite(b):
                assert a == pytest.approx(b, rel=NORM_RTOL[torch.float32]), where
        assert mine.scaler.get_scale() == theirs.scaler.get_scale(), where
        assert mine.scaler._get_growth_tracker() == theirs.scaler._get_growth_tracker(), where
        assert mine.steps_taken() == theirs.steps_taken(), f"{where}: skip decisions differ"
        for p, q in zip(mine.params, theirs.params):
            torch.testing.assert_close(p.detach(), q.detach(), **tol, msg=lambda m, w=where: f"{w}: {m}")
        # Gradients: unwritten by the fold, and all left scaled by an overflowed clip (README, on
        # purpose; torch writes NaN/0 there), so they are compared on the unscale path while every
        # gradient on both sides is finite.
        grads = [t.grad for t in mine.params + theirs.params]
        if not fused and all(g is not None and bool(g.isfinite().all()) for g in grads):
            for p, q in zip(mine.params, theirs.params):
                torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, w=where: f"{w}: grad {m}")


@SETTINGS
@given(ops=SEQUENCES)
def test_random_call_sequences_match_torch_with_sgd(backend, ops):
    run_sequence(backend, False, ops)


@SETTINGS
@given(ops=SEQUENCES)
def test_random_call_sequences_match_torch_with_fused_adamw(backend, ops):
    run_sequence(backend, True, ops)


# A few fixed sequences that must be in every run, whatever hypothesis draws.
FIXED = {
    "overflow_then_recovery": ["backward:inf", "clip", "step", "update", "zero_grad", "backward", "clip", "step"],
    "raising_step_then_retry": ["backward", "arm_raising_hook", "step", "step", "update"],
    "raising_step_after_clip": ["backward", "clip", "arm_raising_hook", "step", "step", "update"],
    "round_trip_mid_iteration": ["backward", "unscale_", "round_trip", "step", "backward", "step", "update"],
    "growth_then_nan": ["backward", "step", "update"] * 2 + ["backward:nan", "unscale_", "update", "step"],
}


def parse(word):
    name, _, bad = word.partition(":")
    return (name, {"": None, "inf": math.inf, "nan": math.nan}[bad], 1, 0.5)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_adamw"])
@pytest.mark.parametrize("sequence", list(FIXED))
def test_fixed_call_sequences_match_torch(backend, fused, sequence):
    run_sequence(backend, fused, [parse(w) for w in FIXED[sequence]])
