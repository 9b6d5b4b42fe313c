"""What of the scaler a ``torch.compile``d caller traces, and what runs eagerly inside it.

Traced into the caller's graph (``fullgraph=True`` holds): ``clip_grad_norm_`` and ``update()``,
when nothing in them talks to other ranks or reads the host on purpose. While Dynamo traces, every
host read takes its device form (``host_reads.are_free``), nothing is proved by address (a traced
tensor has none: ``grads/groups.collect_grads``), and the Triton passes are custom ops
(``passes/backends/custom_ops.py``), so no Python number and no address of the first trace is baked
into the graph.

Everything else runs eagerly inside a compiled caller, with a graph break around it, as Dynamo
skips torch.amp.GradScaler: ``runs_eagerly`` marks those calls, and the ``*_stays_eager`` checks
send a clip or an update that cannot be traced (process groups, DTensor gradients, a policy's
host checks) through an eager twin. ``step()`` is among them: traced, torch 2.13's fused
optimizers ignore ``found_inf`` (and fused SGD ``grad_scale``), so the hand-over stays eager
(``tests/passes/test_fused_step_under_compile.py``). A ``torch.compile`` made inside an eager call
(the policy rule on CUDA) still compiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

# Private Dynamo API, the three pieces below, where torch.compiler.disable does the same job at two
# costs (seen on torch 2.13): made with it, every decorated method imports torch._dynamo at
# ``import tritonscale`` (about 2 s; tests/scaler/test_compile_boundary.py's
# test_importing_and_making_a_scaler_imports_no_dynamo fails: "torch._dynamo was imported"), and
# every call pays Dynamo's frame switch, compiling or not (measured: 1.3 us a call, 0.5 us here). The
# public API has no mark Dynamo reads that costs no import, no test for "a compiled caller is
# running" (torch.compiler.is_compiling() is True only while Dynamo traces, not while the compiled
# code calls out) and no way to skip one code object. Where it costs nothing, the public API is used:
# torch.compiler.disable inside a compiled caller, torch.compiler.is_compiling() below.
from torch._C._dynamo import eval_frame as _frames  # the C half of Dynamo: importing it imports nothing

from ..grads.sharding import any_marked, is_dtensor

_F = TypeVar("_F", bound=Callable[..., Any])
_REASON = "tritonscale runs the scaler's calls eagerly, as torch.amp.GradScaler's"


def runs_eagerly(fn: _F) -> _F:
    """Decorator: ``fn``, and all it calls, is never traced by Dynamo (``torch.compiler.disable``),
    made so that nothing is paid, and Dynamo not imported, while nothing compiles.

    Dynamo meets the wrapper marked as disabled (a graph break around the call, as for
    ``torch.compiler.disable``); the wrapper's own frame is one Dynamo skips (set once, below, for
    the code object every wrapper shares). At run time the wrapper calls ``fn`` directly while no
    Dynamo frame callback is set, and through ``torch.compiler.disable(fn)`` (made at the first such
    call) inside a compiled caller, so that the frames ``fn`` calls are not compiled either.
    Example: ``step = runs_eagerly(step)``."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def eager_call(*args: Any, **kwargs: Any) -> Any:
        if _frames.get_eval_frame_callback() is None:  # nothing compiling around this call
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn, recursive=True, reason=_REASON))
        return disabled[0](*args, **kwargs)

    # What torch.compiler.disable sets on its wrapper (torch/_dynamo/eval_frame.py, DisableContext):
    # Dynamo does not inline the call, it graph-breaks around it and names _REASON.
    eager_call._torchdynamo_disable = True
    eager_call._torchdynamo_disable_msg = _REASON
    return eager_call  # type: ignore[return-value]


# Every runs_eagerly wrapper shares one code object: Dynamo runs its frames as they are.
_SKIP_THIS_FRAME = _frames._FrameExecStrategy(_frames._FrameAction.SKIP, _frames._FrameAction.DEFAULT)
_frames.set_code_exec_strategy(runs_eagerly(lambda: None).__code__, _SKIP_THIS_FRAME)


@runs_eagerly
def call_eagerly(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``method(*args, **kwargs)`` run eagerly from inside a compiled caller: the eager twin of a
    call that may be traced but cannot be this time (``*_stays_eager``). Example:
    ``call_eagerly(scaler.update, new_scale)``."""
    return method(*args, **kwargs)


def update_stays_eager(process_group: Any, ranks: Any, policy: Any, new_scale: Any = None) -> bool:
    """True while Dynamo traces an update() it may not take into the caller's graph. It may when
    there is no process group on the scaler, no rank mismatch pending, a policy that reads nothing
    on the host, and no ``new_scale`` given as a Python number (checked on the host, and a number
    Dynamo would specialise on; a tensor is traced). Example:
    ``update_stays_eager(None, RankChecks(), LossScalePolicy())``."""
    return torch.compiler.is_compiling() and not (
        process_group is None
        and ranks.pending is None
        and not policy.needs_host_check()
        and (new_scale is None or isinstance(new_scale, torch.Tensor))
    )


def clip_stays_eager(process_group: Any, optimizer: torch.optim.Optimizer) -> bool:
    """True while Dynamo traces a clip_grad_norm_ it may not take into the caller's graph. It may
    with no process group (the call's or the scaler's) and gradients local to this rank (no
    DTensor, nothing mark_replicated): nothing talks to other ranks. Example:
    ``clip_stays_eager(None, optimizer)``."""
    return torch.compiler.is_compiling() and not (
        process_group is None
        and not any_marked()
        and not any(
            is_dtensor(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        )
    )
