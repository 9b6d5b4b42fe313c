"""Rows about the scaler's state between processes: a checkpoint loaded mid-run into a scaler
built with defaults, one carried through torch's GradScaler (whose keys are torch's), and each
peer's own checkpoint imported (``from_megatron``, ``from_deepspeed``, ``from_apex``,
``from_fairseq``) from the twin's transcription of that peer's state at the same step; DeepSpeed's
also as the file its ZeRO optimizer writes (its own classes pickled by torch.save) read back by
``load_checkpoint``.

The oracle is the twin run straight through: a checkpoint loaded mid-window (the scale, its
trackers, hysteresis, the spike rules' windows) must continue exactly as if nothing happened.
"""

from __future__ import annotations

import importlib.util
import io
from collections import OrderedDict

import torch
from oracles.peer_rules import RULES

import tritonscale

from .entry_points import ROUND_TRIP, EntryPoint, Observations, clip_oracle, clip_ours
from .policies import PolicyContext, TwinRule
from .twins import Side, make_scaler


def into_default_ours(side: Side, step: int) -> Observations:
    """``GradScaler("cpu").load_state_dict(saved)``: the checkpoint alone brings the policy."""
    if step == ROUND_TRIP:
        saved = side.scaler.state_dict()
        side.scaler = tritonscale.GradScaler("cpu", enabled=side.cell.scale.enabled, backend=side.cell.scaler_backend())
        side.scaler.load_state_dict(saved)
    return clip_ours(side, step)


def through_torch(side: Side, step: int) -> None:
    """The state_dict loaded into torch's GradScaler, and torch's state_dict into a scaler built
    with the same arguments (on the twin: torch's scaler through another torch scaler)."""
    if step != ROUND_TRIP:
        return
    enabled = side.cell.scale.enabled
    carrier = torch.amp.GradScaler("cpu", enabled=enabled)
    carrier.load_state_dict(side.scaler.state_dict())
    side.scaler = make_scaler(side.ours, side.cell.scale, side.cell.scaler_backend(), side.cell.policy)
    side.scaler.load_state_dict(carrier.state_dict())


def through_torch_ours(side: Side, step: int) -> Observations:
    through_torch(side, step)
    return clip_ours(side, step)


def through_torch_oracle(side: Side, step: int) -> Observations:
    through_torch(side, step)
    if step == ROUND_TRIP:  # ours' skip counters are no torch key: the new scaler counts from 0
        side.skipped_steps = side.consecutive_skips = 0
    return clip_oracle(side, step)


# ------------------------------------------------------------------------ the peers' checkpoints
def megatron_state(rule) -> dict:
    """Megatron-LM's ``DynamicGradScaler.state_dict()``."""
    trackers = {"growth_tracker": rule._growth_tracker, "hysteresis_tracker": rule._hysteresis_tracker}
    return {"scale": rule._scale, **trackers}


def deepspeed_state(rule) -> dict:
    """A ZeRO checkpoint's optimizer entry: its ``DynamicLossScaler``, as a dict of its attributes."""
    return {"loss_scaler": dict(vars(rule))}


def apex_state(rule) -> dict:
    """apex ``amp.state_dict()``."""
    return {"loss_scaler0": {"loss_scale": rule._loss_scale, "unskipped": rule._unskipped}}


def fairseq_state(rule) -> dict:
    """fairseq ``FP16Optimizer.state_dict()``: the scale alone."""
    return {"loss_scale": rule.loss_scale}


def knobs(args: dict, *dropped: str, **renamed: str) -> dict:
    """The preset's arguments an importer takes (the checkpoint brings the scale)."""
    return {renamed.get(k, k): v for k, v in args.items() if k not in dropped}


#: peer -> (its checkpoint from the twin's rule, the importer called on it)
IMPORTERS = {
    "megatron": (megatron_state, lambda s, a: tritonscale.from_megatron(s, **knobs(a, "initial_scale"))),
    "deepspeed": (deepspeed_state, lambda s, a: tritonscale.from_deepspeed(s)),
    "apex": (apex_state, lambda s, a: tritonscale.from_apex(s, **knobs(a, "init_scale"))),
    "fairseq": (fairseq_state, lambda s, a: tritonscale.from_fairseq(s, **knobs(a, "fp16_init_scale"))),
}


def import_ours(side: Side, step: int) -> Observations:
    """At ROUND_TRIP a scaler built with defaults loads the peer's checkpoint of this moment."""
    if step == ROUND_TRIP:
        policy = side.cell.policy
        state_of, importer = IMPORTERS[policy.preset]
        side.scaler = tritonscale.GradScaler("cpu", backend=side.cell.scaler_backend())
        side.scaler.load_state_dict(importer(state_of(side.cell.twin_rule.scale_rule), policy.preset_args))
    return clip_ours(side, step)


#: DeepSpeed's classes write the ZeRO file; without DeepSpeed installed the row has no cell
#: (load_checkpoint's own tests cover that install: tests/peer_apis/test_safe_checkpoint.py).
DEEPSPEED_FOUND = importlib.util.find_spec("deepspeed") is not None


def deepspeed_file(rule) -> dict:
    """The twin's DeepSpeed state as a ZeRO stage-2 optimizer writes it (``optimizer_state_dict`` of
    ``zero_pp_rank_0_mp_rank_00_optim_states.pt``: the DynamicLossScaler object, a ZeroStageEnum, the
    slice mappings as fragment_address), built by DeepSpeed's classes, read by load_checkpoint."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    scaler = DynamicLossScaler.__new__(DynamicLossScaler)
    scaler.__dict__.update(vars(rule))
    state = {"loss_scaler": scaler, "dynamic_loss_scale": True, "overflow": False, "clip_grad": 0.0,
             "zero_stage": ZeroStageEnum.gradients, "partition_count": [1], "ds_version": "0.19.8",
             "param_slice_mappings": [OrderedDict(weight=fragment_address(numel=16, start=0))]}  # fmt: skip
    written = io.BytesIO()
    torch.save({"optimizer_state_dict": state}, written)
    written.seek(0)
    return tritonscale.load_checkpoint(written)["optimizer_state_dict"]


def import_file_ours(side: Side, step: int) -> Observations:
    """At ROUND_TRIP a scaler built with defaults loads DeepSpeed's ZeRO file of this moment."""
    if step == ROUND_TRIP:
        side.scaler = tritonscale.GradScaler("cpu", backend=side.cell.scaler_backend())
        side.scaler.load_state_dict(tritonscale.from_deepspeed(deepspeed_file(side.cell.twin_rule.scale_rule)))
    return clip_ours(side, step)


def import_oracle(side: Side, step: int) -> Observations:
    """The peer runs on; fairseq keeps no counters in its checkpoint, so its run restarts them."""
    policy = side.cell.policy
    if step == ROUND_TRIP:
        side.skipped_steps = side.consecutive_skips = 0  # ours' skip counters are in no peer's checkpoint
        if policy.preset == "fairseq":
            args = {**policy.preset_args, "fp16_init_scale": side.rule.scale_rule.loss_scale}
            side.rule.scale_rule = RULES["fairseq"](**args)
    return clip_oracle(side, step)


def importer_row(peer: str) -> EntryPoint:
    return EntryPoint(
        f"from_{peer}",
        "fused_adamw",
        import_ours,
        import_oracle,
        disabled=False,
        policies=lambda p: p.preset == peer,
        narrow=True,
    )


STATE_ROWS = [
    EntryPoint("state_dict_into_default", "fused_adamw", into_default_ours, clip_oracle, narrow=True),
    EntryPoint(
        "state_dict_through_torch",
        "sgd",
        through_torch_ours,
        through_torch_oracle,
        grads_after=True,
        policies=lambda p: p.torch_keys,
        narrow=True,
    ),
    *(importer_row(peer) for peer in IMPORTERS),
    EntryPoint(
        "load_checkpoint",
        "fused_adamw",
        import_file_ours,
        import_oracle,
        disabled=False,
        policies=lambda p: p.preset == "deepspeed" and DEEPSPEED_FOUND,
        narrow=True,
    ),
]


# ------------------------------------------------------------------------ the other scale managers
def managers(name: str):
    """A scale manager of MindSpore's or TensorFlow 1.x's driving ours; the twin runs the peer's
    rule (tests/oracles/peer_rules.py) in place of torch's, from the same initial scale."""

    def setup(side: Side) -> None:
        scale = side.cell.scale.init_scale
        if side.ours:
            manager = (
                tritonscale.FixedLossScaleManager(scale, backend=side.cell.scaler_backend())
                if name == "fixed"
                else tritonscale.ExponentialUpdateLossScaleManager(scale, 2, backend=side.cell.scaler_backend())
            )
            side.objects["manager"], side.scaler = manager, manager.grad_scaler
        else:
            args = {"loss_scale": scale} if name == "fixed" else {"init_loss_scale": scale, "incr_every_n_steps": 2}
            side.rule = TwinRule(PolicyContext(name, dict, lambda: RULES["tf1"](**args)))

    return setup


def manager_ours(side: Side, step: int) -> Observations:
    return {**clip_ours(side, step), "loss_scale": side.objects["manager"].get_loss_scale()}


def manager_oracle(side: Side, step: int) -> Observations:
    return {**clip_oracle(side, step), "loss_scale": side.rule.scale}


STATE_ROWS += [
    EntryPoint(
        f"{cls}LossScaleManager",
        "sgd",
        manager_ours,
        manager_oracle,
        setup=managers(name),
        grads_after=True,
        disabled=False,
        min_scale=1.0,
        narrow=True,
    )
    for name, cls in (("fixed", "Fixed"), ("exponential", "ExponentialUpdate"))
]
