"""Every backend hal ships, and a plugin that reads token tables only, down every engine's entry path into the plan
step, each answer held to the float64 reference (``hal.kernels.reference``, through the conformance builder).

The paths: eager (``init_forward_metadata`` over an SGLang-style batch, token table); vLLM's eager steps
(``StepTranslator``: a block table only); hal's ``GraphRunner`` (capture at padded sizes, replay); SGLang's graph
runner as ``hal.integrations.sglang`` drives it (``init_cuda_graph_state``, ``out_graph(in_capture=True)`` outside
the capture, ``in_graph`` and the forward inside it, ``out_graph`` before each replay, a new view of the batch each
call); vLLM's full decode graphs (``GraphDecodeSteps``: a static step with a block table only, captured over a
padding batch, refilled in place and replayed); vllm-ascend's route (the same builder steps over the npu device's
backend, the route ``hal.integrations.vllm_ascend`` installs). Captures run under hal's ``EagerGraph``, whose guard
fails on a replay that reads other tensors than the capture did, as a real graph would misread them.
"""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_flashinfer_backend import _RerunGraph as RerunGraph  # replays by rerunning (FlashInfer's fake kernels)

from hal.backend import AttentionBackend
from hal.batch import ForwardMode, device_lens, static_decode_batch
from hal.conformance import Case, build, tolerance
from hal.devices.cpu import CompiledBackend, PlainTorchBackend, cpu_capability
from hal.graph import EagerGraph, GraphRunner
from hal.integrations.vllm_steps import GraphDecodeSteps, StepTranslator
from hal.registry import get_registry, probe_device

EXAMPLE_SRC = Path(__file__).resolve().parents[1] / "examples" / "hal-device-example" / "src"
DECODE = ((5, 1), (17, 1), (34, 1))  # (cached tokens, new tokens) per request: pages of 16 crossed
PAGE = 16


class TokenTableOnly(AttentionBackend):
    """A plugin written to docs/porting.md that reads ``req_to_token`` only (and declares it), with graphs."""

    name = "token_only"
    dtypes = frozenset({"fp32"})
    reads_tables = frozenset({"token"})

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        pass

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def plan_out_graph(self, fb, in_capture=False):
        width = fb.req_to_token_pool.req_to_token.shape[1]  # fixed: a graph replays every step at this width
        self.plan.set_metadata(SimpleNamespace(width=width), fb)

    def plan_in_graph(self, fb):
        meta = self.plan.metadata_for(fb)
        _, kv_lens = device_lens(fb)
        keys = torch.arange(meta.width, device=kv_lens.device)
        meta.valid = keys[None, :] < kv_lens[:, None]
        meta.slots = torch.where(meta.valid, fb.req_to_token_pool.req_to_token[fb.req_pool_indices.long()], 0).long()

    def run_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        meta = self.forward_metadata
        pool = fb.token_to_kv_pool
        group = layer.tp_q_head_num // layer.tp_k_head_num
        keys = pool.get_key_buffer(layer.layer_id)[meta.slots].float().repeat_interleave(group, 2)
        values = pool.get_value_buffer(layer.layer_id)[meta.slots].float().repeat_interleave(group, 2)
        scores = torch.einsum("bhd,bwhd->bhw", q.float(), keys) * layer.scaling
        probs = torch.softmax(scores.masked_fill(~meta.valid[:, None, :], float("-inf")), -1)
        return torch.einsum("bhw,bwhd->bhd", probs, values)

    run_extend = run_decode


def _triton():
    from hal.devices.triton_backend import TritonBackend

    cap = cpu_capability()
    if not cap.triton_target:
        pytest.skip("the triton backend runs here under TRITON_INTERPRET=1 only (tox's triton env sets it)")
    return TritonBackend(cap), EagerGraph, torch.float32


def _flashinfer(monkeypatch):
    from test_flashinfer_backend import FLASHINFER_RANGES, _FakeFlashInfer, cuda_cap

    import hal.devices.cuda.flashinfer_backend as fib

    module = _FakeFlashInfer(version=next(iter(FLASHINFER_RANGES.values()))).module
    monkeypatch.setattr(module, "__spec__", importlib.machinery.ModuleSpec("flashinfer", None), raising=False)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return fib.FlashInferBackend(cuda_cap(torch_type="cpu"), workspace_mb=1), RerunGraph, torch.bfloat16


def _ascend(monkeypatch):
    from hal.devices.npu.ascend_backend import AscendBackend

    monkeypatch.delenv("HAL_PLUGINS", raising=False)
    monkeypatch.setenv("HAL_NPU_EMULATION", "1")
    cap = probe_device(get_registry(reload=True).get("npu"))
    if not cap.emulated:
        pytest.skip("a real NPU is visible: the emulation is not used")
    return AscendBackend(cap), EagerGraph, torch.float16


def _example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    from hal_toy.backend import ToyBackend

    return ToyBackend(cpu_capability()), EagerGraph, torch.float32


BACKENDS = {
    "cpu_torch": lambda mp: (PlainTorchBackend(cpu_capability()), EagerGraph, torch.float32),
    "cpu_compiled": lambda mp: (CompiledBackend(cpu_capability()), EagerGraph, torch.float32),
    "triton": lambda mp: _triton(),
    "flashinfer": _flashinfer,
    "ascend": _ascend,
    "example_plugin": _example,
    "token_only_plugin": lambda mp: (TokenTableOnly(cpu_capability()), EagerGraph, torch.float32),
}


@pytest.fixture(params=sorted(BACKENDS))
def served(request, monkeypatch, restore_registry):
    backend, graph, dtype = BACKENDS[request.param](monkeypatch)
    built = build(Case("entry_paths", ForwardMode.DECODE, DECODE, page_size=PAGE, dtype=dtype))
    return backend, graph, built


def _check(out: torch.Tensor, built) -> None:
    rows = built.expected.shape[0]
    got = out[:rows].reshape(rows, -1).float()
    torch.testing.assert_close(got, built.expected.float(), **tolerance(built.case.dtype))


def _max_blocks(fb) -> int:
    return -(-fb.req_to_token_pool.req_to_token.shape[1] // PAGE)


def _block_table(fb) -> torch.Tensor:
    """The step's block table (vLLM's form: row b = request b), from its page-aligned token table."""
    table = fb.req_to_token_pool.req_to_token[fb.req_pool_indices.long()]
    return (table[:, ::PAGE] // PAGE).to(torch.int32).contiguous()


def _vllm_metadata(fb, pad_to: int | None = None, blank: bool = False):
    """vLLM's ``CommonAttentionMetadata`` of the decode batch ``fb``, padded to ``pad_to`` requests as vLLM pads a
    full graph's batch; ``blank``: every request a padding one (vLLM's capture batch)."""
    bs = fb.batch_size
    n = pad_to or bs
    table = torch.zeros(n, _max_blocks(fb), dtype=torch.int32)
    seq = torch.ones(n, dtype=torch.int32)
    slots = torch.zeros(n, dtype=torch.int64)
    if not blank:
        table[:bs] = _block_table(fb)
        seq[:bs] = fb.seq_lens.to(torch.int32)
        slots[:bs] = fb.out_cache_loc
    qsl = torch.arange(n + 1, dtype=torch.int32)
    return SimpleNamespace(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq,
        seq_lens_cpu_upper_bound=seq.clone(),
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=int(seq.max()),
        block_table_tensor=table,
        slot_mapping=slots,
        causal=True,
        positions=(seq - 1).long(),
    )


def test_eager(served):
    backend, _, built = served
    backend.init_forward_metadata(built.batch)
    _check(backend.forward(built.q, built.k, built.v, built.layer, built.batch), built)


def test_vllm_eager_steps_carry_a_block_table_only(served):
    backend, _, built = served
    fb = built.batch
    translator = StepTranslator(fb.token_to_kv_pool, PAGE, 8, _max_blocks(fb))
    step = translator.translate(_vllm_metadata(fb))
    assert step.req_to_token_pool is None
    backend.init_forward_metadata(step)
    _check(backend.forward(built.q, built.k, built.v, built.layer, step), built)


def test_hal_graph_runner(served):
    backend, graph, built = served
    fb = built.batch
    runner = GraphRunner(
        backend, [built.layer], fb.req_to_token_pool, fb.token_to_kv_pool, graph, (2, 4), built.case.dtype
    )
    runner.capture()
    _check(runner.run(fb, built.q, built.k, built.v)[0], built)


class _SGLangView:
    """What ``hal.integrations.sglang.SGLangBatch`` hands hal for a graph step: a new view of the runner's batch at
    every call, ``graph_static`` set, every other field read through."""

    __slots__ = ("batch", "graph_static", "req_to_page_pool", "req_pool_indices", "req_to_token_pool")

    def __init__(self, batch):
        self.batch, self.graph_static = batch, True
        self.req_to_token_pool = batch.req_to_token_pool

    def __getattr__(self, name):
        return getattr(self.batch, name)


def test_sglang_graph_runner_sequence(served):
    backend, graph_class, built = served
    fb, layer, size = built.batch, built.layer, 4
    backend.init_cuda_graph_state(size, size)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    static = static_decode_batch(size, fb.req_to_token_pool, fb.token_to_kv_pool, fill)
    q, k, v = (torch.zeros(size, *t.shape[1:], dtype=t.dtype) for t in (built.q, built.k, built.v))
    out = torch.zeros(size, built.expected.shape[1], dtype=built.q.dtype)
    graph = graph_class()

    def step():
        view = _SGLangView(static)
        backend.init_forward_metadata_in_graph(view)
        return backend.forward(q, k, v, layer, view, out=out)

    with graph.outside(static):
        backend.init_forward_metadata_out_graph(_SGLangView(static), in_capture=True)
    graph.warmup(step)  # SGLang's warm-up runs before its capture
    backend.on_after_cuda_graph_warmup()
    with graph.outside(static):
        backend.init_forward_metadata_out_graph(_SGLangView(static), in_capture=True)
    graph.capture(step)
    bs = fb.batch_size
    static.req_pool_indices.zero_()[:bs].copy_(fb.req_pool_indices)
    static.seq_lens.fill_(fill)[:bs].copy_(fb.seq_lens)
    static.out_cache_loc.fill_(0)[:bs].copy_(fb.out_cache_loc)
    static.set_decode_host_lens(list(fb.seq_lens.tolist()) + [fill] * (size - bs))
    for static_t, t in ((q, built.q), (k, built.k), (v, built.v)):
        static_t[:bs].copy_(t)
    with graph.outside(static):
        backend.init_forward_metadata_out_graph(_SGLangView(static))
    graph.replay()
    _check(out, built)


def _vllm_graph(backend, graph_class, built, pool=None):
    """vLLM's full decode graph of ``built``'s batch: captured over a padding batch, replayed for the batch."""
    fb, size = built.batch, 4
    pool = pool or fb.token_to_kv_pool
    max_blocks = _max_blocks(fb)
    backend.init_cuda_graph_state(size, size)
    steps = GraphDecodeSteps(pool, PAGE, size, max_blocks, backend.get_cuda_graph_seq_len_fill_value())
    translator = StepTranslator(pool, PAGE, size, max_blocks)
    q, k, v = (torch.zeros(size, *t.shape[1:], dtype=t.dtype) for t in (built.q, built.k, built.v))
    out = torch.zeros(size, built.expected.shape[1], dtype=built.q.dtype)
    graph = graph_class()

    def prepare(cm, capture=False):
        static = steps.fill(cm, translator.translate(cm))
        assert static.req_to_token_pool is None or static.req_to_token_pool.graph
        with graph.outside(static):
            backend.init_forward_metadata_out_graph(static, in_capture=capture)
        return static

    static = prepare(_vllm_metadata(fb, size, blank=True), capture=True)

    def step():
        backend.init_forward_metadata_in_graph(static)
        return backend.forward(q, k, v, built.layer, static, out=out)

    graph.warmup(step)  # vLLM's warm-up runs of the size before its capture
    prepare(_vllm_metadata(fb, size, blank=True), capture=True)
    graph.capture(step)
    assert prepare(_vllm_metadata(fb, size)) is static  # the captured step, refilled in place
    for static_t, t in ((q, built.q), (k, built.k), (v, built.v)):
        static_t[: fb.batch_size].copy_(t)
    graph.replay()
    return out


def test_vllm_full_decode_graphs(served):
    backend, graph, built = served
    _check(_vllm_graph(backend, graph, built), built)


def test_vllm_ascend_route(monkeypatch, restore_registry):
    """vllm-ascend's route (``hal.integrations.vllm_ascend``: hal's builder steps for the dense layers it serves) over
    the npu device's backend and its preferred KV layout: eager steps and full decode graphs."""
    backend, graph, _ = _ascend(monkeypatch)
    built = build(Case("entry_paths_ascend", ForwardMode.DECODE, DECODE, page_size=PAGE, dtype=torch.float16))
    fb = built.batch
    translator = StepTranslator(fb.token_to_kv_pool, PAGE, 8, _max_blocks(fb))
    step = translator.translate(_vllm_metadata(fb))
    backend.init_forward_metadata(step)
    _check(backend.forward(built.q, built.k, built.v, built.layer, step), built)
    graph_built = build(Case("entry_paths_ascend", ForwardMode.DECODE, DECODE, page_size=PAGE, dtype=torch.float16))
    _check(_vllm_graph(type(backend)(backend.capability), graph, graph_built), graph_built)


@pytest.mark.parametrize("validate", ["cheap", "full"])
def test_a_derived_graph_table_is_one_buffer_refilled_in_place(validate):
    """The token table a token-reading backend gets from a full graph's block table: made at capture, the same tensor
    (address) at every later step of any captured size, its rows the step's. ``full`` validation checks each step on
    the block table the engine gave, not on the buffer still holding the previous step's rows."""
    backend = TokenTableOnly(cpu_capability(), validate=validate)
    built = build(Case("entry_paths_buffer", ForwardMode.DECODE, DECODE, page_size=PAGE))
    fb = built.batch
    max_blocks = _max_blocks(fb)
    steps = GraphDecodeSteps(fb.token_to_kv_pool, PAGE, 4, max_blocks, 1)
    translator = StepTranslator(fb.token_to_kv_pool, PAGE, 4, max_blocks)
    seen = []
    for size, blank, capture in ((4, True, True), (3, True, True), (4, False, False), (3, False, False)):
        cm = _vllm_metadata(fb, size, blank)
        static = steps.fill(cm, translator.translate(cm))
        backend.init_forward_metadata_out_graph(static, in_capture=capture)
        seen.append(static.req_to_token_pool.req_to_token)
    assert len({t.data_ptr() for t in seen}) == 1
    want = fb.req_to_token_pool.req_to_token[fb.req_pool_indices.long()]
    for row, kv_len in enumerate(fb.seq_lens.tolist()):  # the step's requests, row by row
        assert torch.equal(seen[-1][row, :kv_len], want[row, :kv_len])
