"""Process-group arguments: what every stage that takes a torch.distributed group checks.

A leaf: it imports nothing of the package (torch.distributed only when a group is given), so the
gradient layouts (``grads/sharding.py``), the passes' rank combine, the controller and the
``Updater`` check a group with this one rule and its messages.
"""

from __future__ import annotations

from typing import Any

#: A torch.distributed ProcessGroup, or None for "this rank's gradients are the whole".
Group = Any


def check_process_group(group: Group, name: str = "process_group", *, optional: bool = True) -> Group:
    """``group`` if it is a torch.distributed ProcessGroup of an initialized run (or None, where
    ``optional``); a TypeError naming ``name`` otherwise, and a ValueError on a rank that is not a
    member of it (``dist.new_group(ranks)`` hands the ranks it leaves out a placeholder)."""
    if group is None and optional:
        return None
    import torch.distributed as dist

    if isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{name} is a process group this rank is not a member of (dist.new_group(ranks) returns "
            "GroupMember.NON_GROUP_MEMBER on the ranks it leaves out): pass it only on its member ranks, "
            "and None (or their own group) on the others"
        )
    if not isinstance(group, dist.ProcessGroup):
        allowed = "ProcessGroup or None" if optional else "ProcessGroup"
        raise TypeError(f"{name} must be a torch.distributed {allowed}, got {type(group).__name__}")
    return group
