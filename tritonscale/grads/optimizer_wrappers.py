"""Wrapper optimizers: the scaler keys its bookkeeping on the real optimizer inside.

Frameworks hand users wrappers that keep the real optimizer in ``.optimizer`` (Accelerate's
``AcceleratedOptimizer``, Fabric's ``_FabricOptimizer``) and call ``scaler.step(wrapper.optimizer)``
themselves. Keyed on the object passed, ``clip_grad_norm_(wrapper)`` followed by a step through the
inner optimizer would unscale twice; keyed on the innermost optimizer, any mix of wrapper and inner
object is unscaled exactly once.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer at the end of ``optimizer``'s ``.optimizer`` chain (itself if it has none).

    Raises TypeError for an object that is neither an optimizer (something with ``param_groups``)
    nor a wrapper of one, and ValueError for a chain that loops.

    Example::

        inner = unwrap_optimizer(accelerator_wrapped_optimizer)   # the torch.optim.AdamW inside
    """
    if isinstance(optimizer, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(f"expected an optimizer, got the LR scheduler {type(optimizer).__name__}")
    chain = [optimizer]
    while True:
        inner = getattr(chain[-1], "optimizer", None)
        if inner is None or inner is chain[-1]:
            break
        if any(inner is seen for seen in chain):
            names = " -> ".join(type(o).__name__ for o in [*chain, inner])
            raise ValueError(f"the .optimizer chain of {type(optimizer).__name__} loops: {names}")
        chain.append(inner)
    real = chain[-1]
    if not hasattr(real, "param_groups"):
        what = (
            type(optimizer).__name__
            if real is optimizer
            else f"{type(optimizer).__name__} (wrapping {type(real).__name__})"
        )
        raise TypeError(f"expected a torch.optim.Optimizer or a wrapper with .optimizer, got {what}{_hint(real)}")
    return real


def _hint(given: Any) -> str:
    """What works instead, for the likely mix-up: parameters (or a module) where the optimizer goes,
    as torch.nn.utils.clip_grad_norm_ takes them."""
    if isinstance(given, (torch.Tensor, torch.nn.Module)) or inspect.isgenerator(given) or isinstance(given, list):
        return (
            ". The scaler's methods take the optimizer, whose param_groups hold the gradients: "
            "scaler.clip_grad_norm_(optimizer, max_norm), unlike torch.nn.utils.clip_grad_norm_(parameters, max_norm)"
        )
    return ""
