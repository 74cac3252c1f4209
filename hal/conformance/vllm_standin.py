"""vLLM's side of attention steps without vLLM: its caches as it allocates them and its per-step metadata.

Read from vLLM 0.32 (``vllm/v1/attention/backend.py`` ``CommonAttentionMetadata``, ``vllm/v1/kv_cache_interface.py``,
``vllm/v1/attention/backends/cpu_attn.py``) and vllm-ascend 182b75e (``vllm_ascend/worker/model_runner_v1.py``
``_reshape_kv_cache_tensors`` L4254-4395, ``vllm_ascend/_310p/model_runner_310p.py`` L764-801): what
``hal.integrations.vllm``'s builder and impls are handed, so that its translation (:mod:`hal.integrations.vllm_steps`)
is driven as vLLM drives it where vLLM is not installed. Used by ``hal report --matrix``
(:mod:`hal.conformance.matrix`) and the project's tests.

* :func:`vllm_cache` / :func:`vllm_cpu_cache` / :func:`ascend_pair`: one layer's cache as vLLM (LBNHC, LBHNC) or
  vllm-ascend (a ``(k_cache, v_cache)`` pair, token-major or FRACTAL_NZ) allocates it;
* :class:`StandInMetadata`: the ``CommonAttentionMetadata`` fields hal reads;
* :class:`SimulatedEngine`: a block allocator, the steps of a schedule and every token's q/k/v;
  :data:`STEPS`, a schedule as vLLM's makes it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

import hal
from hal.integrations.vllm_steps import hal_kv_cache_dtype
from hal.kernels.reference import dequantize_kv, quantize_kv
from hal.kv_dtypes import KV_STORAGE_DTYPES
from hal.kv_layouts import AMX_PACKED, FRACTAL_NZ, HEAD_MAJOR, KV_LAYOUTS, TOKEN_MAJOR

__all__ = [
    "vllm_cache",
    "vllm_cpu_cache",
    "lbhnc_views",
    "ascend_pair",
    "StandInMetadata",
    "SimulatedEngine",
    "STEPS",
    "FP8_SCALES",
    "FP8_CACHE_DTYPE",
]

FP8_SCALES = (0.5, 2.0)  # the layers' k_scale, v_scale over an fp8 cache (SimulatedEngine.dense reads them)
FP8_CACHE_DTYPE = KV_STORAGE_DTYPES[hal_kv_cache_dtype("fp8")]  # what vLLM's --kv-cache-dtype fp8 bytes hold


def vllm_cache(blocks: int, heads: int, block_size: int, head_size: int, dtype=torch.float32) -> torch.Tensor:
    """A layer's cache as vLLM 0.32 allocates it for a backend declaring LBNHC: memory [blocks, block_size,
    heads, 2 * head_size], handed over as the logical [blocks, heads, block_size, 2 * head_size] view."""
    return torch.zeros(blocks, block_size, heads, 2 * head_size, dtype=dtype).permute(0, 2, 1, 3)


def vllm_cpu_cache(blocks: int, heads: int, block_size: int, head_size: int, dtype=torch.float32) -> torch.Tensor:
    """A layer's cache as vLLM 0.32 allocates it for CPU_ATTN's layout (LBHNC): [blocks, heads, block_size,
    2 * head_size], dense in that order."""
    return torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)


def lbhnc_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How vLLM's CPU_ATTN reads K and V out of that cache (vllm/v1/attention/backends/cpu_attn.py)."""
    blocks, heads, block_size, _ = cache.shape
    return cache.view(blocks, heads, block_size * 2, -1).chunk(2, dim=2)


def _to(cache, device: torch.device):
    """A cache (a tensor or a pair) on ``device``, its strides kept (vLLM's LBNHC view is a permuted one)."""
    if isinstance(cache, tuple):
        return tuple(_to(t, device) for t in cache)
    if cache.device == device:
        return cache
    return torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype, device=device).copy_(cache)


def ascend_pair(
    blocks: int, heads: int, block_size: int, head_size: int, kv_layout: str = TOKEN_MAJOR, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """vllm-ascend's per-layer pair: two ``get_kv_cache_shape(...)[1:]`` tensors, token-major ``[blocks, block_size,
    heads, head_size]`` (``AscendAttentionBackend``) or FRACTAL_NZ ``[blocks, heads * head_size // 16, block_size,
    16]`` (``AscendAttentionBackend310``)."""
    if kv_layout == FRACTAL_NZ:
        shape = (blocks, heads * head_size // 16, block_size, 16)
    else:
        shape = (blocks, block_size, heads, head_size)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


@dataclass
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
        self,
        *,
        block_size=16,
        num_blocks=40,
        heads=4,
        kv_heads=2,
        head_dim=32,
        max_reqs=8,
        seed=0,
        fp8=False,
        kv_layout=TOKEN_MAJOR,
        pair=False,
        cache_block_size=None,
        dtype=torch.float32,
        device="cpu",
    ):
        self.block_size, self.heads, self.kv_heads, self.head_dim = block_size, heads, kv_heads, head_dim
        self.dtype, self.fp8, self.pair, self.kv_layout = dtype, fp8, pair, kv_layout
        self.cache_block_size = cache_block_size or block_size
        storage = torch.uint8 if fp8 else dtype
        self.device = torch.device(device)  # where the caches, the step's device tensors and q/k/v live
        if pair:  # vllm-ascend's runner: a (k_cache, v_cache) pair, its blocks possibly of another size
            size = self.cache_block_size
            self.cache = ascend_pair(num_blocks * block_size // size, kv_heads, size, head_dim, kv_layout, storage)
        else:
            allocate = vllm_cpu_cache if kv_layout in (HEAD_MAJOR, AMX_PACKED) else vllm_cache
            self.cache = allocate(num_blocks, kv_heads, block_size, head_dim, storage)
        self.cache = _to(self.cache, self.device)
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.gen = torch.Generator().manual_seed(seed)
        self.blocks: dict[int, list[int]] = {}
        self.qkv: dict[int, list[torch.Tensor]] = {}  # per request: q, k, v of every token so far
        self.max_reqs, self.max_blocks = max_reqs, 8

    def new_tokens(self, req: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(n, self.heads, self.head_dim, generator=self.gen).to(self.dtype)
        k = torch.randn(n, self.kv_heads, self.head_dim, generator=self.gen).to(self.dtype)
        v = torch.randn(n, self.kv_heads, self.head_dim, generator=self.gen).to(self.dtype)
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
        for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "positions"):
            setattr(cm, name, getattr(cm, name).to(self.device))  # vLLM's device tensors; *_cpu stay on the host
        q, k, v = (t.to(self.device) for t in (q, k, v))
        return cm, q, k, v

    def dense(self, schedule, layer: hal.AttentionLayer) -> torch.Tensor:
        """Each scheduled token's attention over its request's keys so far, computed densely (fp64)."""
        rows = []
        group = self.heads // self.kv_heads
        for req, n in schedule:
            q, k, v = (t.double() for t in self.qkv[req])
            if self.fp8:  # what an fp8 cache holds: the keys and values quantised
                k, v = (
                    dequantize_kv(quantize_kv(t, FP8_CACHE_DTYPE, s), s).double() for t, s in zip((k, v), FP8_SCALES)
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

    def slots(self, req: int) -> list[int]:
        """The KV slots of request ``req``'s tokens so far, in order."""
        blocks, n = self.blocks[req], self.qkv[req][1].shape[0]
        return [blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(n)]

    def stored_kv(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V rows ``[n, kv_heads, head_dim]`` at ``slots`` of the engine's own cache, read as vLLM
        (LBNHC: K then V on the content axis; LBHNC: CPU_ATTN's views, AMX-packed within each (block, head) as its
        AMX kernel keeps them) or vllm-ascend (the pair's K and V tensors; FRACTAL_NZ by its documented element
        order) reads them, not through hal's pool."""
        slots = slots.to(self.device)
        blocks, offsets = slots // self.cache_block_size, slots % self.cache_block_size
        if self.pair and self.kv_layout == FRACTAL_NZ:
            read = KV_LAYOUTS[FRACTAL_NZ].read
            return read(self.cache[0], slots, self.kv_heads), read(self.cache[1], slots, self.kv_heads)
        if self.pair:
            return self.cache[0][blocks, offsets], self.cache[1][blocks, offsets]
        if self.kv_layout == HEAD_MAJOR:
            k, v = lbhnc_views(self.cache)
            return k[blocks, :, offsets], v[blocks, :, offsets]
        if self.kv_layout == AMX_PACKED:
            k, v = lbhnc_views(self.cache)
            layout = KV_LAYOUTS[AMX_PACKED]
            return layout.reader()(k, slots, self.kv_heads), layout.reader(value=True)(v, slots, self.kv_heads)
        rows = self.cache[blocks, :, offsets]  # [n, kv_heads, head_dim + head_dim]
        return rows[..., : self.head_dim], rows[..., self.head_dim :]


# Steps as vLLM schedules them: a prefill in chunks, decodes first once requests run, a request joining
# mid-way (continuous batching), a one-token prompt, then padded steps.
STEPS = [
    [(0, 40), (1, 1)],  # EXTEND: a 1-token prompt is "decode"-shaped: MIXED
    [(0, 1), (1, 1), (2, 37)],
    [(0, 1), (1, 1), (2, 1)],
    [(1, 1), (0, 1), (3, 70)],  # decodes first, then a long prefill chunk
    [(3, 30), (4, 18)],
]
