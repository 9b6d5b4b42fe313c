"""Pre-bound launches (``tritonscale/kernels/bound_launch.py``) against Triton's JIT path, on Triton's
real launch path: every bound launch is compared, argument by argument, with the launch the JIT
path makes for the same call.

Not collected by the suite (no ``test_`` prefix): ``tests/kernels/test_bound_launch.py`` runs it with
pytest in a subprocess without ``TRITON_INTERPRET`` (``--noconftest``: tests/conftest.py sets it),
at harness level 1 (``fake_driver``: the launcher records its call) or, with
``TRITONSCALE_LAUNCH_LEVEL=2``, level 2 (``stub``: Triton's own C launcher over the stub libcuda,
whose parameter blocks are compared too)::

    env -u TRITON_INTERPRET TRITONSCALE_AUTOTUNE=0 PYTHONPATH=$PWD:$PWD/tests \\
        python -m pytest -q -p no:cacheprovider --noconftest tests/launch_path/bound_tier.py

The oracle of every test is Triton's own: the JIT path's launch for the same arguments (made right
after the bound one, through ``kernel[grid]``), and Triton's own binder and cache key for "which
compiled kernel would this call launch".
"""

from __future__ import annotations

import importlib
import os
from typing import Any, NamedTuple

import pytest

LEVEL = int(os.environ.get("TRITONSCALE_LAUNCH_LEVEL", "1"))
if LEVEL == 1:
    from launch_path import fake_driver

    DRIVER = fake_driver.activate()
    RECORDS = DRIVER.launches
else:
    from launch_path import stub

    DRIVER = stub.activate()
    RECORDS = DRIVER.python_launches

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from triton import knobs  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction, compute_cache_key  # noqa: E402

import tritonscale  # noqa: E402
from tritonscale import LossScalePolicy  # noqa: E402
from tritonscale.kernels.bound_launch import BoundLaunch, PreparedLaunch  # noqa: E402

from launch_path.scenarios import gpu_paths_on_cpu  # noqa: E402  (with the host-read guard of the step)

# The modules (``tritonscale.kernels`` exports functions of the same names as two of them).
apply_pass, bound_launch, check_pass, finalize, loop_state, policy_update = (
    importlib.import_module(f"tritonscale.kernels.{name}")
    for name in ("apply_pass", "bound_launch", "check_pass", "finalize", "loop_state", "policy_update")
)
LAUNCHERS = {
    "check_pass": check_pass._CHECK_PASS,
    "finalize": finalize._FINALIZE,
    "apply_table": apply_pass._APPLY_TABLE,
    "apply_flat": apply_pass._APPLY_FLAT,
    "policy_update": policy_update._UPDATE,
    "gather_stats": loop_state._GATHER_STATS,
    "advance_lr": loop_state._ADVANCE_LR,
}
KERNEL_NAMES = {
    "check_pass_kernel", "finalize_kernel", "apply_kernel", "policy_update_kernel", "gather_stats_kernel",
    "advance_lr_kernel",
}  # fmt: skip


def test_bound_launches_are_on_here():
    assert bound_launch.ENABLED, "this tier needs the JIT path: no TRITON_INTERPRET, a tested triton"
    assert all(launcher.declined is None for launcher in LAUNCHERS.values()), {
        name: launcher.declined for name, launcher in LAUNCHERS.items()
    }


# ---------------------------------------------------------------------------------------- twins
class Twin(NamedTuple):
    """One call of a BoundLaunch (or of a PreparedLaunch, ``prepared``): its launch, the JIT path's
    launch for the same arguments, whether the bound call was a hit (it did not enter
    ``JITFunction.run``), and at level 2 the parameter blocks the stub's ``cuLaunchKernelEx``
    received for the two."""

    launcher: BoundLaunch
    bound: Any
    jit: Any
    hit: bool
    blocks: tuple | None
    prepared: bool = False


def _stub_count() -> int:
    return len(stub.launches()) if LEVEL == 2 else 0


@pytest.fixture(autouse=True)
def _no_earlier_launches():
    """Each test reads only its own launches."""
    if LEVEL == 2:
        stub.reset()
    RECORDS.clear()
    for launcher in LAUNCHERS.values():  # and prepares its call sites again (BoundLaunch.at)
        launcher._sites.clear()


@pytest.fixture
def twins(monkeypatch):
    """Every BoundLaunch call made while the fixture is on also launches through ``kernel[grid]``
    with the same arguments (the JIT path: the oracle); the list holds a Twin per call."""
    made: list[Twin] = []
    entered = [0]
    run = JITFunction.run

    def counted(self, *args, **kwargs):
        entered[0] += 1
        return run(self, *args, **kwargs)

    call = BoundLaunch.__call__

    def twinned(self, grid, *args, **kwargs):
        start, runs, stub_start = len(RECORDS), entered[0], _stub_count()
        call(self, grid, *args, **kwargs)
        hit = entered[0] == runs
        if hit:
            assert len(RECORDS) - start == 1, "a hit launches once"
        bound, stub_mid = RECORDS[-1], _stub_count()
        self.kernel[grid](*args, **kwargs)
        blocks = (stub.launches()[stub_mid - 1].params, stub.launches()[-1].params) if LEVEL == 2 else None
        made.append(Twin(self, bound, RECORDS[-1], hit, blocks))

    def twinned_direct(launch, launcher, grid, args, kwargs):
        """A launch made through a prepared launch, twinned with the JIT path's launch for the
        call's own arguments, unless it went through the launcher's call (twinned there)."""
        start, runs, twins_before = len(RECORDS), entered[0], len(made)
        result = launch()
        if len(made) > twins_before:
            return result
        assert entered[0] == runs and len(RECORDS) - start == 1, "a prepared launch launches once, directly"
        bound, stub_mid = RECORDS[-1], _stub_count()
        launcher.kernel[grid](*args, **kwargs)
        blocks = (stub.launches()[stub_mid - 1].params, stub.launches()[-1].params) if LEVEL == 2 else None
        made.append(Twin(launcher, bound, RECORDS[-1], True, blocks, prepared=True))
        return result

    prepared_call, at = PreparedLaunch.__call__, BoundLaunch.at

    def twinned_prepared(self, *varying):
        grid, args, kwargs = self.full_call(*varying)
        return twinned_direct(lambda: prepared_call(self, *varying), self.launcher, grid, args, kwargs)

    def twinned_at(self, site, grid, args, kwargs, varying):
        # The oracle is the JIT path for the caller's own arguments: a site key that left out
        # something an argument depends on would launch the prepared call's stale value, and differ.
        return twinned_direct(lambda: at(self, site, grid, args, kwargs, varying), self, grid, args, kwargs)

    monkeypatch.setattr(JITFunction, "run", counted)
    monkeypatch.setattr(BoundLaunch, "__call__", twinned)
    monkeypatch.setattr(PreparedLaunch, "__call__", twinned_prepared)
    monkeypatch.setattr(BoundLaunch, "at", twinned_at)
    return made


def _launch_metadata(value) -> Any:
    return (value.data, value.extras) if value is not None else None


def _calls_nothing(hook) -> bool:
    return hook is None or (type(hook) is knobs.HookChain and not hook.calls)


def assert_same_launch(twin: Twin) -> None:
    """The bound launch is the JIT path's: the same compiled kernel, grid, stream, function handle
    and packed metadata, and the same arguments in the same order. Where the JIT path's launch
    hooks call nothing (empty ``HookChain``s), the bound launch passes None for them and for the
    launch metadata (Triton's launcher then calls nothing, as it calls nothing through an empty
    chain), and each plain tensor as the address Triton's launcher reads from it (``data_ptr()``);
    with hooks that call something, the hooks, the launch metadata and the tensors themselves. A
    miss is the JIT path's launch itself."""
    bound, jit = twin.bound, twin.jit
    assert bound.name == jit.name
    assert bound.metadata is jit.metadata, "another compiled kernel"
    assert (bound.grid, bound.stream, bound.function, bound.packed_metadata) == (
        jit.grid, jit.stream, jit.function, jit.packed_metadata,
    )  # fmt: skip
    quiet = twin.hit and _calls_nothing(jit.enter_hook) and _calls_nothing(jit.exit_hook)
    if quiet:
        assert bound.enter_hook is None and bound.exit_hook is None and bound.launch_metadata is None
        # (an autotuned kernel's hits pass the tensors: the autotuner's key reads their dtypes)
        addresses = not isinstance(twin.launcher.kernel, Autotuner)
    else:
        assert bound.enter_hook is jit.enter_hook and bound.exit_hook is jit.exit_hook
        assert _launch_metadata(bound.launch_metadata) == _launch_metadata(jit.launch_metadata)
    assert bound.signature == jit.signature and bound.constants == jit.constants
    names = list(jit.signature)
    assert len(bound.args) == len(jit.args) == len(names)

    def same(ours, theirs) -> bool:
        if ours is theirs:
            return True
        if type(ours) is type(theirs) and type(ours) in (int, float, bool):  # (a prepared launch's own copy)
            return ours == theirs
        return quiet and addresses and type(theirs) is torch.Tensor and type(ours) is int and ours == theirs.data_ptr()

    differ = [name for name, a, b in zip(names, bound.args, jit.args) if not same(a, b)]
    assert not differ, f"{jit.name}: arguments {differ} differ from the JIT path's"
    if twin.blocks is not None:
        assert twin.blocks[0] == twin.blocks[1], f"{jit.name}: the parameter blocks differ"


# ------------------------------------------------------------------ the library's steps, on the GPU paths
POLICIES = {
    "default": {},
    "hysteresis2_snf5": {"hysteresis": 2, "skip_norm_factor": 5.0},
    "zscore": {"skip_norm_sigma": 2.0, "skip_norm_window": 4},
    "zclip": {"clip_norm_z": 1.5, "clip_norm_warmup_steps": 3},
}
#: Gradient layouts: parameter shapes, and whether they go into one flatten_grads_ buffer.
LAYOUTS = {
    "one_tensor": ([(48, 32)], False),  # one contiguous tensor: FLAT over it, numel a multiple of 16
    "one_odd_tensor": ([(7, 5)], False),  # FLAT, numel not a multiple of 16
    "many_aligned": ([(32, 16), (16,), (64, 8), (16, 16), (48,)], False),  # TABLE, ALIGNED
    "many_odd": ([(7, 5), (3,), (33, 2), (5, 5, 5)], False),  # TABLE, not ALIGNED
    "flat_buffer": ([(7, 5), (3,), (33, 2), (16, 16)], True),  # FLAT over a flatten_grads_ buffer
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _parameters(layout: str, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    shapes, flat = LAYOUTS[layout]
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in shapes]
    if flat:
        tritonscale.flatten_grads_(params)
    return params


def _loss(params) -> torch.Tensor:
    return sum((p.float() * p.float()).sum() for p in params)


def sgd_steps(policy: dict, layout: str, dtype: torch.dtype, rounds: int = 2) -> None:
    """SGD with a tensor lr under SkipAwareLR: per round an ``unscale_`` step and a
    ``clip_grad_norm_`` step, each with ``update()`` and ``stats()`` (check, finalize, apply TABLE or
    FLAT, the policy update, the gathers). float16 gradients are never unscaled in place (the
    library refuses it, as torch does): there SGD is fused, the first step of a round a plain
    ``step`` and the clip folds into the optimizer."""
    params = _parameters(layout, dtype)
    half = dtype == torch.float16
    optimizer = torch.optim.SGD(params, lr=torch.tensor(0.01), fused=half or None)
    scaler = tritonscale.GradScaler("cpu", backend="triton", policy=LossScalePolicy(**policy))
    schedule = tritonscale.SkipAwareLR(
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=2), scaler, total_steps=2 * rounds
    )
    for _ in range(rounds):
        for clip in (False, True):
            optimizer.zero_grad(set_to_none=False)
            scaler.scale(_loss(params)).backward()
            if clip:
                scaler.clip_grad_norm_(optimizer, 1.0)
            elif not half:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            schedule.step()
            scaler.stats()


def fused_steps(policy: dict, dtype: torch.dtype, rounds: int = 2) -> None:
    """Fused AdamW on a flat buffer: the clip folded into the optimizer (finalize with FOLD)."""
    params = _parameters("flat_buffer", dtype)
    optimizer = torch.optim.AdamW(params, lr=torch.tensor(1e-3), fused=True)
    scaler = tritonscale.GradScaler("cpu", backend="triton", policy=LossScalePolicy(**policy))
    for _ in range(rounds):
        optimizer.zero_grad(set_to_none=False)
        scaler.scale(_loss(params)).backward()
        scaler.clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)
        scaler.update()


def _check_round_two(made: list[Twin], rounds: int = 2) -> None:
    """Every launch equals the JIT path's; the last round's calls are all hits (the first round
    bound every specialization the step uses)."""
    assert made, "no bound launch was made"
    for twin in made:
        assert_same_launch(twin)
    last = made[len(made) * (rounds - 1) // rounds :]
    missed = [twin.jit.name for twin in last if not twin.hit]
    assert not missed, f"launches of the last round that took the JIT path: {missed}"
    # The policy update's launches after the first are prepared ones (policy_update.PreparedUpdates).
    updates = [twin.prepared for twin in made if twin.launcher is LAUNCHERS["policy_update"]]
    assert updates[0] is False and updates[-1] is True, updates


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", POLICIES)
def test_sgd_steps_launch_as_the_jit_path(twins, policy, layout, dtype):
    with gpu_paths_on_cpu():
        sgd_steps(POLICIES[policy], layout, DTYPES[dtype])
    _check_round_two(twins)
    launched = {twin.jit.name for twin in twins}
    assert launched == KERNEL_NAMES - ({"apply_kernel"} if dtype == "fp16" else set()), launched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", POLICIES)
def test_fused_steps_launch_as_the_jit_path(twins, policy, dtype):
    with gpu_paths_on_cpu():
        fused_steps(POLICIES[policy], DTYPES[dtype])
    _check_round_two(twins)
    assert {twin.jit.name for twin in twins} == {"check_pass_kernel", "finalize_kernel", "policy_update_kernel"}


def test_the_autotuned_flat_apply_binds_the_tuned_config(twins, monkeypatch):
    """With autotuning on, the first FLAT apply tunes (the fake benchmarker times each candidate);
    later ones launch the config the autotuner holds for the tuning key, as the JIT path does."""
    monkeypatch.delenv("TRITONSCALE_AUTOTUNE", raising=False)
    tuner = apply_pass.apply_kernel_flat_autotuned
    saved = dict(tuner.cache)
    tuner.cache.clear()
    try:
        with gpu_paths_on_cpu():
            sgd_steps({}, "flat_buffer", torch.float32)
        flat = [twin for twin in twins if twin.launcher is LAUNCHERS["apply_flat"]]
        assert len(flat) == 4 and [twin.hit for twin in flat][2:] == [True, True]
        for twin in twins:
            assert_same_launch(twin)
        tuned = {dict(zip(twin.jit.signature, twin.jit.args))["BLOCK"] for twin in flat}
        assert tuned <= {config.kwargs["BLOCK"] for config in tuner.cache.values()}
        # A config the autotuner no longer holds is not launched: the call takes the JIT path again.
        tuner.cache.clear()
        before = len(twins)
        with gpu_paths_on_cpu():
            sgd_steps({}, "flat_buffer", torch.float32, rounds=1)
        assert not any(twin.hit for twin in twins[before:] if twin.launcher is LAUNCHERS["apply_flat"])
        for twin in twins[before:]:
            assert_same_launch(twin)
    finally:
        tuner.cache.clear()
        tuner.cache.update(saved)


# ------------------------------------------------------------------------------ one-argument mutations
def _base_calls() -> dict[str, tuple]:
    """(grid, args, kwargs) of one call of each launcher, as the library makes them."""
    calls: dict[str, tuple] = {}
    with pytest.MonkeyPatch.context() as patch:
        call = BoundLaunch.__call__

        def captured(self, grid, *args, **kwargs):
            name = next(name for name, launcher in LAUNCHERS.items() if launcher is self)
            calls.setdefault(name, (grid, args, kwargs))
            return call(self, grid, *args, **kwargs)

        patch.setattr(BoundLaunch, "__call__", captured)
        patch.setattr(BoundLaunch, "at", lambda self, site, grid, args, kwargs, varying: captured(self, grid, *args, **kwargs))
        with gpu_paths_on_cpu():
            sgd_steps(POLICIES["hysteresis2_snf5"], "many_odd", torch.float32, rounds=1)
            sgd_steps({}, "flat_buffer", torch.bfloat16, rounds=1)
    assert set(calls) == set(LAUNCHERS), set(calls)
    return calls


@pytest.fixture(scope="module")
def base_calls() -> dict[str, tuple]:
    return _base_calls()


def _runtime_positions(launcher: BoundLaunch, args: tuple) -> list[tuple[int, str]]:
    """(position in args, name) of the positional arguments that are runtime parameters."""
    params = [p for p in launcher._jit.params]
    return [(i, params[i].name) for i in range(len(args)) if not params[i].is_constexpr]


def _unaligned(tensor: torch.Tensor) -> torch.Tensor:
    """A view of ``tensor``'s shape and dtype whose address is one element past a 16-byte boundary."""
    base = torch.zeros(tensor.numel() + 16, dtype=tensor.dtype)
    view = base[1 : 1 + tensor.numel()].view(tensor.shape)
    assert view.data_ptr() % 16 != 0
    return view


def _other_dtype(tensor: torch.Tensor) -> torch.Tensor:
    other = {torch.float32: torch.float16, torch.int64: torch.int32, torch.int32: torch.int64}.get(
        tensor.dtype, torch.float32
    )
    return torch.zeros(tensor.shape, dtype=other)


def _mutations(launcher: BoundLaunch, args: tuple) -> list[tuple[str, int, Any]]:
    """One-argument mutations: each int argument as 0, 1, 3, 16 and 2**31; the first and the last
    tensor argument in another dtype, as an unaligned view, and as None."""
    out = []
    runtime = _runtime_positions(launcher, args)
    ints = [(i, name) for i, name in runtime if type(args[i]) is int]
    tensors = [(i, name) for i, name in runtime if isinstance(args[i], torch.Tensor)]
    for i, name in ints:
        out += [(f"{name}={value}", i, value) for value in (0, 1, 3, 16, 2**31)]
    for i, name in dict.fromkeys([tensors[0], tensors[-1]]):
        t = args[i]
        out += [(f"{name} {_other_dtype(t).dtype}", i, _other_dtype(t)), (f"{name} unaligned", i, _unaligned(t))]
        out.append((f"{name}=None", i, None))
    return out


def _outcome(fn):
    try:
        fn()
        return None
    except Exception as error:  # the JIT path's own error, raised through both paths
        return type(error), str(error)[:200]


@pytest.mark.parametrize("name", LAUNCHERS)
def test_one_argument_mutations_launch_as_the_jit_path(twins, base_calls, name):
    """A call that differs from a bound one in one argument launches what the JIT path launches for
    it: a hit where Triton's key is the bound one's, else the JIT path and a new binding (the second
    such call a hit). Where Triton refuses the call (a compile error), both paths raise its error."""
    launcher = LAUNCHERS[name]
    grid, args, kwargs = base_calls[name]
    launcher(grid, *args, **kwargs)
    launcher(grid, *args, **kwargs)
    assert twins[-1].hit
    mutations = _mutations(launcher, args)
    assert 3 <= len(mutations) <= 24
    for label, i, value in mutations:
        mutated = args[:i] + (value,) + args[i + 1 :]
        expected = _triton_pick(launcher, mutated, kwargs)
        before = len(twins)
        error = _outcome(lambda: launcher(grid, *mutated, **kwargs))
        if error is not None:
            assert _outcome(lambda: launcher.kernel[grid](*mutated, **kwargs)) == error, label
            continue
        (first,) = twins[before:]
        assert_same_launch(first)
        assert first.hit == (expected is not None and expected in _bound_kernels(launcher)), label
        launcher(grid, *mutated, **kwargs)  # bound now: a hit, the same launch
        assert twins[-1].hit, f"{label}: the second call did not hit"
        assert_same_launch(twins[-1])


# -------------------------------------------------------------------- the guard against Triton's own key
def _triton_pick(launcher: BoundLaunch, args: tuple, kwargs: dict):
    """The compiled kernel Triton's own code would launch for this call without compiling or
    tuning anything, or None (it would compile, tune, or raise). For an autotuned kernel, the config
    is what ``Autotuner.run`` itself chooses (run with the launch replaced by a capture, and
    benchmarking refused); then Triton's binder and ``compute_cache_key`` name the kernel."""
    kernel = launcher.kernel
    jit_kwargs = dict(kwargs)
    if isinstance(kernel, Autotuner):
        chosen: list[dict] = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernel.fn, "run", lambda *a, **k: chosen.append(k))
            patch.setattr(kernel, "_bench", _refuse_benchmark)
            patch.setattr(kernel, "prune_configs", _refuse_benchmark)
            try:
                kernel.run(*args, grid=(1,), warmup=False, **kwargs)
            except _WouldTune:
                return None
        (jit_kwargs,) = chosen
        jit_kwargs = {k: v for k, v in jit_kwargs.items() if k not in ("grid", "warmup")}
        kernel = kernel.fn
    from triton.runtime.driver import driver

    kernel_cache, kernel_key_cache, _, _, binder = kernel.device_caches[driver.active.get_current_device()]
    jit_kwargs["debug"] = jit_kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    jit_kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # 3.9
        jit_kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    try:
        _, specialization, options = binder(*args, **jit_kwargs)
    except Exception:
        return None
    if getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None:
        return None
    return kernel_cache.get(compute_cache_key(kernel_key_cache, specialization, options))


class _WouldTune(Exception):
    pass


def _refuse_benchmark(*args, **kwargs):
    raise _WouldTune


def _bound_kernels(launcher: BoundLaunch) -> list:
    return [bound.kernel for bound in launcher.bound.values()]


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8]
_BUFFERS = {dtype: torch.zeros(64, dtype=dtype) for dtype in _DTYPES}
_EDGE_INTS = [0, 1, 3, 15, 16, -1, -16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63,
              2**63 + 16, 2**64 - 1, 2**64, -(2**63) - 1]  # fmt: skip


def _runtime_values(base: Any):
    """Values a runtime argument may take, the informative ones most often: for a tensor, the same
    dtype at every alignment; for an int, its neighbours across the buckets (1 a constexpr, odd,
    multiples of 16, the 32- and 64-bit edges); then any kind: tensors of other dtypes, ints
    anywhere, bools, floats, None, and kinds the bound path does not restate (tuples, strings)."""
    anything = st.one_of(
        st.builds(
            lambda dtype, offset: _BUFFERS[dtype][offset : offset + 8], st.sampled_from(_DTYPES), st.integers(0, 8)
        ),
        st.sampled_from(_EDGE_INTS),
        st.integers(-(2**65), 2**65),
        st.booleans(),
        st.floats(allow_nan=False),
        st.none(),
        st.sampled_from([(1, 2), "x"]),
    )
    if isinstance(base, torch.Tensor):
        same = torch.zeros(base.numel() + 16, dtype=base.dtype)
        near = st.builds(lambda offset: same[offset : offset + base.numel()], st.integers(0, 8))
    elif type(base) is int:
        near = st.sampled_from([0, 1, 3, 16, base + 1, base ^ 16, 2**31 - 1, 2**31])
    else:
        near = st.just(base)
    return st.one_of(st.just(base), near, anything)


def _constexpr_values(base: Any):
    """Values a constexpr may take: its own, and others equal or close to it (True for 1, ...)."""
    return st.sampled_from([base, True, False, 0, 1, 2, 3, None])


@st.composite
def _calls(draw, base_calls, name):
    launcher = LAUNCHERS[name]
    grid, args, kwargs = base_calls[name]
    args = list(args)
    runtime = [i for i, _ in _runtime_positions(launcher, tuple(args))]
    for i in draw(st.lists(st.sampled_from(runtime), max_size=3, unique=True)):
        args[i] = draw(_runtime_values(args[i]))
    kwargs = dict(kwargs)
    constexprs = [key for key in kwargs if key.isupper() and not isinstance(kwargs[key], tuple)]
    for key in draw(st.lists(st.sampled_from(constexprs), max_size=1)) if constexprs else ():
        kwargs[key] = draw(_constexpr_values(kwargs[key]))
    options = [key for key in kwargs if key in ("num_warps", "enable_fp_fusion")]  # the call site's options
    for key in draw(st.lists(st.sampled_from(options), max_size=1)) if options else ():
        kwargs[key] = draw(st.sampled_from([1, 2, 4, 8] if key == "num_warps" else [False, True]))
    knob_state = draw(st.sampled_from([(False, ""), (True, ""), (False, "fpsan")]))
    return tuple(args), kwargs, knob_state


def _agrees_with_triton(launcher: BoundLaunch, args: tuple, kwargs: dict, knob_state=(False, "")) -> bool:
    """Assert that the guard accepts this call exactly when Triton's own binder and cache key pick
    a kernel the launcher has bound, and then names that kernel; returns whether it accepted."""
    debug, mode = knob_state
    with knobs.runtime.scope(), knobs.compilation.scope():
        knobs.runtime.debug = debug
        knobs.compilation.instrumentation_mode = mode
        triton_kernel = _triton_pick(launcher, args, kwargs)
        ours = launcher.lookup(*args, **kwargs)
    expected = triton_kernel if any(triton_kernel is k for k in _bound_kernels(launcher)) else None
    assert ours is expected, (args, kwargs, knob_state)
    return ours is not None


def _single_changes(base: Any) -> list:
    """Every informative one-argument change of a runtime argument (the sweep's values)."""
    values = [None, True, False, 0.5, (1, 2), *_EDGE_INTS]
    values += [_BUFFERS[dtype][offset : offset + 8] for dtype in _DTYPES for offset in (0, 1, 2, 4)]
    if type(base) is int:
        values += [base + 1, base ^ 16]
    return values


@pytest.mark.parametrize("name", LAUNCHERS)
def test_the_guard_accepts_exactly_where_triton_picks_a_bound_kernel(base_calls, name):
    """For calls that differ from the library's, the guard accepts exactly when Triton's own binder
    and cache key pick a compiled kernel the launcher has bound, and then names that kernel: every
    runtime argument swept through every informative value (tensors of each dtype and alignment,
    ints at every bucket edge, bools, floats, None, a tuple), then a property over any mix of
    changed arguments, constexprs, options and key knobs."""
    launcher = LAUNCHERS[name]
    grid, args, kwargs = base_calls[name]
    launcher(grid, *args, **kwargs)  # bound (with the variants earlier tests bound)
    outcomes = {True: 0, False: 0}
    for i, _ in _runtime_positions(launcher, args):
        for value in _single_changes(args[i]):
            outcomes[_agrees_with_triton(launcher, args[:i] + (value,) + args[i + 1 :], kwargs)] += 1

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(_calls(base_calls, name))
    def check(call):
        args, kwargs, knob_state = call
        outcomes[_agrees_with_triton(launcher, args, kwargs, knob_state)] += 1

    check()
    assert min(outcomes.values()) >= 10, outcomes  # both answers well represented


# -------------------------------------------------------------------------- what a hit also checks
#: A module-level constexpr the kernel below reads: Triton checks it on every JIT launch.
FILL = tl.constexpr(3)


@triton.jit
def _fills_a_global(out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, FILL, mask=offsets < n)


def test_a_changed_global_takes_the_jit_path(twins):
    """A global the kernel reads (the library's kernels read none: their constants are a defaulted
    constexpr), rebound: to an equal object, still a hit (Triton compares by value); to another
    value, the call takes the JIT path, which raises Triton's error."""
    global FILL
    launcher = BoundLaunch(_fills_a_global)
    out = torch.zeros(16, dtype=torch.int32)
    launcher((1,), out, 16, BLOCK=16)
    assert ("FILL", id(globals())) in launcher._jit.used_global_vals
    assert launcher.lookup(out, 16, BLOCK=16) is not None
    original = FILL
    try:
        FILL = tl.constexpr(3)
        assert launcher.lookup(out, 16, BLOCK=16) is not None
        launcher((1,), out, 16, BLOCK=16)
        assert twins[-1].hit
        FILL = tl.constexpr(4)
        assert launcher.lookup(out, 16, BLOCK=16) is None
        with pytest.raises(RuntimeError, match="Global variable FILL has changed"):
            launcher((1,), out, 16, BLOCK=16)
    finally:
        FILL = original
    assert launcher.lookup(out, 16, BLOCK=16) is not None
    for twin in twins:
        assert_same_launch(twin)


def test_a_pre_run_hook_or_a_knob_change_takes_the_jit_path(twins, base_calls):
    grid, args, kwargs = base_calls["check_pass"]
    launcher = LAUNCHERS["check_pass"]
    launcher(grid, *args, **kwargs)
    assert launcher.lookup(*args, **kwargs) is not None
    seen = []
    launcher._jit.add_pre_run_hook(lambda *a, **k: seen.append(1))
    try:
        assert launcher.lookup(*args, **kwargs) is None
        launcher(grid, *args, **kwargs)
        assert seen and not twins[-1].hit
    finally:
        launcher._jit.pre_run_hooks.clear()
    with knobs.runtime.scope():
        knobs.runtime.debug = True  # enters Triton's key: another compiled kernel
        launcher(grid, *args, **kwargs)
        launcher(grid, *args, **kwargs)
        assert [twin.hit for twin in twins[-2:]] == [False, True]
        assert twins[-1].jit.metadata.debug
        for twin in twins[-2:]:
            assert_same_launch(twin)
    assert launcher.lookup(*args, **kwargs) is not None


def test_launch_hooks_that_call_something_get_what_the_jit_path_gives_them(twins, base_calls):
    """A launch hook added to Triton's chain (as Proton adds its own): a bound hit passes the
    hooks, the launch metadata and the tensors themselves, as the JIT path does, and the hook is
    called for it with the metadata the JIT path's launch gives it; removed, the chain calls nothing
    again and the bound launch passes None."""
    grid, args, kwargs = base_calls["check_pass"]
    launcher = LAUNCHERS["check_pass"]
    launcher(grid, *args, **kwargs)
    seen = []

    def hook(metadata) -> None:
        seen.append(_launch_metadata(metadata))

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launcher(grid, *args, **kwargs)
        assert_same_launch(twins[1])  # (while the chain calls the hook: the comparison reads it)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    launcher(grid, *args, **kwargs)
    assert [twin.hit for twin in twins] == [twins[0].hit, True, True]
    hooked, quiet = twins[1], twins[2]
    assert hooked.bound.enter_hook is knobs.runtime.launch_enter_hook and hooked.bound.launch_metadata is not None
    assert any(isinstance(a, torch.Tensor) for a in hooked.bound.args)
    if LEVEL == 2:  # Triton's C launcher calls the hooks (level 1's recording launcher does not)
        assert len(seen) == 2 and seen[0] == seen[1], "the hook saw the bound launch as it saw the JIT path's"
    assert quiet.bound.enter_hook is None and quiet.bound.launch_metadata is None
    assert not any(isinstance(a, torch.Tensor) for a in quiet.bound.args), "tensors pass as their addresses"
    assert_same_launch(twins[0])
    assert_same_launch(quiet)


# ------------------------------------------------------------------------------ prepared launches
PREPARABLE = [name for name, launcher in LAUNCHERS.items() if not isinstance(launcher.kernel, Autotuner)]


def _prepared_from(name: str, base_calls) -> tuple[PreparedLaunch, list[int], tuple]:
    """A launch prepared from ``name``'s base call (its tensors copied, so that the test may move
    them), the first and the last tensor argument varying; and the call's arguments."""
    grid, args, kwargs = base_calls[name]
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    launcher = LAUNCHERS[name]
    launcher(grid, *args, **kwargs)  # bound
    tensors = [i for i, _ in _runtime_positions(launcher, args) if isinstance(args[i], torch.Tensor)]
    varying = sorted({tensors[0], tensors[-1]})
    return launcher.prepare(grid, args, kwargs, tuple(varying)), varying, args


def _made_by(twins: list[Twin], before: int) -> Twin:
    (twin,) = twins[before:]
    return twin


@pytest.mark.parametrize("name", PREPARABLE)
def test_a_prepared_launch_is_the_jit_paths_or_goes_through_the_launcher(twins, base_calls, name):
    """A prepared launch with the arguments it was prepared from launches directly, as the JIT path
    launches them; one varying argument in another dtype, as an unaligned view or as None, and a
    fixed tensor whose memory moved, go through the launcher's call instead (which launches what
    the JIT path launches for them), and the next call with the prepared arguments is direct again."""
    prepared, varying, args = _prepared_from(name, base_calls)
    assert prepared.direct, prepared.why_not
    same = [args[i] for i in varying]
    before = len(twins)
    prepared(*same)
    direct = _made_by(twins, before)
    assert direct.prepared and direct.hit
    assert_same_launch(direct)
    for label, index, value in [
        ("other dtype", 0, _other_dtype(same[0])), ("unaligned", 0, _unaligned(same[0])), ("None", 0, None),
        ("last unaligned", len(same) - 1, _unaligned(same[-1])),
    ]:  # fmt: skip
        mutated = list(same)
        mutated[index] = value
        before = len(twins)
        error = _outcome(lambda: prepared(*mutated))
        if error is not None:  # Triton refuses the call: the launcher's call raised Triton's error
            assert _outcome(lambda: LAUNCHERS[name].kernel[prepared.grid](*prepared.full_call(*mutated)[1],
                                                                          **prepared.kwargs)) == error, label  # fmt: skip
            continue
        through = _made_by(twins, before)
        assert not through.prepared, f"{label}: launched directly"
        assert_same_launch(through)
    fixed = next(i for i, _ in _runtime_positions(LAUNCHERS[name], args) if isinstance(args[i], torch.Tensor)
                 and i not in varying)  # fmt: skip
    moved = args[fixed]
    old = moved.data_ptr()
    moved.set_(moved.clone().untyped_storage(), 0, moved.shape, moved.stride())
    assert moved.data_ptr() != old
    before = len(twins)
    prepared(*same)
    through = _made_by(twins, before)
    assert not through.prepared, "a fixed tensor moved: the prepared launch must not pass its old address"
    assert_same_launch(through)
    assert moved.data_ptr() in through.bound.args or moved in through.bound.args


def test_call_sites_key_every_argument_they_fix(twins):
    """The wrappers that launch through ``BoundLaunch.at`` (the check pass, the finalize) name in
    their site key everything that fixes the arguments they do not pass as varying: a sequence of
    calls each differing from the one before in one argument of the wrapper launches, every time,
    what the JIT path launches for that call's own arguments (a key that left something out would
    launch the prepared call's stale value)."""
    from tritonscale.kernels import describe_grads
    from tritonscale.kernels.interfaces import STEP_OFF, FinalizeStep

    torch.manual_seed(0)
    layouts = [
        describe_grads([torch.randn(48, 32)]),  # FLAT
        describe_grads([torch.randn(48, 31)]),  # FLAT, another numel
        describe_grads([torch.randn(7, 5), torch.randn(3), torch.randn(33, 2)]),  # TABLE, not aligned
        describe_grads([torch.randn(32, 16), torch.randn(16)]),  # TABLE, aligned
    ]
    wide = torch.zeros(3, 64)
    for layout in layouts:
        for code in (2, 1, 0):
            for partials in (wide, torch.zeros(3, 32)):
                check_pass.check_pass(layout, partials, code)
                check_pass.check_pass(layout, partials, code)  # (the second: through the prepared launch)
    scale = torch.tensor(1024.0)
    earlier = torch.zeros(1)
    norm_stats = torch.tensor([2.0, 3.0])
    steps = [
        None, FinalizeStep(dict(STEP_OFF, FOLD=True)), FinalizeStep(dict(STEP_OFF, FOLD=True, DECIDE=True)),
        FinalizeStep(dict(STEP_OFF, DECIDE=True), earlier), FinalizeStep(dict(STEP_OFF, DECIDE=True), None),
        FinalizeStep(dict(STEP_OFF, DECIDE=True, NORM_FACTOR=5.0, NORM_WARMUP=2), None, norm_stats),
        FinalizeStep(dict(STEP_OFF, DECIDE=True, NORM_FACTOR=4.0, NORM_WARMUP=2), None, norm_stats),
    ]  # fmt: skip
    for partials in (wide, torch.rand(3, 32)):
        for columns in (1, 3, 32):
            for code in (2, 0):
                for max_norm in (None, 1.0, 0.5):
                    for step in steps:
                        finalize.finalize(partials, columns, scale, code, max_norm, step)
    assert sum(twin.prepared for twin in twins) > len(twins) // 3, "the calls went through prepared launches"
    for twin in twins:
        assert_same_launch(twin)


def test_a_prepared_launch_proves_globals_hooks_knobs_on_each_call(twins, base_calls):
    """What a hit's guard reads besides the arguments, a prepared launch reads on each call: a
    pre-run hook, a knob in Triton's key and a launch hook each send it through the launcher."""
    prepared, varying, args = _prepared_from("check_pass", base_calls)
    same = [args[i] for i in varying]
    seen = []
    launcher = LAUNCHERS["check_pass"]
    launcher._jit.add_pre_run_hook(lambda *a, **k: seen.append(1))
    try:
        prepared(*same)
        assert seen and not twins[-1].prepared and not twins[-1].hit
    finally:
        launcher._jit.pre_run_hooks.clear()
    with knobs.runtime.scope():
        knobs.runtime.debug = True  # another key: another compiled kernel
        prepared(*same)
        assert not twins[-1].prepared and twins[-1].jit.metadata.debug
        assert_same_launch(twins[-1])
    knobs.runtime.launch_enter_hook.add(hook := lambda metadata: None)
    try:
        prepared(*same)
        assert not twins[-1].prepared
        assert_same_launch(twins[-1])
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    prepared(*same)
    assert twins[-1].prepared
    assert_same_launch(twins[-1])


def test_a_prepared_launch_of_an_unbound_call_goes_through_the_launcher(twins, base_calls):
    """Prepared from a call no launch has bound (an autotuned kernel, a call that was never made):
    every call goes through the launcher's own call."""
    grid, args, kwargs = base_calls["check_pass"]
    fresh = BoundLaunch(check_pass.check_pass_kernel)
    prepared = fresh.prepare(grid, args, kwargs, ())
    assert not prepared.direct and "not bound" in prepared.why_not
    prepared()
    assert not twins[-1].prepared
    assert_same_launch(twins[-1])
    tuner = LAUNCHERS["apply_flat"]
    assert not tuner.prepare(*base_calls["apply_flat"], ()).direct


def test_a_backend_with_its_own_tensor_rule_stays_on_the_jit_path(twins, monkeypatch):
    """A backend whose tensor specialization is not Triton's native one (ROCm's adds "S" for
    tensors within 2 GB) is never bound: after its first launch every call takes the JIT path."""
    from triton.backends.nvidia.compiler import CUDABackend

    monkeypatch.setattr(CUDABackend, "supports_native_tensor_specialization", False)
    launcher = BoundLaunch(_fills_a_global)
    out = torch.zeros(16, dtype=torch.int32)
    for _ in range(3):
        launcher((1,), out, 16, BLOCK=16)
    assert "CUDABackend" in launcher.declined and not launcher.bound
    assert [twin.hit for twin in twins] == [False, False, False]
    for twin in twins:
        assert_same_launch(twin)


def test_the_specialization_rule_is_tritons():
    """``specialization`` gives what Triton's native binder gives, for the kinds it restates."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    values = [*_EDGE_INTS[:-2], -(2**63), True, False, 0.5, None, torch.nn.Parameter(torch.zeros(3))]
    values += [buffer[offset:] for buffer in _BUFFERS.values() for offset in (0, 1, 4)]
    for value in values:
        ours = bound_launch.specialization(value)
        assert ours == tuple(native_specialize_impl(CUDABackend, value, False, True, True)), value
    for value in (2**64, -(2**63) - 1):  # Triton refuses them; the bound path leaves them to it
        with pytest.raises(OverflowError):
            native_specialize_impl(CUDABackend, value, False, True, True)
        with pytest.raises(bound_launch.Unbindable):
            bound_launch.specialization(value)
