"""How long the main job will take on this machine, and how big its slow stages may be to fit a budget.

Why: the same CPU run took a few minutes on one 2-core machine and 20 on another, whose CPU has no
fast float16 (no AVX512-FP16 or AMX): there one float16-autocast step of the experiments' model took
many times as long (issue 22). Instead of fixed sizes, ``run_all.py`` measures the work its stages are made of, on
this machine, in about a second (``measure``), then picks sizes that fit its time budget
(``plan``, a pure function of the measurement, so tests feed it made-up machines) and prints the
estimate before it starts. Every measurement, the sizes chosen, the estimate per stage and the
time each stage really took go to ``run_all.json``, so an estimate that drifts is visible.

What is measured (each a pilot of the real work, the minimum of a few calls after a warm-up):

* matmul under float16 / bfloat16 autocast against float32 (reported: why float16 is slow here);
* forward + backward of the experiments' transformer (float16 at two widths, bfloat16) and MLP
  (float16), at a smaller batch, scaled up (time is close to linear in tokens);
* two points of the sweep (65536 and 2**20 float32 elements): its per-round overhead, its time per
  byte of the bytes model, and its set-up per element;
* forward + backward and a fused AdamW step of the whole-step benchmark's model.

The stages that cannot be resized (compiling kernels, spawning ranks, torch.compile) are estimated
in units of the sweep's per-round overhead (dispatch-bound, like them); ``FIXED_UNITS`` holds those
factors, from runs on the development machine, and ``run_all.json`` shows how close they come.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# Steps below which the overflow experiment's learning-rate spike (40-45% of the run) and the
# regrowth after it (growth interval 20) no longer show.
MIN_STEPS = 40
FP16_WIDTHS = (64, 32)  # d_model of the float16 transformer experiments, preferred first
SWEEP_MAX_SIZES = (2**26, 2**24, 2**22)  # largest sweep point, preferred first
SWEEP_REPEATS = (15, 9, 5)
TRAIN_STEP_STEPS = (60, 40, 20)
PILOT_BATCH = 4  # sequences per pilot call of the experiments' transformer (the preset uses 16)
VOCAB = 25  # characters in the experiments' generated corpus
# Stages that are not resized, in sweep per-round overheads (see the module docstring).
FIXED_UNITS = {"kernel_report": 1000, "collectives": 1000, "train_step_compile": 2000, "experiments_fixed": 800,
               "sweep_fixed": 600}  # fmt: skip


def best_ms(fn: Callable[[], object], calls: int = 3) -> float:
    """The fastest of ``calls`` timed calls after one untimed warm-up, in ms (the minimum: another
    process on a shared machine only ever adds time)."""
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def matmul_slowdown(tokens: int = 256, width: int = 64) -> dict[str, float]:
    """Time of the experiments' matmul shape (``tokens x width`` by ``width x 4 width``, ten of them)
    under float16 / bfloat16 autocast, over float32's."""
    a, b = torch.randn(tokens, width), torch.randn(width, 4 * width)

    def under(dtype):
        def call():
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                for _ in range(10):
                    a @ b

        return best_ms(call)

    base = under(None)
    return {"float16": under(torch.float16) / base, "bfloat16": under(torch.bfloat16) / base}


def lm_step_ms(d_model: int, dtype: torch.dtype | None, p) -> float:
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

    return best_ms(call) * p.batch / PILOT_BATCH


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

    return best_ms(call) * 128 / 32


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

    return {"forward_backward_ms": best_ms(forward_backward), "adamw_step_ms": best_ms(opt.step)}


def measure(fp16_slowdown: float = 1.0) -> dict[str, object]:
    """Every pilot above, on this machine. ``fp16_slowdown`` multiplies the float16 autocast times:
    > 1 simulates a CPU without fast float16 (to test the sizing on one that has it)."""
    import experiments

    start = time.perf_counter()
    p = experiments.PRESETS["cpu"]
    with torch.no_grad():
        matmul = matmul_slowdown()
    m = {
        "matmul_time_vs_float32": {k: v * (fp16_slowdown if k == "float16" else 1.0) for k, v in matmul.items()},
        "lm_step_ms": {
            **{f"float16@{d}": lm_step_ms(d, torch.float16, p) * fp16_slowdown for d in FP16_WIDTHS},
            f"bfloat16@{p.d_model}": lm_step_ms(p.d_model, torch.bfloat16, p),
        },
        "mlp_float16_step_ms": mlp_step_ms(p) * fp16_slowdown,
        "sweep": sweep_pilot(),
        "train_step": train_step_pilot(),
        "simulated_fp16_slowdown": fp16_slowdown,
    }
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
    """The unit of the stages that are not resized: the sweep's per-round overhead, in seconds."""
    return m["sweep"]["round_overhead_ms"] / 1e3


def levels(preset_steps: int) -> dict[str, list[dict]]:
    """Each resizable stage's sizes, largest first: what ``plan`` may step down through."""
    steps = sorted({preset_steps, *(s for s in (100, 70, MIN_STEPS) if s < preset_steps)}, reverse=True)
    experiments = [{"steps": preset_steps, "fp16_d_model": FP16_WIDTHS[0]}]
    experiments += [{"steps": s, "fp16_d_model": FP16_WIDTHS[-1]} for s in steps]
    sweep = [{"max_size": n, "repeats": r} for n in SWEEP_MAX_SIZES for r in SWEEP_REPEATS[:2]]
    sweep.append({"max_size": SWEEP_MAX_SIZES[-1], "repeats": SWEEP_REPEATS[-1]})
    return {"experiments": experiments, "sweep": sweep, "train_step": [{"steps": s} for s in TRAIN_STEP_STEPS]}


def estimate_s(m: dict, stage: str, size: dict) -> float:
    """Seconds of one stage at ``size`` (one of ``levels``), on the measured machine ``m``."""
    if stage == "experiments":
        return experiments_estimate_s(m, size["steps"], size["fp16_d_model"])
    if stage == "sweep":
        return sweep_estimate_s(m, size["max_size"], size["repeats"])
    if stage == "train_step":
        return train_step_estimate_s(m, size["steps"])
    return FIXED_UNITS[stage] * unit_s(m)


def plan(m: dict, budget_s: float, preset_steps: int = 150) -> dict[str, object]:
    """Sizes of the stages that fit ``budget_s`` seconds on the machine measured as ``m``.

    Starts every stage at its largest size and, while the total estimate exceeds the budget, steps
    the stage with the largest estimate down to its next size (the float16 experiments' width
    first, then their steps; the sweep's repeats, then its largest point). When even the smallest
    sizes do not fit, the plan says so (``over_budget``) and runs them anyway.
    """
    options = levels(preset_steps)
    chosen = {stage: 0 for stage in options}
    stages = ["experiments", "sweep", "kernel_report", "collectives", "train_step"]

    def current(stage):
        size = options[stage][chosen[stage]] if stage in options else {}
        return size, estimate_s(m, stage, size)

    while True:
        estimates = {stage: current(stage)[1] for stage in stages}
        total = sum(estimates.values()) + m.get("seconds", 0.0)
        movable = [s for s in options if chosen[s] + 1 < len(options[s])]
        if total <= budget_s or not movable:
            break
        chosen[max(movable, key=lambda s: estimates[s])] += 1
    return {
        "budget_s": budget_s,
        "estimate_s": total,
        "over_budget": total > budget_s,
        "sizes": {stage: current(stage)[0] for stage in stages},
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
