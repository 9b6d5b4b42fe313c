"""Where a compiled caller finds the scaler: a module global, an ``nn.Module`` attribute, a closure.

Dynamo treats each differently: what it reads through a global or a module attribute becomes a
constant of the graph, guarded by value (a Python int on the scaler recompiles at every change),
while an int held in a closure turns into a graph input after one recompilation. So a compiled
scaler call is tested from each place. ``placed(where, scaler, body)`` returns a function of the
call's arguments that runs ``body(scaler, *args)`` with the scaler found in that place::

    clip = placed("global", scaler, lambda s, max_norm: s.clip_grad_norm_(optimizer, max_norm))
    torch.compile(clip, backend="aot_eager", fullgraph=True)(0.5)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tritonscale.torch_compat import COMPILED_CLIP, has_torch

#: A test that compiles clip_grad_norm_: refused before torch 2.12 (tests/test_torch_compat.py checks that).
needs_compiled_clip = pytest.mark.skipif(
    not has_torch(COMPILED_CLIP), reason="a compiled clip_grad_norm_ needs torch>=2.12 (refused before it)"
)

PLACES = ("global", "attribute", "closure")

#: The module-global case: the scaler and the body, read by ``_through_global`` as globals.
SCALER: Any = None
BODY: Callable[..., Any] | None = None


def _through_global(*args: Any) -> Any:
    return BODY(SCALER, *args)


class _Holder(torch.nn.Module):
    """The attribute case: the scaler is an attribute of the module that is compiled."""

    def __init__(self, scaler: Any, body: Callable[..., Any]) -> None:
        super().__init__()
        self.scaler, self.body = scaler, body

    def forward(self, *args: Any) -> Any:
        return self.body(self.scaler, *args)


def placed(where: str, scaler: Any, body: Callable[..., Any]) -> Callable[..., Any]:
    """A function of the call's arguments running ``body(scaler, *args)``, with ``scaler`` held
    as ``where`` says (one of PLACES). The global case replaces the previous global scaler."""
    global SCALER, BODY
    if where == "global":
        SCALER, BODY = scaler, body
        return _through_global
    if where == "attribute":
        return _Holder(scaler, body)
    if where == "closure":
        return lambda *args: body(scaler, *args)
    raise ValueError(f"where must be one of {PLACES}, got {where!r}")
