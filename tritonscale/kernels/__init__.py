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

from .supported import NORM_INF, norm_code


def _import_triton() -> ImportError | None:
    """None where triton imports, else its ImportError. torch's rule (``has_triton_package`` in
    torch/utils/_triton.py): a triton that is installed but fails to import counts as no triton, so
    ``import tritonscale`` still works and the backend falls back as torch's own code does."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return error
    return None


#: Why triton cannot be used here (None: it imports): not installed, or installed and failing to import.
TRITON_IMPORT_ERROR = _import_triton()
#: Whether triton imports. It is no dependency of a CPU install (the default backend there runs
#: torch's ops; CUDA builds of torch bring their own triton), so without it this package still
#: imports, with its triton-free ``supported`` tables, and the launchers raise ``triton_missing()``.
TRITON_FOUND = TRITON_IMPORT_ERROR is None

if TRITON_FOUND:
    from .apply_pass import apply_factor_
    from .check_pass import check_pass
    from .finalize import finalize
    from .tensor_table import GradLayout, describe_grads


def triton_missing(what: str = "tritonscale's Triton kernels") -> ImportError:
    """The error for a kernel asked for where triton does not import: a ModuleNotFoundError naming
    the install where it is not installed, an ImportError naming triton's own error (its cause)
    where it is installed but fails to import."""
    error = TRITON_IMPORT_ERROR
    if error is None or (isinstance(error, ModuleNotFoundError) and error.name == "triton"):
        return ModuleNotFoundError(
            f"{what}: triton is not installed. On a GPU machine install the CUDA (or ROCm) build of "
            "torch, which brings the triton it was built with; for Triton's interpreter on a CPU, "
            "`pip install 'triton>=3.8'` (the test extra: `pip install -e \".[test]\"`). Without triton, "
            "GradScaler(..., backend='torch') (the CPU default) runs every pass with torch's own ops",
            name="triton",
        )
    broken = ImportError(
        f"{what}: triton is installed but fails to import ({type(error).__name__}: {error}), so it counts "
        "as absent, as torch counts it. Reinstall the triton your torch was built with (a CUDA or ROCm "
        "build of torch brings it; on a CPU `pip install 'triton>=3.8'`); meanwhile "
        "GradScaler(..., backend='torch') (the CPU default) runs every pass with torch's own ops",
        name="triton",
    )
    broken.__cause__ = error
    return broken


def __getattr__(name: str):
    if name in ("GradLayout", "apply_factor_", "check_pass", "describe_grads", "finalize"):
        raise triton_missing(f"tritonscale.kernels.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GradLayout",
    "NORM_INF",
    "apply_factor_",
    "check_pass",
    "describe_grads",
    "finalize",
    "norm_code",
]
