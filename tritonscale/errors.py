"""Exception types. Each subclasses the builtin that torch.amp.GradScaler raises in the same case,
so code written against torch keeps catching them."""


class ScalerConfigError(ValueError, AssertionError):
    """A loss-scale hyperparameter or a loaded state_dict is invalid.

    torch.amp.GradScaler raises AssertionError for a bad growth/backoff factor; this error is
    also a ValueError, which is what new code should catch.
    """


class RankMismatchError(RuntimeError):
    """The ranks of a process group disagree on a value that must be the same on all of them (the
    loss scale, the call sequence, which gradients the Updater sums: ``rank_validation.py``). Raised on
    every rank; nothing of the step that found it was applied. torch has no such check; a RuntimeError
    like the failed collective it stands in for."""
