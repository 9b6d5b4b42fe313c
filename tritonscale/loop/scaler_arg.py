"""The one rule for the scaler a loop helper is given: a ``tritonscale.GradScaler``, told by the
public method the helper reads from it.

``StepLog`` reads ``stats()``; ``SkipAwareLR`` and ``AppliedSteps`` read ``last_skip_flag()``. A
``torch.amp.GradScaler`` has neither, and ``None`` (a scaler not built yet) has nothing: each is
refused where it is handed over, naming the helper, what it takes and what it got, instead of an
``AttributeError`` at the first step. The check is by method, not by class, so a wrapper that
forwards the method passes.
"""

from __future__ import annotations


def check_scaler(scaler: object, helper: str, method: str) -> None:
    """Raise a TypeError unless ``scaler`` has a callable ``method`` (the one ``helper`` reads).
    Example: ``check_scaler(scaler, "AppliedSteps.record", "last_skip_flag")``."""
    if not callable(getattr(scaler, method, None)):
        raise TypeError(
            f"{helper} takes a tritonscale.GradScaler (it reads its {method}()), got {type(scaler).__name__}"
        )
