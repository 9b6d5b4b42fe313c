"""Walks of an optimizer through the scaler: which modules a call visits, and how often it climbs.

A reader who follows ``scaler.step(optimizer)`` or ``scaler.clip_grad_norm_(optimizer, 1.0)`` from
its first line follows the optimizer: every Python function of ``tritonscale`` that receives it as
an argument is a place they must read. This script traces one call of each (``sys.setprofile``,
a tiny CPU model, SGD and fused AdamW) and prints, per call:

* ``rooms``: the distinct modules whose functions took the optimizer as an argument;
* ``stays``: maximal runs of consecutive such calls in one module (a reader's page turns);
* ``returns``: stays in a module the walk already left once (the reader turns back a page);
* ``climbs``: such calls made from a module of an earlier stage into a later one (``passes``
  calling back into ``scaler``): the stage order of ``tests/test_layering.py``, where ``kernels``
  < ``grads`` < ``policy`` < ``passes`` < ``scaler`` < ``loop`` < ``peer_apis``/``integrations``;
  a call from a top-level leaf module counts from the last stage above it.

The figures describe the code's shape for review (issue 47); no test asserts them.
Run: ``TRITON_INTERPRET=1 python bench/walks.py [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import tritonscale

PACKAGE = Path(tritonscale.__file__).parent
ORDER = {"kernels": 0, "grads": 1, "policy": 2, "passes": 3, "scaler": 4, "loop": 5}
ORDER |= {"peer_apis": 6, "integrations": 6}


def module_of(frame: FrameType) -> str | None:
    """The dotted tritonscale module a frame runs in, or None outside the package."""
    try:
        relative = Path(frame.f_code.co_filename).resolve().relative_to(PACKAGE.resolve())
    except ValueError:
        return None
    return ".".join(("tritonscale", *relative.with_suffix("").parts))


def stage(module: str) -> int | None:
    """The stage number of a module (None for a leaf at the package's top)."""
    parts = module.split(".")
    return ORDER.get(parts[1]) if len(parts) > 2 else None


def takes(frame: FrameType, target: Any) -> bool:
    """Whether ``target`` is among the arguments of the frame's function (positional, keyword,
    ``*args``), as they stand at the call."""
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:count])
    if code.co_flags & 0x04:  # *args
        names.append(code.co_varnames[count])
    values = [frame.f_locals.get(name) for name in names]
    return any(v is target or (isinstance(v, tuple) and any(x is target for x in v)) for v in values)


def caller_stage(frame: FrameType) -> int | None:
    """The stage of the nearest tritonscale frame above ``frame`` with a stage (leaves skipped)."""
    up = frame.f_back
    while up is not None:
        module = module_of(up)
        if module is not None and stage(module) is not None:
            return stage(module)
        up = up.f_back
    return None


def walk(call: Any, target: Any) -> dict[str, Any]:
    """Run ``call()`` and describe the walk of ``target`` through tritonscale."""
    visits: list[tuple[str, str, bool]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = module_of(frame)
        if module is None or not takes(frame, target):
            return
        here, above = stage(module), caller_stage(frame)
        climb = here is not None and above is not None and here > above
        visits.append((module, frame.f_code.co_qualname, climb))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    starts = [v[0] for i, v in enumerate(visits) if i == 0 or visits[i - 1][0] != v[0]]
    return {
        "rooms": len({m for m, _, _ in visits}),
        "stays": len(starts),
        "returns": len(starts) - len(set(starts)),
        "climbs": sum(c for _, _, c in visits),
        "calls": len(visits),
        "climbing": sorted({f"{m}.{q}" for m, q, c in visits if c}),
        "visits": [f"{m}.{q}" for m, q, _ in visits],
    }


def walks() -> dict[str, dict[str, Any]]:
    """The walks of ``clip_grad_norm_`` and ``step`` for a plain and a fused optimizer."""
    found = {}
    for name, make in (
        ("SGD", lambda p: torch.optim.SGD(p, lr=0.1)),
        ("AdamW(fused)", lambda p: torch.optim.AdamW(p, lr=0.1, fused=True)),
    ):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        optimizer = make(model.parameters())
        scaler = tritonscale.GradScaler("cpu")
        for step in range(2):  # the second iteration: nothing made for the first call
            optimizer.zero_grad()
            scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
            clip = walk(lambda: scaler.clip_grad_norm_(optimizer, 1.0), optimizer)
            stepped = walk(lambda: scaler.step(optimizer), optimizer)
            scaler.update()
        found[f"{name} clip_grad_norm_"] = clip
        found[f"{name} step"] = stepped
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the walks (with every visit) to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    found = walks()
    for name, w in found.items():
        print(f"{name:28s} rooms {w['rooms']:3d}  stays {w['stays']:3d}  returns {w['returns']:3d}  climbs {w['climbs']:3d}  calls {w['calls']:3d}")
        for q in w["climbing"]:
            print(f"    climbs into {q}")
    if args.json:
        made = {"torch": torch.__version__, "python": platform.python_version(), "git": _commit(), "walks": found}
        args.json.write_text(json.dumps(made, indent=1) + "\n")


def _commit() -> str:
    """The commit of the tritonscale that was walked (the code's shape is all a walk measures)."""
    done = subprocess.run(["git", "-C", str(PACKAGE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
