"""load_checkpoint: a peer's checkpoint read with nothing in it run (torch's restricted unpickler with
DeepSpeed's loss scalers admitted as plain records), against the old documented way as the oracle:
``from_deepspeed(torch.load(path, weights_only=False)["optimizer"])``."""

from __future__ import annotations

import os
import pickle
import sys
import types

import pytest
import torch

import tritonscale
from tritonscale.framework_apis.safe_checkpoint import SavedLossScaler

#: What a malicious checkpoint's payload calls, when anything calls it.
CALLED: list[str] = []


def payload(note: str) -> None:
    CALLED.append(note)


class Malicious:
    """An object whose unpickling calls ``call(*args)``: what a tampered checkpoint carries."""

    def __init__(self, call, args):
        self.call, self.args = call, args

    def __reduce__(self):
        return (self.call, self.args)


def _zero_state(loss_scaler) -> dict:
    """A ZeRO optimizer's state_dict as DeepSpeed saves it: the scaler object among tensors."""
    return {"loss_scaler": loss_scaler, "dynamic_loss_scale": True, "overflow": False, "zero_stage": 2,
            "single_partition_of_fp32_groups": [torch.arange(4.0)], "ds_version": "0.19.8"}  # fmt: skip


def test_a_real_deepspeed_zero_checkpoint_imports_as_the_unsafe_load_does(tmp_path):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    scaler = loss_scaler.DynamicLossScaler(2.0**12, 500, 2.0, 3, False, raise_error_at_min_scale=False)
    scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis = 41, 30, 1
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"optimizer": _zero_state(scaler)}, path)
    safe = tritonscale.load_checkpoint(path)["optimizer"]
    assert isinstance(safe["loss_scaler"], SavedLossScaler)
    assert vars(safe["loss_scaler"]) == vars(scaler)
    assert torch.equal(safe["single_partition_of_fp32_groups"][0], torch.arange(4.0))
    unsafe = torch.load(path, weights_only=False)["optimizer"]  # the old documented way: the oracle
    assert tritonscale.from_deepspeed(safe) == tritonscale.from_deepspeed(unsafe)


def test_a_zero_checkpoint_loads_without_deepspeed_installed(tmp_path, monkeypatch):
    # A stand-in class under DeepSpeed's module path writes the file; the module is gone when it is read.
    module = types.ModuleType("deepspeed.runtime.fp16.loss_scaler")

    class DynamicLossScaler:
        pass

    DynamicLossScaler.__module__, DynamicLossScaler.__qualname__ = module.__name__, "DynamicLossScaler"
    module.DynamicLossScaler = DynamicLossScaler
    saved = DynamicLossScaler()
    saved.__dict__.update(cur_scale=1024.0, cur_iter=9, last_overflow_iter=2, scale_factor=2.0, scale_window=4,
                          min_scale=1.0, delayed_shift=2, cur_hysteresis=2, consecutive_hysteresis=False,
                          raise_error_at_min_scale=True, dynamic=True, dtype=torch.float16)  # fmt: skip
    path = tmp_path / "zero.pt"
    with monkeypatch.context() as patch:
        for parent in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16"):  # importable, installed or not
            patch.setitem(sys.modules, parent, types.ModuleType(parent))
        patch.setitem(sys.modules, module.__name__, module)
        torch.save({"optimizer": _zero_state(saved)}, path)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # no DeepSpeed importable while reading
    state = tritonscale.from_deepspeed(tritonscale.load_checkpoint(path)["optimizer"])
    # 9 - 2 - 1 = 6 good steps since the overflow; window 4, grown one step later (growth_delay).
    assert state["scale"] == 1024.0 and state["growth_interval"] == 4 and state["_growth_tracker"] == 1


@pytest.mark.parametrize(
    "make, global_name",
    [
        (lambda tmp: Malicious(os.system, (f"touch {tmp / 'ran'}",)), "system"),
        (lambda tmp: Malicious(payload, ("ran",)), f"{__name__}.payload"),
        (lambda tmp: Malicious(eval, (f"open({str(tmp / 'ran')!r}, 'w')",)), "eval"),
    ],
    ids=["os.system", "a module's function", "eval"],
)
def test_a_malicious_reduce_is_refused_naming_it_and_nothing_runs(tmp_path, make, global_name):
    path = tmp_path / "tampered.pt"
    torch.save({"optimizer": _zero_state(make(tmp_path))}, path)
    CALLED.clear()
    with pytest.raises(pickle.UnpicklingError, match=rf"refused .*tampered.pt: it names the global \S*{global_name}"):
        tritonscale.load_checkpoint(path)
    assert CALLED == [] and not (tmp_path / "ran").exists()
