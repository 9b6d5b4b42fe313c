"""Exception types. Each subclasses the builtin that torch.amp.GradScaler raises in the same case,
so code written against torch keeps catching them."""


class ScalerConfigError(ValueError, AssertionError):
    """A loss-scale hyperparameter or a loaded state_dict is invalid.

    torch.amp.GradScaler raises AssertionError for a bad growth/backoff factor; this error is
    also a ValueError, which is what new code should catch.
    """
