"""The old path of ``tritonscale.grads.sharding`` (renamed in issue 40: a module in ``grads/`` does
not repeat its folder).

``from tritonscale.grads.grad_sharding import mark_replicated`` still works, with one
DeprecationWarning: the old name is the same module object as the new one. New code imports the
public name from ``tritonscale`` (``tritonscale.mark_replicated``).
"""

from __future__ import annotations

import sys
import warnings

from . import sharding

warnings.warn(
    "tritonscale.grads.grad_sharding is now tritonscale.grads.sharding; import mark_replicated from "
    "tritonscale (tritonscale.mark_replicated)",
    DeprecationWarning,
    stacklevel=2,
)

# The import system hands back what sys.modules holds once this file ran: the new module itself,
# so every later import of the old path is that module (no second warning, no second copy).
sys.modules[__name__] = sharding
