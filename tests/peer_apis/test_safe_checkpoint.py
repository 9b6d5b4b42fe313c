"""load_checkpoint: a peer's checkpoint read with nothing in it run (torch's restricted unpickler with
DeepSpeed's ZeRO classes admitted as values of ours), against the old documented way as the oracle:
``torch.load(path, weights_only=False)``, which builds DeepSpeed's own objects. The files are written
by DeepSpeed itself: a real engine on the CPU saving its checkpoint, and DeepSpeed's classes pickled
by ``torch.save``; the hostile files are those classes' names used otherwise."""

from __future__ import annotations

import copyreg
import enum
import os
import pickle
import pickletools
import socket
import subprocess
import sys
import textwrap
import types
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import tritonscale
from tritonscale.peer_apis.safe_checkpoint import SavedFragmentAddress, SavedLossScaler, ZeroStage

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


#: A DeepSpeed engine on the CPU (world size 1, gloo) trained two steps and saving its checkpoint, for
#: each ZeRO optimizer whose state pickles DeepSpeed objects: stage 2 under fp16 (DynamicLossScaler,
#: ZeroStageEnum, fragment_address), stage 3 (no slice mappings) and stage 1 under bf16 (LossScaler).
#: DeepSpeed's CPU accelerator refuses fp16 by default; it is only asked to allow it. Its
#: communication backend compiles a shared-memory all-reduce (a C++ extension, ~30 s on a quiet
#: 2-core machine, past the 300 s timeout on a loaded one: CI of 7455b7b) that one rank never
#: calls; the engine is asked not to build it.
ENGINE = textwrap.dedent(
    """
    import importlib, os, sys, torch
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    get_accelerator().is_fp16_supported = lambda: True
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    for name, stage, precision in [("zero2_fp16", 2, "fp16"), ("zero3_fp16", 3, "fp16"), ("zero1_bf16", 1, "bf16")]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        config = {"train_batch_size": 1, "zero_optimization": {"stage": stage}, precision: {"enabled": True},
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        x = torch.randn(1, 4).to(torch.float16 if precision == "fp16" else torch.bfloat16)
        for _ in range(3):
            engine.backward(engine(x).float().sum())
            engine.step()
        engine.save_checkpoint(os.path.join(sys.argv[1], name), tag="step3")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def zero_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The ZeRO optimizer states a real DeepSpeed engine wrote, by name."""
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("deepspeed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-c", ENGINE, str(out)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {d.name: next((d / "step3").glob("*optim_states.pt")) for d in out.iterdir()}


def _deepspeed_globals(path: Path) -> set[str]:
    """The DeepSpeed classes a torch.save file names (its pickle's GLOBAL opcodes)."""
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    names = {arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}
    return {name.split()[1] for name in names if name.startswith("deepspeed")}


def _same(safe, unsafe, where="state") -> None:
    """``safe`` (load_checkpoint's) holds what ``unsafe`` (DeepSpeed's objects) does: tensors equal,
    each DeepSpeed object as our value of it (a record of its attributes, the stage's name and value)."""
    if isinstance(unsafe, torch.Tensor):
        assert torch.equal(safe, unsafe) and safe.dtype == unsafe.dtype, where
    elif isinstance(unsafe, enum.Enum):
        assert isinstance(safe, ZeroStage) and (safe.name, int(safe)) == (unsafe.name, int(unsafe)), where
    elif isinstance(unsafe, dict):
        assert type(safe) is type(unsafe) and list(safe) == list(unsafe), where
        for key in unsafe:
            _same(safe[key], unsafe[key], f"{where}[{key!r}]")
    elif isinstance(unsafe, (list, tuple)):
        assert type(safe) is type(unsafe) and len(safe) == len(unsafe), where
        for i, (a, b) in enumerate(zip(safe, unsafe)):
            _same(a, b, f"{where}[{i}]")
    elif type(unsafe).__module__.startswith("deepspeed"):
        record = {"fragment_address": SavedFragmentAddress}.get(type(unsafe).__name__, SavedLossScaler)
        assert type(safe) is record, where
        _same(vars(safe), vars(unsafe), where)
    else:
        assert type(safe) is type(unsafe) and safe == unsafe, where


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2_fp16", "zero3_fp16", "zero1_bf16"])
def test_a_zero_optimizer_state_deepspeed_wrote_loads_as_the_unsafe_load_reads_it(zero_checkpoints, name):
    path = zero_checkpoints[name]
    unsafe = torch.load(path, weights_only=False)  # DeepSpeed's own objects: the oracle
    named = {"zero2_fp16": {"DynamicLossScaler", "ZeroStageEnum", "fragment_address"},
             "zero3_fp16": {"DynamicLossScaler", "ZeroStageEnum"}, "zero1_bf16": {"LossScaler", "ZeroStageEnum",
             "fragment_address"}}  # fmt: skip
    assert _deepspeed_globals(path) == named[name]  # what the file pickles: the cell crosses them all
    safe = tritonscale.load_checkpoint(path)
    _same(safe, unsafe)
    state = safe["optimizer_state_dict"]
    assert state["zero_stage"] == unsafe["optimizer_state_dict"]["zero_stage"] == int(name[4])
    assert tritonscale.from_deepspeed(state) == tritonscale.from_deepspeed(unsafe["optimizer_state_dict"])
    scaler = tritonscale.GradScaler("cpu")
    scaler.load_state_dict(tritonscale.from_deepspeed(state))
    assert scaler.get_scale() == float(state["loss_scaler"].cur_scale)


def _deepspeed_zero_state() -> dict:
    """A stage-2 ZeRO optimizer's state_dict() keys, its DeepSpeed objects built by DeepSpeed's classes."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    scaler = DynamicLossScaler(2.0**12, 500, 2.0, 3, False, raise_error_at_min_scale=False)
    mappings = [OrderedDict(weight=fragment_address(numel=12, start=0), bias=fragment_address(numel=3, start=12))]
    return {**_zero_state(scaler), "zero_stage": ZeroStageEnum.gradients, "param_slice_mappings": mappings}


def test_deepspeeds_zero_classes_pickled_by_torch_save_load_as_values(tmp_path):
    pytest.importorskip("deepspeed")
    state = _deepspeed_zero_state()
    path = tmp_path / "optim_states.pt"
    torch.save({"optimizer_state_dict": state}, path)
    safe = tritonscale.load_checkpoint(path)["optimizer_state_dict"]
    _same(safe, state)
    assert safe["zero_stage"] is ZeroStage.gradients and safe["zero_stage"] == state["zero_stage"]
    address = safe["param_slice_mappings"][0]["bias"]
    assert (address.numel, address.start) == (3, 12)


class Crafted:
    """What a tampered file holds in place of a DeepSpeed object: ``__reduce__`` as given."""

    def __init__(self, *reduce):
        self.reduce = reduce

    def __reduce__(self):
        return self.reduce

    @property
    def __class__(self):  # what pickle's NEWOBJ form asks of the object it writes
        return self.reduce[1][0] if self.reduce[0] is copyreg.__newobj__ else Crafted


def _crafted_cases():
    """(an object whose pickle uses an admitted DeepSpeed name otherwise than DeepSpeed does, what the
    refusal must name), each built from DeepSpeed's real classes."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return {
        "a loss scaler called with arguments": (Crafted(DynamicLossScaler, (1024.0, 2)), r"loss scaler .* arguments"),
        "a loss scaler's state not a dict": (
            Crafted(copyreg.__newobj__, (DynamicLossScaler,), ["cur_scale", 1.0]),
            r"loss scaler .* the state \[.cur_scale"),
        "a fragment_address built with arguments": (
            Crafted(copyreg.__newobj__, (fragment_address, 12, 0)), r"fragment_address with arguments"),
        "a stage that does not exist": (Crafted(ZeroStageEnum, (7,)), r"ZeroStageEnum\(7\), which is no ZeRO stage"),
        "a stage given a state": (Crafted(ZeroStageEnum, (2,), {"_value_": 0}), r"ZeRO stage gradients the state"),
        "a payload inside a loss scaler's state": (
            Crafted(copyreg.__newobj__, (DynamicLossScaler,), {"cur_scale": Malicious(payload, ("ran",))}),
            rf"the global {__name__}.payload"),
    }  # fmt: skip


@pytest.mark.parametrize(
    "case",
    ["a loss scaler called with arguments", "a loss scaler's state not a dict", "a fragment_address built with "
     "arguments", "a stage that does not exist", "a stage given a state", "a payload inside a loss scaler's state"],
)  # fmt: skip
def test_an_admitted_deepspeed_name_used_otherwise_is_refused_naming_the_file(tmp_path, case):
    pytest.importorskip("deepspeed")
    crafted, what = _crafted_cases()[case]
    path = tmp_path / "crafted.pt"
    torch.save({"optimizer_state_dict": {**_deepspeed_zero_state(), "loss_scaler": crafted}}, path)
    CALLED.clear()
    with pytest.raises(pickle.UnpicklingError, match=rf"load_checkpoint refused \S*crafted.pt: (it|.*){what}") as error:
        tritonscale.load_checkpoint(path)
    assert "nothing in the file was run" in str(error.value).lower()
    assert CALLED == [] and ZeroStage.gradients.value == 2 and ZeroStage(2) is ZeroStage.gradients
