"""How far the fold's parameters are from torch's: the same model trained three times in lockstep.

Question answered: what does folding the clip into a fused optimizer change in the numbers, and
how much? The three runs start from one seed and see the same batches (the tiny character LM of
``experiments.py``, float16 autocast, fused AdamW, a clip that is active at every step):

* ``torch``   torch.amp.GradScaler: unscale_, torch.nn.utils.clip_grad_norm_, step, update
* ``fold``    tritonscale.GradScaler: clip_grad_norm_ hands the fused AdamW ``scale / clip_coef``
* ``unfold``  the same with ``fold_into_optimizer=False``: the clip writes the unscaled, clipped
              gradients, as torch's unscale_ + clip do

Reported per step, for ``fold`` and ``unfold`` against ``torch``: the largest absolute parameter
difference, the number of parameter elements that differ, and the parameter holding the largest
difference with its size. Written as JSON to ``--out``.

    python bench/fold_numerics.py                 # 30 steps on the CPU (under a minute)
    python bench/fold_numerics.py --steps 3       # the smoke test's size
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from experiments import PRESETS, lm_task
from timing import machine

import tritonscale

RUNS = ("torch", "fold", "unfold")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-norm", type=float, default=0.1, help="small enough that the clip is active every step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend", choices=["auto", "torch", "triton"], default="auto",
        help="tritonscale's passes: on a CPU 'auto' is torch's ops (the Triton kernels' norm sums in another order)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("out/fold_numerics.json"))
    return parser.parse_args(argv)


class Run:
    def __init__(self, name: str, task, seed: int, max_norm: float, backend: str) -> None:
        torch.manual_seed(seed)
        self.name, self.task, self.max_norm = name, task, max_norm
        self.model = task.make_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=task.lr, fused=True)
        kw = dict(growth_interval=50)
        if name == "torch":
            self.scaler = torch.amp.GradScaler("cpu", **kw)
        else:
            self.scaler = tritonscale.GradScaler("cpu", fold_into_optimizer=name == "fold", backend=backend, **kw)

    def step(self, batch) -> float:
        self.opt.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = self.task.loss(self.model, batch)
        self.scaler.scale(loss).backward()
        if self.name == "torch":
            self.scaler.unscale_(self.opt)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        else:
            norm = self.scaler.clip_grad_norm_(self.opt, self.max_norm)
        self.scaler.step(self.opt)
        self.scaler.update()
        return float(norm)


def compare(ours: Run, torch_run: Run) -> dict:
    """The step's differences of ``ours``' parameters from torch's."""
    pairs = list(zip(ours.model.named_parameters(), torch_run.model.parameters()))
    diffs = {name: (p.detach() - q.detach()).abs() for (name, p), q in pairs}
    worst = max(diffs, key=lambda name: float(diffs[name].max()))
    return {
        "max_abs": max(float(d.max()) for d in diffs.values()),
        "elements_differing": sum(int((d != 0).sum()) for d in diffs.values()),
        "worst_parameter": worst,
        "worst_parameter_numel": diffs[worst].numel(),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one thread: the same reduction order in every run
    task = lm_task(PRESETS["cpu"], args.steps, seed=args.seed)
    runs = {name: Run(name, task, args.seed, args.max_norm, args.backend) for name in RUNS}
    elements = sum(p.numel() for p in runs["torch"].model.parameters())
    steps, clip_active = [], []
    for i, batch in enumerate(task.batches):
        norms = {name: run.step(batch) for name, run in runs.items()}  # lockstep: same batch, one after another
        clip_active.append(norms["torch"] > args.max_norm)
        steps.append({"step": i, **{name: compare(runs[name], runs["torch"]) for name in ("fold", "unfold")}})
    last = steps[-1]
    result = {
        "machine": machine(),
        "torch": torch.__version__,
        "steps": args.steps,
        "max_norm": args.max_norm,
        "backend": args.backend,
        "clip_active_steps": sum(clip_active),
        "parameter_elements": elements,
        "per_step": steps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    first = steps[0]
    for name in ("fold", "unfold"):
        print(
            f"{name}: after step 0 max |diff| {first[name]['max_abs']:.3g} in {first[name]['worst_parameter']} ("
            f"{first[name]['elements_differing']} of {elements} elements differ); after {args.steps} steps "
            f"{last[name]['max_abs']:.3g} in {last[name]['worst_parameter']}"
        )
    print(f"clip active on {sum(clip_active)} of {args.steps} steps; written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
