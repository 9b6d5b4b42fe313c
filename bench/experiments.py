"""Fused-clip experiments: small models trained twice from one seed, torch's way and tritonscale's.

Question answered: at equal results, what does tritonscale's fused path change? Each experiment
trains the same model from the same seed on the same batches, in lockstep (the two runs alternate
step by step, so machine drift hits both):

* ``torch``        torch.amp.GradScaler: scale(loss).backward(); unscale_; clip_grad_norm_; step; update
* ``tritonscale``  tritonscale.GradScaler: scale(loss).backward(); clip_grad_norm_; step; update

with the same optimizer (AdamW, fused by default, so tritonscale folds the unscale and clip into
it). Experiments:

* ``lm-fp16``   a tiny character transformer LM on a generated corpus, float16 autocast, dynamic scale
* ``lm-bf16``   the same with bfloat16 autocast and scaling disabled (``enabled=False``): clip only
                (tritonscale still checks for inf/NaN and would skip such a step)
* ``mlp-fp16``  an MLP regression, float16 autocast
* ``overflow``  the LM with init_scale 2**24 and a learning-rate spike mid-run: overflows, backoffs
                and regrowth. A third run uses Megatron-LM's policy (hysteresis 2, min_scale 1) with
                OLMo-core's norm-spike skip, to show what the policies add.

Reported per experiment: the maximum difference of the loss curves, whether the scale and skipped
steps match torch's, the median time of a whole step and of the gradient handling (clip + step +
update), and their ratios torch / tritonscale with the 20% and 80% quantiles of the per-step
ratios (step i of both runs is one interleaved round), marked "within noise" when those contain
1.0. A figure (``experiments_plot.py``: loss, its difference from torch's, scale, gradient norm,
skipped steps; one row per experiment) and a JSON file of every series go to ``--out``.

    python bench/experiments.py                      # CPU preset (minutes; longer where float16 is slow)
    python bench/experiments.py --preset gpu         # bigger model and longer runs on CUDA
    python bench/experiments.py --steps 20 --only lm-fp16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import experiments_plot
import torch
from timing import describe, format_ratio, machine, ratio_spread, round_order

import tritonscale

EXPERIMENTS = ("lm-fp16", "lm-bf16", "mlp-fp16", "overflow")


@dataclass(frozen=True)
class Preset:
    device: str
    steps: int
    d_model: int
    layers: int
    context: int
    batch: int
    mlp_width: int


PRESETS = {
    "cpu": Preset(device="cpu", steps=150, d_model=64, layers=2, context=64, batch=16, mlp_width=256),
    "gpu": Preset(device="cuda", steps=2000, d_model=512, layers=8, context=256, batch=32, mlp_width=4096),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="cpu")
    parser.add_argument("--steps", type=int, help="override the preset's steps per run")
    parser.add_argument("--d-model", type=int, help="override the preset's transformer width")
    parser.add_argument("--fp16-d-model", type=int,
                        help="transformer width of the float16 experiments (lm-fp16, overflow): smaller where "
                             "float16 is slow (run_all's budget); default --d-model")  # fmt: skip
    parser.add_argument("--only", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS), help="experiments to run")
    parser.add_argument(
        "--optimizer", choices=["fused", "foreach"], default="fused", help="AdamW(fused=True) or foreach"
    )
    parser.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto", help="tritonscale's")
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip_grad_norm_'s max_norm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/experiments"), help="folder of the JSON and PNG")
    parser.add_argument("--cut-note", help="run_all's line saying its re-planner cut this run below the planned "
                        "size: the plot's title ends with it")  # fmt: skip
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- data and models


def char_corpus(n_sentences: int, seed: int) -> str:
    """A generated English-like corpus: sentences from a small grammar (learnable, nothing shipped)."""
    gen = torch.Generator().manual_seed(seed)
    subjects = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "our team"]
    verbs = ["sees", "likes", "finds", "chases", "paints", "builds", "carries", "forgets"]
    objects = ["a red ball", "the green door", "two apples", "the river", "a long letter", "his hat"]
    endings = [".", " today.", " again.", " at night.", "!"]

    def pick(words):
        return words[int(torch.randint(len(words), (), generator=gen))]

    return " ".join(f"{pick(subjects)} {pick(verbs)} {pick(objects)}{pick(endings)}" for _ in range(n_sentences))


class TinyLM(torch.nn.Module):
    """A pre-norm causal transformer over characters."""

    def __init__(self, vocab: int, d_model: int, layers: int, context: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.position = torch.nn.Parameter(torch.randn(context, d_model) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(
            d_model, nhead=max(1, d_model // 32), dim_feedforward=4 * d_model, dropout=0.0, batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        x = self.blocks(x, mask=self.causal[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(x))


@dataclass
class Task:
    """A model factory, the batches of every step and the loss."""

    make_model: object
    batches: list
    loss: object
    lr: float


def lm_task(p: Preset, steps: int, seed: int) -> Task:
    text = char_corpus(n_sentences=max(2000, steps * p.batch * p.context // 30), seed=seed)
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(steps):
        starts = torch.randint(len(data) - p.context - 1, (p.batch,), generator=gen)
        window = torch.stack([data[s : s + p.context + 1] for s in starts.tolist()])
        batches.append((window[:, :-1], window[:, 1:]))

    def loss(model, batch):
        tokens, targets = batch
        logits = model(tokens)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return Task(lambda: TinyLM(len(vocab), p.d_model, p.layers, p.context), batches, loss, lr=3e-3)


def mlp_task(p: Preset, steps: int, seed: int) -> Task:
    gen = torch.Generator().manual_seed(seed + 1)
    w_true = torch.randn(64, 1, generator=gen)
    batches = []
    for _ in range(steps):
        x = torch.randn(128, 64, generator=gen)
        batches.append((x, torch.tanh(x @ w_true) + 0.1 * torch.randn(128, 1, generator=gen)))

    def make():
        w = p.mlp_width
        layers = [
            torch.nn.Linear(64, w),
            torch.nn.GELU(),
            torch.nn.Linear(w, w),
            torch.nn.GELU(),
            torch.nn.Linear(w, 1),
        ]
        return torch.nn.Sequential(*layers)

    def loss(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x).float(), y)

    return Task(make, batches, loss, lr=3e-3)


# ----------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Setting:
    """What differs between experiments."""

    task: str  # "lm" or "mlp"
    amp_dtype: torch.dtype
    init_scale: float = 2.0**16
    growth_interval: int = 50
    enabled: bool = True  # False: bf16 without loss scaling
    lr_spike: tuple[float, float, float] | None = None  # (start fraction, end fraction, multiplier)


SETTINGS = {
    "lm-fp16": Setting("lm", torch.float16),
    "lm-bf16": Setting("lm", torch.bfloat16, enabled=False),
    "mlp-fp16": Setting("mlp", torch.float16),
    "overflow": Setting("lm", torch.float16, init_scale=2.0**24, growth_interval=20, lr_spike=(0.4, 0.45, 30.0)),
}

# The third run of the overflow experiment: Megatron-LM's hysteresis and floor, OLMo-core's norm-spike skip.
POLICY_RUN = dict(hysteresis=2, min_scale=1.0, skip_norm_factor=8.0, norm_warmup_steps=10)


class Run:
    """One training run: model, optimizer, scaler, and the per-step series it records."""

    def __init__(self, name: str, task: Task, setting: Setting, args, device: torch.device, policy: dict):
        self.name, self.task, self.setting, self.device = name, task, setting, device
        torch.manual_seed(args.seed)
        self.model = task.make_model().to(device)
        fused = args.optimizer == "fused"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=task.lr, fused=fused, foreach=None if fused else True)
        kw = dict(init_scale=setting.init_scale, growth_interval=setting.growth_interval, enabled=setting.enabled)
        self.ours = name != "torch"
        if self.ours:
            self.scaler = tritonscale.GradScaler(device.type, backend=args.backend, **kw, **policy)
        else:
            self.scaler = torch.amp.GradScaler(device.type, **kw)
        self.max_norm = args.max_norm
        self.series: dict[str, list] = {k: [] for k in ("loss", "scale", "grad_norm", "skipped", "step_ms", "grad_ms")}

    def step(self, i: int, batch) -> None:
        setting, scaler = self.setting, self.scaler
        if setting.lr_spike is not None:
            start, end, mult = setting.lr_spike
            steps = len(self.task.batches)
            spiking = int(start * steps) <= i < int(end * steps)
            for group in self.opt.param_groups:
                group["lr"] = self.task.lr * (mult if spiking else 1.0)
        scale_before = scaler.get_scale() if setting.enabled else 1.0
        clock = Clock(self.device)
        clock.mark()
        self.opt.zero_grad(set_to_none=False)
        with torch.autocast(self.device.type, dtype=setting.amp_dtype):
            loss = self.task.loss(self.model, batch)
        scaler.scale(loss).backward()
        clock.mark()
        if self.ours:
            norm = scaler.clip_grad_norm_(self.opt, self.max_norm)
        else:
            scaler.unscale_(self.opt)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
        scaler.step(self.opt)
        scaler.update()
        clock.mark()
        forward_backward_ms, grad_ms = clock.intervals_ms()
        # Host reads after the timed section: these are the experiment's records, not the step's cost.
        if self.ours:
            skipped = scaler.last_step_skipped()
        else:
            # torch's rule halves the scale on every overflowed (skipped) step and never grows then.
            skipped = setting.enabled and scaler.get_scale() < scale_before
        s = self.series
        s["loss"].append(float(loss.detach()))
        s["scale"].append(scale_before)
        s["grad_norm"].append(float(norm))
        s["skipped"].append(bool(skipped))
        s["step_ms"].append(forward_backward_ms + grad_ms)
        s["grad_ms"].append(grad_ms)


class Clock:
    """Marks points in a step: host time on CPU, CUDA events (read after the step) on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def run_experiment(name: str, args, preset: Preset, device: torch.device, progress=None) -> dict:
    setting = SETTINGS[name]
    steps = args.steps or preset.steps
    if setting.task == "lm" and setting.amp_dtype == torch.float16 and args.fp16_d_model:
        preset = Preset(**{**asdict(preset), "d_model": args.fp16_d_model})
    make_task = lm_task if setting.task == "lm" else mlp_task
    task = make_task(preset, steps, args.seed)
    task.batches = [tuple(t.to(device) for t in batch) for batch in task.batches]
    runs = [Run("torch", task, setting, args, device, {}), Run("tritonscale", task, setting, args, device, {})]
    if name == "overflow":
        runs.append(Run("tritonscale + Megatron/OLMo policy", task, setting, args, device, POLICY_RUN))
    for i, batch in enumerate(task.batches):
        for run in round_order(runs, i):
            run.step(i, batch)
        if progress is not None:
            progress()
    result = summarize(name, setting, runs)
    result["d_model"] = preset.d_model if setting.task == "lm" else None
    return result


def summarize(name: str, setting: Setting, runs: list[Run]) -> dict:
    ref, ours = runs[0].series, runs[1].series
    warm = slice(min(5, len(ref["loss"]) - 1), None)  # the first steps pay one-time costs (allocation, tuning)

    def median(series, key):
        return statistics.median(series[key][warm])

    diffs = [abs(a - b) for a, b in zip(ref["loss"], ours["loss"])]
    result = {
        "experiment": name,
        "setting": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in asdict(setting).items()},
        "steps": len(ref["loss"]),
        "max_loss_diff": max(diffs),
        "max_rel_loss_diff": max(d / max(abs(a), 1e-12) for d, a in zip(diffs, ref["loss"])),
        "final_loss": {run.name: run.series["loss"][-1] for run in runs},
        "same_scales": ref["scale"] == ours["scale"],
        "same_skipped_steps": ref["skipped"] == ours["skipped"],
        "skipped_steps": {run.name: sum(run.series["skipped"]) for run in runs},
        "median_step_ms": {run.name: median(run.series, "step_ms") for run in runs},
        "median_grad_ms": {run.name: median(run.series, "grad_ms") for run in runs},
        "runs": {run.name: run.series for run in runs},
    }
    # Step i of the two runs is one interleaved round: the spread is over the per-step ratios.
    for key, series in (("step_time", "step_ms"), ("grad_time", "grad_ms")):
        result[f"{key}_spread"] = ratio_spread(ref[series][warm], ours[series][warm])
        result[f"{key}_ratio"] = result[f"{key}_spread"]["ratio"]
    return result


# ----------------------------------------------------------------------------- output


def print_table(results: list[dict]) -> None:
    """One line per experiment; the time ratios torch / tritonscale with their p20-p80 over the steps."""
    print(f"{'experiment':>10} {'max|dloss|':>10} {'same scale':>10} {'skipped':>9} {'step ms torch/ours':>19} "
          f"{'ratio [p20, p80]':>30} {'clip+step+update ms':>20} {'ratio [p20, p80]':>30}")  # fmt: skip
    for r in results:
        skipped = "/".join(str(r["skipped_steps"][k]) for k in ("torch", "tritonscale"))
        steps_ms = "/".join(f"{r['median_step_ms'][k]:.2f}" for k in ("torch", "tritonscale"))
        grad_ms = "/".join(f"{r['median_grad_ms'][k]:.3f}" for k in ("torch", "tritonscale"))
        print(f"{r['experiment']:>10} {r['max_loss_diff']:>10.3g} {str(r['same_scales']):>10} {skipped:>9} "
              f"{steps_ms:>19} {format_ratio(r['step_time_spread']):>30} {grad_ms:>20} "
              f"{format_ratio(r['grad_time_spread']):>30}")  # fmt: skip
        for k in [k for k in r["runs"] if k not in ("torch", "tritonscale")]:
            print(f"{'':>10} {k}: {r['skipped_steps'][k]} skipped, final loss {r['final_loss'][k]:.4f} "
                  f"(torch {r['final_loss']['torch']:.4f})")  # fmt: skip


def main(argv=None, progress=None) -> int:
    """Run the experiments; ``progress(done, total)`` is called after every step (run_all's bar)."""
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    if args.d_model:
        preset = Preset(**{**asdict(preset), "d_model": args.d_model})
    device = torch.device(preset.device)
    steps = args.steps or preset.steps
    info = machine(device)
    fp16_width = f", float16 transformer d_model {args.fp16_d_model}" if args.fp16_d_model else ""
    print(f"experiments on {describe(info)}, {steps} steps each, d_model {preset.d_model}{fp16_width}, "
          f"AdamW ({args.optimizer}), clip {args.max_norm}")  # fmt: skip
    total, done = steps * len(args.only), 0

    def tick():
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    results = [run_experiment(name, args, preset, device, tick) for name in args.only]
    print_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "experiments.json"
    sizes = asdict(preset) | {"steps": steps, "fp16_d_model": args.fp16_d_model or preset.d_model}
    json_path.write_text(json.dumps({"machine": info, "args": vars(args) | {"out": str(args.out)}, "sizes": sizes,
                                     "results": results}))  # fmt: skip
    png = experiments_plot.plot(results, args.out / "experiments.png", experiments_plot.figure_title(info, args.cut_note))
    print(f"wrote {json_path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
