"""Every preset follows its peer's transcribed rule bit for bit, on random knobs and overflow sequences.

One hypothesis property test per preset (``tritonscale.presets``): random overflow sequences with
bursts, random peer arguments within the peer's valid ranges (scales within float32's normal range
and below 2**100), the scaler driven through its real API beside tests/oracles/peer_rules.py's rule: the
same float32 scale bits after every update, the same skipped steps, the same raise at the same
update. On both backends (the ``backend`` fixture) and on the paths a GPU takes ("gpu": the
``forbid_host_reads`` fixture, the rule as device ops; no host read inside the step, except the one
documented read of the policies that must stop training: DeepSpeed ZeRO's raise at min scale,
fairseq's FloatingPointError).
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles.peer_rules import RULES, follow
from oracles.scale_rules import Loop

from tritonscale import GradScaler, ScalerConfigError, presets
from tritonscale.policy.rounding import SCALE_FLOOR

#: Overflow sequences as bursts (so hysteresis budgets, tolerances and windows are spent and refilled).
OVERFLOWS = st.lists(st.tuples(st.booleans(), st.integers(1, 3)), min_size=1, max_size=8).map(
    lambda bursts: [flag for flag, length in bursts for _ in range(length)][:12]
)
#: Factors that are not powers of two round differently in float32 and in double.
GROWTH = st.sampled_from([2.0, 1.5, 3.0, 1.1, 4.0])
BACKOFF = st.sampled_from([0.5, 0.25, 0.8, 0.9, 1 / 3])
INTERVAL = st.integers(1, 4)
SCALES = st.sampled_from([1.0, 3.0, 400.0, 1000.0, 2.0**16, 2.0**32, 2.0**-10, 0.1])
PATHS = pytest.mark.parametrize("paths", ["cpu", "gpu"])
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def check(request, name, peer_args, overflows, backend, paths):
    """The preset ``name`` and its peer's rule, built from the same peer arguments, side by side."""
    preset = presets.PRESETS[name](**peer_args)
    assert presets.preset(name, **peer_args) == preset
    scaler = GradScaler("cpu", policy=preset, backend=backend)
    no_host_reads = None
    if paths == "gpu":  # the paths a GPU takes: the rule as device ops, no host read
        guard = request.getfixturevalue("forbid_host_reads")
        no_host_reads = contextlib.nullcontext if preset.policy.needs_host_check() else guard.armed
    follow(scaler, RULES[name](**peer_args), overflows, backend, no_host_reads)


@st.composite
def torch_args(draw):
    return dict(init_scale=draw(SCALES), growth_factor=draw(GROWTH), backoff_factor=draw(BACKOFF),
                growth_interval=draw(INTERVAL))  # fmt: skip


@st.composite
def megatron_args(draw):
    initial_scale = draw(st.sampled_from([3.0, 1000.0, 2.0**16, 2.0**32, 1.0]))
    args = dict(initial_scale=initial_scale, min_scale=draw(st.sampled_from([1.0, 0.5, 2.0**-10, 3.0, 0.1])))
    args["min_scale"] = min(args["min_scale"], initial_scale)  # Megatron asserts min_scale <= initial_scale
    loss_scale = draw(st.one_of(st.none(), st.sampled_from([1024.0, 3.0])))  # ConstantGradScaler
    args.update(growth_factor=draw(GROWTH), backoff_factor=draw(BACKOFF), growth_interval=draw(INTERVAL),
                hysteresis=draw(st.integers(1, 3)), loss_scale=loss_scale)  # fmt: skip
    return args


@st.composite
def deepspeed_fp16_config(draw, min_loss_scales=(1, 0.25, 2.0**-10, 4, 3.0)):
    """DeepSpeed's ``fp16`` keys (its config itself takes ``min_loss_scale`` as an int: the library
    test draws ints; the rule takes any positive number)."""
    return dict(
        initial_scale_power=draw(st.one_of(st.integers(2, 4), st.integers(2, 32))),  # reach min_loss_scale too
        loss_scale_window=draw(INTERVAL),
        hysteresis=draw(st.integers(1, 3)),
        consecutive_hysteresis=draw(st.booleans()),
        min_loss_scale=draw(st.sampled_from(min_loss_scales)),
        loss_scale=draw(st.sampled_from([0, 0, 0, 128.0])),
    )


@st.composite
def deepspeed_args(draw):
    return dict(
        **draw(deepspeed_fp16_config()),
        optimizer=draw(st.sampled_from(["zero", "fp16"])),
        version=draw(st.sampled_from(["0.14.0", "0.16.9", "0.17.1", "0.19.6"])),
    )


@st.composite
def apex_args(draw):
    max_loss_scale = draw(st.sampled_from([2.0**24, 2.0**17, 2.0**40, 1000.0]))
    init_scale = draw(st.sampled_from([2.0**16, 1000.0, 2.0**30, 1.0, 3.0]))
    min_loss_scale = draw(st.sampled_from([None, 1.0, 0.25, 2.0**-20]))
    if min_loss_scale is not None:
        min_loss_scale = min(min_loss_scale, init_scale, max_loss_scale)
    loss_scale = draw(st.sampled_from(["dynamic", "dynamic", "dynamic", 128.0, 1.0, 3.0]))
    return dict(loss_scale=loss_scale, init_scale=init_scale, scale_window=draw(INTERVAL),
                min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale)  # fmt: skip


@st.composite
def apex_hysteresis_args(draw):
    return dict(init_scale=draw(SCALES), growth_factor=draw(GROWTH), backoff_factor=draw(BACKOFF),
                growth_interval=draw(INTERVAL), hysteresis=draw(st.integers(1, 4)))  # fmt: skip


@st.composite
def fairseq_args(draw):
    min_loss_scale = draw(st.sampled_from([1e-4, 0.5, 2.0, 64.0]))
    init = draw(st.sampled_from([128, 1.0, 2.0**15, 3.0, 2.0**-12, 100.0]))
    world, update_freq = draw(st.sampled_from([1, 8, 3000, 4096, 8192])), draw(st.integers(1, 2))
    window = draw(st.one_of(st.none(), INTERVAL))
    if window is None and int(2**14 / world / update_freq) < 1:
        window = 1  # fairseq's default window would be 0 (a ZeroDivisionError in fairseq)
    # fairseq also starts below threshold_loss_scale (its first backoff then RAISES the scale to the
    # threshold); the preset refuses a scale below its min_scale, so those are left out here.
    threshold = draw(st.sampled_from([None, None, 1.0, 0.5]))
    return dict(
        fp16_init_scale=max(init, 2 * min_loss_scale, threshold or 0),  # no raise before the first update
        fp16_scale_window=window,
        fp16_scale_tolerance=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0, 0.3])),
        threshold_loss_scale=threshold,
        min_loss_scale=min_loss_scale,
        distributed_world_size=world,
        update_freq=update_freq,
    )


@st.composite
def keras_args(draw):
    return dict(initial_scale=draw(SCALES), dynamic_growth_steps=draw(INTERVAL))


@st.composite
def tf_keras_args(draw):
    if not draw(st.booleans()):
        return dict(dynamic=False, initial_scale=draw(SCALES))
    # tf-keras also takes a dynamic initial_scale below 1 (its first overflow then RAISES the scale to its
    # floor, 1); the preset refuses a scale below its min_scale, so those are left out here.
    initial_scale = draw(st.one_of(st.none(), SCALES.filter(lambda scale: scale >= 1)))
    return dict(initial_scale=initial_scale, dynamic_growth_steps=draw(st.one_of(st.none(), INTERVAL)))


@st.composite
def tf1_args(draw):
    if draw(st.integers(0, 3)) == 0:
        return dict(loss_scale=draw(st.sampled_from([1000.0, 1.0, 3.0])))
    return dict(
        init_loss_scale=draw(st.sampled_from([1.0, 1024.0, 3.0, 2.0**20, 1000.0])),
        incr_every_n_steps=draw(INTERVAL),
        decr_every_n_nan_or_inf=draw(st.integers(1, 3)),
        incr_ratio=draw(st.sampled_from([2, 1.5, 3, 1.1])),
        decr_ratio=draw(st.sampled_from([0.8, 0.5, 0.9, 1 / 3])),
    )


#: Each preset's random peer arguments, within the peer's valid ranges.
PEER_ARGS = {
    "torch": torch_args(),
    "megatron": megatron_args(),
    "deepspeed": deepspeed_args(),
    "apex": apex_args(),
    "apex-hysteresis": apex_hysteresis_args(),
    "fairseq": fairseq_args(),
    "keras": keras_args(),
    "tf-keras": tf_keras_args(),
    "tf1": tf1_args(),
}


def test_every_preset_has_its_property_test():
    assert set(PEER_ARGS) == set(presets.PRESETS)


@PATHS
@pytest.mark.parametrize("name", list(PEER_ARGS))
@PROPERTY
@given(data=st.data(), overflows=OVERFLOWS)
def test_the_preset_follows_its_peers_rule(request, backend, paths, name, data, overflows):
    check(request, name, data.draw(PEER_ARGS[name], label="peer_args"), overflows, backend, paths)


# ------------------------------------------------------------------ the presets' own arguments
def test_a_presets_name_is_taken_as_a_user_writes_it():
    assert presets.preset("TF_Keras") == presets.preset("tf-keras") == presets.tf_keras()
    assert GradScaler("cpu", policy="DeepSpeed").get_policy() == presets.deepspeed().policy


@pytest.mark.parametrize("version, delayed", [("0.16.9+cu121", False), ("0.17.1", True), ("0.18", True), (None, True)])
def test_a_deepspeed_version_as_pip_reports_it_picks_the_rule(version, delayed):
    assert presets.deepspeed(version=version).policy.growth_delay == int(delayed)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: presets.deepspeed(loss_scale_window=0), r"presets.deepspeed\(loss_scale_window=0\): .* an int >= 1"),
        (lambda: presets.deepspeed(version="latest"), "version must be a DeepSpeed release such as '0.16.9'"),
        (lambda: presets.deepspeed(optimizer="zero3"), "'zero' .* or 'fp16'"),
        (lambda: presets.megatron(growth_factor=1.00000001), r"presets 'megatron': growth_factor must be > 1"),
        (lambda: presets.tf_keras(dynamic=False), '"initial_scale" must be specified'),
        (lambda: presets.tf1(), "init_loss_scale and incr_every_n_steps"),
        (lambda: presets.fairseq(fp16_scale_tolerance=0.5, min_loss_scale=-1.0), "presets 'fairseq': min_loss_scale"),
    ],
    ids=["window", "version", "optimizer", "megatron-float32-growth", "tf-keras-fixed", "tf1", "fairseq"],
)
def test_a_bad_peer_argument_is_named_with_its_preset(make, match):
    with pytest.raises(ScalerConfigError, match=match):
        make()


@pytest.mark.parametrize("loss_scale", ["Dynamic", "DYNAMIC", "auto", "dynamic ", None, b"dynamic"])
def test_apex_takes_loss_scale_as_amp_reads_it_and_refuses_other_strings(loss_scale):
    # amp's Properties: loss_scale == "dynamic" or float(loss_scale) (so "Dynamic" fails in amp too).
    with pytest.raises(ScalerConfigError, match=r'presets.apex\(loss_scale=...\) takes "dynamic" .*or a number, got'):
        presets.apex(loss_scale=loss_scale)


def test_apex_reads_a_number_in_a_string_as_amp_does():
    # apex's examples pass --loss-scale from argparse as a string: amp reads it with float().
    assert presets.apex(loss_scale="128") == presets.apex(loss_scale=128.0) == presets.apex(loss_scale=128)
    assert presets.apex(loss_scale="dynamic") == presets.apex()


#: Every preset argument that takes a number (its default is one, or None), with a string given.
NUMBER_ARGS = [
    (name, arg)
    for name, make in presets.PRESETS.items()
    for arg, parameter in inspect.signature(make).parameters.items()
    if arg != "version" and (parameter.default is None or type(parameter.default) in (int, float))
]


@pytest.mark.parametrize("name, arg", NUMBER_ARGS, ids=[f"{name}-{arg}" for name, arg in NUMBER_ARGS])
def test_a_string_where_a_number_goes_is_refused_naming_the_argument(name, arg):
    function = presets.PRESETS[name].__name__
    with pytest.raises(ScalerConfigError, match=rf"^presets\.{function}\({arg}=\.\.\.\) takes (a number|an int)"):
        presets.preset(name, **{arg: "1"})


#: Per preset: each argument that sets a policy knob or the initial scale, given a value out of that
#: knob's bounds (with what the preset needs beside it). The refusal must come from the preset and name
#: the argument, not the knob it sets (Megatron's loss_scale_window is the policy's growth_interval).
OUT_OF_BOUNDS = {
    "torch": {"init_scale": {"init_scale": float("inf")}, "growth_factor": {"growth_factor": 1.0},
              "backoff_factor": {"backoff_factor": 1.0}, "growth_interval": {"growth_interval": 0}},
    "megatron": {"initial_scale": {"initial_scale": float("inf")}, "min_scale": {"min_scale": 0.0},
                 "growth_factor": {"growth_factor": 1.0}, "backoff_factor": {"backoff_factor": 0.0},
                 "growth_interval": {"growth_interval": 0}, "hysteresis": {"hysteresis": 0},
                 "loss_scale": {"loss_scale": -1.0}, "initial_loss_scale": {"initial_loss_scale": float("inf")},
                 "min_loss_scale": {"min_loss_scale": 0.0}, "loss_scale_window": {"loss_scale_window": 0}},
    "deepspeed": {"initial_scale_power": {"initial_scale_power": 200}, "loss_scale_window": {"loss_scale_window": 0},
                  "hysteresis": {"hysteresis": 0}, "min_loss_scale": {"min_loss_scale": 0.0},
                  "loss_scale": {"loss_scale": float("inf")}},
    "apex": {"loss_scale": {"loss_scale": -1.0}, "init_scale": {"init_scale": 0.0}, "scale_window": {"scale_window": 0},
             "min_loss_scale": {"min_loss_scale": -1.0}, "max_loss_scale": {"max_loss_scale": 0.0}},
    "apex-hysteresis": {"init_scale": {"init_scale": 0.0}, "growth_factor": {"growth_factor": 1.0},
                        "backoff_factor": {"backoff_factor": 1.0}, "growth_interval": {"growth_interval": 0},
                        "hysteresis": {"hysteresis": 0}},
    "fairseq": {"fp16_init_scale": {"fp16_init_scale": float("inf")}, "fp16_scale_window": {"fp16_scale_window": 0},
                "fp16_scale_tolerance": {"fp16_scale_tolerance": -0.5},
                "threshold_loss_scale": {"threshold_loss_scale": 0.0},
                "min_loss_scale": {"min_loss_scale": -1.0}, "distributed_world_size": {"distributed_world_size": 0},
                "update_freq": {"update_freq": 0}},
    "keras": {"initial_scale": {"initial_scale": 0.0}, "dynamic_growth_steps": {"dynamic_growth_steps": 0}},
    "tf-keras": {"initial_scale": {"initial_scale": float("inf")}, "dynamic_growth_steps": {"dynamic_growth_steps": 0}},
    "tf1": {"init_loss_scale": {"init_loss_scale": 0.0, "incr_every_n_steps": 2},
            "incr_every_n_steps": {"init_loss_scale": 8.0, "incr_every_n_steps": 0},
            "decr_every_n_nan_or_inf": {"init_loss_scale": 8.0, "incr_every_n_steps": 2, "decr_every_n_nan_or_inf": 0},
            "incr_ratio": {"init_loss_scale": 8.0, "incr_every_n_steps": 2, "incr_ratio": 1.0},
            "decr_ratio": {"init_loss_scale": 8.0, "incr_every_n_steps": 2, "decr_ratio": 0.0},
            "loss_scale": {"loss_scale": 0.0}},
}  # fmt: skip
#: How the policy names its knobs and the scale in its own refusals: none may stand for a peer's argument.
KNOB_WORDS = ("init_scale", "growth interval", "growth_interval", "growth factor", "growth_factor", "backoff factor",
              "backoff_factor", "min_scale", "max_scale", "hysteresis", "overflow_tolerance",
              "raise_at_scale")  # fmt: skip
BOUNDED = [(name, arg) for name, args in OUT_OF_BOUNDS.items() for arg in args]


def test_every_numeric_argument_of_every_preset_has_its_out_of_bounds_case():
    numeric = {*NUMBER_ARGS, ("apex", "loss_scale")}  # apex's default is "dynamic"; it takes a number too
    assert numeric == set(BOUNDED), sorted(numeric ^ set(BOUNDED))


@pytest.mark.parametrize("name, arg", BOUNDED, ids=[f"{name}-{arg}" for name, arg in BOUNDED])
def test_an_out_of_bounds_argument_is_refused_by_the_preset_naming_the_argument(name, arg):
    with pytest.raises(ScalerConfigError) as refused:
        presets.preset(name, **OUT_OF_BOUNDS[name][arg])
    message = str(refused.value)
    prefixes = (f"presets {name!r}: ", f"presets.{presets.PRESETS[name].__name__}(")
    prefix = next((p for p in prefixes if message.startswith(p)), None)
    assert prefix, message  # refused by the preset, naming it
    assert arg in message, message
    said = message.removeprefix(prefix).replace(arg, "")  # an argument may be spelled as its knob (torch's)
    assert not [word for word in KNOB_WORDS if word in said.lower()], message


# ------------------------------------------------ the edges where a peer and its preset part (docs/policies.md)
PAST_THE_MAX = {
    # float32 products with no finiteness check: inf
    "keras": dict(initial_scale=2.0**127, dynamic_growth_steps=1),
    "megatron": dict(initial_scale=2.0**127, growth_interval=1, hysteresis=1),
    # Python floats: past float32's range
    "deepspeed": dict(initial_scale_power=127, loss_scale_window=1, version="0.16.9"),
    "fairseq": dict(fp16_init_scale=2.0**127, fp16_scale_window=1),
}


@pytest.mark.parametrize("name", list(PAST_THE_MAX))
def test_past_float32s_max_the_peer_leaves_float32_and_the_preset_keeps_its_scale(backend, name):
    args = PAST_THE_MAX[name]
    peer, scaler = RULES[name](**args), GradScaler("cpu", policy=presets.preset(name, **args), backend=backend)
    peer.update(False)
    Loop(scaler, backend).step(False)
    assert peer.scale > 3.4028234663852886e38  # inf, or a Python float past float32's max
    assert scaler.get_scale() == 2.0**127  # torch's rule: a growth that is not finite is not taken


@pytest.mark.parametrize("name", ["keras", "apex"])
def test_below_2_to_the_minus_126_the_peer_goes_on_and_the_preset_stops(backend, name):
    args = {"keras": dict(initial_scale=2.0**-125), "apex": dict(init_scale=2.0**-125)}[name]
    peer, scaler = RULES[name](**args), GradScaler("cpu", policy=presets.preset(name, **args), backend=backend)
    loop = Loop(scaler, backend)
    for _ in range(3):
        peer.update(True)
        loop.step(True)
    assert peer.scale == 2.0**-128  # a float32 subnormal (Keras), a Python float (apex)
    assert scaler.get_scale() == SCALE_FLOOR == 2.0**-126


@pytest.mark.parametrize("preset", [presets.tf_keras(initial_scale=0.5), presets.tf1(0.5, incr_every_n_steps=2)])
def test_an_initial_scale_below_the_peers_floor_is_refused_where_it_is_set(preset):
    # tf.keras and TF 1.x would raise it to 1 at the first overflow; here it is refused at once.
    with pytest.raises(ScalerConfigError, match=r"init_scale=0.5 is below min_scale=1.0"):
        GradScaler("cpu", policy=preset)
