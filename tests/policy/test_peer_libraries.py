"""The peers' own libraries, installed, as the oracle of ``tritonscale.presets``.

tests/policy/test_peer_presets.py checks each preset against tests/oracles/peer_rules.py's transcriptions;
here the transcription is replaced by THE PEER'S OWN CODE where it runs on a CPU: the same random
peer arguments build the preset and the peer's real scaler, one overflow sequence drives both
(tests/oracles/peer_rules.py's ``follow``: tritonscale.GradScaler through its real API), and after every
update the float32 bits of the scales, the skipped steps and the raises must be equal. Each test is
skipped when its library is missing (the ``peers`` extra installs them). Ran against keras 3.15.1,
deepspeed 0.19.8 and megatron-core 0.16.1 (PyPI) with torch 2.13 CPU; fairseq 0.12.2 does not import
on Python 3.11, so its one self-contained scaler file is loaded from the installed package.

Each adapter below has the harness's interface (``update(overflow)``, ``.scale``, ``.skipped``) and
drives the library the way its optimizer does; ``skipped`` restates that optimizer's step (every one
of them skips an overflowed step) except for Keras, whose variable is watched.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from oracles.peer_rules import follow
from test_peer_presets import OVERFLOWS, PROPERTY, deepspeed_fp16_config, fairseq_args, keras_args, megatron_args

from tritonscale import GradScaler, presets


def run(preset, peer, overflows, backend, library):
    """The preset and the peer's own scaler side by side (``library``: its name and version, for the report)."""
    note(f"oracle: {library}")
    follow(GradScaler("cpu", policy=preset, backend=backend), peer, overflows, backend)


# ------------------------------------------------------------------------------------------ Keras 3
class KerasLossScaleOptimizer:
    """keras.optimizers.LossScaleOptimizer around an SGD on one keras Variable (torch backend): an
    update is one ``apply`` of the scaled gradient of ``sum(v)``, holding inf on an overflow."""

    def __init__(self, keras, initial_scale, dynamic_growth_steps):
        self.keras, self.variable = keras, keras.Variable(torch.ones(4).numpy())
        inner = keras.optimizers.SGD(learning_rate=1e-3)
        self.optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale, dynamic_growth_steps)
        self.optimizer.build([self.variable])
        self.skipped = False

    @property
    def scale(self) -> float:
        return float(self.optimizer.dynamic_scale.value)

    def update(self, overflow: bool) -> None:
        before = self.variable.value.detach().clone()
        grad = torch.full_like(before, self.scale)  # the scaled gradient of sum(v)
        if overflow:
            grad[1] = math.inf
        self.optimizer.apply([grad], [self.variable])
        self.skipped = torch.equal(before, self.variable.value.detach())


def keras3(monkeypatch):
    """Keras 3 on its torch backend (the backend is chosen at its first import)."""
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras", minversion="3.0")
    if keras.backend.backend() != "torch":
        pytest.skip(f"keras was imported with the {keras.backend.backend()!r} backend; this test needs 'torch'")
    return keras


@PROPERTY
@given(data=st.data(), overflows=OVERFLOWS)
def test_keras_loss_scale_optimizer(monkeypatch, backend, data, overflows):
    keras = keras3(monkeypatch)
    args = data.draw(keras_args(), label="peer_args")
    peer = KerasLossScaleOptimizer(keras, args["initial_scale"], args["dynamic_growth_steps"])
    run(presets.keras(**args), peer, overflows, backend, f"keras {keras.__version__}")


# ---------------------------------------------------------------------------------------- DeepSpeed
class DeepSpeedScaler:
    """DeepSpeed's scalers, built from its own ``fp16`` config (DeepSpeedFP16Config) as its engine
    builds them. ZeRO: ``CreateLossScaler`` (DynamicLossScaler or, for ``loss_scale > 0``, LossScaler)
    and ``update_scale(overflow)``, as stage_1_and_2's ``_update_scale``. FP16_Optimizer and
    FP16_UnfusedOptimizer: their ``_update_scale`` called on a stand-in holding a real
    ``LossScaleConfig`` of the engine's profile for that class ("fused", "unfused"; their
    constructors need a GPU). The optimizers skip every overflowed step."""

    def __init__(self, modules, optimizer, fp16_optimizer, **fp16):
        loss_scaler, config_class = modules
        config = config_class(enabled=True, **fp16)
        args, dynamic = config.dynamic_loss_scale_args(), config.loss_scale == 0
        if optimizer == "zero":
            self.scaler = loss_scaler.CreateLossScaler(torch.half, config.loss_scale, dynamic, args)
            self._update, self._state = self.scaler.update_scale, self.scaler
        else:
            optimizer_class, profile = fp16_optimizer
            state = loss_scaler.LossScaleConfig(
                torch.half, dynamic, config.loss_scale, args, profile=loss_scaler.LossScaleProfile(profile)
            )
            stand_in = SimpleNamespace(loss_scale_config=state, verbose=False)
            self._update = lambda skip: optimizer_class._update_scale(stand_in, skip)
            self._state = state
        self.skipped = False

    @property
    def scale(self) -> float:
        return self._state.cur_scale

    def update(self, overflow: bool) -> None:
        self.skipped = bool(overflow)
        self._update(overflow)


def deepspeed_modules(monkeypatch):
    """DeepSpeed's loss_scaler module and its fp16 config class; ``update_scale`` logs with
    ``deepspeed.comm.get_rank()`` on an overflow, which needs an initialised backend: that one
    function is patched (to rank 0) for the test, no process group is created."""
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda group=None: 0)
    return deepspeed.__version__, (loss_scaler, DeepSpeedFP16Config)


@PROPERTY
@given(data=st.data(), overflows=OVERFLOWS)
def test_deepspeed_loss_scalers(monkeypatch, backend, data, overflows):
    version, modules = deepspeed_modules(monkeypatch)
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    fp16 = data.draw(deepspeed_fp16_config(min_loss_scales=(1, 4, 3, 2)), label="fp16_config")
    optimizer = data.draw(st.sampled_from(["zero", "fp16"]), label="optimizer")
    engine_profiles = [(FP16_Optimizer, "fused"), (FP16_UnfusedOptimizer, "unfused")]  # as DeepSpeedEngine picks
    fp16_optimizer = data.draw(st.sampled_from(engine_profiles), label="fp16_optimizer")
    peer = DeepSpeedScaler(modules, optimizer, fp16_optimizer, **fp16)
    preset = presets.deepspeed(**fp16, optimizer=optimizer, version=version)
    run(preset, peer, overflows, backend, f"deepspeed {version} ({optimizer}, {fp16_optimizer[0].__name__})")


# ------------------------------------------------------------------------------------- Megatron-LM
class _TorchWithCpuTensors:
    """grad_scaler.py's name ``torch`` with ``torch.tensor(..., device='cuda')`` made on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, **kwargs)


class MegatronGradScaler:
    """megatron.core.optimizer.grad_scaler's DynamicGradScaler, or ConstantGradScaler for a truthy
    ``loss_scale`` (as get_megatron_optimizer chooses). Its constructors hard-code ``device='cuda'``:
    while one runs, and only then, the module's global ``torch`` is a proxy whose ``tensor`` drops
    the device (everything else is torch's); ``update`` runs unpatched. MixedPrecisionOptimizer.step
    skips every step with found_inf."""

    def __init__(self, grad_scaler, monkeypatch, loss_scale=None, **dynamic):
        with monkeypatch.context() as patch:
            patch.setattr(grad_scaler, "torch", _TorchWithCpuTensors())
            if loss_scale:
                self.scaler = grad_scaler.ConstantGradScaler(loss_scale)
            else:
                self.scaler = grad_scaler.DynamicGradScaler(**dynamic)
        self.skipped = False

    @property
    def scale(self) -> float:
        return self.scaler.scale.item()

    def update(self, overflow: bool) -> None:
        self.scaler.update(bool(overflow))
        self.skipped = bool(overflow)


@PROPERTY
@given(data=st.data(), overflows=OVERFLOWS)
def test_megatron_grad_scalers(monkeypatch, backend, data, overflows):
    pytest.importorskip("megatron.core")
    grad_scaler = pytest.importorskip("megatron.core.optimizer.grad_scaler")
    version = importlib.metadata.version("megatron-core")
    args = data.draw(megatron_args(), label="peer_args")
    peer = MegatronGradScaler(grad_scaler, monkeypatch, **args)
    assert peer.scaler.scale.device.type == "cpu"
    run(presets.megatron(**args), peer, overflows, backend, f"megatron-core {version}")


# -------------------------------------------------------------------------------------------- fairseq
class FairseqScaler:
    """fairseq/optim/dynamic_loss_scaler.py's DynamicLossScaler, driven as fp16_optimizer.py drives
    it: ``clip_grad_norm`` calls ``check_overflow(grad_norm)`` (an overflow raises OverflowError, which
    the trainer catches and skips the step; FloatingPointError stops training), a good step ends with
    ``update()``."""

    def __init__(self, scaler_class, fp16_init_scale, fp16_scale_window, fp16_scale_tolerance, threshold_loss_scale,
                 min_loss_scale, distributed_world_size, update_freq):  # fmt: skip
        window = fp16_scale_window
        if window is None:  # FP16Optimizer.__init__ (model_parallel_size 1, one update_freq)
            window = int(2**14 / distributed_world_size / update_freq)
        self.scaler = scaler_class(init_scale=fp16_init_scale, scale_window=window, tolerance=fp16_scale_tolerance,
                                   threshold=threshold_loss_scale, min_loss_scale=min_loss_scale)  # fmt: skip
        self.skipped = False

    @property
    def scale(self) -> float:
        return self.scaler.loss_scale

    def update(self, overflow: bool) -> None:
        self.skipped = bool(overflow)
        try:
            self.scaler.check_overflow(math.inf if overflow else 1.0)
        except OverflowError:
            return
        self.scaler.update()


@functools.cache
def fairseq_scaler_class():
    """The installed fairseq's DynamicLossScaler, loaded from its own file: fairseq 0.12.2's package
    ``__init__`` fails on Python 3.11 (a dataclass with a mutable default), the scaler file imports nothing."""
    spec = importlib.util.find_spec("fairseq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fairseq is not installed")
    path = Path(spec.submodule_search_locations[0]) / "optim" / "dynamic_loss_scaler.py"
    module_spec = importlib.util.spec_from_file_location("fairseq_dynamic_loss_scaler", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.DynamicLossScaler, importlib.metadata.version("fairseq")


@PROPERTY
@given(data=st.data(), overflows=OVERFLOWS)
def test_fairseq_dynamic_loss_scaler(backend, data, overflows):
    scaler_class, version = fairseq_scaler_class()
    args = data.draw(fairseq_args(), label="peer_args")
    run(presets.fairseq(**args), FairseqScaler(scaler_class, **args), overflows, backend, f"fairseq {version}")
