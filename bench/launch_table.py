"""Device launches per phase of a step on the GPU paths, torch's GradScaler beside ours, as a markdown table.

Counted on the CPU by ``launch_count.LaunchCounter`` (the counter the launch-count tests use): the
host-read switch off (the paths a GPU takes), ``backend="triton"`` through Triton's interpreter,
``compile_policy=False``; the last of 3 steps counted, phase by phase. Cases: 1 tensor of 1024 and
148 tensors of 64, fused AdamW and foreach SGD, torch's scaler, ours with the defaults and ours with
``hysteresis=2, skip_norm_factor=5.0``. docs/performance.md's table is this script's output:

    python bench/launch_table.py                 # ~10 s; paste the table into docs/performance.md
    python bench/launch_table.py --ops           # each phase's launches by name, below the table
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # backend="triton" on CPU tensors: set before triton is imported
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import argparse  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from launch_count import LaunchCounter, count_scaled_step  # noqa: E402

import tritonscale  # noqa: E402
from tritonscale import host_reads  # noqa: E402

PHASES = ("scale", "clip", "step", "update")
#: torch's GradScaler (None), ours with the defaults and with a rich policy (the knobs)
SCALERS = {"torch": None, "ours": {},
           "ours, hysteresis=2, skip_norm_factor=5.0": {"hysteresis": 2, "skip_norm_factor": 5.0}}  # fmt: skip
OPTIMIZERS = {"AdamW(fused=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
              "SGD(foreach=True)": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True)}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", action="store_true", help="list each phase's launches by name")
    return parser.parse_args(argv)


def count(scaler_name: str, tensors: int, optimizer: str, steps: int = 3) -> LaunchCounter:
    """The launches of the last of ``steps`` steps, per phase; the clip is torch's ``unscale_`` +
    ``clip_grad_norm_`` for torch's scaler, ``clip_grad_norm_`` for ours."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1024 if tensors == 1 else 64)) for _ in range(tensors)]
    opt = OPTIMIZERS[optimizer](params)
    knobs = SCALERS[scaler_name]
    if knobs is None:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    else:
        scaler = tritonscale.GradScaler("cpu", init_scale=2.0**10, backend="triton", compile_policy=False, **knobs)
    return count_scaled_step(scaler, opt, params, clip="torch" if knobs is None else "ours", steps=steps)


def table(show_ops: bool = False) -> str:
    """The markdown table (and, with ``show_ops``, each row's launches by name below it)."""
    rows = ["| scaler | optimizer | tensors | " + " | ".join(PHASES) + " | total |",
            "|---|---|---|" + "---|" * (len(PHASES) + 1)]  # fmt: skip
    listed = []
    for optimizer in OPTIMIZERS:
        for tensors in (1, 148):
            for name in SCALERS:
                counter = count(name, tensors, optimizer)
                cells = [str(counter.counts[p]) for p in PHASES] + [str(sum(counter.counts.values()))]
                rows.append(f"| {name} | {optimizer} | {tensors} | " + " | ".join(cells) + " |")
                listed.append(f"- {name}, {optimizer}, {tensors}: {dict(counter.ops)}")
    return "\n".join(rows + ([""] + listed if show_ops else []))


def main(argv=None) -> int:
    args = parse_args(argv)
    are_free = host_reads.are_free
    host_reads.are_free = lambda device: False  # the paths a GPU takes, as the tests' forbid_host_reads
    try:
        print(table(args.ops))
    finally:
        host_reads.are_free = are_free
    return 0


if __name__ == "__main__":
    sys.exit(main())
