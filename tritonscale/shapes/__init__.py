"""The old name of ``tritonscale.framework_apis`` (other frameworks' APIs over the scaler).

``from tritonscale.shapes.checkpoint_import import from_megatron`` and the other import paths of
the 0.2 docs still work, with a DeprecationWarning: each module here is the same module object as
in ``tritonscale.framework_apis``. New code imports the public names from ``tritonscale``
(``tritonscale.from_megatron``, ``tritonscale.Updater``, ...).
"""

from __future__ import annotations

import importlib
import sys
import warnings

warnings.warn(
    "tritonscale.shapes is now tritonscale.framework_apis; import the public names from tritonscale "
    "(e.g. tritonscale.from_megatron, tritonscale.LossScaleOptimizer)",
    DeprecationWarning,
    stacklevel=2,
)

#: Every module of the old package, each the same object under both names.
MODULES = (
    "checkpoint_import",
    "loss_scale_manager",
    "loss_scale_optimizer",
    "mindspore_manager",
    "scale_managers",
    "step_updater",
    "tf1_manager",
    "updater_config",
    "updater_errors",
)
for _name in MODULES:
    _module = importlib.import_module(f"tritonscale.framework_apis.{_name}")
    globals()[_name] = sys.modules[f"{__name__}.{_name}"] = _module
