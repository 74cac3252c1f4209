"""The npu device and its ascend backend, run over the CPU emulation of the torch_npu ops.

``HAL_NPU_EMULATION=1`` makes the npu device available here; every test counts what reached the
(emulated) torch_npu ops and compares outputs with the reference (``hal.conformance.cases.build``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from hal.batch import ForwardMode, static_decode_batch
from hal.config import AttentionConfig
from hal.conformance.cases import Case, build, tolerance
from hal.devices.cpu import CompiledBackend
from hal.devices.cpu.capability import cpu_capability
from hal.devices.npu import EMULATED_NAME, AscendBackend, emulation_requested
from hal.devices.npu import device as npu_device
from hal.errors import ConfigError, DeviceUnavailableError, GraphCaptureError, InvalidBatchError, UnsupportedError
from hal.graph import EagerGraph, GraphRunner
from hal.kernels import reference as TORCH_OPS
from hal.kernels import triton as TRITON_OPS
from hal.kernels.npu import OP_NAMES, emulation, load_torch_npu
from hal.registry import get_registry, probe_device
from hal.selection import select

pytestmark = pytest.mark.skipif(
    load_torch_npu()[0] is not None, reason="a real NPU is visible: the emulation is not used (run `hal check`)"
)

D, E, M, V = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY
MIXED_REQS = ((140, 1), (0, 30), (129, 9), (3, 1))  # decodes and chunked prefills, crossing 128-token pages
EXTEND_REQS = ((130, 5), (0, 20), (200, 12))
DECODE_REQS = ((0, 1), (130, 1), (260, 1), (5, 1))
FIA, SPLITFUSE = "npu_fused_infer_attention_score", "_npu_paged_attention_splitfuse"


def _emulated(monkeypatch, value: str):
    monkeypatch.delenv("HAL_PLUGINS", raising=False)
    monkeypatch.setenv("HAL_NPU_EMULATION", value)
    device = get_registry(reload=True).get("npu")
    return device, probe_device(device)


@pytest.fixture
def npu(monkeypatch):
    """The emulated npu device (an A2, ``HAL_NPU_EMULATION=1``) and its capability, loaded through the registry."""
    return _emulated(monkeypatch, "1")


@pytest.fixture
def npu310p(monkeypatch):
    """The emulated npu device as a 310P: ATB ops only (vllm-ascend's 310P routes)."""
    return _emulated(monkeypatch, "310P")


WRITES = ("_npu_reshape_and_cache", "npu_scatter_pa_kv_cache")


@pytest.fixture
def op_calls(monkeypatch):
    """Count every call to the emulated torch_npu ops, keeping the keyword arguments they received."""
    calls: dict[str, list[dict]] = {name: [] for name in OP_NAMES}

    def counting(name, op):
        def counted(*args, **kwargs):
            calls[name].append(kwargs)
            return op(*args, **kwargs)

        return counted

    for name in OP_NAMES:
        monkeypatch.setattr(emulation.torch_npu, name, counting(name, getattr(emulation.torch_npu, name)))
    return calls


def _counts(calls) -> dict[str, int]:
    return {name: len(c) for name, c in calls.items()}


def _close(out, built):
    assert out.shape == built.expected.shape and out.dtype == built.q.dtype
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(built.case.dtype))


def _run(backend, built, **kwargs):
    backend.init_forward_metadata(built.batch)
    return backend.forward(built.q, built.k, built.v, built.layer, built.batch, **kwargs)


def _count_methods(monkeypatch, backend, names=("run_extend", "run_mixed", "run_decode")):
    counts = dict.fromkeys(names, 0)
    for name in names:
        method = getattr(backend, name)

        def counted(*args, _name=name, _method=method, **kwargs):
            counts[_name] += 1
            return _method(*args, **kwargs)

        monkeypatch.setattr(backend, name, counted)
    return counts


# ----------------------------------------------------------------------------- the device


def test_emulated_device_capability(npu):
    device, cap = npu
    assert device.name == "npu" and device.priority == 90
    assert cap.available and cap.emulated and cap.type == "npu"
    assert cap.torch_type == "cpu" and cap.torch_device == torch.device("cpu")
    assert cap.name == EMULATED_NAME
    assert cap.dtypes == ("fp32", "bf16", "fp16") and "fp16" not in cap.reasons  # the emulation computes it in fp32
    assert cap.reasons["emulated"].startswith("correctness only, never performance")
    assert load_torch_npu()[1] in cap.reasons["emulated"]  # and why there is no real NPU
    assert cap.graph == "eager_guard" and cap.triton_target is None
    assert isinstance(device.make_graph(cap), EagerGraph)
    assert device.backends() == [AscendBackend]


def test_without_the_flag_the_device_is_unavailable_with_load_torch_npus_reason(monkeypatch):
    for value in (None, "0"):
        if value is None:
            monkeypatch.delenv("HAL_NPU_EMULATION", raising=False)
        else:
            monkeypatch.setenv("HAL_NPU_EMULATION", value)
        cap = npu_device.probe()
        assert not cap.available and not cap.emulated
        assert cap.reasons["device"] == load_torch_npu()[1]
        if importlib.util.find_spec("torch_npu") is None:
            assert cap.reasons["device"] == "torch_npu not installed"


@pytest.mark.parametrize("value", ["yes", "true", "2", "", " 1"])
def test_a_bad_flag_value_raises_config_error(monkeypatch, value):
    monkeypatch.setenv("HAL_NPU_EMULATION", value)
    with pytest.raises(ConfigError, match=r"HAL_NPU_EMULATION = .*expected '1'.*'0' or unset"):
        emulation_requested()
    with pytest.raises(ConfigError, match="HAL_NPU_EMULATION"):
        npu_device.probe()
    # A typo must not make the device quietly vanish from selection: loud through the registry too,
    # while `hal info` still lists every device, this one with the error as its reason.
    with pytest.raises(ConfigError, match="HAL_NPU_EMULATION"):
        probe_device(npu_device)
    from hal.commands.info import info

    npu = next(d for d in info()["devices"] if d["name"] == "npu")
    assert not npu["available"] and "HAL_NPU_EMULATION" in npu["reasons"]["device"]


def test_importing_the_device_never_imports_torch_npu(tmp_path):
    """A torch_npu that explodes on import: importing the device is fine, probing reports the failure."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("raise OSError('libascendcl.so: cannot open shared object')\n")
    script = textwrap.dedent(
        """
        import sys
        import hal.devices.npu as npu
        assert "torch_npu" not in sys.modules
        cap = npu.device.probe()
        assert not cap.available, cap
        assert "failed to import" in cap.reasons["device"] and "libascendcl" in cap.reasons["device"], cap
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("HAL_NPU_EMULATION", None)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_selection_picks_the_emulated_npu_for_what_it_serves(npu):
    chosen = select(AttentionConfig(page_size=128, dtype=torch.bfloat16))
    assert (chosen.device_name, chosen.backend) == ("npu", "ascend")
    fallback = select(AttentionConfig(page_size=1, dtype=torch.bfloat16))  # the ATB ops need 16-token pages
    assert fallback.device_name == "cpu"
    assert any("npu/ascend: rejected" in step and "page_size 1" in step for step in fallback.trace)


# ----------------------------------------------------------------------------- validate


def test_validate_reasons_are_exactly_what_the_ops_cannot_do(npu310p):
    _, cap = npu310p
    ok = AttentionConfig(tp_q_head_num=32, tp_k_head_num=8, head_dim=128, page_size=128, dtype=torch.float32)
    assert AscendBackend.unsupported_reasons(ok, cap) == []  # fp32 is fine on the emulation
    for cfg in (
        dataclasses.replace(ok, sliding_window_size=64, non_causal=True, custom_mask=True, graph=True),
        dataclasses.replace(ok, page_size=16, dtype=torch.float16),
        dataclasses.replace(ok, head_dim=64, v_head_dim=64, page_size=64),
    ):
        assert AscendBackend.unsupported_reasons(cfg, cap) == [], cfg
    # ATB PagedAttention: block_size <= 128 (vllm-ascend's 310P kernel block sizes are 128 and 64)
    assert "<= 128" in " | ".join(
        AscendBackend.unsupported_reasons(dataclasses.replace(ok, head_dim=64, v_head_dim=64, page_size=256), cap)
    )
    assert "no bf16" in " | ".join(
        AscendBackend.unsupported_reasons(dataclasses.replace(ok, dtype=torch.bfloat16), cap)
    )

    def reasons(**changes):
        return " | ".join(AscendBackend.unsupported_reasons(dataclasses.replace(ok, **changes), cap))

    assert "logit cap not supported" in reasons(logit_cap=30.0)
    assert "v_head_dim 64 != head_dim 128" in reasons(v_head_dim=64)
    assert "page size 8: ATB PagedAttention takes a multiple of 16, <= 128" in reasons(page_size=8)
    assert "head_dim * page size = 32768 > 128 * 128" in reasons(page_size=256)
    assert reasons(dtype=torch.float16) == ""  # the emulation computes fp16 (in fp32)

    real = dataclasses.replace(
        cap, emulated=False, torch_type="npu", dtypes=("fp16", "bf16"), reasons={"fp32": "fp16/bf16 only"}
    )
    fp32 = " | ".join(AscendBackend.unsupported_reasons(ok, real))
    assert "device has no fp32" in fp32 and "dtype torch.float32 unsupported" in fp32
    assert AscendBackend.unsupported_reasons(dataclasses.replace(ok, dtype=torch.float16), real) == []
    assert "float16 only, not torch.bfloat16" in " | ".join(  # 310P's ATB ops take float16 only
        AscendBackend.unsupported_reasons(dataclasses.replace(ok, dtype=torch.bfloat16), real)
    )
    windowed_graph = dataclasses.replace(ok, dtype=torch.float16, graph=True, sliding_window_size=64)
    assert "graph" in " | ".join(AscendBackend.unsupported_reasons(windowed_graph, real))
    with pytest.raises(DeviceUnavailableError, match="torch_npu"):
        AscendBackend(real)  # a real NPU's backend needs the real module


# ----------------------------------------------------------------------------- routing


def test_mixed_batch_is_one_splitfuse_call_on_the_npu_and_forward_extend_on_the_cpu(npu310p, op_calls, monkeypatch):
    _, cap = npu310p
    case = Case("mixed_page128", M, MIXED_REQS, page_size=128, tp_q_head_num=8, tp_k_head_num=2)
    built = build(case, layer_num=2)
    backend = AscendBackend(cap)
    methods = _count_methods(monkeypatch, backend)
    for layer_id in (0, 1):  # one splitfuse call per layer forward
        layer = case.layer(layer_id)
        backend.init_forward_metadata(built.batch)
        out = backend.forward(built.q, built.k, built.v, layer, built.batch)
        assert methods == {"run_extend": 0, "run_mixed": layer_id + 1, "run_decode": 0}
        assert _counts(op_calls) == {
            "_npu_reshape_and_cache": 0,
            "npu_scatter_pa_kv_cache": 0,
            "npu_scatter_nd_update_": 2 * (layer_id + 1),  # 310P: K and V rows into hal's ND pool
            "npu_format_cast": 3 * (layer_id + 1),  # the NZ key and value pages and the NZ mask
            "_npu_paged_attention": 0,
            "_npu_paged_attention_splitfuse": layer_id + 1,
            "npu_fused_infer_attention_score": 0,
        }
        if layer_id == 0:
            _close(out, built)
    call = op_calls["_npu_paged_attention_splitfuse"][0]
    fb = built.batch
    for name, expected in (("seq_len", fb.lens.query), ("context_lens", fb.lens.kv)):
        assert call[name].device.type == "cpu" and call[name].dtype == torch.int32
        assert call[name].tolist() == expected
    width, rows = -(-max(fb.lens.kv) // 16), -(-fb.num_tokens // 16) * 16
    assert call["mask"].shape == (1, width, rows, 16)  # FRACTAL_NZ, as vllm-ascend's 310P splitfuse mask
    assert emulation.get_npu_format(call["mask"]) == 29 and emulation.get_npu_format(call["key_cache"]) == 29
    assert call["block_table"].dtype == torch.int32 and call["block_table"].shape == (4, 2)

    # The same batch on the CPU torch backend: the extend step (its fused call, or run_extend), never run_mixed.
    cpu_built = build(case)
    torch_backend = CompiledBackend(cpu_capability())
    cpu_methods = _count_methods(monkeypatch, torch_backend, ("run_extend", "run_mixed", "run_decode", "run_fused"))
    _close(_run(torch_backend, cpu_built), cpu_built)
    assert cpu_methods["run_mixed"] == cpu_methods["run_decode"] == 0
    assert cpu_methods["run_extend"] + cpu_methods["run_fused"] == 1


def test_layers_with_different_windows_get_their_own_mask(npu, op_calls):
    """One batch, a full-attention layer then a windowed one: two masks, each layer equal to its reference."""
    _, cap = npu
    plain = Case("mixed_page16", M, MIXED_REQS, page_size=16)
    windowed = dataclasses.replace(plain, name="mixed_page16_window", sliding_window_size=8)
    built, built_windowed = build(plain), build(windowed)  # same seed: the same batch and inputs
    assert torch.equal(built.q, built_windowed.q)
    backend = AscendBackend(cap)
    backend.init_forward_metadata(built.batch)
    _close(backend.forward(built.q, built.k, built.v, built.layer, built.batch), built)
    _close(backend.forward(built.q, built.k, built.v, built_windowed.layer, built.batch), built_windowed)
    masks = [call["mask"] for call in op_calls[SPLITFUSE]]
    assert len(masks) == 2 and not torch.equal(masks[0], masks[1])
    assert set(backend.forward_metadata.masks) == {("causal", -1), ("causal", 8)}


def test_forward_extend_called_directly_on_a_mixed_batch_takes_the_same_single_call(npu, op_calls):
    _, cap = npu
    built = build(Case("mixed_page16_bf16", M, MIXED_REQS, page_size=16, dtype=torch.bfloat16))
    backend = AscendBackend(cap)
    backend.init_forward_metadata(built.batch)
    q, k, v = (t.view(t.shape[0], -1, built.layer.head_dim) for t in (built.q, built.k, built.v))
    _close(backend.forward_extend(q, k, v, built.layer, built.batch), built)
    assert _counts(op_calls)["_npu_paged_attention_splitfuse"] == 1
    assert _counts(op_calls)["npu_fused_infer_attention_score"] == 0


def test_decode_uses_npu_paged_attention_with_host_lengths(npu310p, op_calls):
    _, cap = npu310p
    built = build(Case("decode_page128", D, DECODE_REQS, page_size=128))
    backend = AscendBackend(cap)
    _close(_run(backend, built), built)
    assert _counts(op_calls) == {
        "_npu_reshape_and_cache": 0,
        "npu_scatter_pa_kv_cache": 0,
        "npu_scatter_nd_update_": 2,
        "npu_format_cast": 2,
        "_npu_paged_attention": 1,
        "_npu_paged_attention_splitfuse": 0,
        "npu_fused_infer_attention_score": 0,
    }
    call = op_calls["_npu_paged_attention"][0]
    lens = call["context_lens"]
    assert lens.device.type == "cpu" and lens.dtype == torch.int32 and lens.tolist() == [1, 131, 261, 6]
    table = call["block_table"]
    assert table.dtype == torch.int32 and table.shape == (4, 3)  # ceil(261 / 128) blocks
    fb = built.batch
    assert torch.equal(table, torch.arange(12, dtype=torch.int32).view(4, 3))  # the batch's pages, copied NZ
    case = built.case
    # 310P: ATB reads FRACTAL_NZ caches [blocks, kv_heads * head_dim / 16, block_size, 16] (vllm-ascend's 310P layout)
    assert call["key_cache"].shape == (12, case.tp_k_head_num * case.head_dim // 16, 128, 16)
    assert emulation.get_npu_format(call["key_cache"]) == 29
    pool = fb.token_to_kv_pool
    assert torch.equal(pool.k_buffer[0][fb.out_cache_loc.long()], built.expected_k[fb.out_cache_loc.long()])


def test_decode_with_a_sliding_window_goes_through_splitfuse(npu, op_calls):
    _, cap = npu
    built = build(Case("decode_window", D, DECODE_REQS, page_size=16, sliding_window_size=8))
    _close(_run(AscendBackend(cap), built), built)
    assert _counts(op_calls)["_npu_paged_attention"] == 0
    assert _counts(op_calls)["_npu_paged_attention_splitfuse"] == 1
    mask = op_calls["_npu_paged_attention_splitfuse"][0]["mask"]
    assert (mask[2, :252] != 0).all() and (mask[2, 252:261] == 0).all()  # request 2 at position 260 sees 252..260


@pytest.mark.parametrize(
    "case, op, sparse_mode",
    [
        (Case("extend_page128", E, EXTEND_REQS, page_size=128, head_dim=128), FIA, 3),
        (Case("extend_page128_bf16", E, EXTEND_REQS, page_size=128, head_dim=128, dtype=torch.bfloat16), FIA, 3),
        (
            Case("extend_page128_nc", E, ((0, 7), (0, 12)), page_size=128, head_dim=128, attn_type="encoder_only"),
            FIA,
            0,
        ),
        (
            Case("draft_extend_page128", ForwardMode.DRAFT_EXTEND, ((6, 3), (140, 3)), page_size=128, head_dim=128),
            FIA,
            3,
        ),
        (Case("extend_page128_d64", E, EXTEND_REQS, page_size=128), SPLITFUSE, None),  # FIA TND: 128/192 only
        (Case("extend_page16", E, EXTEND_REQS, page_size=16), SPLITFUSE, None),
        (Case("extend_page128_window", E, EXTEND_REQS, page_size=128, sliding_window_size=6), SPLITFUSE, None),
        (Case("extend_page16_nc", E, ((0, 7), (0, 12)), page_size=16, attn_type="encoder_only"), SPLITFUSE, None),
        (Case("verify_page128", V, ((130, 4), (3, 4)), page_size=128), SPLITFUSE, None),
        (Case("verify_page16_window", V, ((30, 4), (3, 4)), page_size=16, sliding_window_size=7), SPLITFUSE, None),
    ],
    ids=lambda x: x.name if isinstance(x, Case) else None,
)
def test_extend_routing(npu, op_calls, case, op, sparse_mode):
    _, cap = npu
    built = build(case)
    _close(_run(AscendBackend(cap), built), built)
    attention = {name: n for name, n in _counts(op_calls).items() if name not in WRITES}
    assert attention == {name: int(name == op) for name in attention}
    call = op_calls[op][0]
    fb = built.batch
    if sparse_mode is not None:  # FIA, TND: host lists, cumulative query ends and per-request KV lengths
        assert call["sparse_mode"] == sparse_mode and call["input_layout"] == "TND"
        assert call["actual_seq_lengths"] == list(itertools.accumulate(fb.lens.query))
        assert call["actual_seq_lengths_kv"] == fb.lens.kv
        assert all(type(n) is int for n in call["actual_seq_lengths"] + call["actual_seq_lengths_kv"])
        assert (call.get("atten_mask") is None) == (sparse_mode == 0)
    else:
        assert call["seq_len"].tolist() == fb.lens.query and call["context_lens"].tolist() == fb.lens.kv


def test_save_kv_cache_false_writes_nothing(npu, op_calls):
    _, cap = npu
    built = build(Case("decode_page16", D, DECODE_REQS, page_size=16))
    pool = built.batch.token_to_kv_pool
    pool.k_buffer[0].copy_(built.expected_k)
    pool.v_buffer[0].copy_(built.expected_v)
    _close(_run(AscendBackend(cap), built, save_kv_cache=False), built)
    assert _counts(op_calls)["_npu_reshape_and_cache"] == _counts(op_calls)["npu_scatter_pa_kv_cache"] == 0
    assert torch.equal(pool.k_buffer[0], built.expected_k)


def test_forward_needs_metadata_and_refuses_what_the_ops_cannot_do(npu):
    _, cap = npu
    built = build(Case("decode_page16", D, DECODE_REQS, page_size=16))
    backend = AscendBackend(cap)
    with pytest.raises(InvalidBatchError, match="init_forward_metadata"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    backend.init_forward_metadata(built.batch)
    capped = dataclasses.replace(built.layer, logit_cap=5.0)
    with pytest.raises(UnsupportedError, match="soft cap"):
        backend.forward(built.q, built.k, built.v, capped, built.batch)


def test_helper_ops_follow_support_triton(npu):
    _, cap = npu
    backend = AscendBackend(cap)
    assert backend.support_triton() is False and backend.helper_ops is TORCH_OPS
    with_target = AscendBackend(dataclasses.replace(cap, triton_target="npu:Ascend910B3"))
    assert with_target.support_triton() is True and with_target.helper_ops is TRITON_OPS


# ----------------------------------------------------------------------------- graphs


def _graph_runner(npu, built, sinks=None) -> GraphRunner:
    """A captured GraphRunner (batch sizes 1, 2, 4) of the ascend backend over ``built``'s layer and pools."""
    device, cap = npu
    fb = built.batch
    runner = GraphRunner(
        AscendBackend(cap),
        [built.layer],
        fb.req_to_token_pool,
        fb.token_to_kv_pool,
        make_graph=lambda: device.make_graph(cap),
        capture_bs=(1, 2, 4),
        dtype=built.case.dtype,
        sinks=sinks,
    )
    runner.capture()
    return runner


@pytest.mark.parametrize(
    "case",
    [
        Case("graph_page128", D, ((3, 1), (200, 1), (130, 1)), page_size=128),
        Case(
            "graph_page16_window_bf16",
            D,
            ((3, 1), (40, 1), (20, 1)),
            page_size=16,
            sliding_window_size=8,
            dtype=torch.bfloat16,
        ),
    ],
    ids=lambda c: c.name,
)
def test_graph_replay_under_the_emulation_matches_the_reference(npu, op_calls, case):
    built = build(case)
    fb = built.batch
    pool = fb.token_to_kv_pool
    runner = _graph_runner(npu, built)
    op = "_npu_paged_attention" if case.sliding_window_size < 0 else "_npu_paged_attention_splitfuse"
    for _ in range(2):
        before = len(op_calls[op])
        out = runner.run(fb, built.q, built.k, built.v)
        _close(out[0], built)
        assert len(op_calls[op]) == before + 1
        # The replay read this batch's host lengths, padded with the fill value to the captured size 4.
        assert op_calls[op][-1]["context_lens"].tolist() == fb.lens.kv + [1]
    assert torch.equal(pool.k_buffer[0][pool.page_size :], built.expected_k[pool.page_size :])


def test_the_eager_guard_still_watches_the_backends_own_code(npu, monkeypatch):
    """Only the emulated op launches are opaque: a host sync in the backend fails the capture."""
    device, cap = npu
    built = build(Case("graph_page16", D, ((3, 1), (20, 1)), page_size=16))
    fb = built.batch
    backend = AscendBackend(cap)
    runner = GraphRunner(backend, [built.layer], fb.req_to_token_pool, fb.token_to_kv_pool, EagerGraph, (2,))
    prepare = backend._prepare

    def syncing(q, layer, fb):
        prepared = prepare(q, layer, fb)
        prepared[1].sum().item()  # a host sync in the backend's own code
        return prepared

    monkeypatch.setattr(backend, "_prepare", syncing)
    with pytest.raises(GraphCaptureError, match="host sync"):
        runner.capture()


class _FakeNpu(types.SimpleNamespace):
    """Just enough of ``torch.npu`` to record the graph task-group / task-update protocol."""

    def __init__(self):
        super().__init__(log=[], capturing=False)
        log = self.log

        class Event:
            def wait(self, stream):
                log.append(("event.wait", stream))

            def reset(self, stream):
                log.append(("event.reset", stream))

            def record(self, stream):
                log.append(("event.record", stream))

        class Stream:
            def wait_stream(self, other):
                log.append(("wait_stream", self, other))

        self.ExternalEvent, self.Stream, self.NPUGraph = Event, Stream, object
        self.main = Stream()
        self.handles = itertools.count()

    def is_current_stream_capturing(self):
        return self.capturing

    def current_stream(self):
        return self.main

    def stream(self, stream):
        self.log.append(("stream", stream))
        return contextlib.nullcontext()

    def graph_task_group_begin(self, stream):
        self.log.append(("group_begin", stream))

    def graph_task_group_end(self, stream):
        handle = next(self.handles)
        self.log.append(("group_end", stream, handle))
        return handle

    def graph_task_update_begin(self, stream, handle):
        self.log.append(("update_begin", stream, handle))

    def graph_task_update_end(self, stream):
        self.log.append(("update_end", stream))


def test_real_npu_graph_path_updates_the_captured_tasks_host_lengths(npu, op_calls, monkeypatch):
    """The task-group protocol of the real-NPU path, with a recording torch.npu (the hardware part is unverified)."""
    _, cap = npu
    fake = _FakeNpu()
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    workspaces = []  # newer torch_npu sizes the graph workspace with _npu_paged_attention_get_workspace

    def get_workspace(**kwargs):
        workspaces.append((kwargs["context_lens"].tolist(), torch.empty(16)))
        return workspaces[-1][1]

    monkeypatch.setattr(emulation.torch_npu, "_npu_paged_attention_get_workspace", get_workspace, raising=False)
    case = Case("graph_page128", D, ((3, 1), (200, 1), (130, 1)), page_size=128)
    built = build(case, layer_num=2)
    fb = built.batch
    backend = AscendBackend(cap)
    backend.capability = dataclasses.replace(cap, emulated=False)  # take the real-NPU code path over the emulation
    backend.init_cuda_graph_state(4, 4)
    static = static_decode_batch(4, fb.req_to_token_pool, fb.token_to_kv_pool, 1)
    q = torch.zeros(4, built.q.shape[1])
    k, v = torch.zeros(4, built.k.shape[1]), torch.zeros(4, built.v.shape[1])

    backend.init_forward_metadata_out_graph(static, in_capture=True)
    fake.capturing = True
    backend.init_forward_metadata_in_graph(static)
    for layer_id in (0, 1):
        backend.forward(q, k, v, case.layer(layer_id), static)
    fake.capturing = False
    captured = op_calls["_npu_paged_attention"][:]
    assert [c["context_lens"].tolist() for c in captured] == [[1, 1, 1, 1]] * 2
    width = fb.req_to_token_pool.max_context_len
    assert [lens for lens, _ in workspaces] == [[width] * 4] * 2  # sized for the longest context at capture
    assert [c["workspace"] for c in captured] == [w for _, w in workspaces]
    groups = [e for e in fake.log if e[0] in ("event.wait", "event.reset", "group_begin", "group_end")]
    assert [e[0] for e in groups] == ["event.wait", "event.reset", "group_begin", "group_end"] * 2

    # Replay of a 3-request batch: refill the static batch as GraphRunner does, then out_graph updates the tasks.
    static.req_pool_indices.zero_()[:3].copy_(fb.req_pool_indices)
    static.seq_lens.fill_(1)[:3].copy_(fb.seq_lens)
    static.set_decode_host_lens(fb.seq_lens_cpu.tolist() + [1])
    fake.log.clear()
    backend.init_forward_metadata_out_graph(static)
    names = [e[0] for e in fake.log]
    assert names == ["wait_stream", "stream"] + ["update_begin", "update_end", "event.record"] * 2
    update_stream = fake.log[0][1]
    assert fake.log[0][2] is fake.main  # the update waits for the previous replay on the main stream
    assert [e[2] for e in fake.log if e[0] == "update_begin"] == [0, 1]  # the handles from group_end, in order
    assert all(e[1] is update_stream for e in fake.log if e[0] in ("update_begin", "update_end", "event.record"))
    reissued = op_calls["_npu_paged_attention"][2:]
    assert [lens for lens, _ in workspaces[2:]] == [fb.lens.kv + [1]] * 2  # recomputed per update
    for old, new, (_, workspace) in zip(captured, reissued, workspaces[2:]):
        assert new["context_lens"].tolist() == fb.lens.kv + [1]
        assert new["workspace"] is workspace
        for name in ("query", "key_cache", "value_cache", "block_table", "out"):
            assert new[name] is old[name]  # same tensors: only the host lengths change


@pytest.mark.parametrize("head_dim, op", [(128, FIA), (64, SPLITFUSE), (256, "")])  # 256 * 128 > ATB's 128 * 128
def test_extend_route_is_declared_with_the_reason(npu, head_dim, op):
    _, cap = npu
    config = AttentionConfig(tp_q_head_num=8, tp_k_head_num=2, head_dim=head_dim, page_size=128, dtype=torch.bfloat16)
    route, reasons = AscendBackend.extend_route(config, cap)
    assert route == op
    assert bool(reasons) == (op != FIA)
    if reasons:
        assert "TND takes head dim 128 or 192" in reasons[0]
    assert any("head_dim 128 or 192" in n for n in AscendBackend.notes(cap))


def test_routes_are_functions_of_the_steps_facts_and_the_layer_and_graph_tasks_a_part(npu):
    """The backend is one class over AttentionBackend: routing reads only the facts it is given (no backend),
    and the captured graph tasks are an object the backend owns."""
    from hal.backend import AttentionBackend
    from hal.devices.npu import routing
    from hal.devices.npu.graph_tasks import GraphTasks
    from hal.devices.npu.metadata import StepFacts
    from hal.layer import AttentionLayer

    assert AscendBackend.__bases__ == (AttentionBackend,)
    assert isinstance(AscendBackend(npu[1]).graph_tasks, GraphTasks)
    a2 = StepFacts("A2", 128, torch.bfloat16, torch.bfloat16)
    layer = AttentionLayer(layer_id=3, tp_q_head_num=8, tp_k_head_num=2, head_dim=128)
    route = routing.attention_route
    assert route(a2, layer, "decode", False) == routing.Route(FIA, decode=True)
    assert route(a2, layer, "decode", True) == routing.Route(routing.PAGED, captured=True)
    assert route(a2, layer, "extend", True) == routing.Route(FIA, uncapturable=True)
    assert route(a2, layer, "target_verify", False) == routing.Route(SPLITFUSE, mask=("custom", -1))
    small_pages = dataclasses.replace(a2, page_size=16)
    assert route(small_pages, layer, "mixed", False) == routing.Route(SPLITFUSE, mask=("causal", -1))
    windowed = dataclasses.replace(layer, sliding_window_size=8)
    assert route(dataclasses.replace(a2, generation="310P"), windowed, "decode", False).mask == ("causal", 8)
    a5 = dataclasses.replace(a2, generation="A5")
    head_64 = dataclasses.replace(layer, head_dim=64)
    assert "decode of layer 3 on A5: FIA cannot serve it" in route(a5, head_64, "decode", False).refused
    assert "which A5 does not have" in route(a5, head_64, "extend", False).refused
    assert not route(a5, layer, "decode", False).refused
    # FIA v2 with learnable_sink on A5: vllm-ascend calls it there with no device gate (contracts: v2 "chips")
    assert routing.sink_route(a5, layer, "decode", False) == routing.Route(routing.FIA_V2, decode=True)
    # decodes over more than 262144 keys: FIA at Q_S = 2 (pages of 128..512), else ATB on A2/A3, refused on A5
    long = dataclasses.replace(a2, page_size=16, long_kv=True)
    assert route(dataclasses.replace(long, page_size=128), layer, "decode", False) == routing.Route(FIA, decode=True)
    assert route(long, layer, "decode", False) == routing.Route(routing.PAGED)
    refused = route(dataclasses.replace(long, generation="A5"), layer, "decode", False).refused
    assert "on A5: FIA cannot serve it" in refused and "Q_S = 2" in refused
    assert routing.sink_route(a2, layer, "decode", False) == routing.Route(routing.FIA_V2, decode=True)
    mla = AttentionLayer(4, 16, 1, 576, v_head_dim=512, kv_lora_rank=512, qk_rope_head_dim=64)
    assert routing.mla_route(a2, mla, "decode", True, False, False).op == routing.MLA_DECODE
    assert routing.mla_route(a2, mla, "decode", False, False, False).op == routing.FIA_V2  # a split pool
    assert routing.mla_route(a2, mla, "target_verify", True, False, False).mask == ("tree", -1)
    assert "no Ascend MLA op takes a sink" in routing.mla_route(a2, mla, "decode", True, True, False).refused


def test_a_captured_verify_step_has_a_splitfuse_mask_row_per_draft_token(npu):
    """SGLang's graph runner captures TARGET_VERIFY at bs requests of draft tokens each: the mask buffer
    needs bs * draft_token_num rows (init_cuda_graph_state's max_num_tokens), not max_bs."""
    _, cap = npu
    built = build(Case("graph_verify", V, ((5, 4), (20, 4), (17, 4)), page_size=16))
    fb = built.batch
    fb.graph_static = True  # a graph runner's static batch
    backend = AscendBackend(cap)
    backend.init_cuda_graph_state(max_bs=3, max_num_tokens=3 * 4)
    for in_capture in (True, False):  # capture, then a replay of the same (mode, batch size)
        backend.init_forward_metadata_out_graph(fb, in_capture=in_capture)
        backend.init_forward_metadata_in_graph(fb)
        assert backend.forward_metadata.graph_static
        _close(backend.forward(built.q, built.k, built.v, built.layer, fb), built)
    with pytest.raises(GraphCaptureError, match="max_num_tokens"):
        backend.init_cuda_graph_state(max_bs=3, max_num_tokens=3)
        backend.init_forward_metadata_out_graph(fb, in_capture=True)


def _permute_new_slots(built, request: int) -> None:
    """Scatter request ``request``'s new tokens over its new-token slots in another order (SGLang's kit
    layout ``non_monotonic_extend``): req_to_token and out_cache_loc agree; pages no longer hold
    token i at offset i % page_size."""
    fb = built.batch
    prefix, new = built.case.requests[request]
    row = int(fb.req_pool_indices[request])
    start = sum(n for _, n in built.case.requests[:request])
    slots = fb.req_to_token_pool.req_to_token[row, prefix : prefix + new].clone()
    order = torch.arange(new).roll(1)
    fb.req_to_token_pool.req_to_token[row, prefix : prefix + new] = slots[order]
    fb.out_cache_loc[start : start + new] = slots[order].to(fb.out_cache_loc.dtype)


@pytest.mark.parametrize("mode", [E, M], ids=["extend", "mixed"])
def test_eager_steps_with_slots_off_their_page_offsets_are_served_through_an_aligned_copy(npu, mode):
    _, cap = npu
    requests = ((0, 20), (14, 5), (40, 1)) if mode == M else ((0, 20), (14, 5))
    built = build(Case("misaligned", mode, requests, page_size=16))
    backend = AscendBackend(cap)
    backend.init_forward_metadata(built.batch)
    assert backend.forward_metadata.relayout is None  # hal's layout: page-aligned, read in place
    _permute_new_slots(built, 0)
    _permute_new_slots(built, 1)
    out = _run(backend, built)
    assert backend.forward_metadata.relayout is not None
    _close(out, built)


# ----------------------------------------------------------------------------- generations (vllm-ascend's routes)


@pytest.mark.parametrize("value, arch", [("1", "Ascend910B"), ("a3", "Ascend910_93"), ("310P", "Ascend310P")])
def test_the_emulated_generation_is_the_capability_arch(monkeypatch, value, arch):
    _, cap = _emulated(monkeypatch, value)
    assert cap.arch == arch and cap.emulated
    assert ("bf16" in cap.dtypes) == (arch != "Ascend310P")


def test_a2_runs_fia_for_decode_extend_and_mixed_and_scatters_the_kv(npu, op_calls):
    _, cap = npu
    for mode, reqs in ((D, DECODE_REQS), (E, EXTEND_REQS), (M, MIXED_REQS)):
        for calls in op_calls.values():
            calls.clear()
        built = build(Case(f"a2_{mode.name}", mode, reqs, page_size=128, head_dim=128))
        _close(_run(AscendBackend(cap), built), built)
        assert _counts(op_calls) == {name: int(name in (FIA, "npu_scatter_pa_kv_cache")) for name in OP_NAMES}
        call, fb = op_calls[FIA][0], built.batch
        assert call["input_layout"] == "TND" and call["actual_seq_lengths_kv"] == fb.lens.kv
        assert call["actual_seq_lengths"] == list(itertools.accumulate(fb.lens.query))
        write = op_calls["npu_scatter_pa_kv_cache"][0]
        assert write["cache_mode"] == "Norm" and write["slot_mapping"].dtype == torch.int32


def test_routes_follow_the_generation(monkeypatch):
    config = AttentionConfig(tp_q_head_num=8, tp_k_head_num=2, head_dim=128, page_size=128, dtype=torch.float16)
    routes = {gen: AscendBackend.step_routes(config, _emulated(monkeypatch, gen)[1]) for gen in ("A2", "A5", "310P")}
    assert routes["A2"] == {"kv_write": "npu_scatter_pa_kv_cache", "decode": FIA, "extend": FIA, "mixed": FIA}
    assert routes["A5"] == routes["A2"]
    assert routes["310P"] == {
        "kv_write": "npu_scatter_nd_update_",
        "decode": "_npu_paged_attention",
        "extend": SPLITFUSE,
        "mixed": SPLITFUSE,
    }
    graphed = dataclasses.replace(config, graph=True)
    assert AscendBackend.step_routes(graphed, _emulated(monkeypatch, "A2")[1])["graph_decode"] == "_npu_paged_attention"
    a5 = _emulated(monkeypatch, "A5")[1]
    assert "A5 has no ATB ops" in " | ".join(AscendBackend.unsupported_reasons(graphed, a5))  # never PA on A5
    # FIA takes a window as band mode 4 (vllm-ascend attention_v1.py), a decode padded to two query rows
    windowed = dataclasses.replace(config, sliding_window_size=8)
    assert AscendBackend.unsupported_reasons(windowed, a5) == []
    assert AscendBackend.step_routes(windowed, a5)["decode"] == FIA
    a2 = _emulated(monkeypatch, "1")[1]
    assert AscendBackend.unsupported_reasons(dataclasses.replace(config, sliding_window_size=8), a2) == []


def test_head_dim_192_never_reaches_splitfuse_off_a_128_page(npu):
    _, cap = npu
    config = AttentionConfig(tp_q_head_num=8, tp_k_head_num=2, head_dim=192, page_size=64, dtype=torch.float16)
    assert AscendBackend.step_routes(config, cap)["extend"] == ""
    assert "may crash" in " | ".join(AscendBackend.unsupported_reasons(config, cap))
    assert AscendBackend.step_routes(dataclasses.replace(config, page_size=128), cap)["extend"] == FIA


def test_negative_slots_go_to_the_padding_slot_before_the_scatter(npu, op_calls):
    _, cap = npu
    built = build(Case("decode_page16", D, DECODE_REQS, page_size=16))
    fb = built.batch
    pool = fb.token_to_kv_pool
    fb.out_cache_loc[1] = -1  # a padding token
    backend = AscendBackend(cap)
    backend.init_forward_metadata(fb)
    k = built.k.view(built.k.shape[0], -1, built.layer.head_dim)
    backend.save_kv(built.layer, fb, k, k)
    slots = op_calls["npu_scatter_pa_kv_cache"][0]["slot_mapping"]
    assert slots[1] == pool.padding_slot and (slots >= 0).all()
    with pytest.raises(ValueError, match="slot_mapping"):  # the op's documented range, as the emulation enforces it
        emulation.torch_npu.npu_scatter_pa_kv_cache(
            k[:1].contiguous(), k[:1].contiguous(), *npu_kv(pool), torch.tensor([-1]), cache_mode="Norm"
        )


def npu_kv(pool):
    from hal.kv_cache import paged_view

    return paged_view(pool, 0)


def test_npu_graph_replay_synchronises_the_current_stream_first():
    from hal.devices.npu import NpuGraph

    log = []
    stream = types.SimpleNamespace(synchronize=lambda: log.append("sync"))
    graph = types.SimpleNamespace(replay=lambda: log.append("replay"))
    module = types.SimpleNamespace(NPUGraph=lambda: graph, current_stream=lambda: stream)
    NpuGraph(module, module.NPUGraph).replay()
    assert log == ["sync", "replay"]


# ----------------------------------------------------------------------------- MLA, attention sinks, fp8 (issue 19)

DEEPSEEK = dict(tp_q_head_num=16, tp_k_head_num=1, head_dim=576, kv_lora_rank=512, qk_rope_head_dim=64)
FIA2, PA_MLA, SISO = "npu_fused_infer_attention_score_v2", "_npu_paged_attention_mla", "_npu_reshape_and_cache_siso"


@pytest.fixture
def v2_calls(monkeypatch):
    """Every call to the emulated ops of the MLA and sinks paths, with its keyword arguments."""
    calls: dict[str, list[dict]] = {name: [] for name in (FIA2, PA_MLA, SISO, "npu_scatter_pa_kv_cache")}
    for name in calls:
        op = getattr(emulation.torch_npu, name)

        def counted(*args, _name=name, _op=op, **kwargs):
            calls[_name].append(kwargs)
            return _op(*args, **kwargs)

        monkeypatch.setattr(emulation.torch_npu, name, counted)
    return calls


def _mla_case(name, mode, reqs, **kw):
    return Case(name, mode, reqs, **{"dtype": torch.bfloat16, "page_size": 16, **DEEPSEEK, **kw})


def test_mla_routes_follow_the_generation(monkeypatch):
    config = AttentionConfig(dtype=torch.bfloat16, page_size=16, custom_mask=True, **DEEPSEEK)
    a2 = {"kv_write": SISO, "decode": PA_MLA, "extend": FIA2, "mixed": FIA2, "target_verify": FIA2}
    for gen in ("A2", "A3"):
        cap = _emulated(monkeypatch, gen)[1]
        # K_CACHE_V_BYPASS (siso) is documented for A2 only: A3 writes the cache rows with npu_scatter_nd_update_
        want = a2 if gen == "A2" else {**a2, "kv_write": "npu_scatter_nd_update_"}
        assert AscendBackend.step_routes(config, cap) == want
        assert "mla_split" in AscendBackend.routes(config, cap) and not AscendBackend.unsupported_reasons(config, cap)
    for gen, why in (("A5", "no ATB ops"), ("310P", "no MLA op")):
        reasons = AscendBackend.unsupported_reasons(config, _emulated(monkeypatch, gen)[1])
        assert reasons and all(f"MLA on {gen}: {why}" in r for r in reasons if "MLA on" in r), reasons
    windowed = dataclasses.replace(config, sliding_window_size=8, custom_mask=False)
    cap = _emulated(monkeypatch, "A2")[1]
    assert AscendBackend.step_routes(windowed, cap)["decode"] == FIA2  # _npu_paged_attention_mla has no window
    small = AttentionConfig(
        dtype=torch.bfloat16, page_size=16, **{**DEEPSEEK, "head_dim": 80, "kv_lora_rank": 64, "qk_rope_head_dim": 16}
    )
    assert any("latent 64 + rope 16" in r for r in AscendBackend.unsupported_reasons(small, cap))


def test_mla_decode_reads_the_one_cache_in_place_and_writes_the_key_only(npu, v2_calls):
    built = build(_mla_case("mla_decode", D, ((40, 1), (3, 1), (17, 1))))
    backend = AscendBackend(npu[1])
    _close(_run(backend, built), built)
    pool = built.batch.token_to_kv_pool
    (decode,), (write,) = v2_calls[PA_MLA], v2_calls[SISO]
    assert decode["key_cache"].data_ptr() == pool.get_key_buffer(0).data_ptr()  # no copy
    assert decode["key_cache"].shape[1:] == (16, 1, 576) and decode["mla_vheadsize"] == 512
    assert write["key_cache"].data_ptr() == pool.get_key_buffer(0).data_ptr() and write["key"].shape == (3, 1, 576)
    assert not v2_calls[FIA2] and not v2_calls["npu_scatter_pa_kv_cache"]
    assert backend.route_of(built.batch, built.layer) == ["kv_write:" + SISO, "decode:" + PA_MLA]


def test_mla_eager_padding_tokens_write_nothing(npu, v2_calls):
    """ReshapeAndCache skips a negative slot: an eager batch's tokens aimed at the padding slot go to the A2 MLA
    write as -1 (not slot 0 repeated, which the op forbids), as a captured graph's do."""
    built = build(_mla_case("mla_decode_pad", D, ((40, 1), (3, 1), (17, 1))))
    fb = built.batch
    pool = fb.token_to_kv_pool
    fb.out_cache_loc[1] = pool.padding_slot
    backend = AscendBackend(npu[1])
    backend.init_forward_metadata(fb)
    assert not backend.forward_metadata.graph_static
    k = built.k.view(built.k.shape[0], 1, -1)
    backend.save_kv(built.layer, fb, k, k)
    (write,) = v2_calls[SISO]
    assert write["slot_indices"][1] == -1 and write["slot_indices"].dtype == torch.int32


def test_long_contexts_route_past_fias_one_token_limit(monkeypatch):
    """A model served past 262144 keys: its FIA decode runs at Q_S = 2 (pages of 128..512), so smaller pages are
    refused at selection on A5 with the reason, and take _npu_paged_attention on A2."""
    config = AttentionConfig(head_dim=128, page_size=16, dtype=torch.bfloat16, max_context_len=300_000)
    a5 = _emulated(monkeypatch, "A5")[1]
    assert any("262144" in r or "Q_S = 2" in r for r in AscendBackend.unsupported_reasons(config, a5))
    assert not AscendBackend.unsupported_reasons(dataclasses.replace(config, page_size=128), a5)
    a2 = _emulated(monkeypatch, "A2")[1]
    assert AscendBackend.step_routes(config, a2)["decode"] == "_npu_paged_attention"
    assert AscendBackend.step_routes(dataclasses.replace(config, max_context_len=4096), a2)["decode"] == FIA


@pytest.mark.parametrize(
    "mode, reqs, sparse_mode",
    [(E, ((12, 4), (0, 5)), 3), (M, ((12, 1), (0, 5), (7, 3)), 3), (V, ((20, 3), (7, 3)), 9)],
)
def test_mla_multi_token_steps_run_fia_v2_over_the_split_latent_and_rope(npu, v2_calls, mode, reqs, sparse_mode):
    built = build(_mla_case(f"mla_{mode.name}", mode, reqs))
    backend = AscendBackend(npu[1])
    _close(_run(backend, built), built)
    (call,) = v2_calls[FIA2]
    assert call["sparse_mode"] == sparse_mode and call["input_layout"] == "TND" and call["num_key_value_heads"] == 1
    assert call["query_rope"].shape[-1] == 64 and call["key_rope"].shape[-1] == 64 and call["num_query_heads"] == 16
    assert "mla_split" in backend.route_of(built.batch, built.layer)


def test_mla_verify_with_a_mask_hiding_the_prefix_is_refused(npu):
    built = build(_mla_case("mla_blind", V, ((20, 3), (7, 3)), blind_row=True))
    with pytest.raises(UnsupportedError, match="hides prefix keys from a draft token"):
        _run(AscendBackend(npu[1]), built)


def test_mla_with_sinks_is_refused_not_ignored(npu):
    built = build(_mla_case("mla_sinks", D, ((9, 1), (3, 1))))
    backend = AscendBackend(npu[1])
    backend.init_forward_metadata(built.batch)
    with pytest.raises(UnsupportedError, match="no Ascend MLA op takes a sink"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch, sinks=torch.zeros(16))


@pytest.mark.parametrize("mode, reqs", [(D, DECODE_REQS), (E, EXTEND_REQS), (M, MIXED_REQS)])
def test_sinks_run_fia_v2_with_learnable_sink(npu, v2_calls, mode, reqs):
    built = build(Case(f"sinks_{mode.name}", mode, reqs, head_dim=128, page_size=128, dtype=torch.bfloat16, sinks=True))
    _close(_run(AscendBackend(npu[1]), built, sinks=built.sinks), built)
    (call,) = v2_calls[FIA2]
    assert call["learnable_sink"].dtype == torch.bfloat16 and call["input_layout"] == "TND"
    assert call["actual_seq_kvlen"] == built.batch.lens.kv


def test_sinks_where_no_op_takes_them_are_refused_with_the_reason(npu, monkeypatch):
    built = build(Case("sinks_verify", V, ((10, 4), (3, 4)), head_dim=128, page_size=128, sinks=True))
    with pytest.raises(UnsupportedError, match="TND takes no custom mask"):
        _run(AscendBackend(npu[1]), built, sinks=built.sinks)
    config = AttentionConfig(head_dim=64, page_size=16, attention_sinks=True, dtype=torch.bfloat16)
    assert not AscendBackend.unsupported_reasons(config, npu[1])  # gpt-oss's head 64: FIA v2 TND takes it
    odd = dataclasses.replace(config, head_dim=80)
    assert any("paged TND without rope takes 64 or 128" in r for r in AscendBackend.unsupported_reasons(odd, npu[1]))
    a5 = _emulated(monkeypatch, "A5")[1]
    assert not AscendBackend.unsupported_reasons(config, a5)  # FIA v2 sinks on A5, as vllm-ascend runs them
    p310 = _emulated(monkeypatch, "310P")[1]
    config = dataclasses.replace(config, head_dim=128, page_size=128, dtype=torch.float16)
    assert any("attention sinks on 310P" in r for r in AscendBackend.unsupported_reasons(config, p310))


def test_fp8_kv_cache_is_off_with_each_generations_reason(monkeypatch):
    config = AttentionConfig(head_dim=128, page_size=128, dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3")
    for gen, why in (("A2", "int8"), ("A3", "int8"), ("310P", "no fp8 dtype"), ("A5", "query_quant_mode 3")):
        reasons = AscendBackend.unsupported_reasons(config, _emulated(monkeypatch, gen)[1])
        assert any(f"fp8 KV cache on {gen}" in r and why in r for r in reasons), (gen, reasons)


@pytest.mark.parametrize("window", [-1, 8])
def test_mla_decode_graph_replays_under_the_emulations_checked_graph(npu, v2_calls, window):
    """A captured MLA decode step (the eager guard: no host sync, no fresh tensor) replays each batch exactly."""
    built = build(_mla_case(f"mla_graph_{window}", D, ((3, 1), (40, 1), (17, 1)), sliding_window_size=window))
    fb, pool = built.batch, built.batch.token_to_kv_pool
    runner = _graph_runner(npu, built)
    op = PA_MLA if window < 0 else FIA2
    for _ in range(2):
        before = len(v2_calls[op])
        _close(runner.run(fb, built.q, built.k, built.v)[0], built)
        assert len(v2_calls[op]) == before + 1
    assert torch.equal(pool.k_buffer[0][pool.page_size :], built.expected_k[pool.page_size :])


def test_sinks_decode_graph_replays_under_the_emulations_checked_graph(npu, v2_calls):
    case = Case("sinks_graph", D, ((3, 1), (200, 1), (130, 1)), head_dim=128, page_size=128, sinks=True)
    built = build(dataclasses.replace(case, sliding_window_size=6))
    fb = built.batch
    runner = _graph_runner(npu, built, sinks=[built.sinks])
    for _ in range(2):
        _close(runner.run(fb, built.q, built.k, built.v)[0], built)
    assert len(v2_calls[FIA2]) >= 2 and all(c["learnable_sink"] is not None for c in v2_calls[FIA2])


@pytest.mark.parametrize("seed", range(16))
def test_random_deepseek_mla_batches_match_the_reference(npu, seed):
    """Random MLA batches at the dims the ops take: modes, pages, windows, scattered slots, verify trees."""
    import random

    rng = random.Random(seed)
    mode = rng.choice([D, E, M, V, ForwardMode.DRAFT_EXTEND])
    page = rng.choice([16, 32, 64])
    bs = rng.randint(1, 3)
    draft = rng.randint(1, 4)
    reqs = []
    for _ in range(bs):
        prefix = rng.randint(0 if mode in (E, M) else 1, 2 * page + 3)
        new = {D: 1, V: draft}.get(mode, rng.randint(1, page + 2))
        reqs.append((prefix, new))
    window = rng.choice([-1, -1, 0, 5, page + 1]) if mode != V else -1
    case = _mla_case(
        f"mla_random_{seed}",
        mode,
        tuple(reqs),
        page_size=page,
        sliding_window_size=window,
        tp_q_head_num=rng.choice([16, 8, 6]),
        slots=rng.choice(["aligned", "scattered"]),
        scaling=rng.choice([None, 192**-0.5]),
        seed=seed,
    )
    built = build(case)
    _close(_run(AscendBackend(npu[1]), built), built)
    pool = built.batch.token_to_kv_pool
    assert torch.equal(pool.k_buffer[0][pool.page_size :], built.expected_k[pool.page_size :])


@pytest.mark.parametrize("layout", ["contiguous", "strided_rows"])
@pytest.mark.parametrize(
    "generation, case, op",
    [
        ("310P", Case("decode_page128", D, DECODE_REQS, page_size=128), "_npu_paged_attention"),
        ("310P", Case("mixed_page128", M, MIXED_REQS, page_size=128), SPLITFUSE),
        ("A2", Case("decode_window", D, ((40, 1), (3, 1)), page_size=16, sliding_window_size=8), SPLITFUSE),
        ("A2", _mla_case("mla_decode", D, ((40, 1), (3, 1), (17, 1))), PA_MLA),
        ("A2", Case("extend_page128", E, EXTEND_REQS, page_size=128, head_dim=128), FIA),
    ],
    ids=lambda p: p if isinstance(p, str) else p.name,
)
def test_forward_out_is_written_by_the_atb_op_itself(monkeypatch, generation, case, op, layout):
    """``forward(out=)``: an ATB op (``_npu_paged_attention``, its splitfuse and MLA forms) writes the caller's buffer
    in place, no copy, where it can: contiguous (their contract: the ``out`` rows); a buffer with padded rows, and
    FIA (no output argument), get the op's own output copied in by the base class. Rows right, padding untouched."""
    import hal.backend

    cap = _emulated(monkeypatch, generation)[1]
    built = build(case)
    layer, tokens = built.layer, built.q.shape[0]
    width = layer.tp_q_head_num * layer.v_head_dim
    whole = torch.full((tokens + 2, width + (8 if layout == "strided_rows" else 0)), -7.0, dtype=built.q.dtype)
    out = whole[:, :width]
    given, written_in_place = [], []
    real_op, write_output = getattr(emulation.torch_npu, op), hal.backend.write_output

    def recorded(*args, **kwargs):
        given.append(kwargs.get("out"))
        return real_op(*args, **kwargs)

    def watched(result, q, layer, rows):
        written_in_place.append(result.data_ptr() == rows.data_ptr())
        return write_output(result, q, layer, rows)

    monkeypatch.setattr(emulation.torch_npu, op, recorded)
    monkeypatch.setattr(hal.backend, "write_output", watched)
    result = _run(AscendBackend(cap), built, out=out)
    assert result.data_ptr() == out.data_ptr()
    _close(out[:tokens], built)
    assert (whole[tokens:] == -7.0).all() and (whole[:, width:] == -7.0).all()
    in_place = layout == "contiguous" and op != FIA
    assert len(given) == 1 and (given[0] is not None and given[0].data_ptr() == out.data_ptr()) == in_place
    assert written_in_place == [in_place]
