"""What breaks the first time hal meets a real GPU or NPU, checked on the CPU against tests/hardware_fakes.py."""

from __future__ import annotations

import pytest
import torch
from hardware_fakes import NNAL_OSERROR, fake_torch_npu

from hal.config import AttentionConfig
from hal.devices.npu import AscendBackend, npu_capability
from hal.errors import DeviceUnavailableError
from hal.kernels.npu import load_torch_npu

# ----------------------------------------------------------------------------- ATB on the NPU


def test_npu_probe_loads_atb_and_reports_its_failure(monkeypatch):
    """The op names exist without NNAL; only loading the ATB extensions tells: the probe does, and says why."""
    log = fake_torch_npu(monkeypatch, atb_loads=False)
    monkeypatch.delenv("HAL_NPU_EMULATION", raising=False)
    assert load_torch_npu()[0] is not None  # the names are all there
    cap = npu_capability()
    assert log["register"] == 1 and log["op_calls"] == 0, "the probe loads ATB, it calls no op"
    assert cap.available and not cap.emulated
    assert NNAL_OSERROR in cap.reasons["atb"] and "libatb.so" in cap.reasons["atb"]
    assert "set_env.sh" in cap.reasons["atb"]
    assert cap.libraries["atb"] == ""
    reasons = AscendBackend.validate(AttentionConfig(dtype=torch.bfloat16, page_size=128), cap)
    assert reasons and "libatb.so" in reasons[0], reasons
    with pytest.raises(DeviceUnavailableError, match="ATB"):
        AscendBackend(cap)


def test_npu_probe_with_atb_loaded_has_no_atb_reason(monkeypatch):
    log = fake_torch_npu(monkeypatch, atb_loads=True)
    monkeypatch.delenv("HAL_NPU_EMULATION", raising=False)
    cap = npu_capability()
    assert log["register"] == 1
    assert "atb" not in cap.reasons and cap.libraries["atb"] == "loaded"
    assert not AscendBackend.available(cap)


def test_load_atb_without_torch_npu_is_no_reason():
    from hal.kernels.npu import load_atb

    assert load_atb() == ""  # no torch_npu here: nothing to load (load_torch_npu says why there is no NPU)
