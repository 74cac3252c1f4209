"""What breaks the first time hal meets a real GPU or NPU, checked on the CPU against tests/hardware_fakes.py."""

from __future__ import annotations

import configparser
import fnmatch
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hardware_fakes import NNAL_OSERROR, FakeGraphModule, fake_flashinfer_stack, fake_torch_npu

from hal.capability import DeviceCapability
from hal.commands.cli import main
from hal.config import AttentionConfig
from hal.conformance.cases import GRAPH_CASES, build
from hal.devices.cpu import CompiledBackend
from hal.devices.cpu import device as cpu_device
from hal.devices.cuda import cuda_capability
from hal.devices.cuda import flashinfer_env as fib
from hal.devices.cuda.flashinfer_backend import FlashInferBackend
from hal.devices.npu import AscendBackend, npu_capability
from hal.errors import ConfigError, DeviceUnavailableError
from hal.graph import GraphRunner, TorchGraph
from hal.kernels.npu import load_torch_npu
from hal.registry import get_registry


def cuda_cap(**kw) -> DeviceCapability:
    kw.setdefault("torch_type", "cuda")
    return DeviceCapability(type="cuda", available=True, vendor="NVIDIA", arch="sm_90", dtypes=("fp16", "bf16"), **kw)


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
    reasons = AscendBackend.unsupported_reasons(AttentionConfig(dtype=torch.bfloat16, page_size=128), cap)
    assert reasons and "libatb.so" in reasons[0], reasons
    with pytest.raises(DeviceUnavailableError, match="ATB"):
        AscendBackend(cap)


def test_npu_probe_with_atb_loaded_has_no_atb_reason(monkeypatch):
    log = fake_torch_npu(monkeypatch, atb_loads=True)
    monkeypatch.delenv("HAL_NPU_EMULATION", raising=False)
    cap = npu_capability()
    assert log["register"] == 1
    assert "atb" not in cap.reasons and cap.libraries["atb"] == "loaded"
    assert not AscendBackend.unavailable_reasons(cap)


def test_real_npu_declares_it_cannot_capture_verify_graphs(monkeypatch):
    """splitfuse's host lengths have no in-graph update on a real NPU: a verify graph is refused up front."""
    fake_torch_npu(monkeypatch, atb_loads=True)
    monkeypatch.delenv("HAL_NPU_EMULATION", raising=False)
    cap = npu_capability()
    config = AttentionConfig(tp_q_head_num=8, tp_k_head_num=2, head_dim=128, page_size=128, dtype=torch.bfloat16)
    verify_graph = AscendBackend.unsupported_reasons(replace(config, graph=True, custom_mask=True), cap)
    assert any("TARGET_VERIFY" in r for r in verify_graph), verify_graph
    assert not any("TARGET_VERIFY" in r for r in AscendBackend.unsupported_reasons(replace(config, graph=True), cap))


def test_load_atb_without_torch_npu_is_no_reason():
    from hal.kernels.npu import load_atb

    assert load_atb() == ""  # no torch_npu here: nothing to load (load_torch_npu says why there is no NPU)


# ----------------------------------------------------------------------------- FlashInfer: installed is not usable


@pytest.fixture
def no_default_cuda(monkeypatch, tmp_path):
    """FlashInfer's last resort, /usr/local/cuda, points nowhere (this machine may have one)."""
    monkeypatch.setattr(fib, "DEFAULT_CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.delenv("FLASHINFER_DISABLE_VERSION_CHECK", raising=False)


@pytest.mark.parametrize(
    "stack, state, needle",
    [
        (dict(), "none", "no prebuilt kernels"),
        (dict(cubin="0.7.4"), "none", "no JIT toolchain: no nvcc"),  # cubins are not the FA2 modules
        (dict(nvcc=True, ninja=False), "none", "ninja"),
        (dict(nvcc=True), "jit: nvcc ", None),
        (dict(jit_cache="0.7.4+cu129"), "prebuilt: flashinfer-jit-cache 0.7.4+cu129", None),
        (dict(jit_cache="0.7.3+cu129", nvcc=True), "none", "flashinfer-jit-cache 0.7.3+cu129 does not match"),
        (dict(cubin="0.7.3", jit_cache="0.7.4"), "none", "flashinfer-cubin 0.7.3 does not match"),
    ],
    ids=["neither", "cubin_only", "no_ninja", "jit", "prebuilt", "jit_cache_mismatch", "cubin_mismatch"],
)
def test_flashinfer_kernels_tell_prebuilt_jit_and_neither_apart(
    monkeypatch, tmp_path, no_default_cuda, stack, state, needle
):
    fake_flashinfer_stack(monkeypatch, tmp_path, **stack)
    got, why = fib.flashinfer_kernels()
    assert got.startswith(state), (got, why)
    if needle is None:
        assert why is None
    else:
        assert needle in why, why
        assert FlashInferBackend.unavailable_reasons(cuda_cap(reasons={"flashinfer": why})) == [why]


@pytest.fixture
def fake_h100(monkeypatch):
    """torch.cuda says one H100 is there (no CUDA call reaches a driver)."""
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 << 30)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)


def test_cuda_capability_and_hal_info_show_where_flashinfer_kernels_come_from(
    monkeypatch, tmp_path, no_default_cuda, fake_h100, capsys
):
    fake_flashinfer_stack(monkeypatch, tmp_path, nvcc=True)
    cap = cuda_capability()
    assert cap.available and cap.libraries["flashinfer_kernels"].startswith("jit: nvcc")
    assert "flashinfer" not in cap.reasons
    assert any("compiles at its first plan()" in n for n in FlashInferBackend.notes(cap))
    monkeypatch.setenv("HAL_PLUGINS", "cpu,cuda")
    get_registry(reload=True)
    try:
        assert main(["info"]) == 0
    finally:
        monkeypatch.delenv("HAL_PLUGINS")
        get_registry(reload=True)
    out = capsys.readouterr().out
    assert "flashinfer" in out and "compiles at its first plan()" in out, out

    monkeypatch.delenv("CUDA_HOME")  # neither: the capability says so, and the backend steps aside
    cap = cuda_capability()
    assert cap.libraries["flashinfer_kernels"] == "none" and "no JIT toolchain" in cap.reasons["flashinfer"]
    assert "no JIT toolchain" in FlashInferBackend.unavailable_reasons(cap)[0]


def test_a_flashinfer_import_failure_is_a_hal_error_with_the_reason(monkeypatch, tmp_path):
    why = "flashinfer-cubin version (0.7.3) does not match flashinfer version (0.7.4)."
    fake_flashinfer_stack(monkeypatch, tmp_path, import_error=why)
    with pytest.raises(DeviceUnavailableError, match=r"flashinfer failed to import: RuntimeError: .*0\.7\.3"):
        fib.import_flashinfer()
    backend = FlashInferBackend(cuda_cap(torch_type="cpu"), workspace_mb=1)
    with pytest.raises(DeviceUnavailableError, match="flashinfer failed to import"):
        backend._fi()


# ----------------------------------------------------------------------------- FlashInfer workspace


def test_flashinfer_workspace_is_sized_as_vllm_sizes_it_and_is_an_option(monkeypatch):
    """vLLM 0.32: max(394 MiB, max_num_batched_tokens x q_heads x head_dim x 16); the token count from the engine
    (the option, or init_cuda_graph_state before the buffer exists); an explicit size wins."""
    from hal.config import AttentionConfig

    monkeypatch.delenv("HAL_FLASHINFER_WORKSPACE_MB", raising=False)
    cap = cuda_cap(torch_type="cpu")
    assert FlashInferBackend(cap).workspace_bytes == 394 * 1024 * 1024  # vLLM's VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE
    wide = AttentionConfig(tp_q_head_num=64, head_dim=256)
    assert FlashInferBackend(cap, wide, max_num_tokens=8192).workspace_bytes == 8192 * 64 * 256 * 16  # 2 GiB
    assert FlashInferBackend(cap, wide, max_num_tokens=256).workspace_bytes == 394 << 20  # the floor
    engine = FlashInferBackend(cap, wide)
    engine.init_cuda_graph_state(8, 8192)
    assert engine.workspace_bytes == 8192 * 64 * 256 * 16 and engine.workspace_mb == 2048
    assert FlashInferBackend(cap, workspace_mb=512).workspace_bytes == 512 << 20
    monkeypatch.setenv("HAL_FLASHINFER_WORKSPACE_MB", "768")
    assert FlashInferBackend(cap).workspace_mb == 768
    assert FlashInferBackend(cap, workspace_mb=256).workspace_mb == 256  # the option wins over the variable


def test_vllm_hands_its_batched_tokens_to_a_backend_that_sizes_by_them(monkeypatch):
    """hal's vLLM builder creates the backend with the scheduler's max_num_batched_tokens where a chosen backend
    declares max_num_tokens (FlashInfer), so its workspace is the one vLLM would size; nothing for others."""
    from hal.integrations.vllm_steps import engine_options
    from hal.selection import Selection

    monkeypatch.delenv("HAL_FLASHINFER_WORKSPACE_MB", raising=False)
    vllm_config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_batched_tokens=8192))
    wide = AttentionConfig(tp_q_head_num=64, head_dim=256)
    cap = cuda_cap(torch_type="cpu")
    chosen = Selection("cuda", cap, FlashInferBackend, FlashInferBackend, config=wide)
    assert engine_options(chosen, vllm_config) == {"max_num_tokens": 8192}
    assert chosen.create(**engine_options(chosen, vllm_config)).workspace_bytes == 8192 * 64 * 256 * 16
    plain = Selection("cpu", cap, CompiledBackend, CompiledBackend, config=wide)
    assert engine_options(plain, vllm_config) == {}
    assert engine_options(chosen, types.SimpleNamespace()) == {}  # no scheduler config: the backend's default


@pytest.mark.parametrize(
    "env, option", [("lots", None), ("0", None), ("-5", None), (None, 0), (None, True), (None, 1.5)]
)
def test_flashinfer_workspace_is_validated(monkeypatch, env, option):
    if env is None:
        monkeypatch.delenv("HAL_FLASHINFER_WORKSPACE_MB", raising=False)
    else:
        monkeypatch.setenv("HAL_FLASHINFER_WORKSPACE_MB", env)
    name = "HAL_FLASHINFER_WORKSPACE_MB" if env is not None else "workspace_mb"
    with pytest.raises(ConfigError, match=rf"^{name} = .*expected a whole number of MB"):
        FlashInferBackend(cuda_cap(torch_type="cpu"), workspace_mb=option)


# ----------------------------------------------------------------------------- tox device envs see the toolchain


def _pass_env(env: str) -> list[str]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(Path(__file__).parents[1] / "tox.ini")
    raw = parser[f"testenv:{env}"].get("passenv", parser["testenv"]["passenv"])
    raw = raw.replace("{[testenv]passenv}", parser["testenv"]["passenv"])
    return [v.strip() for v in raw.replace(",", "\n").split("\n") if v.strip()]


CANN_SET_ENV = (  # ascend-toolkit/set_env.sh and nnal/atb/set_env.sh
    "ASCEND_TOOLKIT_HOME",
    "ASCEND_HOME_PATH",
    "ASCEND_OPP_PATH",
    "ASCEND_AICPU_PATH",
    "TOOLCHAIN_HOME",
    "ATB_HOME_PATH",
    "ATB_OPERATION_EXECUTE_ASYNC",
    "ASDOPS_HOME_PATH",
    "ASDOPS_LOG_LEVEL",
    "LCCL_DETERMINISTIC",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",  # ${ASCEND_TOOLKIT_HOME}/python/site-packages:.../opp/built-in/op_impl/ai_core/tbe
)
CUDA_TOOLCHAIN = ("CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "FLASHINFER_WORKSPACE_BASE")


@pytest.mark.parametrize("env, names", [("npu", CANN_SET_ENV), ("cuda", CUDA_TOOLCHAIN)])
def test_device_tox_envs_pass_the_toolchain_variables(env, names):
    patterns = _pass_env(env)
    assert all(" " not in p for p in patterns), "tox 4 rejects whitespace inside a pass_env value"
    missing = [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    assert not missing, f"tox -e {env} drops {missing}"


# ----------------------------------------------------------------------------- CUDA / NPU graph memory


def test_graphs_share_one_memory_pool_largest_first_and_warm_up_on_a_side_stream():
    """torch's CUDA-graph docs: warm up on a side stream; SGLang: one pool for every captured size, largest first."""
    fake = FakeGraphModule()
    built = build(GRAPH_CASES[0])
    seen: list[tuple[int, object]] = []

    class Watching(CompiledBackend):
        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            seen.append((forward_batch.batch_size, fake.current))
            return super().forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    fb = built.batch
    runner = GraphRunner(
        Watching(cpu_device.probe()),
        [built.layer],
        fb.req_to_token_pool,
        fb.token_to_kv_pool,
        make_graph=lambda: TorchGraph(fake, fake.CUDAGraph),
        capture_bs=(1, 2, 4, 8),
        dtype=built.case.dtype,
    )
    runner.capture()
    assert len(fake.pools) == 1 and [c["pool"] for c in fake.captures] == fake.pools * 4, "one pool for all sizes"
    assert [bs for bs, where in seen if where == "capture"] == [8, 4, 2, 1], "largest size captured first"
    warmups = [(bs, where) for bs, where in seen if where != "capture"]
    assert [bs for bs, _ in warmups] == [8, 4, 2, 1]
    assert all(isinstance(where, fake.Stream) for _, where in warmups), "warm-up on a side stream"
    assert runner.pool == fake.pools[0]
    out = runner.run(fb, built.q, built.k, built.v)  # the fake replays nothing: only the plumbing is checked here
    assert out.shape[1] == fb.batch_size


# ----------------------------------------------------------------------------- the oldest supported stack


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


def test_oldest_env_runs_pyprojects_lower_bounds():
    """tox -e oldest pins Triton at pyproject's lower bound, and torch at the oldest CPU build reachable here."""
    root = Path(__file__).parents[1]
    text = (root / "pyproject.toml").read_text()
    pins = _pins(root / "constraints-oldest.txt")
    assert '"triton>=3.6"' in text and pins["triton"] == "3.6.0"
    assert '"torch>=2.11"' in text, "torch 2.11: the GPU hosts we support"
    assert tuple(map(int, pins["torch"].split(".")[:2])) >= (2, 11)
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(root / "tox.ini")
    assert "constraints-oldest.txt" in parser["testenv:oldest"]["install_command"]
