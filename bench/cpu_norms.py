"""The sum of squares on the CPU: how fast each way of taking a float32 norm is, and how accurate.

Question answered: which norm should the torch backend take over a flat buffer (or a run of
views) and over a list of tensors, on the CPU? Candidates, over the same ``--size`` float32
elements:

* ``vector_norm``    one ``torch.linalg.vector_norm`` over the whole buffer;
* ``rows of 4096``   the torch backend's run norm (``torch_backend._run_norm``): row norms of 4096
                     elements, then the norm of those;
* ``dot``            ``torch.dot(x, x).sqrt()`` (BLAS);
* ``foreach``        ``torch._foreach_norm`` over the buffer split into ``--tensors`` views (what
                     torch's clip_grad_norm_ and the backend's list path take);
* ``mul_``           one in-place multiply: a read+write pass, the bandwidth reference.

Two kinds of data: normal values (``randn``) and values whose squares are float32 subnormals
(``randn * 1e-22``: tiny gradients, as dead units give), where some CPUs slow down many times.
Accuracy is each norm's relative difference from a float64 norm of the same data. GB/s counts one
read (two passes for ``mul_``).

    python bench/cpu_norms.py                                   # 16M elements, ~30 s
    python bench/cpu_norms.py --size 65536 --repeats 2 --out /tmp/n.json   # the smoke size
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from timing import describe, interleaved, machine, write_results

from tritonscale.passes.backends.torch_backend import _run_norm

DATA = {"normal": 1.0, "subnormal squares": 1e-22}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2**24)
    parser.add_argument("--tensors", type=int, default=200, help="views for the foreach norm")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("out/cpu_norms.json"))
    return parser.parse_args(argv)


def candidates(x: torch.Tensor, n_tensors: int) -> dict:
    views = list(x.split(-(-x.numel() // n_tensors)))
    return {
        "vector_norm": lambda: torch.linalg.vector_norm(x),
        "rows of 4096": lambda: _run_norm(x, 2.0),
        "dot": lambda: torch.dot(x, x).sqrt(),
        "foreach": lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(views, 2.0, dtype=torch.float32))),
        "mul_": lambda: x.mul_(1.0),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    info = machine()
    print(f"float32 norms over {args.size} elements on {describe(info)}; {args.repeats} interleaved repeats, medians")
    print(f"{'data':>18} {'norm':>13} {'ms':>8} {'GB/s':>7} {'rel. error vs float64':>22}")
    torch.manual_seed(0)
    results = []
    for data, magnitude in DATA.items():
        x = torch.randn(args.size) * magnitude
        exact = torch.linalg.vector_norm(x.double()).item()
        ops = candidates(x, args.tensors)
        timed = interleaved(ops, args.repeats, reset=lambda name: None)
        for name, op in ops.items():
            ms = timed[name]["median_ms"]
            passes = 2 if name == "mul_" else 1
            error = None if name == "mul_" else abs(float(op()) - exact) / exact
            results.append({"data": data, "norm": name, **timed[name], "error": error,
                            "gb_per_s": passes * x.numel() * 4 / (ms * 1e-3) / 1e9})  # fmt: skip
            shown = "" if error is None else f"{error:.1e}"
            print(f"{data:>18} {name:>13} {ms:>8.2f} {results[-1]['gb_per_s']:>7.1f} {shown:>22}")
    write_results(args.out, info, args, results=results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
