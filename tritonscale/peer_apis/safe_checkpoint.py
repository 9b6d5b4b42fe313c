"""Read a peer's checkpoint file with nothing in it executed.

A DeepSpeed ZeRO optimizer state (``zero_pp_rank_*_optim_states.pt``) pickles three kinds of
DeepSpeed objects among its tensors: the optimizer's loss scaler (``DynamicLossScaler``, or
``LossScaler`` under bf16), the stage as a ``ZeroStageEnum`` and, for stages 1 and 2, the
parameter slice mappings as ``fragment_address`` dataclasses. Reading it with
``torch.load(path, weights_only=False)`` unpickles the whole file: any global it names is imported
and any callable it names is called (arbitrary code, the reason torch made ``weights_only=True`` its
default), and DeepSpeed must be installed. :func:`load_checkpoint` is ``torch.load(weights_only=True)``
-- torch's restricted unpickler: tensors, containers, numbers, strings, dtypes -- with exactly those
DeepSpeed classes admitted, each read back as a value of ours (:data:`DEEPSPEED_GLOBALS`): the
loss scaler and the fragment address as plain records of the attributes they saved
(:class:`SavedLossScaler`, :class:`SavedFragmentAddress`), the stage as the member of
:class:`ZeroStage` with the same name and value. No DeepSpeed code is imported or run, and the
admitted names can do nothing but that: a record takes no constructor arguments and only a dict of
attributes, the stage only one of its values; anything else is refused naming the file and what is
wrong. Any other global is refused with an error that names it.

Example::

    state = tritonscale.load_checkpoint("global_step100/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    scaler.load_state_dict(tritonscale.from_deepspeed(state["optimizer_state_dict"]))
"""

from __future__ import annotations

import enum
import os
import pickle
import re
from typing import IO, Any

import torch


class _NotAsSaved(ValueError):
    """An admitted name used otherwise than DeepSpeed's pickle uses it: what load_checkpoint refuses."""


class _SavedRecord:
    """A peer's pickled object read back as its saved attributes only: ``vars(record)`` is what the
    peer's object held; none of the peer's methods or code. Built only as pickle builds a plain
    object (``cls.__new__(cls)``, then its attribute dict): constructor arguments, or a state that
    is not a dict of attribute names, are refused."""

    PEER = ""  # the peer's class(es) this record stands for, for the refusals

    def __new__(cls, *args: Any, **kwargs: Any):
        if args or kwargs:
            raise _NotAsSaved(
                f"it calls {cls.PEER} with arguments {args or kwargs!r}, but DeepSpeed's torch.save writes one "
                "as its attributes only (no arguments)"
            )
        return super().__new__(cls)

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
            raise _NotAsSaved(
                f"it gives {type(self).PEER} the state {state!r}, but DeepSpeed's torch.save writes a dict of "
                "its attribute names"
            )
        self.__dict__.update(state)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    __hash__ = None  # records compare by value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)!r})"


class SavedLossScaler(_SavedRecord):
    """DeepSpeed's pickled loss scaler read back as its attributes (``cur_scale``, ``cur_iter``, ...):
    what :func:`tritonscale.from_deepspeed` reads."""

    PEER = "DeepSpeed's loss scaler (deepspeed.runtime.fp16.loss_scaler)"


class SavedFragmentAddress(_SavedRecord):
    """DeepSpeed's ``fragment_address`` (a parameter's slice of a flat partition) read back as its
    attributes: ``record.numel``, ``record.start``."""

    PEER = "DeepSpeed's fragment_address"


class ZeroStage(enum.IntEnum):
    """DeepSpeed's ``ZeroStageEnum`` (deepspeed/runtime/zero/config.py): the same names and values, an
    int as DeepSpeed's is, so ``state["zero_stage"] == 2`` and ``.name == "gradients"`` read alike."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # DeepSpeed's alias of weights

    @classmethod
    def _missing_(cls, value: object):
        raise _NotAsSaved(
            f"it names ZeroStageEnum({value!r}), which is no ZeRO stage (DeepSpeed's are "
            f"{', '.join(f'{m.value} ({m.name})' for m in cls)})"
        )

    def __setstate__(self, state: Any) -> None:
        raise _NotAsSaved(f"it gives the ZeRO stage {self.name} the state {state!r}; DeepSpeed's enum has none")


#: The DeepSpeed globals a ZeRO optimizer state pickles (deepspeed/runtime/zero/stage_1_and_2.py,
#: stage3.py ``state_dict``), each with what :func:`load_checkpoint` reads it back as.
DEEPSPEED_GLOBALS: dict[str, type] = {
    **{f"deepspeed.runtime.fp16.loss_scaler.{name}": SavedLossScaler
       for name in ("DynamicLossScaler", "LossScaler", "LossScalerBase")},  # fmt: skip
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": SavedFragmentAddress,
}


def load_checkpoint(f: str | os.PathLike | IO[bytes], *, map_location: Any = "cpu") -> Any:
    """Read a checkpoint as ``torch.load(f, weights_only=True)`` does, with DeepSpeed's ZeRO classes read
    back as values of ours (:data:`DEEPSPEED_GLOBALS`); nothing in the file is run.

    Args:
        f: a path or a binary file object, as ``torch.load`` takes.
        map_location: where the tensors go, as ``torch.load``'s (default ``"cpu"``).

    Returns:
        What the file holds: tensors, containers, numbers, strings and dtypes as ``torch.load``
        gives them; DeepSpeed's loss scalers as :class:`SavedLossScaler`, its ``fragment_address``
        as :class:`SavedFragmentAddress`, its ``ZeroStageEnum`` as :class:`ZeroStage`.

    Raises:
        pickle.UnpicklingError: the file names any other global, or uses an admitted one otherwise
            than DeepSpeed writes it (arguments to a record, a stage that does not exist); the message
            names the file and what is wrong. Nothing in the file was run.

    Example: ``tritonscale.from_deepspeed(load_checkpoint(path)["optimizer_state_dict"])``.
    """
    try:
        with torch.serialization.safe_globals([(value, name) for name, value in DEEPSPEED_GLOBALS.items()]):
            return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise pickle.UnpicklingError(_refusal(f, str(error))) from None
    except _NotAsSaved as error:
        raise pickle.UnpicklingError(
            f"load_checkpoint refused {_source(f)}: {error}; the file was not written by DeepSpeed as it "
            "writes these objects (tampered, or another program's). Nothing in the file was run."
        ) from None


def _source(f: Any) -> str:
    return str(f) if isinstance(f, (str, os.PathLike)) else "the file"


def _refusal(f: Any, torch_message: str) -> str:
    """Our error for a refused file: the global it names (from torch's message), that nothing was
    run, and the one way to read it anyway -- not torch's advice to allow-list the global."""
    found = re.search(r"GLOBAL ([\w.]+)", torch_message)
    what = f"the global {found.group(1)}" if found else "something besides tensors, containers and numbers"
    return (
        f"load_checkpoint refused {_source(f)}: it names {what}, which is neither a tensor, a container, a number "
        f"nor one of DeepSpeed's ZeRO classes ({', '.join(DEEPSPEED_GLOBALS)}); nothing in the file was "
        "run. Only if you trust where the file came from: torch.load(path, weights_only=False) runs its code. "
        f"torch said: {torch_message.splitlines()[0] if torch_message else ''}"
    )


__all__ = ["DEEPSPEED_GLOBALS", "SavedFragmentAddress", "SavedLossScaler", "ZeroStage", "load_checkpoint"]
