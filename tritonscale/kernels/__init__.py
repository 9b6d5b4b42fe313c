"""Triton kernels of tritonscale: the bottom layer, importing nothing else of the package.

Data flow of one step, one file each:

* ``check_pass``  -- read-only pass over the gradients: per-program partial norms and inf/NaN flags.
* ``finalize``    -- one tiny program: reduces the partials in a fixed order and writes found_inf,
  the total norm, the clip coefficient and the combined factor ``inv_scale * clip_coef``.
* ``apply_pass``  -- multiplies the gradients in place by that factor (optionally checking for
  inf/NaN in the same pass, which is what a plain ``unscale_`` needs).
* ``policy_update`` -- one tiny program: the loss-scale policy's whole update (``update()``'s one launch).

Beside them: ``tensor_table`` describes any number of gradient tensors to one launch;
``launch_config`` holds block sizes, program counts and the autotune configurations;
``supported`` the accepted dtypes, layouts and norm types; ``jit_helpers`` the shared
``@triton.jit`` helpers and the interpreter switch (a leaf module); ``reference`` the same passes
in plain PyTorch. Which gradients form one run (flat buffers, buckets) is host-side layout logic,
in ``tritonscale/grads/``: the caller hands the run to ``describe_grads``.
"""

from .apply_pass import apply_factor_
from .check_pass import check_pass
from .finalize import finalize
from .supported import NORM_INF, norm_code
from .tensor_table import GradLayout, describe_grads

__all__ = [
    "GradLayout",
    "NORM_INF",
    "apply_factor_",
    "check_pass",
    "describe_grads",
    "finalize",
    "norm_code",
]
