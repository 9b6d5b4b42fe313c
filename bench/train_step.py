"""A whole training step, phase by phase: what share of it is the scaler, against torch and against no scaling?

Question answered: in a real step (forward, scaled backward, clip/unscale, optimizer step, scale
update, zero_grad) of a small transformer LM, how long does each phase take per variant, and how
much of the step is the loss scaler's?

Variants (same model, same seed, same batches, AdamW, clipping at ``--max-norm``):

* ``no-scaling``           loss.backward(); AdamW(fused=True).step() -- no scaler, no clipping
* ``no-scaling+clip``      the same with ``torch.nn.utils.clip_grad_norm_(foreach=True)``
* ``torch-fused``          torch.amp.GradScaler: scale(loss).backward(); unscale_; clip_grad_norm_(foreach=True);
                           step (AdamW fused); update
* ``torch-foreach``        the same with AdamW(foreach=True)
* ``tritonscale-fold``     tritonscale.GradScaler: scale(loss).backward(); clip_grad_norm_ (folded into the
                           fused AdamW: the optimizer unscales and clips in its own pass); step; update
* ``tritonscale-foreach``  the same with AdamW(foreach=True): our clip writes the gradients
* ``tritonscale-flat``     the fold with every gradient a view of one flat buffer (``flatten_grads_``),
                           zeroed with one ``buffer.zero_()`` (the others use ``zero_grad(set_to_none=True)``)
* ``tritonscale-compiled`` the fold with ``clip_grad_norm_`` and ``update`` each compiled whole
                           (``torch.compile(..., fullgraph=True)``, ``--compile-backend``, inductor by
                           default); ``scaler.step`` runs eagerly between them, as in a compiled
                           post-backward function. The compiles (and update's one recompilation,
                           when the iteration counter turns dynamic) happen in the warm-up steps:
                           at least ``COMPILE_WARMUP`` with this variant.

Phases, timed with ``time.perf_counter`` around each call (on CUDA with ``torch.cuda.synchronize()``
at every phase boundary, so a phase owns its kernels): forward (the loss, under autocast when
``--autocast`` is set), backward, scaler (the clip/unscale calls), step (``scaler.step`` or
``optimizer.step``), update (``scaler.update``), zero_grad. The variants run interleaved step by
step, in rotating order (``timing.round_order``), each on its own copy of the model, so machine
drift hits all of them; the first ``--warmup`` steps are not recorded. Reported per variant: median and 20/80%
quantiles of every phase and of the whole step, the scaler's share of the step (scaler median /
step median), the step relative to ``no-scaling`` with the 20/80% quantiles of the per-step ratios
("within noise" when they contain 1.0), and scaler + step + update (the gradient handling). In the
fold the unscale and the clip's multiply run inside the optimizer's step, so compare whole steps
(or scaler + step + update), not the scaler phase alone.

    python bench/train_step.py                                   # CPU preset: ~5M parameters, float32
    python bench/train_step.py --device cuda --autocast float16  # GPU preset: ~100M parameters
    python bench/train_step.py --quick --out /tmp/ts             # a tiny model, 3 steps (smoke run)
    python bench/train_step.py --replot out/train_step/train_step.json   # the plot again, from its JSON

The plot (``figure``) puts the scaler's part of the step (``SCALER_PHASES``: scaler + step + update,
the part the variants differ in) in a panel of its own, and the whole step with its phases below it;
its title names the steps every median is over and, when run_all's re-planner cut them, says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import figures
import torch
from timing import describe, format_ratio, machine, quantiles, ratio_spread, round_order

import tritonscale
from tritonscale.torch_compat import COMPILED_CLIP, has_torch

VARIANTS = (
    "no-scaling",
    "no-scaling+clip",
    "torch-fused",
    "torch-foreach",
    "tritonscale-fold",
    "tritonscale-foreach",
    "tritonscale-flat",
    "tritonscale-compiled",
)
#: What runs when --variants is not given: the compiled clip is refused before torch 2.12 (tritonscale.torch_compat).
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "tritonscale-compiled" or has_torch(COMPILED_CLIP)]
COMPILE_WARMUP = 3  # warm-up steps the compiled variant needs: compile, recompile once, run warm
PHASES = ("forward", "backward", "scaler", "step", "update", "zero_grad")
#: The phases the loss scaler runs or changes: the clip/unscale calls, the optimizer's step
#: (``scaler.step``; in the fold it unscales and applies the clip's multiply inside) and the scale's
#: update. Not forward (the model, under autocast), backward (the model's gradients; the scaler
#: adds one multiply of the loss) or zero_grad (the optimizer's, or one fill of the flat buffer).
#: Their per-step sum is what the variants are compared by (``scaler_step_update``).
SCALER_PHASES = ("scaler", "step", "update")
PHASE_ROLES = {"scaler": "the clip/unscale calls", "step": "scaler.step or optimizer.step", "update": "scaler.update"}
PHASE_COLORS = {
    "forward": "tab:blue",
    "backward": "tab:cyan",
    "scaler": "tab:red",
    "step": "tab:green",
    "update": "tab:orange",
    "zero_grad": "tab:gray",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
AUTOCAST = {"none": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Preset:
    d_model: int
    layers: int
    context: int
    batch: int
    vocab: int
    steps: int
    warmup: int


PRESETS = {
    # ~4.9M parameters in 6 pre-norm blocks; 256 tokens a step: tens of ms on a 2-core CPU.
    "cpu": Preset(d_model=256, layers=6, context=64, batch=4, vocab=256, steps=60, warmup=3),
    # ~101M parameters, 8K tokens a step.
    "gpu": Preset(d_model=1024, layers=8, context=512, batch=16, vocab=256, steps=50, warmup=5),
    "quick": Preset(d_model=32, layers=1, context=16, batch=2, vocab=64, steps=3, warmup=1),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the same script runs on both)")
    parser.add_argument("--preset", choices=list(PRESETS), help="default: gpu on cuda, else cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 3 steps (the smoke run)")
    parser.add_argument("--d-model", type=int, help="override the preset's width")
    parser.add_argument("--layers", type=int, help="override the preset's number of blocks")
    parser.add_argument("--batch", type=int, help="override the preset's sequences per step")
    parser.add_argument("--steps", type=int, help="override the preset's recorded steps per variant")
    parser.add_argument("--warmup", type=int, help="override the preset's unrecorded first steps")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="parameter dtype")
    parser.add_argument("--autocast", choices=list(AUTOCAST), default="none", help="autocast dtype of the forward")
    parser.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto", help="tritonscale's")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=DEFAULT_VARIANTS)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of tritonscale-compiled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/train_step"))
    parser.add_argument("--cut-note", help="run_all's line saying its re-planner cut this run below the planned "
                        "steps: the plot's title ends with it")  # fmt: skip
    parser.add_argument("--replot", type=Path, metavar="JSON",
                        help="run nothing: draw train_step.png again from a train_step.json, next to it")  # fmt: skip
    args = parser.parse_args(argv)
    name = "quick" if args.quick else args.preset or ("gpu" if args.device.startswith("cuda") else "cpu")
    overrides = {k: getattr(args, k) for k in ("d_model", "layers", "batch", "steps", "warmup")}
    args.preset_name = name
    args.preset = Preset(**{**asdict(PRESETS[name]), **{k: v for k, v in overrides.items() if v is not None}})
    if "tritonscale-compiled" in args.variants and not has_torch(COMPILED_CLIP):
        parser.error(f"--variants tritonscale-compiled needs torch>=2.12 (this is torch {torch.__version__})")
    if "tritonscale-compiled" in args.variants and args.preset.warmup < COMPILE_WARMUP:
        args.preset = Preset(**{**asdict(args.preset), "warmup": COMPILE_WARMUP})
    return args


class LM(torch.nn.Module):
    """A pre-norm causal transformer over tokens (torch.nn.TransformerEncoderLayer blocks)."""

    def __init__(self, p: Preset):
        super().__init__()
        self.embed = torch.nn.Embedding(p.vocab, p.d_model)
        self.position = torch.nn.Parameter(torch.randn(p.context, p.d_model) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(
            p.d_model, nhead=max(1, p.d_model // 64), dim_feedforward=4 * p.d_model, dropout=0.0,
            batch_first=True, norm_first=True,
        )  # fmt: skip
        self.blocks = torch.nn.TransformerEncoder(layer, p.layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(p.d_model)
        self.head = torch.nn.Linear(p.d_model, p.vocab)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(p.context)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        x = self.blocks(x, mask=self.causal, is_causal=True)
        return self.head(self.norm(x))


class Variant:
    """One variant's model, optimizer and scaler, and its per-phase samples (seconds)."""

    def __init__(self, name: str, args, device: torch.device):
        self.name, self.device = name, device
        torch.manual_seed(args.seed)
        self.model = LM(args.preset).to(device=device, dtype=DTYPES[args.dtype])
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        fused = name in ("no-scaling", "no-scaling+clip", "torch-fused", "tritonscale-fold", "tritonscale-flat",
                         "tritonscale-compiled")  # fmt: skip
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, fused=fused or None, foreach=None if fused else True)
        self.flat = name == "tritonscale-flat"
        self.buffers = tritonscale.flatten_grads_(self.params) if self.flat else []
        kw = dict(init_scale=2.0**16)
        if name.startswith("torch"):
            self.scaler = torch.amp.GradScaler(device.type, **kw)
        elif name.startswith("tritonscale"):
            self.scaler = tritonscale.GradScaler(device.type, backend=args.backend, **kw)
        else:
            self.scaler = None
        self.autocast = AUTOCAST[args.autocast]
        self.max_norm = args.max_norm
        self.cuda = device.type == "cuda"
        self.samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
        self.clip_call, self.update_call = self.clip_eagerly, (self.scaler.update if self.scaler else None)
        if name == "tritonscale-compiled":
            options = {"backend": args.compile_backend, "fullgraph": True}
            self.clip_call = torch.compile(self.clip_eagerly, **options)
            self.update_call = torch.compile(self.scaler.update, **options)

    def tick(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def loss(self, batch) -> torch.Tensor:
        tokens, targets = batch
        context = torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else contextlib.nullcontext()
        with context:
            logits = self.model(tokens)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def clip_eagerly(self) -> None:
        name, scaler = self.name, self.scaler
        if name == "no-scaling+clip":
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        elif name.startswith("torch"):
            scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        elif scaler is not None:
            scaler.clip_grad_norm_(self.opt, self.max_norm)

    def step(self, batch, record: bool) -> None:
        scaler = self.scaler
        marks = [self.tick()]
        loss = self.loss(batch)
        marks.append(self.tick())
        (scaler.scale(loss) if scaler is not None else loss).backward()
        marks.append(self.tick())
        self.clip_call()
        marks.append(self.tick())
        scaler.step(self.opt) if scaler is not None else self.opt.step()
        marks.append(self.tick())
        if scaler is not None:
            self.update_call()
        marks.append(self.tick())
        if self.flat:  # one fill per buffer; optimizer.zero_grad(set_to_none=False) fills view by view
            for buffer in self.buffers:
                buffer.zero_()
        else:
            self.opt.zero_grad(set_to_none=True)
        marks.append(self.tick())
        if record:
            for phase, start, end in zip(PHASES, marks, marks[1:]):
                self.samples[phase].append(end - start)

    def step_samples(self) -> list[float]:
        """Seconds of each recorded step, all phases."""
        return [sum(parts) for parts in zip(*(self.samples[phase] for phase in PHASES))]

    def summary(self) -> dict:
        steps = self.step_samples()
        result = {"phases": {phase: quantiles(self.samples[phase]) for phase in PHASES}, "step": quantiles(steps)}
        handling = [sum(parts) for parts in zip(*(self.samples[phase] for phase in SCALER_PHASES))]
        result["scaler_step_update"] = quantiles(handling)
        result["scaler_share"] = result["phases"]["scaler"]["median_ms"] / result["step"]["median_ms"]
        if scaler_ := self.scaler:
            result["final_scale"] = scaler_.get_scale() if scaler_.is_enabled() else None
        return result


def make_batches(p: Preset, device: torch.device, seed: int, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of random tokens (the timing does not depend on what is learned)."""
    gen = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(n):
        window = torch.randint(p.vocab, (p.batch, p.context + 1), generator=gen)
        batches.append((window[:, :-1].to(device), window[:, 1:].to(device)))
    return batches


def plot(results: dict, path: Path, title: str) -> Path:
    """Write ``figure(results)`` to ``path`` (PNG)."""
    return figures.save(figure(results), path, title)


def plot_title(record: dict) -> str:
    """The plot's title from the JSON record ``main`` writes: the model and its set-up, the steps every
    median and p20-p80 is taken over, the machine, and, where run_all's re-planner cut the steps,
    its line saying so (``--cut-note``)."""
    a, p = record["args"], record["args"]["preset"]
    lines = [
        f"one training step, {setup_line(record['parameters'], record['tensors'], a)}",
        f"{p['steps']} timed steps per variant (every median and p20-p80 is over them), after {p['warmup']} "
        "warm-up, interleaved",
        describe(record["machine"]),
    ]
    return "\n".join(lines + ([a["cut_note"]] if a.get("cut_note") else []))


def setup_line(n_params: int, n_tensors: int, a: dict) -> str:
    """``4.89M parameters in 78 tensors (6 blocks, d_model 256), 4x64 tokens, float32, ...``; ``a``: the
    JSON record's ``args``."""
    p = a["preset"]
    model = f"{n_params / 1e6:.2f}M parameters in {n_tensors} tensors ({p['layers']} blocks, d_model {p['d_model']})"
    return f"{model}, {p['batch']}x{p['context']} tokens, {a['dtype']}, autocast {a['autocast']}, clip {a['max_norm']}"


def replot(json_path: Path, png_path: Path | None = None) -> Path:
    """Draw ``train_step.png`` again from a ``train_step.json`` (next to it unless ``png_path``): a
    committed result gets the current plot without running the benchmark again."""
    record = json.loads(json_path.read_text())
    return plot(record["variants"], png_path or json_path.with_name("train_step.png"), plot_title(record))


STEP_COLOR = "0.75"  # the whole-step bars: light gray, beside the coloured phases
PART_COLOR = "tab:purple"  # the scaler's part (the per-step sum of SCALER_PHASES)
PART_OFFSETS = (-0.3, -0.1, 0.1, 0.3)  # the sum, then each of SCALER_PHASES, around the variant's tick
MEDIANS_DO_NOT_ADD = (
    "* the phases' medians stacked stand\nabove the whole step's median:\nmedians do not add (the median step"
    "\nis not made of each phase's median)"
)


def figure(results: dict):
    """Two panels, the variants side by side in each.

    Top, the scaler's part of the step (``SCALER_PHASES``), where the variants differ: per variant the
    per-step sum of those phases and each of them, every bar drawn to its median with its p20-p80 as
    a whisker centred on that median, and no-scaling's sum (the optimizer step alone) as a dashed
    line; under each variant's name the sum's median [p20, p80] and its share of the step's median.
    Compare the sum: the fold unscales and clips inside its step, so its scaler phase alone looks
    cheap.

    Bottom, the whole step and its phases: the step drawn to its median with its p20-p80 whisker and,
    beside it, the phases' medians stacked. Forward and backward (most of the step) run the same
    model in every variant, so a gap between whole steps that lies there is not the scaler's. The
    phases' medians do not add up to the step's median: where their stack stands above the step's
    bar, a ``*`` over the stack and a note beside the panel say so.

        fig = figure({"no-scaling": summary, ...})   # summary: Variant.summary()'s dict
    """
    plt = figures.pyplot()
    fig, (part_ax, step_ax) = plt.subplots(2, 1, figsize=(1.6 * len(results) + 3.4, 10.0))
    scaler_part_panel(part_ax, results)
    whole_step_panel(step_ax, results)
    return fig


def scaler_part_panel(ax, results: dict) -> None:
    """The top panel of ``figure``: the scaler's part of the step, the sum and each of its phases."""
    names = list(results)
    groups = [("scaler + step + update (per-step sum)", PART_COLOR, [results[n]["scaler_step_update"] for n in names])]
    groups += [(f"{phase}: {PHASE_ROLES[phase]}", PHASE_COLORS[phase], [results[n]["phases"][phase] for n in names])
               for phase in SCALER_PHASES]  # fmt: skip
    tops = []
    for k, (offset, (label, color, stats)) in enumerate(zip(PART_OFFSETS, groups)):
        xs = [i + offset for i in range(len(names))]
        tops += median_bars(ax, xs, stats, 0.19, color, label, "p20-p80 (on its median)" if k == 0 else None)
    if "no-scaling" in results:
        base = results["no-scaling"]["scaler_step_update"]["median_ms"]
        ax.axhline(base, ls="--", lw=1, color=PART_COLOR, label="no-scaling's sum: the optimizer step alone")
    spread = [s["q80_ms"] for _, _, stats in groups for s in stats]
    ax.set_ylim(0, y_top(tops, spread))
    ax.set_xticks(range(len(names)), [part_label(n, results[n]) for n in names], fontsize=8)
    ax.set_title("the scaler's part of the step: clip/unscale + step + update\n"
                 "the fold unscales and clips inside its step: compare the sums", fontsize=9)  # fmt: skip
    ax.set_ylabel("ms per step\nunder each variant: scaler + step + update,\nmedian [p20, p80], share of the step")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def whole_step_panel(ax, results: dict) -> None:
    """The bottom panel of ``figure``: the whole step against its phases' medians stacked."""
    names = list(results)
    steps = [results[n]["step"] for n in names]
    medians = median_bars(ax, [i - 0.2 for i in range(len(names))], steps, 0.38, STEP_COLOR, "whole step (median)",
                          "whole step p20-p80 (on its median)")  # fmt: skip
    stack_x = [i + 0.2 for i in range(len(names))]
    bottoms = [0.0] * len(names)
    for phase in PHASES:
        heights = [results[n]["phases"][phase]["median_ms"] for n in names]
        ax.bar(stack_x, heights, bottom=bottoms, width=0.38, color=PHASE_COLORS[phase], label=f"{phase} (median)")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    taller = [i for i, (stack, step) in enumerate(zip(bottoms, medians)) if stack > step]
    for i in taller:
        ax.annotate("*", (stack_x[i], bottoms[i]), xytext=(0, 3), textcoords="offset points", ha="center",
                    va="bottom", fontsize=12, fontweight="bold")  # fmt: skip
    if taller:  # beside the panel, under its legend, where it hides no data
        ax.text(1.01, 0.0, MEDIANS_DO_NOT_ADD, transform=ax.transAxes, ha="left", va="bottom", fontsize=8)
    ax.set_ylim(0, y_top(medians + bottoms, [s["q80_ms"] for s in steps]))
    ax.set_xticks(range(len(names)), [step_label(n, results[n]) for n in names], fontsize=8)
    ax.set_title("the whole step and its phases\n"
                 "forward, backward: the same model in every variant, not the scaler's", fontsize=9)  # fmt: skip
    ax.set_ylabel("ms per step: whole step (gray) | its phases\n(stacked medians); under each variant:\n"
                  "median [p20, p80] of the step")  # fmt: skip
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def median_bars(ax, xs: list[float], stats: list[dict], width: float, color: str, label: str,
                spread_label: str | None) -> list[float]:  # fmt: skip
    """Bars at ``xs`` drawn to each of ``stats``' medians (``timing.quantiles`` dicts), each with its
    p20-p80 as a whisker centred on that median; returns the medians."""
    medians = [s["median_ms"] for s in stats]
    ax.bar(xs, medians, width=width, color=color, edgecolor="black", lw=0.6, label=label)
    ax.errorbar(xs, medians, yerr=[[m - s["q20_ms"] for m, s in zip(medians, stats)],
                                   [s["q80_ms"] - m for m, s in zip(medians, stats)]],
                fmt="_", color="black", ms=40 * width, capsize=3, lw=1, label=spread_label)  # fmt: skip
    return medians


def y_top(heights: list[float], q80s: list[float]) -> float:
    """The top of a panel's axis. A noisy neighbour can put a p80 tens of times above the medians: the
    axis stops at 2.5x the tallest bar (the whisker runs off the top). The figures go under each
    variant's name, outside the axes, where they hide no data."""
    return 1.08 * min(2.5 * max(heights), max(q80s + heights))


def part_label(name: str, result: dict) -> str:
    """A top-panel tick label: the variant, its scaler's part's median [p20, p80] and share of the step."""
    part, step = result["scaler_step_update"], result["step"]
    share = part["median_ms"] / step["median_ms"]
    return f"{name}\n{part['median_ms']:.2f} ms\n[{part['q20_ms']:.3g}, {part['q80_ms']:.3g}]\n{share:.1%} of the step"


def step_label(name: str, result: dict) -> str:
    """A bottom-panel tick label: the variant and its whole step's median [p20, p80]."""
    s = result["step"]
    return f"{name}\n{s['median_ms']:.1f} ms\n[{s['q20_ms']:.3g}, {s['q80_ms']:.3g}]"


def main(argv=None, progress=None) -> int:
    """Run the benchmark; ``progress(done, total)`` is called after every step of all variants (run_all's bar)."""
    args = parse_args(argv)
    if args.replot:
        print(f"wrote {replot(args.replot)}")
        return 0
    p = args.preset
    device = torch.device(args.device)
    info = machine(device)
    variants = {name: Variant(name, args, device) for name in args.variants}
    n_params = sum(x.numel() for x in next(iter(variants.values())).params)
    n_tensors = len(next(iter(variants.values())).params)
    batches = make_batches(p, device, args.seed)
    meta = {k: v for k, v in vars(args).items() if k not in ("out", "preset", "replot")} | {"preset": asdict(p)}
    print(f"train_step on {describe(info)}")
    print(f"{setup_line(n_params, n_tensors, meta)}; {p.steps} steps after {p.warmup} warm-up, interleaved; "
          "median ms [20%, 80%]")  # fmt: skip
    if args.cut_note:
        print(args.cut_note)
    total = p.warmup + p.steps
    order = list(variants.values())
    for i in range(total):
        for v in round_order(order, i):
            v.step(batches[i % len(batches)], record=i >= p.warmup)
        if progress is not None:
            progress(i + 1, total)
    results = {name: v.summary() for name, v in variants.items()}
    base = variants.get("no-scaling")
    for name, r in results.items():
        # Step i of every variant is one interleaved round: the spread is over the per-step ratios.
        against = base is not None and name != "no-scaling"
        spread = ratio_spread(variants[name].step_samples(), base.step_samples()) if against else None
        r["vs_no_scaling"] = spread["ratio"] if spread else (1.0 if base else None)
        r["vs_no_scaling_spread"] = spread

    print(f"{'variant':>20} " + " ".join(f"{ph:>9}" for ph in PHASES) + f" {'step [20%, 80%]':>24} {'scaler':>7} "
          f"{'vs none [p20, p80]':>30} {'scaler+step+update':>18}")  # fmt: skip
    for name, r in results.items():
        cells = " ".join(f"{r['phases'][ph]['median_ms']:>9.3f}" for ph in PHASES)
        s = r["step"]
        step = f"{s['median_ms']:.2f} [{s['q20_ms']:.2f}, {s['q80_ms']:.2f}]"
        spread = r["vs_no_scaling_spread"]
        versus = f"{format_ratio(spread, 3) if spread else '-':>30}"
        print(
            f"{name:>20} {cells} {step:>24} {r['scaler_share']:>7.1%} {versus} "
            f"{r['scaler_step_update']['median_ms']:>18.3f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "train_step.json"
    record = {
        "machine": info, "args": meta, "parameters": n_params, "tensors": n_tensors, "phases": list(PHASES),
        "median_step_ms": {n: r["step"]["median_ms"] for n, r in results.items()}, "variants": results,
        "raw_ms": {n: {ph: [t * 1e3 for t in v.samples[ph]] for ph in PHASES} for n, v in variants.items()},
    }  # fmt: skip
    json_path.write_text(json.dumps(record, indent=2))
    png = plot(results, args.out / "train_step.png", plot_title(record))
    print(f"wrote {json_path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
