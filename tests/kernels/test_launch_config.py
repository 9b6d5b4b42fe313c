"""launch_config (kernels/launch_config.py): numerics never depend on a stopwatch.

On a GPU ``triton.autotune`` times its candidates at the first launch of each size class and keeps
the fastest, so which config runs is an accident of the machine's load: two DDP ranks, or a run and
its resume, can get different ones. Only a kernel whose output bits are the same under every
candidate may be tuned (the elementwise apply pass); the check pass, whose partial sums' order
follows BLOCK and num_warps, launches ``check_config(device, numel)``, a pure function.

The interpreter has no clock ("0 active drivers"), so ``stopwatch`` stands in for one: it lets every
autotuner tune as on a GPU, and its clock declares the config a test names the fastest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import pkgutil

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.kernel_cases import DTYPES, SETTINGS_SMALL, assert_bitwise, bits, dtype_id, scales_st
from triton.runtime.autotuner import Autotuner

import tritonscale.kernels
from tritonscale.kernels import GradLayout, apply_factor_, check_pass, describe_grads, finalize
from tritonscale.kernels.check_pass import PARTIAL_ROWS
from tritonscale.kernels.launch_config import CHUNK, check_config, streaming_configs
from tritonscale.kernels.reference import inv_scale_of

launch_config = importlib.import_module("tritonscale.kernels.launch_config")
check_pass_module = importlib.import_module("tritonscale.kernels.check_pass")

#: The autotuned kernels, each elementwise: every candidate config must give the same bits
#: (test_every_candidate_of_the_apply_pass_gives_the_same_bits). A kernel tuned by timing that is
#: not listed here fails test_only_elementwise_kernels_are_autotuned.
ELEMENTWISE = {"apply_kernel"}


def autotuned_kernels() -> dict[str, Autotuner]:
    """Every ``triton.autotune``d kernel of tritonscale.kernels, by the name of its function."""
    modules = [
        importlib.import_module(f"tritonscale.kernels.{info.name}")
        for info in pkgutil.iter_modules(tritonscale.kernels.__path__)
    ]
    return {
        value.base_fn.__name__: value
        for module in modules
        for value in vars(module).values()
        if isinstance(value, Autotuner)
    }


@contextlib.contextmanager
def stopwatch(favourite: triton.Config, *, run_candidates: bool = True):
    """Every autotuner of the package tunes afresh, as on a GPU, timed by a clock that finds
    ``favourite`` the fastest. With ``run_candidates`` each candidate still runs once through the
    autotuner's own benchmark (its restore_value hooks included), as ``do_bench`` runs it."""
    real_bench = Autotuner._bench
    timing = {}

    def bench(tuner, *args, config, **meta):
        timing["config"] = config  # the candidate the clock below is timing
        return real_bench(tuner, *args, config=config, **meta)

    def clock(kernel_call, quantiles):
        if run_candidates:
            kernel_call()
        return [1.0 if timing["config"] == favourite else 2.0] * len(quantiles)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch_config, "autotune_enabled", lambda: True)
        patch.setattr(Autotuner, "_bench", bench)
        patch.setattr(Autotuner, "do_bench", property(lambda tuner: clock))  # a cached_property in triton
        for tuner in autotuned_kernels().values():
            patch.setattr(tuner, "cache", {})
        yield


# ---------------------------------------------------------------------------------------------------
# Which kernels may be tuned, and the check pass's one config


def test_only_elementwise_kernels_are_autotuned():
    tuned = autotuned_kernels()
    assert set(tuned) == ELEMENTWISE, f"autotuned: {sorted(tuned)}; elementwise (proved below): {sorted(ELEMENTWISE)}"
    for name in ("check_pass_kernel", "finalize_kernel"):
        module = importlib.import_module(f"tritonscale.kernels.{name.removesuffix('_kernel')}")
        assert not isinstance(getattr(module, name), Autotuner), f"{name} reduces: its config must not be timed"


@SETTINGS_SMALL
@given(numel=st.one_of(st.integers(1, 2**20), st.integers(1, 2**40)))
def test_check_config_is_a_pure_function_of_device_and_size(numel):
    """The same (device, numel) gives the same config whatever the environment and the autotune
    caches hold, and the config is one the kernel can take (power-of-two block and warps)."""
    device = torch.device("cpu")
    first = check_config(device, numel)
    saved = os.environ.get("TRITONSCALE_AUTOTUNE")
    try:
        for knob in ("0", "1"):
            os.environ["TRITONSCALE_AUTOTUNE"] = knob
            for favourite in streaming_configs():
                with stopwatch(favourite, run_candidates=False):
                    assert check_config(device, numel) == first, f"numel {numel}, TRITONSCALE_AUTOTUNE={knob}"
    finally:
        os.environ.pop("TRITONSCALE_AUTOTUNE", None)
        if saved is not None:
            os.environ["TRITONSCALE_AUTOTUNE"] = saved
    block = first.kwargs["BLOCK"]
    assert set(first.kwargs) == {"BLOCK"} and block == triton.next_power_of_2(block) and block >= 16
    assert first.num_warps == triton.next_power_of_2(first.num_warps)


def _spread_grads(sizes: list[int], seed: int) -> list[torch.Tensor]:
    """Float32 gradients over several decades: the check pass rescales its sums mid-stream."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 4, (n,), generator=gen) for n in sizes]


def _partials(grads: list[torch.Tensor], norm: int) -> torch.Tensor:
    layout = describe_grads(grads)
    partials = torch.full((PARTIAL_ROWS, layout.programs), math.nan)
    check_pass(layout, partials, norm)
    return partials


def test_the_check_pass_launches_what_check_config_names(monkeypatch):
    """The launcher takes its block from check_config and nothing else -- and the block changes the
    partials' bits, which is why it must never be timed."""
    # 1.0 then 2**-25s: the lane holding 1.0 drops each 2**-25 added to it (below half its ulp),
    # and which elements share its lane (every BLOCK-th one) is the block's choice.
    grads = [torch.full((20001,), 2.0**-25)]
    grads[0][0] = 1.0
    by_block = {}
    for block in (1024, 8192):
        config = triton.Config({"BLOCK": block})
        monkeypatch.setattr(check_pass_module, "check_config", lambda device, numel, config=config: config)
        by_block[block] = _partials(grads, norm=1)
        layout = describe_grads(grads)
        direct = torch.full((PARTIAL_ROWS, layout.programs), math.nan)
        args = (layout.first, layout.tensors, layout.chunks, layout.num_items, direct, direct.stride(0))
        check_pass_module.check_pass_kernel[(layout.programs,)](
            *args, NORM=1, FLAT=True, ALIGNED=False, CHUNK_SIZE=CHUNK, BLOCK=block
        )
        assert_bitwise(by_block[block], direct, f"check_pass under check_config BLOCK={block}")
    assert not torch.equal(bits(by_block[1024]), bits(by_block[8192])), "the block did not change the partials"


# ---------------------------------------------------------------------------------------------------
# Whatever the stopwatch picks, one step gives the same bits


def _layout(grads: list[torch.Tensor], programs: int) -> GradLayout:
    """describe_grads, launched on ``programs`` programs (any count is valid: the passes stride
    over blocks by the grid; the interpreter's cap would otherwise need 65536 elements each)."""
    return dataclasses.replace(describe_grads(grads), programs=programs)


def _step_outcome(grads: list[torch.Tensor], scale: float, programs: int) -> list[torch.Tensor]:
    """Everything a step computes from ``grads`` with the kernels: the check pass's partials,
    finalize's four results, the gradients after the apply pass, and after a plain unscale_ (the
    apply pass's CHECK+INVERT variant) with its found_inf."""
    clipped = [g.clone() for g in grads]
    layout = _layout(clipped, programs)
    partials = torch.full((PARTIAL_ROWS, programs), math.nan)
    check_pass(layout, partials, 2)
    result = finalize(partials, programs, torch.tensor([scale]), 2, max_norm=1.0)
    apply_factor_(layout, result[3:4])
    unscaled = [g.clone() for g in grads]
    found_inf = torch.zeros(1)
    apply_factor_(_layout(unscaled, programs), torch.tensor([scale]), invert=True, found_inf=found_inf)
    return [partials, result, *clipped, *unscaled, found_inf]


STEP_CASES = {  # sizes, a non-finite value or None, programs
    "FLAT": ([2 * 8192 + 5], None, 3),  # no multiple of any candidate block; 3 blocks of the largest
    "FLAT-inf": ([2 * 8192 + 5], math.inf, 3),
    "TABLE": ([20001, 8195, 1, 70], None, 4),
}


@pytest.mark.parametrize("case", STEP_CASES)
def test_no_stopwatch_changes_a_bit_of_a_step(case):
    """One step under every possible autotune outcome (each candidate the fastest in turn): the
    partials, the norm, the clip coefficient and the gradients are the same bits."""
    sizes, poison, programs = STEP_CASES[case]
    grads = _spread_grads(sizes, seed=1)
    if poison is not None:
        grads[0][len(grads[0]) // 3] = poison
    outcomes = {}
    for favourite in streaming_configs():
        with stopwatch(favourite):
            outcomes[str(favourite)] = _step_outcome(grads, 2.0**16, programs)
            chosen = [config for tuner in autotuned_kernels().values() for config in tuner.cache.values()]
            assert all(config == favourite for config in chosen), "the stopwatch did not pick the favourite"
            assert chosen or case == "TABLE", "nothing was tuned (TABLE launches are never tuned)"
    (first_name, first), *others = outcomes.items()
    for name, outcome in others:
        for i, (got, want) in enumerate(zip(outcome, first)):
            assert_bitwise(got, want, f"{case}: output {i} with {name} the fastest vs {first_name}")


# ---------------------------------------------------------------------------------------------------
# Every candidate of the elementwise apply pass, through the interpreter

# Six launches an example: fewer examples than the other kernel tests.
_SETTINGS = settings(SETTINGS_SMALL, max_examples=8)
_BLOCK_EDGES = sorted({c.kwargs["BLOCK"] + d for c in streaming_configs() for d in (-1, 0, 1)})
_NONFINITE = st.lists(
    st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from([math.inf, -math.inf, math.nan])), max_size=3
)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@_SETTINGS
@given(
    numel=st.one_of(st.sampled_from(_BLOCK_EDGES), st.integers(1, 2 * 8192 + 100)),
    programs=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    poison=_NONFINITE,
    scale=scales_st,
    mode=st.sampled_from(["factor", "unscale_", "factor+check"]),
)
def test_every_candidate_of_the_apply_pass_gives_the_same_bits(dtype, numel, programs, seed, poison, scale, mode):
    """Each candidate config the autotuner may pick, on any number of programs, writes the same
    gradient bits and the same found_inf -- torch's _amp_foreach_non_finite_check_and_unscale_'s."""
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    for where, value in poison:
        grad[int(where * numel)] = value
    invert, check = mode == "unscale_", mode != "factor"
    factor = torch.tensor([scale])
    outputs = []
    tuner = autotuned_kernels()["apply_kernel"]
    for config in tuner.configs:
        g, found_inf = grad.clone(), torch.zeros(1)
        layout = _layout([g], programs)
        assert layout.flat, "the autotuned launch is the FLAT one"
        with stopwatch(config, run_candidates=False):
            apply_factor_(layout, factor, invert=invert, found_inf=found_inf if check else None)
            assert tuner.best_config == config
        outputs.append((str(config), g, found_inf))
    expected, found_expected = grad.clone(), torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(
        [expected], found_expected, torch.tensor([inv_scale_of(scale) if invert else scale])
    )
    (_, first, _), *_ = outputs
    for name, g, found_inf in outputs:
        assert_bitwise(g, first, f"{mode} with {name} vs {outputs[0][0]}")
        assert_bitwise(g, expected, f"{mode} with {name} vs torch", nan_aware=True)
        assert found_inf.item() == (found_expected.item() if check else 0.0), f"{mode} found_inf with {name}"
