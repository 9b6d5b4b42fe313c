"""GradScaler's API contract: misuse errors, validation, state_dict/pickle, no host sync, launches."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch

import tritonscale
from tritonscale import GradScaler, LossScalePolicy, ScalerConfigError, host_reads

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def tiny_setup(backend="torch", n_params=3, **kw):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(n_params)]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend=backend, **kw)
    return params, opt, scaler


def backward(params, scaler, bad=None):
    loss = sum((p * (i + 1)).sum() for i, p in enumerate(params))
    scaler.scale(loss).backward()
    if bad is not None:
        params[0].grad[0, 0] = bad


# --------------------------------------------------------------- construction
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"growth_factor": 1.0}, "growth factor"),
        ({"growth_factor": 0.5}, "growth factor"),
        ({"backoff_factor": 1.0}, "backoff factor"),
        ({"backoff_factor": 0.0}, "backoff factor"),
        ({"backoff_factor": -0.5}, "backoff factor"),
        ({"growth_interval": 0}, "growth interval"),
        ({"growth_interval": 2.5}, "growth interval"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_bad_hyperparameters_raise_naming_the_problem(kwargs, match):
    with pytest.raises(ScalerConfigError, match=match) as info:
        GradScaler("cpu", **kwargs)
    # torch raises AssertionError for the factors; ours is both, so torch-era code still catches it.
    assert isinstance(info.value, AssertionError) and isinstance(info.value, ValueError)


def test_setters_validate_and_keep_the_old_value():
    scaler = GradScaler("cpu")
    with pytest.raises(ScalerConfigError):
        scaler.set_growth_factor(0.9)
    with pytest.raises(ScalerConfigError):
        scaler.set_backoff_factor(1.5)
    with pytest.raises(ScalerConfigError):
        scaler.set_growth_interval(0)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (2.0, 0.5, 2000)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (4.0, 0.25, 7)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend"):
        GradScaler("cpu", backend="cuda")


def test_cuda_default_without_cuda_disables_with_a_warning():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.warns(UserWarning, match="CUDA is not available") as caught:
        scaler = GradScaler()
    assert not scaler.is_enabled()
    assert 'GradScaler("cpu")' in str(caught[0].message)  # what works on this machine, named


def test_backend_for_names_the_backend_that_runs(monkeypatch):
    """"auto" is what was asked; ``backend_for`` is what runs: the backend object whose passes a step
    on that device calls (its own record, not a second rule)."""
    from tritonscale.passes import grad_passes

    ran = []
    for name in ("auto", "torch", "triton"):
        scaler = GradScaler("cpu", backend=name)
        assert scaler.backend == name
        params = [torch.nn.Parameter(torch.ones(3))]
        scaler.scale(params[0].sum()).backward()
        opt = torch.optim.SGD(params, lr=0.1)
        real = grad_passes._backend

        def spy(*args, **kwargs):
            backend = real(*args, **kwargs)
            ran.append(backend.name)
            return backend

        monkeypatch.setattr(grad_passes, "_backend", spy)
        scaler.unscale_(opt)
        monkeypatch.setattr(grad_passes, "_backend", real)
        assert scaler.backend_for() == scaler.backend_for("cpu") == ran[-1] in ("triton", "torch")
    assert ran[1] == "torch" and ran[2] == "triton"


def test_same_constructor_defaults_as_torch():
    ours, theirs = GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for getter in ("get_scale", "get_growth_factor", "get_backoff_factor", "get_growth_interval", "is_enabled"):
        assert getattr(ours, getter)() == getattr(theirs, getter)()
    assert {k: ours.state_dict()[k] for k in TORCH_KEYS} == theirs.state_dict()


# ------------------------------------------------------------ a disabled scaler's knobs
NORM_RULES = {"skip_norm_above": 100.0, "skip_norm_factor": 3.0, "skip_norm_sigma": 3.0, "clip_norm_z": 2.5}


@pytest.mark.parametrize("knob", list(NORM_RULES))
@pytest.mark.parametrize("given", ["knob", "policy", "preset"])
def test_a_disabled_scaler_refuses_the_norm_rules_by_name(knob, given):
    """A bf16 run's scaler (enabled=False) keeps no norm history: a norm rule would be ignored (a
    50x norm applied), so it is refused, however it comes, naming the knob and what works."""
    knobs = {knob: NORM_RULES[knob], "skip_norm_window": 4}
    policy = tritonscale.LossScalePolicy(**knobs)
    arguments = {
        "knob": knobs,
        "policy": {"policy": policy},
        "preset": {"policy": tritonscale.PeerPreset("mine", 1024.0, policy, "a test")},
    }[given]
    with pytest.raises(ScalerConfigError, match=rf"enabled=False\) got {knob}=") as error:
        GradScaler("cpu", enabled=False, **arguments)
    message = str(error.value)
    assert "keeps no norm history" in message and "scaler.clip_grad_norm_" in message and "enabled scaler" in message


def test_a_disabled_scaler_keeps_the_scale_knobs_unused_as_torch():
    """torch's disabled scaler takes its knobs and ignores them; so do presets' scale rules."""
    for arguments in ({"hysteresis": 2, "growth_interval": 10}, {"policy": "megatron"}, {"policy": "deepspeed"}):
        assert not GradScaler("cpu", enabled=False, **arguments).is_enabled()


# ------------------------------------------------------------ peers' presets
def test_a_presets_name_is_its_call_with_the_peers_defaults():
    for name in tritonscale.presets.PRESETS:
        if name == "tf1":  # its manager has required arguments: the name alone is refused, naming them
            with pytest.raises(ScalerConfigError, match="init_loss_scale and incr_every_n_steps"):
                GradScaler("cpu", policy=name)
            continue
        preset = tritonscale.presets.preset(name)
        by_name, by_call = GradScaler("cpu", policy=name), GradScaler("cpu", policy=preset)
        assert by_name.state_dict() == by_call.state_dict()
        assert by_name.get_scale() == preset.init_scale and by_name.get_policy() == preset.policy


def test_init_scale_given_overrides_the_presets_even_when_it_is_torchs_value():
    # The default init_scale is torch's 2**16; a preset's own scale applies only where none was given.
    assert GradScaler("cpu", policy="keras").get_scale() == 2.0**15
    assert GradScaler("cpu", policy="keras", init_scale=2.0**16).get_scale() == 2.0**16
    assert GradScaler("cpu", policy="keras", init_scale=8.0).get_scale() == 8.0
    assert GradScaler("cpu", 2.0**16, policy="megatron").get_scale() == 2.0**16  # positionally too
    assert type(GradScaler("cpu").state_dict()["scale"]) is float


def test_a_preset_takes_every_knob_beside_it_over_its_own_torchs_three_included():
    """One rule for knobs beside a preset: given, it overrides; left out, the preset's stays. torch's
    three were refused there while ours were taken (issue 42); an explicit torch default counts too."""
    scaler = GradScaler("cpu", policy="megatron", hysteresis=3, min_scale=2.0)
    expected = tritonscale.presets.megatron().policy
    expected.hysteresis, expected.min_scale = 3, 2.0
    assert scaler.get_policy() == expected
    scaler = GradScaler("cpu", 2.0**10, 3.0, 0.25, 10, policy="megatron", hysteresis=3)
    expected = tritonscale.presets.megatron(growth_factor=3.0, backoff_factor=0.25, growth_interval=10).policy
    expected.hysteresis = 3
    assert scaler.get_policy() == expected and scaler.get_scale() == 2.0**10
    explicit_default = GradScaler("cpu", growth_interval=2000, policy=LossScalePolicy(growth_interval=5))
    assert explicit_default.get_policy().growth_interval == 2000
    assert GradScaler("cpu", policy=LossScalePolicy(growth_interval=5)).get_policy().growth_interval == 5


def test_each_of_torchs_knobs_passed_at_torchs_value_overrides_the_policys():
    """A knob passed at exactly torch's default (by keyword or position) still counts as passed;
    left out, the policy's stays. Oracle: the policy's own values, which differ from torch's."""
    policy = LossScalePolicy(growth_factor=4.0, backoff_factor=0.25, growth_interval=5)
    assert GradScaler("cpu", policy=policy).get_policy().knobs() == policy.knobs()
    for name, torchs in (("growth_factor", 2.0), ("backoff_factor", 0.5), ("growth_interval", 2000)):
        by_keyword = GradScaler("cpu", policy=policy, **{name: torchs}).get_policy()
        assert by_keyword.knobs() == {**policy.knobs(), name: torchs}, name
    by_position = GradScaler("cpu", 2.0**16, 2.0, 0.5, 2000, policy=policy).get_policy()
    assert by_position.knobs() == {**policy.knobs(), "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


def test_megatrons_preset_takes_its_config_names():
    by_config = tritonscale.presets.megatron(initial_loss_scale=2.0**20, min_loss_scale=4.0, loss_scale_window=10)
    by_scaler = tritonscale.presets.megatron(initial_scale=2.0**20, min_scale=4.0, growth_interval=10)
    assert by_config == by_scaler
    with pytest.raises(ScalerConfigError, match="loss_scale_window=10 and growth_interval=5 .* set one of them"):
        tritonscale.presets.megatron(loss_scale_window=10, growth_interval=5)


def test_a_disabled_deepspeed_preset_with_window_0_is_refused_saying_what_works():
    # DeepSpeed ignores its fp16 section with fp16 off; a preset is built before the scaler: refused, documented.
    with pytest.raises(ScalerConfigError, match=r"loss_scale_window=0\).*enabled=False.*passes no policy="):
        GradScaler(enabled=False, policy=tritonscale.presets.deepspeed(loss_scale_window=0))
    assert GradScaler("cpu", enabled=False).get_policy() == LossScalePolicy()


@pytest.mark.parametrize(
    "policy, error, match",
    [
        ("deep-speed", ScalerConfigError, r"unknown preset 'deep-speed'; the presets are \['apex'"),
        ({"hysteresis": 2}, TypeError, "a peer's preset .* or a preset's name"),
        (tritonscale.presets.deepspeed, TypeError, "got function"),
    ],
    ids=["misspelt", "dict", "uncalled"],
)
def test_a_policy_that_is_not_one_is_named(policy, error, match):
    with pytest.raises(error, match=match):
        GradScaler("cpu", policy=policy)


def test_loss_scale_optimizer_takes_a_preset_with_its_initial_scale():
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = tritonscale.LossScaleOptimizer(torch.optim.SGD([param], lr=0.1), tritonscale.presets.tf_keras())
    assert optimizer.loss_scale == 2.0**15 and optimizer.scaler.get_policy().min_scale == 1.0


# -------------------------------------------------------------------- misuse
def test_misuse_errors_match_torch(backend):
    # Run each misuse against torch's scaler and ours; both must raise the same type and message.
    def misuse(make_scaler):
        outcomes = []
        params, opt, _ = tiny_setup()
        for action in (
            "unscale_before_scale",
            "step_before_scale",
            "update_before_scale",
            "unscale_twice",
            "unscale_after_step",
            "step_twice",
            "closure",
            "update_no_checks",
        ):
            scaler = make_scaler()
            for p in params:
                p.grad = None
            try:
                if action == "unscale_before_scale":
                    scaler.unscale_(opt)
                elif action == "step_before_scale":
                    scaler.step(opt)
                elif action == "update_before_scale":
                    scaler.update()
                else:
                    backward(params, scaler)
                    if action == "unscale_twice":
                        scaler.unscale_(opt)
                        scaler.unscale_(opt)
                    elif action == "unscale_after_step":
                        scaler.step(opt)
                        scaler.unscale_(opt)
                    elif action == "step_twice":
                        scaler.step(opt)
                        scaler.step(opt)
                    elif action == "closure":
                        scaler.step(opt, closure=lambda: 0.0)
                    elif action == "update_no_checks":
                        scaler.update()
                outcomes.append((action, None))
            except Exception as e:  # noqa: BLE001 - the type and text are what we compare
                outcomes.append((action, type(e), str(e)))
        return outcomes

    ours = misuse(lambda: GradScaler("cpu", backend=backend))
    theirs = misuse(lambda: torch.amp.GradScaler("cpu"))
    assert ours == theirs
    assert all(o[1] is not None for o in ours)


def test_clip_after_step_is_refused_and_bad_clip_arguments_change_nothing(backend):
    params, opt, scaler = tiny_setup(backend)
    backward(params, scaler)
    before = [p.grad.clone() for p in params]
    with pytest.raises(ValueError, match="max_norm"):
        scaler.clip_grad_norm_(opt, -1.0)
    with pytest.raises(ValueError, match="norm_type"):
        scaler.clip_grad_norm_(opt, 1.0, norm_type=math.nan)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.clip_grad_norm_(opt, 1.0)


def test_fp16_gradients_refused_like_torch(backend):
    params, opt, scaler = tiny_setup(backend)
    backward(params, scaler)
    params[1].grad_dtype = None  # let the fp32 parameter hold an fp16 gradient
    params[1].grad = params[1].grad.half()
    before = [p.grad.clone() for p in params]
    for call in (lambda: scaler.unscale_(opt), lambda: scaler.clip_grad_norm_(opt, 1.0)):
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            call()
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_non_floating_gradients_raise_and_change_nothing(backend):
    params, opt, scaler = tiny_setup(backend)
    backward(params, scaler)
    params[2].grad_dtype = None  # let the fp32 parameter hold a gradient of another dtype
    params[2].grad = params[2].grad.to(torch.int32)
    before = [p.grad.clone() for p in params[:2]]
    state = scaler.state_dict()
    for call in (lambda: scaler.unscale_(opt), lambda: scaler.clip_grad_norm_(opt, 1.0)):
        with pytest.raises(TypeError, match="non-floating"):
            call()
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    assert scaler.state_dict() == state
    params[2].grad = None
    scaler.unscale_(opt)  # the stage did not advance: unscale_ is still allowed


def test_clip_after_unscale_only_clips(backend):
    params, opt, scaler = tiny_setup(backend, init_scale=8.0)
    backward(params, scaler)
    scaler.unscale_(opt)
    unscaled = [p.grad.clone() for p in params]
    norm = scaler.clip_grad_norm_(opt, 1.0)
    ref = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in params]
    for r, u in zip(ref, unscaled):
        r.grad = u.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-5)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)


# ------------------------------------------------------------- state & pickle
def test_state_dict_round_trips_with_torch_both_ways(backend):
    params, opt, ours = tiny_setup(backend, init_scale=2.0**10, growth_interval=2)
    for bad in (None, math.inf, None):
        backward(params, ours, bad)
        ours.step(opt)
        ours.update()
    saved = ours.state_dict()
    assert set(TORCH_KEYS) <= set(saved)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(saved)  # loads before theirs has a scale tensor; ignores our extra keys
    assert theirs.state_dict() == {k: saved[k] for k in TORCH_KEYS}
    again = GradScaler("cpu", backend=backend)
    again.load_state_dict(theirs.state_dict())  # and ours before its scale exists
    assert {k: again.state_dict()[k] for k in TORCH_KEYS} == theirs.state_dict()
    again.scale(torch.tensor(1.0))
    assert again.get_scale() == saved["scale"] and again._get_growth_tracker() == saved["_growth_tracker"]


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"scale": -1.0}, "scale"),
        ({"scale": "big"}, "scale"),
        ({"growth_factor": 0.5}, "growth factor"),
        ({"backoff_factor": 2.0}, "backoff factor"),
        ({"growth_interval": 0}, "growth interval"),
        ({"_growth_tracker": -3}, "_growth_tracker"),
        ({"growth_interval": None}, "growth_interval"),
    ],
    ids=["neg-scale", "str-scale", "growth", "backoff", "interval", "tracker", "none"],
)
def test_malformed_state_dict_is_rejected_and_changes_nothing(patch, match):
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.tensor(1.0))
    good = scaler.state_dict()
    with pytest.raises(ScalerConfigError, match=match):
        scaler.load_state_dict({**good, **patch})
    assert scaler.state_dict() == good


def test_state_dict_missing_keys_and_empty():
    scaler = GradScaler("cpu")
    with pytest.raises(ScalerConfigError, match="missing"):
        scaler.load_state_dict({"scale": 2.0})
    with pytest.raises(RuntimeError, match="empty"):
        scaler.load_state_dict({})


def test_pickle_round_trip(backend):
    params, opt, scaler = tiny_setup(backend, init_scale=64.0, growth_interval=5)
    backward(params, scaler)
    scaler.step(opt)
    scaler.update()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict() and clone.backend == backend
    backward(params, scaler)
    scaler.unscale_(opt)
    with pytest.raises(AssertionError, match="pickled"):
        pickle.dumps(scaler)
    copy.deepcopy(GradScaler("cpu"))  # before any scale() too


def test_update_with_new_scale():
    scaler = GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))
    scaler.update(new_scale=128.0)
    assert scaler.get_scale() == 128.0
    scaler.update(new_scale=torch.tensor(32.0))
    assert scaler.get_scale() == 32.0
    with pytest.raises(AssertionError, match="new_scale"):
        scaler.update(new_scale=torch.tensor([1.0, 2.0]))
    with pytest.raises(ScalerConfigError):
        scaler.update(new_scale=-1.0)


# ----------------------------------------------------------- no host syncs
POLICIES = {
    "torch": {},
    "megatron+spike": {"hysteresis": 2, "min_scale": 1.0, "skip_norm_factor": 5.0, "norm_warmup_steps": 1},
    # Peers' rules with no check that must stop the run: DeepSpeed's FP16_Optimizer (its growth one
    # step later), fairseq's tolerance without its error scale, Megatron's float32 factors.
    "deepspeed-fp16": {"policy": tritonscale.presets.deepspeed(initial_scale_power=16, optimizer="fp16")},
    "fairseq-tolerance": {
        "policy": tritonscale.presets.fairseq(2**16, 4, 0.5, min_loss_scale=0.0),
        "raise_at_scale": None,
    },
    "megatron-1.1": {"policy": tritonscale.presets.megatron(2.0**16, 1.0, 1.1, 0.9, 3, 1)},
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("mode", ["unscale+clip", "clip", "plain"])
def test_unscale_clip_step_update_never_read_device_values(backend, forbid_host_reads, mode, policy):
    params, _, scaler = tiny_setup(backend, **POLICIES[policy])
    fused = torch.optim.AdamW(params, lr=1e-3, fused=True)
    for bad in (None, math.nan, None):
        backward(params, scaler, bad)
        forbid_host_reads.on = True
        if mode == "unscale+clip":
            scaler.unscale_(fused)
        if mode != "plain":
            scaler.clip_grad_norm_(fused, 0.5)
        scaler.step(fused)  # fused optimizers take found_inf (and grad_scale) on the device
        scaler.update()
        forbid_host_reads.on = False
        for p in params:
            p.grad = None
    # found_inf reached update(): the scale is the rule's for (good, overflow, good); hysteresis 2 absorbs one.
    megatron = (torch.tensor([2.0**16]) * torch.tensor([0.9])).item()  # Megatron's float32 tensors
    expected = {"megatron+spike": 2.0**16, "megatron-1.1": megatron}.get(policy, 2.0**15)
    assert scaler.get_scale() == expected
    assert fused.state[params[0]]["step"] == 2  # and the optimizer skipped that step on the device


def test_step_with_a_plain_optimizer_reads_found_inf_once(backend, monkeypatch):
    monkeypatch.setattr(host_reads, "are_free", lambda device: False)
    params, opt, scaler = tiny_setup(backend)
    backward(params, scaler)
    scaler.clip_grad_norm_(opt, 0.5)
    reads = []
    original = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(1) or original(self))
    scaler.step(opt)
    assert len(reads) == 1


# --------------------------------------------------------------- launches
def count_launches(monkeypatch):
    import tritonscale.passes.backends.custom_ops as ops
    import tritonscale.passes.backends.triton_backend as tb

    calls = []
    for module, name in ((tb, "check_pass"), (tb, "finalize"), (tb, "apply_factor_"), (ops, "apply_factor_")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    return calls


@pytest.mark.parametrize("n_params", [2, 40])
def test_triton_launches_per_step_do_not_grow_with_tensor_count(monkeypatch, n_params):
    calls = count_launches(monkeypatch)
    params, opt, scaler = tiny_setup("triton", n_params=n_params)
    backward(params, scaler)
    scaler.clip_grad_norm_(opt, 0.5)
    assert calls == ["check_pass", "finalize", "apply_factor_"]
    calls.clear()
    for p in params:
        p.grad = None
    scaler.step(opt)
    scaler.update()
    backward(params, scaler)
    scaler.unscale_(opt)
    assert calls == ["apply_factor_"]  # unscale_ alone is one fused read+check+write pass


def test_import_touches_no_gpu_and_exports():
    assert callable(tritonscale.GradScaler) and callable(tritonscale.flatten_grads_)


def test_clip_over_several_devices_is_refused_before_anything_changes(backend):
    # A second device without a GPU: the meta device. The error comes before any pass runs.
    params, opt, scaler = tiny_setup(backend)
    backward(params, scaler)
    elsewhere = torch.nn.Parameter(torch.zeros(3, device="meta"))
    elsewhere.grad = torch.zeros(3, device="meta")
    opt.add_param_group({"params": [elsewhere]})
    before = [p.grad.clone() for p in params]
    with pytest.raises(NotImplementedError, match="several devices"):
        scaler.clip_grad_norm_(opt, 1.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    assert scaler._per_optimizer_states[id(opt)]["stage"] is tritonscale.OptState.READY


# ------------------------------------------------- update(found_inf=...): a flag from the caller
@pytest.mark.parametrize("flag", [True, torch.tensor(1.0), torch.tensor([math.nan]), torch.tensor(True)])
def test_update_with_a_caller_flag_backs_off_like_a_recorded_overflow(backend, flag, forbid_host_reads):
    # Oracle: torch's scaler after a step whose gradient overflowed.
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    theirs.scale(param.sum()).backward()
    param.grad[0] = math.inf
    theirs.step(optimizer)
    theirs.update()
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=2, backend=backend)
    ours.scale(torch.ones(()))
    forbid_host_reads.on = isinstance(flag, torch.Tensor)  # a device flag is never read back
    ours.update(found_inf=flag)
    forbid_host_reads.on = False
    assert ours.get_scale() == theirs.get_scale() == 2.0**9
    assert ours.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"] == 0
    assert ours.last_step_skipped()


def test_update_with_false_flags_grows_on_torch_schedule(backend):
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2, backend=backend)
    scaler.scale(torch.ones(()))
    scales = []
    for flag in [False, torch.tensor(0.0), False, True, False]:
        scaler.update(found_inf=flag)
        scales.append(scaler.get_scale())
    assert scales == [2.0**10, 2.0**11, 2.0**11, 2.0**10, 2.0**10]


def test_update_flag_adds_to_the_recorded_ones(backend):
    params, opt, scaler = tiny_setup(backend)
    backward(params, scaler)
    scaler.step(opt)  # a good step
    scale = scaler.get_scale()
    scaler.update(found_inf=True)  # the caller saw an overflow elsewhere (another model, a loss)
    assert scaler.get_scale() == scale * 0.5


@pytest.mark.parametrize(
    "flag, error", [(1.0, TypeError), ("yes", TypeError), (torch.zeros(2), ValueError)], ids=["float", "str", "two"]
)
def test_update_flag_bad_input_changes_nothing(backend, flag, error):
    scaler = GradScaler("cpu", init_scale=2.0**10, backend=backend)
    scaler.scale(torch.ones(()))
    before = scaler.state_dict()
    with pytest.raises(error, match="found_inf must be a bool or a one-element tensor"):
        scaler.update(found_inf=flag)
    assert scaler.state_dict() == before
