"""The torch releases that some features need, in one place.

pyproject's floor is the oldest torch the GPU paths run on (``.ci/check_floors`` runs the suite
there). A few features need a newer torch: on an older one each either works as torch's own
GradScaler does at that release, or is refused with an error naming the release it needs, never
left to fail as a Dynamo graph break or an AttributeError deep inside.

* The compiled clip (``clip_grad_norm_`` traced by ``torch.compile``) needs torch 2.12: torch 2.11's
  Dynamo cannot trace the guard a fused optimizer gets (``assume_constant_result`` with an
  optimizer argument), nor ``bool()`` of a list or a dict, which the clip's gradient sorting uses.
* torch 2.11's fused Adagrad reads ``grad_scale``/``found_inf`` but does not declare
  ``_step_supports_amp_scaling`` (2.12 does), so torch's GradScaler unscales its gradients in place
  there; ours does the same (``scaler/step_protocols.takes_amp_scaling``): no fold into it.
"""

from __future__ import annotations

import re

import torch

#: (major, minor) of the torch imported; a nightly or a local build counts as its release.
TORCH_RELEASE: tuple[int, int] = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())

COMPILED_CLIP = (2, 12)
FUSED_ADAGRAD_AMP_SCALING = (2, 12)


def has_torch(release: tuple[int, int]) -> bool:
    """Whether the torch imported is ``release`` or newer. Example: ``has_torch(COMPILED_CLIP)``."""
    return TORCH_RELEASE >= release


def refuse_compiled_clip() -> None:
    """Raise the compiled clip's refusal on a torch older than 2.12. It runs while Dynamo traces
    (marked as ``assume_constant_result`` below, so the error is raised, not traced into a graph
    break); torch.compile then reports it as ``InternalTorchDynamoError: RuntimeError: ...``."""
    raise RuntimeError(
        f"tritonscale: scaler.clip_grad_norm_ inside torch.compile needs torch>={_dotted(COMPILED_CLIP)} "
        f"(this is torch {torch.__version__}): call it outside the compiled function (the forward and "
        "backward may stay compiled), or install a newer torch"
    )


# What torch.compiler.assume_constant_result sets, set without importing Dynamo: Dynamo runs the
# function for real while it traces (as scaler/step_protocols.guard_direct_step). The decorator
# itself sets only this attribute, after ``import torch._dynamo`` (about 2 s at ``import
# tritonscale``; tests/scaler/test_compile_boundary.py's no-Dynamo-import test fails with it).
refuse_compiled_clip._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _dotted(release: tuple[int, int]) -> str:
    return ".".join(map(str, release))
