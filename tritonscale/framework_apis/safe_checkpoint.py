"""Read a peer's checkpoint file with nothing in it executed.

A DeepSpeed ZeRO checkpoint pickles the optimizer's ``DynamicLossScaler`` object, so reading it with
``torch.load(path, weights_only=False)`` unpickles the whole file: any global it names is imported
and any callable it names is called (arbitrary code, the reason torch made ``weights_only=True`` its
default), and DeepSpeed must be installed. :func:`load_checkpoint` is ``torch.load(weights_only=True)``
-- torch's restricted unpickler: tensors, containers, numbers, strings, dtypes -- with DeepSpeed's
loss-scaler classes admitted as :class:`SavedLossScaler`, a plain record of the attributes they saved
(no DeepSpeed code is imported or run). Any other global is refused with an error that names it.

Example::

    scaler.load_state_dict(tritonscale.from_deepspeed(tritonscale.load_checkpoint(path)["optimizer"]))
"""

from __future__ import annotations

import os
import pickle
import re
from typing import IO, Any

import torch

#: The classes DeepSpeed pickles as a ZeRO optimizer's ``loss_scaler`` (deepspeed/runtime/fp16/loss_scaler.py).
DEEPSPEED_LOSS_SCALERS = tuple(
    f"deepspeed.runtime.fp16.loss_scaler.{name}" for name in ("DynamicLossScaler", "LossScaler", "LossScalerBase")
)


class SavedLossScaler:
    """A peer's pickled loss scaler read back as its saved attributes only: ``vars(record)`` is what
    the peer's object held (``cur_scale``, ``cur_iter``, ...); none of the peer's methods or code."""

    def __repr__(self) -> str:
        return f"SavedLossScaler({vars(self)!r})"


def load_checkpoint(f: str | os.PathLike | IO[bytes], *, map_location: Any = "cpu") -> Any:
    """``torch.load(f, weights_only=True)`` with DeepSpeed's loss scalers read as :class:`SavedLossScaler`
    records; a file naming any other global is refused (``pickle.UnpicklingError`` naming it) with
    nothing of it run. Example: ``tritonscale.from_deepspeed(load_checkpoint(path)["optimizer"])``."""
    records = [(SavedLossScaler, name) for name in DEEPSPEED_LOSS_SCALERS]
    try:
        with torch.serialization.safe_globals(records):
            return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise pickle.UnpicklingError(_refusal(f, str(error))) from None


def _refusal(f: Any, torch_message: str) -> str:
    """Our error for a refused file: the global it names (from torch's message), that nothing was
    run, and the one way to read it anyway -- not torch's advice to allow-list the global."""
    found = re.search(r"GLOBAL ([\w.]+)", torch_message)
    what = f"the global {found.group(1)}" if found else "something besides tensors, containers and numbers"
    source = f if isinstance(f, (str, os.PathLike)) else "the file"
    return (
        f"load_checkpoint refused {source}: it names {what}, which is neither a tensor, a container, a number "
        f"nor one of DeepSpeed's loss scalers ({', '.join(DEEPSPEED_LOSS_SCALERS)}); nothing in the file was "
        "run. Only if you trust where the file came from: torch.load(path, weights_only=False) runs its code. "
        f"torch said: {torch_message.splitlines()[0] if torch_message else ''}"
    )


__all__ = ["DEEPSPEED_LOSS_SCALERS", "SavedLossScaler", "load_checkpoint"]
