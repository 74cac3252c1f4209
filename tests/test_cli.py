"""The ``hal`` command: ``info`` (in-process and as a subprocess), ``check``, ``demo``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import hal
from hal.capability import DeviceCapability
from hal.commands.cli import main
from hal.devices.cpu import CompiledBackend
from hal.registry import Device, register_device

DEVICE_KEYS = {"name", "available", "emulated", "reasons", "capability", "backends"}
BACKEND_KEYS = {"name", "available", "selected", "reasons"}


pytestmark = pytest.mark.usefixtures("cpu_only")


def _clean_env(plugins: str | None) -> dict[str, str]:
    """This environment without HAL_* or TRITON_INTERPRET (another test module sets it), plus HAL_PLUGINS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAL_") and k != "TRITON_INTERPRET"}
    if plugins is not None:
        env["HAL_PLUGINS"] = plugins
    return env


# The subprocess runs (a few seconds each, CPU-bound), started together the first time one is needed.
SUBPROCESS_RUNS = {
    "info": (("info", "--json"), "cpu"),
    "info_all_plugins": (("info", "--json"), None),
    "check": (("check", "--device", "cpu", "--backend", "torch", "--json"), "cpu"),
    "check_unknown": (("check", "--device", "nosuchdevice"), "cpu"),
    "demo": (("demo", "--check-steps", "--page-size", "32", "--json"), "cpu"),
}


@pytest.fixture(scope="module")
def hal_cli():
    """``hal_cli(name)``: the finished ``python -m hal.commands.cli ...`` run named in SUBPROCESS_RUNS."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "hal.commands.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_clean_env(plugins),
        )
        for name, (args, plugins) in SUBPROCESS_RUNS.items()
    }
    done: dict[str, subprocess.CompletedProcess] = {}

    def result(name: str) -> subprocess.CompletedProcess:
        if name not in done:
            proc = procs[name]
            out, err = proc.communicate(timeout=1800)  # a hang guard only: a busy machine must not fail it
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return done[name]

    yield result
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


class FakeDevice(Device):
    plugin_api = 2

    def __init__(self, name, backends, available=True, priority=50, reason=""):
        self.name, self.priority, self._backends = name, priority, backends
        self._cap = DeviceCapability(
            type=name,
            available=available,
            dtypes=("fp32", "bf16") if available else (),
            graph="eager_guard" if available else None,
            reasons={} if available else {"device": reason},
        )

    def probe(self):
        return self._cap

    def backends(self):
        return self._backends


class Renamed(CompiledBackend):
    name = "renamed"


def check_info_schema(data: dict) -> None:
    assert {"hal_version", "torch_version", "devices", "selection", "config"} <= set(data)
    assert data["hal_version"] == hal.__version__
    assert data["torch_version"] == torch.__version__
    assert data["devices"], "no device listed"
    for dev in data["devices"]:
        assert DEVICE_KEYS <= set(dev), dev["name"]
        assert isinstance(dev["available"], bool) and isinstance(dev["emulated"], bool)
        assert isinstance(dev["reasons"], dict)
        for b in dev["backends"]:
            assert BACKEND_KEYS <= set(b), (dev["name"], b)
            assert isinstance(b["reasons"], list)
            # a backend with reasons against it is never the selected one
            assert not (b["selected"] and b["reasons"]), (dev["name"], b)
    selected_device = data["selection"]["device"]
    assert selected_device is not None, data["selection"]
    [dev] = [d for d in data["devices"] if d["name"] == selected_device]
    assert dev["available"]
    assert [b["name"] for b in dev["backends"] if b["selected"]] == [data["selection"]["backend"]]


# -- hal info ------------------------------------------------------------------------------


def test_info_json_in_process(capsys):
    rc, out, _ = run_main(capsys, "info", "--json")
    assert rc == 0
    data = json.loads(out)
    check_info_schema(data)
    assert [d["name"] for d in data["devices"]] == ["cpu"]
    cpu = data["devices"][0]
    assert cpu["capability"]["type"] == "cpu" and cpu["capability"]["dtypes"] == ["fp32", "bf16"]
    assert [(b["name"], b["selected"]) for b in cpu["backends"]] == [("torch", True), ("triton", False)]
    triton = cpu["backends"][1]
    assert triton["available"] is False and "no Triton target" in triton["reasons"][0]
    assert data["selection"]["device"] == "cpu" and data["selection"]["backend"] == "torch"
    assert data["config"]["dtype"] == "bf16"


def test_info_marks_one_of_two_servable_backends(capsys, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton can serve too, but torch ranks first
    rc, out, _ = run_main(capsys, "info", "--json", "--dtype", "fp32")
    assert rc == 0
    data = json.loads(out)
    check_info_schema(data)
    cpu = data["devices"][0]
    assert cpu["capability"]["triton_target"] == "cpu:interpreter"
    assert [(b["name"], b["available"], b["selected"], b["reasons"]) for b in cpu["backends"]] == [
        ("torch", True, True, []),
        ("triton", True, False, []),
    ]


def test_info_json_as_a_subprocess(hal_cli):
    proc = hal_cli("info")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    check_info_schema(data)
    assert data["selection"]["device"] == "cpu"


def test_info_with_every_installed_plugin_whatever_its_state(hal_cli):
    """The cuda and npu plugins may be unfinished: ``hal info`` still lists every one and selects."""
    proc = hal_cli("info_all_plugins")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    check_info_schema(data)
    assert {"cpu", "cuda", "npu"} <= {d["name"] for d in data["devices"]}


def test_info_dtype_option_changes_the_config(capsys):
    rc, out, _ = run_main(capsys, "info", "--json", "--dtype", "fp16")
    assert rc == 0
    data = json.loads(out)
    assert data["config"]["dtype"] == "fp16"
    # nothing on the CPU serves fp16: the selection says so and nothing is marked selected
    assert data["selection"]["device"] is None
    assert "no attention backend can serve" in data["selection"]["error"]
    assert not any(b["selected"] for d in data["devices"] for b in d["backends"])


def test_info_judges_the_model_shape_given(capsys, restore_registry, monkeypatch):
    from hal.registry import get_registry

    monkeypatch.setenv("HAL_NPU_EMULATION", "1")
    monkeypatch.delenv("HAL_PLUGINS", raising=False)
    get_registry(reload=True)
    args = ("info", "--json", "--page-size", "128", "--head-dim", "128", "--q-heads", "16", "--kv-heads", "4")
    rc, out, _ = run_main(capsys, *args, "--dtype", "bf16")
    data = json.loads(out)
    assert rc == 0
    cfg = data["config"]
    assert (cfg["page_size"], cfg["head_dim"], cfg["tp_q_head_num"], cfg["tp_k_head_num"]) == (128, 128, 16, 4)
    assert (data["selection"]["device"], data["selection"]["backend"]) == ("npu", "ascend")
    rc, out, _ = run_main(capsys, "info", "--json", "--page-size", "4", "--dtype", "bf16")
    npu = next(d for d in json.loads(out)["devices"] if d["name"] == "npu")
    assert any("page_size 4" in why for b in npu["backends"] for why in b["reasons"]), npu["backends"]


def test_human_info_mentions_every_device(capsys):
    register_device(FakeDevice("vendor", [Renamed], priority=10))
    register_device(FakeDevice("absent", [Renamed], available=False, reason="no card in slot 3"))
    rc, out, _ = run_main(capsys, "info")
    assert rc == 0
    lines = out.splitlines()
    for name, state in (("cpu", "available"), ("vendor", "available"), ("absent", "unavailable")):
        assert any(line.startswith(f"{name}: {state}") for line in lines), name
    assert "  - device: no card in slot 3" in lines
    assert "selected: vendor/renamed" in lines
    assert "  * renamed: ok" in lines


def test_info_marks_only_the_selected_backend_of_the_selected_device(capsys):
    register_device(FakeDevice("vendor", [Renamed], priority=10))
    rc, out, _ = run_main(capsys, "info", "--json")
    data = json.loads(out)
    assert data["selection"]["device"] == "vendor"
    selected = [(d["name"], b["name"]) for d in data["devices"] for b in d["backends"] if b["selected"]]
    assert selected == [("vendor", "renamed")]


def test_info_marks_the_forced_backend(capsys, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HAL_ATTENTION_BACKEND", "triton")
    rc, out, _ = run_main(capsys, "info", "--json", "--dtype", "fp32")
    data = json.loads(out)
    assert data["selection"]["backend"] == "triton"
    cpu = data["devices"][0]
    assert [b["name"] for b in cpu["backends"] if b["selected"]] == ["triton"]


def test_bad_hal_device_info_still_works_and_reports_the_error(capsys, monkeypatch):
    monkeypatch.setenv("HAL_DEVICE", "tpu")
    rc, out, _ = run_main(capsys, "info", "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["selection"]["device"] is None and data["selection"]["backend"] is None
    assert data["selection"]["error"].startswith("HAL_DEVICE = 'tpu': expected one of the registered devices")
    assert [d["name"] for d in data["devices"]] == ["cpu"]  # the devices are still reported
    assert data["devices"][0]["available"]

    rc, out, _ = run_main(capsys, "info")
    assert rc == 0
    assert "selected: none: HAL_DEVICE = 'tpu'" in out
    assert "cpu: available" in out


def test_bad_hal_plugins_is_an_error_exit(capsys, monkeypatch):
    monkeypatch.setenv("HAL_PLUGINS", "cpu,tpu")
    rc, out, err = run_main(capsys, "info")
    assert rc == 2
    assert err.startswith("hal: error: HAL_PLUGINS = 'cpu,tpu'")
    assert out == ""


# -- hal check -----------------------------------------------------------------------------


def test_check_cpu_torch_runs_the_conformance_suite(hal_cli):
    proc = hal_cli("check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["exit_code"] == 0 and report["errors"] == []
    [result] = report["results"]
    assert (result["device"], result["backend"]) == ("cpu", "torch")
    assert result["passed"] > 0 and result["failed"] == 0 and "skipped" in result
    assert result["failures"] == []


def test_check_unknown_device_fails_with_a_clear_message(hal_cli):
    proc = hal_cli("check_unknown")
    assert proc.returncode != 0
    assert "device 'nosuchdevice' is not registered: expected one of" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (("--family", "nosuchfamily", "--backend", "torch"), "family ['nosuchfamily'] (--family, --hal-family)"),
        (("--fuzz", "-1"), "fuzz = -1: expected 0 (no random batches) or a count of them"),
    ],
)
def test_check_refuses_an_unknown_family_or_a_negative_fuzz(capsys, args, message):
    rc, out, err = run_main(capsys, "check", "--device", "cpu", *args)
    assert rc == 2 and out == ""
    assert err.startswith("hal: error: ") and message in err
    if "--family" in args:
        assert "expected some of [" in err and "'window'" in err  # the families there are


# -- hal demo ------------------------------------------------------------------------------


def test_demo_json_steps_through_every_mode(hal_cli):
    proc = hal_cli("demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["ok"] is True
    assert data["device"] == "cpu" and data["page_size"] == 32  # --check-steps honours --page-size
    assert {s["mode"] for s in data["steps"]} >= {"EXTEND", "DECODE", "MIXED", "TARGET_VERIFY"}
    assert all(s["ok"] for s in data["steps"])
    assert all(s["max_abs_err"] < 0.1 for s in data["steps"])
