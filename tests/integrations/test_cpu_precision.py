"""On CPU the integrations keep float16 autocast where the framework alone would not: they say so,
once per process and framework, and not for bf16 or on other devices."""

from __future__ import annotations

import warnings

import pytest

from tritonscale.integrations import cpu_precision
from tritonscale.integrations.cpu_precision import CPUFloat16Warning


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    monkeypatch.setattr(cpu_precision, "_warned", set())


def warnings_of(make) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    return [w for w in caught if issubclass(w.category, CPUFloat16Warning)]


def test_lightning_16_mixed_on_cpu_warns_once_with_the_reason():
    lightning = pytest.importorskip("tritonscale.integrations.lightning")
    first = warnings_of(lambda: lightning.FusedClipPrecision("16-mixed", "cpu"))
    assert len(first) == 1
    message = str(first[0].message)
    assert '"16-mixed"' in message and "bfloat16" in message and '"bf16-mixed"' in message
    assert first[0].filename == __file__  # points at the user's line
    # Once per process: a second plugin, Fabric's included, says nothing more.
    assert warnings_of(lambda: lightning.FusedClipPrecision("16-mixed", "cpu")) == []
    assert warnings_of(lambda: lightning.FabricFusedClipPrecision("16-mixed", "cpu")) == []


def test_lightning_bf16_on_cpu_does_not_warn():
    lightning = pytest.importorskip("tritonscale.integrations.lightning")
    assert warnings_of(lambda: lightning.FusedClipPrecision("bf16-mixed", "cpu")) == []
    assert warnings_of(lambda: lightning.FabricFusedClipPrecision("bf16-mixed", "cpu")) == []


@pytest.mark.parametrize("mixed_precision", ["fp16", "bf16"])
def test_accelerate_install_on_cpu_warns_for_fp16_only(mixed_precision):
    accelerate = pytest.importorskip("tritonscale.integrations.accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True)
        caught = warnings_of(lambda: accelerate.install(accelerator))
    finally:
        AcceleratorState._reset_state(True)
    if mixed_precision == "bf16":
        assert caught == []
        return
    assert len(caught) == 1 and 'mixed_precision="bf16"' in str(caught[0].message)
    assert caught[0].filename == __file__
    assert accelerator.native_amp  # what the warning is about: fp16 autocast is back on
