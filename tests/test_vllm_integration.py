"""``hal.integrations.vllm``: hal's backends under vLLM's per-step objects.

The first tests need no vLLM (they run in every env): vLLM's KV cache layout read in place, the layer
descriptors, and the per-step translation driven by a stand-in of vLLM's ``CommonAttentionMetadata``
(the same fields, dtypes and conventions as vLLM 0.32's: ``vllm/v1/attention/backend.py``) over a
simulated engine (block allocator with a null block 0, chunked prefills, decodes first, prefix reuse,
padded requests), checked against dense attention computed here. The last ones need vLLM
(``tox -e vllm-engine``, or ``/work/venvs/vllm``) and check the classes vLLM reads and the opt-in
registration; ``tests/test_vllm_engine.py`` runs vLLM's real engine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import pathlib
import random
import subprocess
import sys

import pytest
import torch

import hal
from hal.errors import InvalidBatchError, KVCacheError, UnsupportedError
from hal.integrations.vllm_steps import StepTranslator, VllmKVPool, kv_views, step_mode, vllm_layer
from hal.kernels.reference import dequantize_kv, quantize_kv

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=ROOT)


# ----------------------------------------------------------------------------- the KV cache, in place


def _vllm_cache(blocks: int, heads: int, block_size: int, head_size: int, dtype=torch.float32) -> torch.Tensor:
    """A layer's cache as vLLM 0.32 allocates it for a backend declaring LBNHC: memory [blocks, block_size,
    heads, 2 * head_size], handed over as the logical [blocks, heads, block_size, 2 * head_size] view."""
    return torch.zeros(blocks, block_size, heads, 2 * head_size, dtype=dtype).permute(0, 2, 1, 3)


def test_kv_views_are_the_cache_itself():
    cache = _vllm_cache(4, 2, 16, 8)
    k, v = kv_views(cache, 8)
    assert k.shape == v.shape == (64, 2, 8)
    k[37] = 1.0  # slot 37: block 2, token 5
    v[37] = 2.0
    assert torch.equal(cache[2, :, 5, :8], torch.ones(2, 8)) and torch.equal(
        cache[2, :, 5, 8:], torch.full((2, 8), 2.0)
    )
    assert cache.sum() == 2 * 8 * 3  # nothing else written
    assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()


def test_kv_views_refuse_a_layout_that_needs_a_copy():
    head_major = torch.zeros(4, 2, 16, 16)  # vLLM's LBHNC (CPU_ATTN's): slots are not one stride apart
    with pytest.raises(KVCacheError, match="LBNHC"):
        kv_views(head_major, 8)
    with pytest.raises(KVCacheError, match="24"):
        kv_views(_vllm_cache(4, 2, 16, 8), 12)


def test_fp8_cache_stored_as_bytes_is_read_as_fp8():
    cache = _vllm_cache(2, 1, 16, 4, dtype=torch.uint8)
    k, _ = kv_views(cache, 4, dtype=torch.float8_e4m3fn)
    assert k.dtype == torch.float8_e4m3fn
    k[20] = torch.tensor(2.0).to(torch.float8_e4m3fn)
    assert cache[1, 0, 4, :4].tolist() == [torch.tensor(2.0).to(torch.float8_e4m3fn).view(torch.uint8).item()] * 4


def test_pool_write_goes_to_vllms_tensor_and_checks_block_size():
    cache = _vllm_cache(3, 2, 16, 8)
    pool = VllmKVPool(16, torch.float32, "cpu", 8)
    pool.bind(5, cache)
    layer = hal.AttentionLayer(layer_id=5, tp_q_head_num=4, tp_k_head_num=2, head_dim=8)
    pool.set_kv_buffer(layer, torch.tensor([17]), torch.ones(1, 2, 8), torch.full((1, 2, 8), 3.0))
    assert torch.equal(cache[1, :, 1, 8:], torch.full((2, 8), 3.0))
    with pytest.raises(KVCacheError, match="layer_id"):
        pool.get_key_buffer(4)
    with pytest.raises(KVCacheError, match="block size"):
        VllmKVPool(32, torch.float32, "cpu", 8).bind(0, cache)


# ----------------------------------------------------------------------------- layers and modes


def test_layer_descriptor_follows_vllms_conventions():
    layer = vllm_layer(3, 8, 2, 32, 0.125, sliding_window=4096, logits_soft_cap=50.0)
    assert (layer.sliding_window_size, layer.logit_cap, layer.scaling, layer.causal) == (4095, 50.0, 0.125, True)
    assert vllm_layer(0, 8, 2, 32, 0.1).sliding_window_size == -1
    assert not vllm_layer(0, 8, 2, 32, 0.1, causal=False).causal
    for kwargs, match in (
        ({"attn_type": "encoder_only"}, "encoder_only"),
        ({"attn_type": "encoder_decoder"}, "cross attention"),
        ({"alibi_slopes": [0.5] * 8}, "ALiBi"),
    ):
        with pytest.raises(UnsupportedError, match=match):
            vllm_layer(0, 8, 2, 32, 0.1, **kwargs)


def test_step_mode():
    assert step_mode([1, 1, 1]) is hal.ForwardMode.DECODE
    assert step_mode([1, 1, 40, 7]) is hal.ForwardMode.MIXED
    assert step_mode([40, 7]) is hal.ForwardMode.EXTEND


# ----------------------------------------------------------------------------- steps, against dense attention


@dataclasses.dataclass
class StandInMetadata:
    """vLLM 0.32's ``CommonAttentionMetadata`` fields the translation reads (same dtypes: int32 query_start_loc
    and seq_lens and block table, int64 slot mapping; padding requests have no query tokens)."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    positions: torch.Tensor | None = None
    seq_lens_cpu_upper_bound: torch.Tensor | None = None


class SimulatedEngine:
    """vLLM's side of a few steps: a block allocator (block 0 is the null block), per-request block tables, the
    step's metadata, and every token's q/k/v (so dense attention can be computed independently)."""

    def __init__(
        self, *, block_size=16, num_blocks=40, heads=4, kv_heads=2, head_dim=32, max_reqs=8, seed=0, fp8=False
    ):
        self.block_size, self.heads, self.kv_heads, self.head_dim = block_size, heads, kv_heads, head_dim
        self.cache = _vllm_cache(num_blocks, kv_heads, block_size, head_dim, torch.uint8 if fp8 else torch.float32)
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.gen = torch.Generator().manual_seed(seed)
        self.blocks: dict[int, list[int]] = {}
        self.qkv: dict[int, list[torch.Tensor]] = {}  # per request: q, k, v of every token so far
        self.max_reqs, self.max_blocks = max_reqs, 8

    def new_tokens(self, req: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(n, self.heads, self.head_dim, generator=self.gen)
        k = torch.randn(n, self.kv_heads, self.head_dim, generator=self.gen)
        v = torch.randn(n, self.kv_heads, self.head_dim, generator=self.gen)
        old = self.qkv.get(req)
        self.qkv[req] = [q, k, v] if old is None else [torch.cat([a, b]) for a, b in zip(old, (q, k, v))]
        return q, k, v

    def step(self, schedule: list[tuple[int, int]], pad_reqs: int = 0, pad_tokens: int = 0):
        """``schedule``: (request, new tokens), decodes first as vLLM orders them. Returns the metadata and the
        step's q/k/v, padded as vLLM pads (requests with no tokens, tokens with slot -1)."""
        starts, seqs, slots, qs, ks, vs, positions = [0], [], [], [], [], [], []
        for req, n in schedule:
            done = 0 if req not in self.qkv else self.qkv[req][0].shape[0]
            q, k, v = self.new_tokens(req, n)
            blocks = self.blocks.setdefault(req, [])
            while len(blocks) * self.block_size < done + n:
                blocks.append(self.free.pop())
            for p in range(done, done + n):
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
                positions.append(p)
            starts.append(starts[-1] + n)
            seqs.append(done + n)
            qs.append(q), ks.append(k), vs.append(v)
        b = len(schedule) + pad_reqs
        starts += [starts[-1]] * pad_reqs
        seqs += [0] * pad_reqs
        table = torch.zeros(self.max_reqs, self.max_blocks, dtype=torch.int32)
        for i, (req, _) in enumerate(schedule):
            table[i, : len(self.blocks[req])] = torch.tensor(self.blocks[req], dtype=torch.int32)
        q, k, v = (torch.cat(t + [t[0].new_zeros(pad_tokens, *t[0].shape[1:])]) for t in (qs, ks, vs))
        qsl = torch.tensor(starts, dtype=torch.int32)
        cm = StandInMetadata(
            query_start_loc=qsl.clone(),
            query_start_loc_cpu=qsl,
            seq_lens=torch.tensor(seqs, dtype=torch.int32),
            num_reqs=b,
            num_actual_tokens=starts[-1] + pad_tokens,
            max_query_len=max(n for _, n in schedule),
            max_seq_len=max(seqs),
            block_table_tensor=table[:b],
            slot_mapping=torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64),
            positions=torch.tensor(positions + [0] * pad_tokens, dtype=torch.int64),
            seq_lens_cpu_upper_bound=torch.tensor(seqs, dtype=torch.int32),
        )
        return cm, q, k, v

    def dense(self, schedule, layer: hal.AttentionLayer) -> torch.Tensor:
        """Each scheduled token's attention over its request's keys so far, computed densely (fp64)."""
        rows = []
        group = self.heads // self.kv_heads
        for req, n in schedule:
            q, k, v = (t.double() for t in self.qkv[req])
            if self.cache.dtype == torch.uint8:  # what an fp8 cache holds: the keys and values quantised
                k, v = (
                    dequantize_kv(quantize_kv(t, torch.float8_e4m3fn, s), s).double() for t, s in ((k, 0.5), (v, 2.0))
                )
            total = q.shape[0]
            for p in range(total - n, total):
                lo = 0 if layer.sliding_window_size < 0 else max(0, p - layer.sliding_window_size)
                keys = k[lo : p + 1].repeat_interleave(group, 1)
                scores = torch.einsum("hd,thd->ht", q[p], keys) * layer.scaling
                if layer.logit_cap > 0:
                    scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
                probs = torch.softmax(scores, -1)
                rows.append(torch.einsum("ht,thd->hd", probs, v[lo : p + 1].repeat_interleave(group, 1)))
        return torch.stack(rows).reshape(len(rows), -1).float()


# Steps as vLLM schedules them: a prefill in chunks, decodes first once requests run, a request joining
# mid-way (continuous batching), a one-token prompt, then padded steps.
STEPS = [
    [(0, 40), (1, 1)],  # EXTEND: a 1-token prompt is "decode"-shaped: MIXED
    [(0, 1), (1, 1), (2, 37)],
    [(0, 1), (1, 1), (2, 1)],
    [(1, 1), (0, 1), (3, 70)],  # decodes first, then a long prefill chunk
    [(3, 30), (4, 18)],
]


@pytest.mark.parametrize(
    "window, cap, fp8", [(None, None, False), (24, 30.0, False), (None, None, True)], ids=["full", "window+cap", "fp8"]
)  # vLLM's sliding_window counts the query's own key
def test_translated_steps_equal_dense_attention(window, cap, fp8):
    engine = SimulatedEngine(fp8=fp8)
    scales = {"k_scale": 0.5, "v_scale": 2.0} if fp8 else {}
    layer = vllm_layer(
        7, engine.heads, engine.kv_heads, engine.head_dim, 0.2, sliding_window=window, logits_soft_cap=cap, **scales
    )
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.float32
    config = hal.AttentionConfig.from_layers(
        [layer], dtype=torch.float32, page_size=engine.block_size, kv_cache_dtype=kv_dtype
    )
    backend = hal.select(config, device="cpu").create(validate="full")
    pool = VllmKVPool(engine.block_size, kv_dtype, "cpu", engine.head_dim)
    translator = StepTranslator(pool, engine.block_size, engine.max_reqs, engine.max_blocks)
    modes = []
    for i, schedule in enumerate(STEPS):
        padded = i == len(STEPS) - 1
        cm, q, k, v = engine.step(schedule, pad_reqs=2 if padded else 0, pad_tokens=3 if padded else 0)
        step = translator.translate(cm)
        modes.append(step.forward_mode.name)
        assert step.batch_size == len(schedule) and step.num_tokens == sum(n for _, n in schedule)
        pool.bind(layer.layer_id, engine.cache)
        backend.init_forward_metadata(step)
        n = step.num_tokens
        out = backend.forward(q[:n], k[:n], v[:n], layer, step)
        torch.testing.assert_close(out, engine.dense(schedule, layer), atol=2e-5, rtol=2e-5)
    assert modes == ["MIXED", "MIXED", "DECODE", "MIXED", "EXTEND"]
    # the keys went into vLLM's tensor where vLLM's slot mapping said
    k0 = engine.qkv[0][1][3]
    stored = engine.cache[engine.blocks[0][0], :, 3, : engine.head_dim]
    if fp8:
        k0 = quantize_kv(k0, kv_dtype, 0.5).view(torch.uint8)
    assert torch.equal(stored, k0)


def test_req_to_token_rows_are_the_block_tables():
    engine = SimulatedEngine(block_size=16)
    pool = VllmKVPool(16, torch.float32, "cpu", engine.head_dim)
    translator = StepTranslator(pool, 16, engine.max_reqs, engine.max_blocks)
    cm, *_ = engine.step([(0, 40), (1, 20)])
    step = translator.translate(cm)
    table = step.req_to_token_pool.req_to_token
    assert step.req_pool_indices.tolist() == [1, 2] and table[0].abs().sum() == 0  # row 0: hal's padding row
    for row, req in ((1, 0), (2, 1)):
        want = [b * 16 + i for b in engine.blocks[req] for i in range(16)]
        assert table[row, : len(want)].tolist() == want
    assert step.out_cache_loc.tolist() == cm.slot_mapping.tolist()
    assert (step.extend_prefix_lens_cpu, step.extend_seq_lens_cpu) == ([0, 0], [40, 20])


def test_host_lengths_come_from_the_host():
    """The translation reads vLLM's host copies; with no host copy of seq_lens on the CPU device it reads the CPU
    tensor itself (no device sync exists there)."""
    engine = SimulatedEngine()
    pool = VllmKVPool(engine.block_size, torch.float32, "cpu", engine.head_dim)
    translator = StepTranslator(pool, engine.block_size, engine.max_reqs, engine.max_blocks)
    cm, *_ = engine.step([(0, 5), (1, 9)])
    cm.seq_lens_cpu_upper_bound = None
    step = translator.translate(cm)
    assert step.seq_lens_cpu == [5, 9] and step.seq_lens_sum == 14
    too_many = StepTranslator(pool, engine.block_size, 1, engine.max_blocks)
    with pytest.raises(InvalidBatchError, match="max_num_seqs"):
        too_many.translate(cm)


def test_no_vllm_module_is_imported_by_the_translation():
    done = _python(
        "import sys; sys.modules['vllm'] = None\n"
        "import hal.integrations.vllm_steps\n"
        "from hal.errors import MissingDependencyError\n"
        "try:\n"
        "    import hal.integrations.vllm\n"
        "except MissingDependencyError as exc:\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "needs vLLM" in done.stdout and "docs/vllm.md" in done.stdout


# ----------------------------------------------------------------------------- with vLLM installed

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (tox -e vllm-engine)")


@needs_vllm
def test_backend_declarations():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import KVCacheLayout

    from hal.integrations.vllm import HalAttentionBackend, HalCpuAttentionBackend

    for cls in (HalAttentionBackend, HalCpuAttentionBackend):
        assert AttentionBackendEnum[cls.get_name()] is not None  # vLLM looks every layer's backend up so
        assert cls.supported_kv_cache_layouts() == (KVCacheLayout.LBNHC,)
        assert cls.supports_sink() and cls.supports_sliding_window() and not cls.is_mla()
        assert 128 in cls.get_supported_kernel_block_sizes()
    assert HalCpuAttentionBackend.get_name() == "CPU_ATTN"


@needs_vllm
def test_registration_is_opt_in():
    """Without HAL_VLLM vLLM's CPU backend stays its own; with it, CPU_ATTN resolves to hal and MLA is refused."""
    code = (
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "from hal.integrations.vllm import vllm_plugin\n"
        "vllm_plugin()\n"
        "print(E.CPU_ATTN.get_path()); print(E.CUSTOM.get_path())\n"
        "try:\n"
        "    E.CPU_MLA.get_class().get_impl_cls()\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    off = _python(code, HAL_VLLM="0")
    assert off.returncode == 0, off.stderr
    lines = off.stdout.splitlines()
    assert lines[0] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    assert lines[1] == "hal.integrations.vllm.HalAttentionBackend"
    on = _python(code, HAL_VLLM="1")
    assert on.returncode == 0, on.stderr
    lines = on.stdout.splitlines()
    assert lines[0] == "hal.integrations.vllm.HalCpuAttentionBackend"
    assert lines[2].startswith("UnsupportedError") and "MLA" in lines[2]


@needs_vllm
def test_impl_refuses_at_construction():
    from hal.integrations.vllm import HalAttentionImpl

    with pytest.raises(UnsupportedError, match="ALiBi"):
        HalAttentionImpl(8, 32, 0.1, 2, alibi_slopes=[0.1] * 8)
    with pytest.raises(UnsupportedError, match="kv_cache_dtype"):
        HalAttentionImpl(8, 32, 0.1, 2, kv_cache_dtype="int8_per_token_head")
    with pytest.raises(UnsupportedError, match="block_m"):
        HalAttentionImpl(8, 32, 0.1, 2, block_m=64)
    impl = HalAttentionImpl(8, 32, 0.1, 2, sliding_window=16, logits_soft_cap=20.0)
    assert math.isclose(impl.hal_layer(3, None).logit_cap, 20.0) and impl.hal_layer(3, None).sliding_window_size == 15
