"""Holding the main job to the estimate it printed: the stages left are re-sized between stages.

Why: a pilot taken at the start cannot foresee the load of a shared machine during the run. One
run printed 228 s and took 537 s (the sweep ran 5x its estimate while the test suite ran beside
it); nothing after the pilots looked at the clock. Here, before each stage, the stages left are
sized (``budget.fit``) to the time left of the estimate, with every estimate multiplied by the
slowdown seen so far (the stages done: real over estimated seconds, pulled toward 1 by a prior of
``SLOWDOWN_PRIOR_S`` seconds, so that two short fixed stages do not swing it) and, where run_all
passes it, the load now (``probe_slowdown``: one of the pilots again, against its pilot; the two
combined by their geometric mean, since the stages done are real work but past, the probe current
but a proxy; load that starts after the pilots shows there before a stage overruns). A run behind may go
below the plan's smallest sizes (``budget.levels(late=True)``); a run ahead may grow back up to
the largest. The stages run with the most resizable one last (``RUN_ORDER``: the experiments,
whose steps come in steps of 10), so that whatever the others overran, it can absorb.

A stage run below its planned size says so where its results are read (a run cut ``train_step``
from 40 planned steps to 10 and the sweep to 4M elements x 5 repeats, and neither its plots nor its
summary said it): ``Replanner.cut`` gives the line, ``CUT by the re-planner: 10 of 40 planned steps
(the machine 3.1x slower than the pilots, ...)``, which run_all passes the stage (``--cut-note``)
for its plot's title and prints again, for every stage cut, at the end of the job; ``run_all.json``
keeps them under ``replanning.cuts``.

Example (``run_all.run_stages`` does this)::

    replanner = Replanner(measurement, plan, preset_steps=150)
    for stage in RUN_ORDER:
        note = replanner.before(stage, elapsed_s=clock() - start)   # None, or why it re-sized
        cut = replanner.cut(stage)   # None, or the line for the stage's plot title
        ...  # run the stage with replanner.sizes[stage] (and --cut-note cut)
        replanner.after(stage, seconds)
"""

from __future__ import annotations

import time

import budget

RUN_ORDER = ("kernel_report", "collectives", "sweep", "train_step", "experiments")
SLOWDOWN_PRIOR_S = 5.0  # seconds of evidence at 1.0x that the slowdown seen so far is pulled toward
RESIZE_MARGIN = 0.1  # the sizes stay while the stages left are expected within 10% of the time left


CUT = "CUT by the re-planner"  # how a cut starts, wherever it is said: run_all's summary, a plot's title
# What each size's number counts, as a cut says it ("10 of 40 planned steps").
SIZE_NOUNS = {"steps": "steps", "repeats": "repeats", "max_size": "elements at the largest size",
              "fp16_d_model": "float16 d_model"}  # fmt: skip


def shown(size: dict) -> str:
    """``steps 60, fp16_d_model 64``: a size as run_all prints it."""
    return ", ".join(f"{k} {v}" for k, v in size.items()) or "fixed size"


def count(n: int) -> str:
    """``4M`` for 4 * 2**20, else the number: a sweep's sizes are powers of two."""
    return f"{n >> 20}M" if n >= 2**20 and n % 2**20 == 0 else str(n)


def is_cut(planned: dict, size: dict) -> bool:
    """Whether a stage runs below its planned size in any of its numbers (a run ahead may grow them)."""
    return any(size[k] < planned[k] for k in planned)


def cut_note(planned: dict, size: dict, replan: dict, estimate_s: float) -> str:
    """The line that says a stage was cut, planned against run, and why (``replan``: the re-plan that
    set the size, one of ``Replanner.replans``): run_all's summary prints it, and the stage puts it in
    its plot's title (``--cut-note``). Example: ``CUT by the re-planner: 10 of 40 planned steps
    (the machine 3.1x slower than the pilots, 52 s left of the 206 s estimate)``."""
    parts = []
    for key, was in planned.items():
        noun, now = SIZE_NOUNS.get(key, key), size[key]
        if now < was:
            parts.append(f"{count(now)} of {count(was)} planned {noun}")
        elif now > was:
            parts.append(f"{count(now)} {noun} ({count(was)} planned)")
    scale = replan["slowdown"]
    pace = f"{scale:.1f}x slower than the pilots" if scale >= 1.0 else f"at {scale:.2f}x the pilots' times"
    left = max(replan["time_left_s"], 0.0)
    return f"{CUT}: {', '.join(parts)} (the machine {pace}, {left:.0f} s left of the {estimate_s:.0f} s estimate)"


class Replanner:
    """The stages' sizes and estimates as last planned, re-planned before each stage (``before``),
    and a record of it all for ``run_all.json`` (``record``)."""

    def __init__(self, m: dict, plan: dict, preset_steps: int, order: tuple[str, ...] = RUN_ORDER):
        self.m, self.preset_steps, self.order = m, preset_steps, order
        self.estimate_s = plan["estimate_s"]
        self.sizes = dict(plan["sizes"])
        self.estimates = dict(plan["stage_estimate_s"])  # expected seconds, slowdown included
        self.done: dict[str, tuple[float, float]] = {}  # stage: (seconds, pilots' estimate at its size)
        self.stages = {s: {"planned_size": self.sizes[s], "planned_estimate_s": self.estimates[s]} for s in order}
        self.replans: list[dict] = []

    def slowdown(self) -> float:
        """Real over estimated seconds of the stages done, with ``SLOWDOWN_PRIOR_S`` at 1.0x."""
        real = sum(seconds for seconds, _ in self.done.values())
        expected = sum(estimate for _, estimate in self.done.values())
        return (real + SLOWDOWN_PRIOR_S) / (expected + SLOWDOWN_PRIOR_S)

    def before(self, stage: str, elapsed_s: float, probe: float | None = None) -> str | None:
        """Re-size ``stage`` and the stages after it to the time left (``elapsed_s`` since the start of
        the job, the measurement included) unless they are expected within ``RESIZE_MARGIN`` of it
        (a margin, so that rounding does not trade a width for a few seconds); the line to print
        when a size changed, else None. ``probe``: ``probe_slowdown``'s reading now, if any."""
        if not self.done and probe is None:
            return None
        left = list(self.order[self.order.index(stage) :])
        seen = self.slowdown()
        time_left, scale = self.estimate_s - elapsed_s, seen if probe is None else (seen * probe) ** 0.5
        sizes = {s: self.sizes[s] for s in left}
        estimates = {s: scale * budget.estimate_s(self.m, s, sizes[s]) for s in left}
        if abs(sum(estimates.values()) - time_left) > RESIZE_MARGIN * max(time_left, 0.0):
            sizes, estimates = budget.fit(self.m, left, time_left, budget.levels(self.preset_steps, late=True), scale)
        changed = {s: (self.sizes[s], sizes[s]) for s in left if sizes[s] != self.sizes[s]}
        self.sizes.update(sizes)
        self.estimates.update(estimates)
        self.replans.append({"before": stage, "elapsed_s": elapsed_s, "time_left_s": time_left, "slowdown": scale,
                             "stages_slowdown": seen, "probe": probe, "sizes": sizes,
                             "stage_estimate_s": estimates})  # fmt: skip
        if not changed:
            return None
        what = "; ".join(f"{s} {shown(old)} -> {shown(new)}" for s, (old, new) in changed.items())
        over = sum(estimates.values()) - time_left
        still = f"; still ~{over:.0f} s over at the smallest sizes" if over > 0 else ""
        now = f", a probe of the load now reads {probe:.2f}x its pilot (taken as {scale:.2f}x)" if probe else ""
        return (f"run_all: re-sized {what}: the stages so far took {seen:.2f}x their estimates{now}, "
                f"{max(time_left, 0.0):.0f} s left of the {self.estimate_s:.0f} s estimate{still}")  # fmt: skip

    def cut(self, stage: str) -> str | None:
        """``cut_note`` for ``stage`` at the size it is about to run (after ``before``), or None when it
        runs at its planned size or above: what run_all passes the stage for its plot's title."""
        planned, size = self.stages[stage]["planned_size"], self.sizes[stage]
        if not self.replans or not is_cut(planned, size):
            return None
        return cut_note(planned, size, self.replans[-1], self.estimate_s)

    def after(self, stage: str, seconds: float) -> None:
        """Record that ``stage`` took ``seconds`` at the size it was given, and whether that was a cut."""
        self.done[stage] = (seconds, budget.estimate_s(self.m, stage, self.sizes[stage]))
        self.stages[stage].update(size=self.sizes[stage], estimate_s=self.estimates[stage], seconds=seconds,
                                  cut=self.cut(stage))  # fmt: skip

    def cuts(self) -> dict[str, dict]:
        """The stages run below their planned size: each one's planned and run size and its ``cut_note``."""
        return {stage: {"planned_size": r["planned_size"], "size": r["size"], "note": r["cut"]}
                for stage, r in self.stages.items() if r.get("cut")}  # fmt: skip

    def record(self) -> dict:
        """For ``run_all.json``: the estimate, each stage's planned and run sizes and estimates, its
        real seconds and its cut (None if none), the stages cut (``cuts``), and every re-plan (the
        slowdown and time left it saw, the sizes it chose)."""
        return {"estimate_s": self.estimate_s, "order": list(self.order), "stages": self.stages,
                "cuts": self.cuts(), "replans": self.replans}  # fmt: skip


def probe_slowdown(m: dict) -> float:
    """How much slower than during the pilots torch work runs now: the bfloat16 step of the
    experiments' transformer (a pilot of ``budget.measure``, a fraction of a second even loaded),
    the median of three calls, over its pilot's figure in ``m``."""
    import experiments
    import torch

    p = experiments.PRESETS["cpu"]
    pilot = m["lm_step_ms"][f"bfloat16@{p.d_model}"]
    return budget.lm_step_ms(p.d_model, torch.bfloat16, p, calls=3) / pilot


# ------------------------------------------------------- torch's threads on a shared machine
# OpenMP threads wait for each other at the end of every parallel op. When a neighbour holds a core,
# the thread on it runs only in the scheduler's slices and the others spin until it does: with two
# busy loops beside it on a 2-core machine, a parallel op on torch's two threads ran an order of
# magnitude slower than on one thread, and a main job whose neighbours started after its pilots
# overran its estimate even at the smallest sizes. One thread slows down only by the share of the
# core it loses, which the re-planning can absorb (figures: docs/performance.md).
PARALLEL_OP_NUMEL = 2**20  # a size torch splits over its threads
PARALLEL_OP_CALLS = 40


def parallel_op_ms(threads: int, calls: int = PARALLEL_OP_CALLS) -> float:
    """Mean milliseconds of one parallel torch op (an in-place add over ``PARALLEL_OP_NUMEL``
    float32 elements) over ``calls`` calls back to back on ``threads`` torch threads; torch's thread
    count is restored after. The mean, not a median: a waiting thread stalls one call in several for
    a scheduler slice, and those stalls are what a stage's long run of ops pays (a median of five
    calls read an unstalled two threads while a stage beside it ran several times its estimate)."""
    import torch

    before = torch.get_num_threads()
    x = torch.zeros(PARALLEL_OP_NUMEL)
    torch.set_num_threads(threads)
    try:
        x.add_(1.0)  # the first call at a thread count starts its threads
        start = time.perf_counter()
        for _ in range(calls):
            x.add_(1.0)
        return 1e3 * (time.perf_counter() - start) / calls
    finally:
        torch.set_num_threads(before)


def threads_for_load(threads: int, op_ms=parallel_op_ms) -> tuple[int, dict[str, float] | None]:
    """The torch thread count for the stages left: 1 when ``threads`` run a parallel op slower than
    one thread does (a neighbour holds a core: see above), else ``threads``; and the two timings
    (None when ``threads`` is 1 already). ``op_ms(threads)`` times the op (a fake one in tests).
    Example: ``threads_for_load(2, lambda n: {2: 3.8, 1: 0.2}[n]) == (1, {"2 threads": 3.8, "1 thread": 0.2})``."""
    if threads <= 1:
        return threads, None
    many, one = op_ms(threads), op_ms(1)
    return (1 if many > one else threads), {f"{threads} threads": many, "1 thread": one}


def fewer_threads_note(timings: dict[str, float], where: str) -> str:
    """The line run_all prints when it drops to one thread ``where`` (``"before sweep"``)."""
    many, one = timings.items()
    return (f"run_all: torch threads {many[0].split()[0]} -> 1 {where} and for the rest of the run: a parallel op "
            f"took {many[1]:.2f} ms on {many[0]} against {one[1]:.2f} ms on {one[0]} (a neighbour holds a core; "
            "threads waiting for each other cost more than one thread loses)")  # fmt: skip
