"""AttentionBackend keeps SGLang's contract: every member, its defaults, and forward's routing."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import hal
from hal.backend import AttentionBackend
from hal.batch import ForwardMode
from hal.capability import DeviceCapability
from hal.conformance.cases import CASES, build

# Every member of SGLang's base_attn_backend.AttentionBackend (shared/seed), in its order.
SGLANG_MEMBERS = [
    "prefill_attention_backend_str",
    "decode_attention_backend_str",
    "supports_ragged_verify_graph",
    "init_forward_metadata",
    "init_forward_metadata_out_graph",
    "init_forward_metadata_in_graph",
    "needs_cpu_seq_lens",
    "use_captured_forward_metadata_for_breakable_cuda_graph",
    "init_cuda_graph_state",
    "init_forward_metadata_for_breakable_cuda_graph_capture",
    "prepare_forward_metadata_for_breakable_cuda_graph_replay",
    "get_cuda_graph_seq_len_fill_value",
    "on_after_cuda_graph_warmup",
    "get_verify_buffers_to_fill_after_draft",
    "update_verify_buffers_to_fill_after_draft",
    "forward",
    "forward_decode",
    "forward_extend",
    "forward_mixed",
    "support_triton",
    "get_indexer_metadata",
]

CPU = DeviceCapability(type="cpu", available=True, dtypes=("fp32", "bf16"))
NPU = dataclasses.replace(CPU, type="npu", emulated=True, fused_mixed=True)
TOY = dataclasses.replace(CPU, type="toy", fused_mixed=True)  # a plugin accelerator with a fused mixed kernel


class Recorder(AttentionBackend):
    """Records which forward_* ran, with what arguments, and returns a marker output."""

    name = "recorder"

    def __init__(self, capability):
        super().__init__(capability)
        self.calls: list[tuple[str, bool, dict]] = []

    def plan_out_graph(self, fb, in_capture=False):
        self.plan.set_metadata(None, fb)  # the forward prologue looks this step's metadata up

    def _record(self, method, q, layer, save_kv_cache, kwargs):
        self.calls.append((method, save_kv_cache, kwargs))
        return torch.full((q.shape[0], layer.tp_q_head_num * layer.v_head_dim), float(len(method)))

    def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._record("forward_decode", q, layer, save_kv_cache, kwargs)

    def run_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._record("forward_extend", q, layer, save_kv_cache, kwargs)

    def run_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._record("forward_mixed", q, layer, save_kv_cache, kwargs)


def test_every_sglang_member_is_there_with_its_signature():
    for name in SGLANG_MEMBERS:
        assert hasattr(AttentionBackend, name), name
    params = inspect.signature(AttentionBackend.forward).parameters
    assert list(params)[:7] == ["self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"]
    assert params["save_kv_cache"].default is True
    out_graph = inspect.signature(AttentionBackend.init_forward_metadata_out_graph).parameters
    assert out_graph["in_capture"].default is False
    replay = inspect.signature(AttentionBackend.prepare_forward_metadata_for_breakable_cuda_graph_replay).parameters
    assert replay["static_forward_batch"].kind is inspect.Parameter.KEYWORD_ONLY


def test_defaults_match_sglang():
    class Unnamed(AttentionBackend):  # the base class's defaults, under the one name a backend must declare
        name = "defaults"

    backend = Unnamed(CPU)
    assert backend.prefill_attention_backend_str is None and backend.decode_attention_backend_str is None
    assert backend.supports_ragged_verify_graph is False
    assert backend.needs_cpu_seq_lens is True
    assert backend.use_captured_forward_metadata_for_breakable_cuda_graph is False
    assert backend.get_verify_buffers_to_fill_after_draft() == [None, None]
    assert backend.support_triton() is True
    assert backend.get_indexer_metadata(0, None) is None
    assert backend.on_after_cuda_graph_warmup() is None
    assert backend.init_forward_metadata_in_graph(None) is None
    for call in (
        lambda: backend.init_cuda_graph_state(8, 8),
        lambda: backend.init_forward_metadata_for_breakable_cuda_graph_capture(None),
        lambda: backend.prepare_forward_metadata_for_breakable_cuda_graph_replay(None, None),
        lambda: backend.get_cuda_graph_seq_len_fill_value(),
        lambda: backend.update_verify_buffers_to_fill_after_draft(None, None),
        lambda: backend.run_decode(None, None, None, None, None),
        lambda: backend.run_extend(None, None, None, None, None),
        lambda: backend.run_mixed(None, None, None, None, None),
    ):
        with pytest.raises(NotImplementedError):
            call()


def test_init_forward_metadata_is_out_graph_then_in_graph():
    order = []

    class Ordered(Recorder):
        def plan_out_graph(self, fb, in_capture=False):
            order.append(("out_graph", in_capture))

        def plan_in_graph(self, fb):
            order.append(("in_graph",))

    Ordered(CPU).init_forward_metadata(build(_case(ForwardMode.DECODE)).batch)
    assert order == [("out_graph", False), ("in_graph",)]


def _case(mode: ForwardMode):
    return next(c for c in CASES if c.mode == mode)


@pytest.mark.parametrize(
    "mode, capability, expected",
    [
        (ForwardMode.DECODE, CPU, "forward_decode"),
        (ForwardMode.DECODE, NPU, "forward_decode"),
        (ForwardMode.EXTEND, CPU, "forward_extend"),
        (ForwardMode.EXTEND, NPU, "forward_extend"),
        (ForwardMode.MIXED, CPU, "forward_extend"),
        (ForwardMode.MIXED, NPU, "forward_mixed"),
        (ForwardMode.TARGET_VERIFY, CPU, "forward_extend"),
        (ForwardMode.TARGET_VERIFY, NPU, "forward_extend"),
        (ForwardMode.DRAFT_EXTEND, CPU, "forward_extend"),
        (ForwardMode.DRAFT_EXTEND, NPU, "forward_extend"),
    ],
)
def test_forward_routes_as_sglang(mode, capability, expected):
    """DECODE -> forward_decode; MIXED on an NPU -> forward_mixed; every other mode -> forward_extend."""
    built = build(_case(mode))
    backend = Recorder(capability)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch, save_kv_cache=False, tag=7)
    assert [c[0] for c in backend.calls] == [expected]
    assert backend.calls[0][1:] == (False, {"tag": 7}), "save_kv_cache and kwargs are passed through"
    assert torch.equal(out, torch.full_like(out, float(len(expected))))


def test_mixed_routing_reads_the_backends_capability_flag_not_a_device_name():
    built = build(_case(ForwardMode.MIXED))
    no_fused_npu = dataclasses.replace(NPU, fused_mixed=False)
    for cap, expected in ((CPU, "forward_extend"), (NPU, "forward_mixed"), (TOY, "forward_mixed")):
        backend = Recorder(cap)
        backend.init_forward_metadata(built.batch)
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
        assert backend.calls[0][0] == expected
    backend = Recorder(no_fused_npu)
    backend.init_forward_metadata(built.batch)
    backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert backend.calls[0][0] == "forward_extend"


def test_idle_returns_an_empty_output_without_calling_a_kernel():
    backend = Recorder(CPU)
    built = build(_case(ForwardMode.DECODE))
    layer = hal.AttentionLayer(0, 4, 2, 32, v_head_dim=16)
    idle = hal.ForwardBatch(
        forward_mode=ForwardMode.IDLE,
        batch_size=0,
        req_pool_indices=torch.zeros(0, dtype=torch.int64),
        seq_lens=torch.zeros(0, dtype=torch.int32),
        out_cache_loc=torch.zeros(0, dtype=torch.int64),
        req_to_token_pool=built.batch.req_to_token_pool,
        token_to_kv_pool=built.batch.token_to_kv_pool,
    )
    q = torch.zeros(0, 4 * 32, dtype=torch.bfloat16)
    out = backend.forward(q, q, q, layer, idle)
    assert out.shape == (0, 4 * 16) and out.dtype == torch.bfloat16
    with pytest.raises(hal.InvalidBatchError, match="IDLE"):  # tokens in an IDLE step: a caller's bug, not garbage
        backend.forward(torch.zeros(3, 4 * 32), q, q, layer, idle)
    assert backend.calls == []


class Shapes(Recorder):
    """Records the shapes forward_* receive and counts the prologue's KV writes."""

    def __init__(self, capability):
        super().__init__(capability)
        self.seen, self.writes = [], 0

    def save_kv(self, layer, fb, k, v):
        self.writes += 1
        super().save_kv(layer, fb, k, v)

    def run_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.seen.append(tuple(None if t is None else tuple(t.shape) for t in (q, k, v)))
        return self.run_mixed(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)  # no second prologue


@pytest.mark.parametrize("flat", [True, False], ids=["[T, H*D]", "[T, H, D]"])
@pytest.mark.parametrize("direct", [False, True], ids=["forward", "forward_extend"])
def test_the_prologue_runs_once_and_hands_over_one_layout(flat, direct):
    built = build(_case(ForwardMode.EXTEND))
    layer, tokens = built.layer, built.q.shape[0]
    shaped = [
        t.flatten(1) if flat else t.unflatten(1, (-1, d)) if t.dim() == 2 else t
        for t, d in ((built.q, layer.head_dim), (built.k, layer.head_dim), (built.v, layer.v_head_dim))
    ]
    backend = Shapes(CPU)
    backend.init_forward_metadata(built.batch)
    call = backend.forward_extend if direct else backend.forward
    call(*shaped, layer, built.batch)
    q_heads, kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
    assert backend.seen == [
        ((tokens, q_heads, layer.head_dim), (tokens, kv_heads, layer.head_dim), (tokens, kv_heads, layer.v_head_dim))
    ]
    assert backend.writes == 1 and [c[0] for c in backend.calls] == ["forward_mixed"]


def test_the_prologue_reads_the_new_kv_back_when_the_caller_saved_it():
    built = build(_case(ForwardMode.EXTEND))
    backend = Shapes(CPU)
    backend.init_forward_metadata(built.batch)
    backend.save_kv(
        built.layer,
        built.batch,
        built.k.unflatten(1, (built.layer.tp_k_head_num, -1)) if built.k.dim() == 2 else built.k,
        built.v.unflatten(1, (built.layer.tp_v_head_num, -1)) if built.v.dim() == 2 else built.v,
    )
    backend.forward(built.q, None, None, built.layer, built.batch, save_kv_cache=False)
    assert backend.writes == 1 and backend.seen[0][1] is not None, "k/v read back from the cache, not written"


def test_metadata_never_prepared_is_refused_before_anything_is_written():
    built = build(_case(ForwardMode.DECODE))
    backend = Shapes(CPU)
    with pytest.raises(hal.InvalidBatchError, match="init_forward_metadata"):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert backend.writes == 0 and backend.calls == []
