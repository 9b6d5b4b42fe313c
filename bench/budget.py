"""How long the main job will take on this machine, and how big its slow stages may be to fit a budget.

Why: the same CPU run took a few minutes on one 2-core machine and 20 on another, whose CPU has no
fast float16 (no AVX512-FP16 or AMX; issue 22). So ``run_all.py`` measures the work its stages are
made of, on this machine (``measure``), picks sizes that fit its budget (``plan``, a pure function
of the measurement, so tests feed it made-up machines), prints the estimate, and holds the run to
it: between stages, ``replan.py`` re-sizes the stages left from the time left and the slowdown seen.

What is measured (pilots of the real work; every pilot once per pass, three passes spread over the
measurement, each figure the median over the passes, so that a neighbour's load peak that lands
in one pass does not inflate the estimate: ``median_of_passes``):

* matmul under float16 / bfloat16 autocast against float32 (reported: why float16 is slow here);
* forward + backward of the experiments' transformer (float16 at two widths, bfloat16) and MLP
  (float16), at a smaller batch, scaled up (time is close to linear in tokens);
* two points of the sweep (65536 and 2**20 float32 elements): its per-round overhead, its time per
  byte of the bytes model, and its set-up per element;
* forward + backward and a fused AdamW step of the whole-step benchmark's model.

The stages that cannot be resized (compiling kernels, spawning ranks, torch.compile) and each
stage's fixed part (imports, plots) are estimated in units of a dispatch-bound probe of tiny ops
on one thread (``dispatch_unit_ms``), which a loaded machine moves little (the sweep's per-round
overhead, the unit before, read 10x to 500x its idle value on a loaded 2-core machine).
``FIXED_UNITS`` holds those factors, from runs on the development machine; ``run_all.json`` shows
how close they come (``stage_drift``: real over estimated). The float16 probe runs on one thread,
interleaved and repeated, and is sanity-bounded (``matmul_slowdown``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch
from timing import cpu_flags, interleaved

# Steps below which the overflow experiment's learning-rate spike (40-45% of the run) and the
# regrowth after it (growth interval 20) no longer show.
MIN_STEPS = 40
FP16_WIDTHS = (64, 32)  # d_model of the float16 transformer experiments, preferred first
SWEEP_MAX_SIZES = (2**26, 2**24, 2**22)  # largest sweep point, preferred first
SWEEP_REPEATS, TRAIN_STEP_STEPS = (15, 9, 5), (60, 50, 40, 30, 20)  # preferred first
LATE_TRAIN_STEP_STEPS, LATE_SWEEP_MAX_SIZE, LATE_SWEEP_REPEATS = (10,), 2**20, (3,)  # levels(late=True) only
PILOT_PASSES = 3  # passes over every pilot; each figure is the median over the passes (``median_of_passes``)
PROBE_ROUNDS = 7  # interleaved rounds of the autocast probe (after one warm-up round)
MATMULS_PER_CALL = {"float32": 8, "float16": 1, "bfloat16": 8}  # see matmul_calls
FAST_FLOAT16_FLAGS = {"avx512_fp16", "amx_fp16"}  # /proc/cpuinfo flags of a CPU with fast float16 matmuls
PILOT_BATCH = 4  # sequences per pilot call of the experiments' transformer (the preset uses 16)
VOCAB = 25  # characters in the experiments' generated corpus
SWEEP_OVERHEAD_UNITS = 7  # the sweep's per-round overhead in dispatch units, idle (``unit_s``)
# Stages that are not resized, in units of ``dispatch_unit_ms`` (see the module docstring).
FIXED_UNITS = {"kernel_report": 5000, "collectives": 7000, "train_step_compile": 14000, "experiments_fixed": 5500,
               "sweep_fixed": 4200}  # fmt: skip


def typical_ms(fn: Callable[[], object], calls: int = 1) -> float:
    """The median of ``calls`` timed calls after one untimed warm-up, in ms. The median, not the
    minimum: on a loaded machine the stages pay their typical time, not their best, and one wild
    call does not move it. One call by default: ``measure`` takes the median over passes instead."""
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def matmul_calls(tokens: int = 256, width: int = 64) -> dict[str, Callable[[], None]]:
    """The experiments' matmul shape (``tokens x width`` by ``width x 4 width``) in float32 and under
    float16 / bfloat16 autocast, ``MATMULS_PER_CALL`` of them per call: the calls ``matmul_slowdown``
    times. float16's call does fewer, so that every call takes about as long where float16 is slow
    and a neighbour's time slice lands on each alike."""
    a, b = torch.randn(tokens, width), torch.randn(width, 4 * width)

    def under(name, dtype):
        def call():
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                for _ in range(MATMULS_PER_CALL[name]):
                    a @ b

        return call

    return {name: under(name, dtype) for name, dtype in
            (("float32", None), ("float16", torch.float16), ("bfloat16", torch.bfloat16))}  # fmt: skip


def autocast_ratios(calls: dict[str, Callable[[], None]], rounds: int, clock: Callable[[], float],
                    per_call: dict[str, int] | None = None) -> dict[str, float]:  # fmt: skip
    """Each call's time over float32's, per matmul (``per_call`` of them in a call, default 1): the
    median of the per-round ratios of ``rounds`` interleaved rounds (after a warm-up round). Drift
    hits both sides of a round alike, and one wild round (a neighbour stalling one call) does not
    move a median."""
    timed = interleaved(calls, rounds, reset=lambda name: None, clock=clock)
    n = per_call or dict.fromkeys(calls, 1)
    base = [t / n["float32"] for t in timed["float32"]["samples_ms"]]
    return {name: statistics.median(t / n[name] / b for t, b in zip(timed[name]["samples_ms"], base))
            for name in calls if name != "float32"}  # fmt: skip


def matmul_slowdown(calls: dict[str, Callable[[], None]] | None = None, rounds: int = PROBE_ROUNDS,
                    clock: Callable[[], float] = time.perf_counter,
                    fast_float16: bool | None = None) -> tuple[dict[str, float], list[str]]:  # fmt: skip
    """Time of a float16 / bfloat16 autocast matmul over float32's (``autocast_ratios``), and notes.

    Sanity bound: float16 autocast converts and then multiplies, so on a CPU without fast float16
    (no ``avx512_fp16`` / ``amx_fp16`` flag; ``fast_float16`` overrides the check) it cannot beat
    float32. A ratio below 1 there is a noisy neighbour: measured again with twice the rounds, and
    if still below 1, taken as 1.0 with a note saying so. Example::

        ratios, notes = matmul_slowdown()   # ({"float16": 31.0, "bfloat16": 0.7}, [])
    """
    per_call = None if calls else MATMULS_PER_CALL
    calls = calls or matmul_calls()
    fast = fast_float16 if fast_float16 is not None else bool(FAST_FLOAT16_FLAGS & cpu_flags())
    ratios = autocast_ratios(calls, rounds, clock, per_call)
    if ratios["float16"] >= 1.0 or fast:
        return ratios, []
    first = ratios["float16"]
    ratios = autocast_ratios(calls, 2 * rounds, clock, per_call)
    if ratios["float16"] >= 1.0:
        return ratios, [f"the float16 autocast probe read {first:.2f}x float32's, impossible without fast float16: "
                        f"measured again: {ratios['float16']:.1f}x"]  # fmt: skip
    note = (f"the float16 autocast probe read {first:.2f}x then {ratios['float16']:.2f}x float32's, impossible on a "
            "CPU without fast float16 (a noisy neighbour): taken as 1.0x")  # fmt: skip
    return {**ratios, "float16": 1.0}, [note]


def dispatch_unit_ms(rounds: int = 7) -> float:
    """The unit of the stages that are not resized: one round of 200 tiny torch ops and a little
    Python (median of ``rounds``). Spawning ranks, importing and compiling are bound by the
    interpreter and torch's dispatch, like this; tiny ops run on one thread, so the unit does not
    take in the thread contention that a loaded 2-core machine inflicts on multi-threaded ops."""
    x = torch.ones(16)

    def call():
        y = x
        for _ in range(200):
            y = y + 1.0
        "".join(str(i) for i in range(2000))

    samples = interleaved({"unit": call}, rounds, reset=lambda name: None)
    return samples["unit"]["median_ms"]


def lm_step_ms(d_model: int, dtype: torch.dtype | None, p, calls: int = 1) -> float:
    """Forward + backward of the experiments' transformer at ``d_model`` under ``dtype`` autocast,
    per step of ``p.batch`` sequences (measured at ``PILOT_BATCH``, scaled)."""
    import experiments

    torch.manual_seed(0)
    model = experiments.TinyLM(VOCAB, d_model, p.layers, p.context)
    tokens = torch.randint(VOCAB, (PILOT_BATCH, p.context))

    def call():
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()

    return typical_ms(call, calls) * p.batch / PILOT_BATCH


def mlp_step_ms(p) -> float:
    """Forward + backward of the experiments' MLP under float16 autocast (a batch of 128 rows, measured at 32)."""
    torch.manual_seed(0)
    w = p.mlp_width
    model = torch.nn.Sequential(torch.nn.Linear(64, w), torch.nn.GELU(), torch.nn.Linear(w, w), torch.nn.GELU(),
                                torch.nn.Linear(w, 1))  # fmt: skip
    x = torch.randn(32, 64)

    def call():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        loss.backward()

    return typical_ms(call) * 128 / 32


def sweep_pilot() -> dict[str, float]:
    """Two sweep points (float32, flat): per-round overhead, ms per MB of the bytes model, set-up ms per M elements."""
    import sweep

    out = {}
    for key, numel in (("small", 2**16), ("large", 2**20)):
        start = time.perf_counter()
        point = sweep.bench_point(numel, torch.float32, "flat", torch.device("cpu"), 1, "sgd")
        wall = (time.perf_counter() - start) * 1e3
        rounds = sweep.rounds_for(numel, 1) + 1  # with the warm-up round
        out[f"{key}_round_ms"] = sum(point[v]["median_ms"] for v in sweep.VARIANTS)
        out[f"{key}_setup_ms"] = max(0.0, wall - rounds * out[f"{key}_round_ms"])
    megabytes = sum(sweep.bytes_model(v, "sgd", 2**20, torch.float32) for v in sweep.VARIANTS) / 1e6
    return {
        "round_overhead_ms": out["small_round_ms"],
        "ms_per_mb": max(0.0, out["large_round_ms"] - out["small_round_ms"]) / megabytes,
        "setup_ms_per_melement": out["large_setup_ms"],
    }


def train_step_pilot() -> dict[str, float]:
    """Forward + backward and a fused AdamW step of the whole-step benchmark's CPU model (float32)."""
    import train_step

    p = train_step.PRESETS["cpu"]
    torch.manual_seed(0)
    model = train_step.LM(p)
    tokens = torch.randint(p.vocab, (p.batch, p.context))
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)

    def forward_backward():
        model(tokens).logsumexp(-1).mean().backward()

    return {"forward_backward_ms": typical_ms(forward_backward), "adamw_step_ms": typical_ms(opt.step)}


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside: the autocast probe measures the CPU's arithmetic, not how two
    threads wait on each other when a neighbour holds a core (float32's two threads read 0.2x
    float16's one that way on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def median_of_passes(pilots: dict[str, Callable[[], object]], passes: int = PILOT_PASSES) -> dict[str, object]:
    """Every pilot once per pass, pass after pass, and each figure's median over the passes.

    Why: pilots timed back to back inside a neighbour's load peak read many times their usual value
    and inflated the estimate (predicted 989 s, took 143 s). Spread over passes, a peak shorter than
    a pass lands in one pass of each pilot, and the median of three drops it. A pilot returns a
    number or a dict of numbers. Example::

        median_of_passes({"unit_ms": dispatch_unit_ms})   # {"unit_ms": 0.7}
    """
    runs = [{name: pilot() for name, pilot in pilots.items()} for _ in range(passes)]
    return {name: median_of([run[name] for run in runs]) for name in pilots}


def median_of(values: list) -> object:  # numbers, or dicts of numbers key by key
    if isinstance(values[0], dict):
        return {key: median_of([v[key] for v in values]) for key in values[0]}
    return statistics.median(values)


def measure(fp16_slowdown: float = 1.0, passes: int = PILOT_PASSES) -> dict[str, object]:
    """Every pilot above, in ``passes`` passes (``median_of_passes``). ``fp16_slowdown`` multiplies the
    float16 times: > 1 simulates a CPU without fast float16 on one that has it. Example: ``measure()``."""
    import experiments

    start = time.perf_counter()
    p = experiments.PRESETS["cpu"]
    with one_thread():
        matmul, notes = matmul_slowdown()
    pilots = {
        "unit_ms": lambda: dispatch_unit_ms(rounds=3),
        "lm_step_ms": lambda: {
            **{f"float16@{d}": lm_step_ms(d, torch.float16, p) * fp16_slowdown for d in FP16_WIDTHS},
            f"bfloat16@{p.d_model}": lm_step_ms(p.d_model, torch.bfloat16, p),
        },
        "mlp_float16_step_ms": lambda: mlp_step_ms(p) * fp16_slowdown,
        "sweep": sweep_pilot,
        "train_step": train_step_pilot,
    }
    m = {
        "matmul_time_vs_float32": {k: v * (fp16_slowdown if k == "float16" else 1.0) for k, v in matmul.items()},
        "notes": notes,
        **median_of_passes(pilots, passes),
        "pilot_passes": passes,
        "simulated_fp16_slowdown": fp16_slowdown,
    }
    wide, narrow = (f"float16@{d}" for d in FP16_WIDTHS)  # a narrower model is not slower (a load artefact)
    m["lm_step_ms"][narrow] = min(m["lm_step_ms"][narrow], m["lm_step_ms"][wide])
    m["seconds"] = time.perf_counter() - start
    return m


# ----------------------------------------------------------------------------- sizing


def experiments_estimate_s(m: dict, steps: int, fp16_width: int) -> float:
    """Seconds of the four experiments: two runs each, three for ``overflow`` (float16, transformer)."""
    lm = m["lm_step_ms"]
    fp16 = lm[f"float16@{fp16_width}"]
    bf16 = next(v for k, v in lm.items() if k.startswith("bfloat16"))
    per_step_ms = 2 * fp16 + 2 * bf16 + 2 * m["mlp_float16_step_ms"] + 3 * fp16
    return steps * per_step_ms / 1e3 + FIXED_UNITS["experiments_fixed"] * unit_s(m)


def sweep_estimate_s(m: dict, max_size: int, repeats: int) -> float:
    """Seconds of the sweep: every point's set-up and interleaved rounds (module docstring of sweep.py)."""
    import sweep

    s, total_ms = m["sweep"], 0.0
    for dtype in sweep.DTYPES.values():
        variants = [v for v in sweep.VARIANTS if sweep.runnable(v, dtype, torch.device("cpu"))]
        for layout in sweep.LAYOUTS:
            sizes = [2000 * 4096] if layout == "2000x4K" else sweep.sizes_between(2**16, max_size)
            for numel in sizes:
                megabytes = sum(sweep.bytes_model(v, "sgd", numel, dtype) for v in variants) / 1e6
                overhead = s["round_overhead_ms"] * (len(variants) - 1) / 4 * (3 if layout == "2000x4K" else 1)
                round_ms = overhead + s["ms_per_mb"] * megabytes
                setup_ms = s["setup_ms_per_melement"] * numel / 2**20 * torch.finfo(dtype).bits / 32
                total_ms += setup_ms + (sweep.rounds_for(numel, repeats) + 1) * round_ms
    return total_ms / 1e3 + FIXED_UNITS["sweep_fixed"] * unit_s(m)


def train_step_estimate_s(m: dict, steps: int) -> float:
    """Seconds of the whole-step benchmark: every variant's steps (and warm-up), plus torch.compile's."""
    import train_step

    t = m["train_step"]
    per_step_ms = t["forward_backward_ms"] + 2 * t["adamw_step_ms"]
    runs = (steps + train_step.COMPILE_WARMUP) * len(train_step.VARIANTS)
    return runs * per_step_ms / 1e3 + FIXED_UNITS["train_step_compile"] * unit_s(m)


def unit_s(m: dict) -> float:
    """The unit of the stages that are not resized (``dispatch_unit_ms``), in seconds. A measurement
    from before that unit (an older ``run_all.json``) has the sweep's per-round overhead only, which
    is ``SWEEP_OVERHEAD_UNITS`` units on an idle development machine."""
    if "unit_ms" in m:
        return m["unit_ms"] / 1e3
    return m["sweep"]["round_overhead_ms"] / SWEEP_OVERHEAD_UNITS / 1e3


def levels(preset_steps: int, late: bool = False) -> dict[str, list[dict]]:
    """Each resizable stage's sizes, largest first: what ``plan`` may step down through. ``late``
    adds smaller sizes still, for a run that is behind its estimate (``replan``)."""
    steps = sorted({preset_steps, *range(preset_steps - 10, MIN_STEPS - 1, -10), MIN_STEPS}, reverse=True)
    experiments = [{"steps": preset_steps, "fp16_d_model": FP16_WIDTHS[0]}]
    experiments += [{"steps": s, "fp16_d_model": FP16_WIDTHS[-1]} for s in steps]
    sweep = [{"max_size": n, "repeats": r} for n in SWEEP_MAX_SIZES for r in SWEEP_REPEATS[:2]]
    sweep.append({"max_size": SWEEP_MAX_SIZES[-1], "repeats": SWEEP_REPEATS[-1]})
    sweep += [{"max_size": LATE_SWEEP_MAX_SIZE, "repeats": r} for r in SWEEP_REPEATS[-1:] + LATE_SWEEP_REPEATS] * late
    train_steps = [{"steps": s} for s in TRAIN_STEP_STEPS + LATE_TRAIN_STEP_STEPS * late]
    return {"experiments": experiments, "sweep": sweep, "train_step": train_steps}


def estimate_s(m: dict, stage: str, size: dict) -> float:
    """Seconds of one stage at ``size`` (one of ``levels``), on the measured machine ``m``."""
    if stage == "experiments":
        return experiments_estimate_s(m, size["steps"], size["fp16_d_model"])
    if stage == "sweep":
        return sweep_estimate_s(m, size["max_size"], size["repeats"])
    if stage == "train_step":
        return train_step_estimate_s(m, size["steps"])
    return FIXED_UNITS[stage] * unit_s(m)


def fit(m: dict, stages: list[str], target_s: float, options: dict[str, list[dict]],
        scale: float = 1.0) -> tuple[dict[str, dict], dict[str, float]]:  # fmt: skip
    """Sizes of ``stages`` whose estimates (times ``scale``) add up to at most ``target_s``, and those
    estimates: all at their largest size in ``options``, then, while over, the stage with the largest
    estimate steps down a size (over at the smallest sizes when nothing fits). Example::

        sizes, estimates = fit(m, ["sweep", "collectives"], 30.0, levels(150))"""
    chosen = {stage: 0 for stage in stages if stage in options}

    def current(stage):
        size = options[stage][chosen[stage]] if stage in chosen else {}
        return size, scale * estimate_s(m, stage, size)

    while True:
        estimates = {stage: current(stage)[1] for stage in stages}
        movable = [s for s in chosen if chosen[s] + 1 < len(options[s])]
        if sum(estimates.values()) <= target_s or not movable:
            return {stage: current(stage)[0] for stage in stages}, estimates
        chosen[max(movable, key=estimates.get)] += 1


def plan(m: dict, budget_s: float, preset_steps: int = 150) -> dict[str, object]:
    """Sizes of the stages that fit ``budget_s`` seconds on the machine measured as ``m`` (``fit``: the
    float16 experiments' width first, then their steps; the sweep's repeats, then its largest point).
    When even the smallest sizes do not fit, the plan says so (``over_budget``) and runs them anyway."""
    stages = ["experiments", "sweep", "kernel_report", "collectives", "train_step"]
    sizes, estimates = fit(m, stages, budget_s - m.get("seconds", 0.0), levels(preset_steps))
    total = sum(estimates.values()) + m.get("seconds", 0.0)
    return {
        "budget_s": budget_s,
        "estimate_s": total,
        "over_budget": total > budget_s,
        "sizes": sizes,
        "stage_estimate_s": estimates,
    }


def stage_arguments(sizes: dict[str, dict]) -> dict[str, list[str]]:
    """The command-line options that give each stage the size ``plan`` chose."""
    e, s, t = sizes["experiments"], sizes["sweep"], sizes["train_step"]
    return {
        "experiments": ["--steps", str(e["steps"]), "--fp16-d-model", str(e["fp16_d_model"])],
        "sweep": ["--max-size", str(s["max_size"]), "--repeats", str(s["repeats"])],
        "train_step": ["--steps", str(t["steps"])],
    }
