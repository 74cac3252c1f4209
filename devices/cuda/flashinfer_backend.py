"""``flashinfer``: the CUDA attention backend over FlashInfer's paged and ragged wrappers.

What runs, per forward mode (``P``: cached prefix, ``E``: query tokens of a request):

* DECODE: ``BatchDecodeWithPagedKVCacheWrapper`` over the pool's paged view
  (``get_paged_kv_buffer``), ``window_left`` = the layer's sliding window,
  ``logits_soft_cap`` = its logit cap. Under graph capture, one wrapper per captured
  batch size is built with ``use_cuda_graph=True`` on fixed indptr / indices /
  last-page-length buffers, and ``out_graph`` re-plans it into them before each replay.
* EXTEND / MIXED / DRAFT_EXTEND, layers without a sliding window (``extend_strategy``
  "auto", the default): the new tokens through ``BatchPrefillWithRaggedKVCacheWrapper``
  (causal per the layer), the cached prefix through ``BatchPrefillWithPagedKVCacheWrapper``
  with ``causal=False``, both with ``return_lse=True``, joined by ``merge_state_in_place`` (into
  the ragged call's output). A
  request without a prefix has zero pages in the prefix call: FlashInfer's paged KV
  ``get_length`` is 0 when a request has no pages, the scheduler still gives it one
  work tile, and that tile writes output 0 and LSE -inf, which the merge weighs
  as nothing (read in FlashInfer 0.2.5 and 0.7.4: ``page.cuh``, ``scheduler.cuh``,
  ``prefill.cuh``, ``cascade.cuh``; SGLang runs the same pattern). When no request of
  the batch has a prefix, the ragged call alone runs.
* EXTEND / MIXED / DRAFT_EXTEND, sliding-window layers (and every layer under
  ``extend_strategy="paged"``): one paged prefill over prefix + new tokens (the KV is
  written first), causal per the layer, ``window_left`` = the window. FlashInfer's window
  test is ``kv_idx + qo_len + window_left >= kv_len + qo_idx`` (``variants.cuh``): the
  query's position is taken bottom-right aligned with the KV it is given, so a
  prefix-only call would place query ``i`` at ``P - E + i`` instead of ``P + i`` and let
  ``E`` keys too many into the window. Over prefix + new it is exact (causal or not).
* TARGET_VERIFY: one paged prefill over committed + draft tokens with
  ``custom_mask`` = ``spec_info.custom_mask`` (FlashInfer's flat layout is hal's: per
  request row-major ``[draft, seq_len + draft]``), ``window_left`` = the window on top.
  Under graph capture, one ``use_cuda_graph=True`` paged-prefill wrapper per captured batch
  size over fixed ``qo_indptr`` / page-table / ``custom_mask_buf`` / ``mask_indptr_buf``
  buffers, re-planned by ``out_graph`` before each replay (SGLang's verify graphs do the same).

FlashInfer fixes the kernel (sliding window on/off, soft cap on/off), the softmax
scale and the schedule at ``plan`` time, so a plan belongs to one *layer variant*
(heads, head_dim, scale, logit cap, window, causality). ``out_graph`` plans every variant
it knows: those given to the constructor (``layers=``) or :meth:`register_layers`, and
those met by earlier forwards. A forward meeting a new variant outside a graph capture
plans it on the spot (host work inside ``forward``, once per variant); inside a capture
that is an error, which the graph runner's eager warm-up pass prevents.

Metadata: ``init_forward_metadata_out_graph`` does all host work (indptrs and last page
lengths from ``*_cpu`` lens, page ids gathered on the device from the batch's block table, or from
``req_to_token`` where it has none, with host-built positions, no device-to-host sync) and every ``plan``;
``init_forward_metadata_in_graph`` has nothing to do: the replayed kernels read the
wrappers' fixed buffers, which ``plan`` refills.

Model features (MLA, attention sinks, fp8 KV caches):

* MLA (latent 512 + rope 64, DeepSeek-V2/V3, absorbed queries): every mode but
  TARGET_VERIFY through ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (flashinfer>=0.2.1):
  ``plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
  head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type)`` over the page
  table of prefix + new keys (causal is bottom-right aligned, as hal's positions),
  ``run(q_nope, q_pe, ckv_cache, kpe_cache)`` with the caches as strided views of the pool's
  one latent buffer (SGLang's flashinfer MLA backend passes the same views). Where the wrapper
  takes 0.7's form (:func:`mla_structural`) the same values go by keyword:
  ``plan(metadata=MLAPlanMetadata.csr(...), query_layout="split", kv_cache_layout="split", ...)``,
  ``run(query=(q_nope, q_pe), kv_cache=(ckv, kpe))``. 0.7.4's FA2 MLA path raises ``ValueError`` unless every
  query, cache and output tensor is 3-D with 16-byte aligned data pointers and outer strides
  (``_backends/_fa_common.py``): hal's views of a 576-wide bf16/fp16 row are (1152-byte rows, 1024-byte
  offset). Decode graphs use ``use_cuda_graph=True`` wrappers on fixed buffers. The wrapper has no custom mask, no
  sliding window and no soft cap, and fp8 MLA only on SM90 for e4m3 at flashinfer>=0.6
  (``ckv_scale`` / ``kpe_scale``): those MLA configs are declared off with that reason, as
  is any other latent shape (its kernels are built and checked for 512 + 64).
* fp8 KV cache (e4m3fn, e5m2; flashinfer>=0.2.0 on sm_75+): ``kv_data_type`` = the pool's
  fp8 dtype at ``plan``, ``run(..., k_scale=, v_scale=)`` (FlashInfer folds ``k_scale`` into
  the softmax scale and multiplies the output by ``v_scale``: the read ``stored * scale``).
  Extend modes then take one paged call over prefix + new tokens, so the new tokens are read
  as stored (quantised), never from ``k``/``v``.
* Attention sinks: not served. FlashInfer's FA2 wrappers (the ones planned here) take no
  sink; ``run(sinks=)`` (flashinfer>=0.2.10) is read only by the trtllm-gen backend
  (Blackwell), and FA2 needs a JIT-compiled custom variant (``AttentionWithSink``).

Assumes page-aligned ``req_to_token`` rows (token ``i`` of a request at offset
``i % page_size`` of its page), as SGLang's paged allocator guarantees and FlashInfer
needs. Not supported: fp32 (FlashInfer compiles fp16/bf16, fp8 KV), ``v_head_dim !=
head_dim`` other than MLA's 512 + 64, head dims outside 64/128/256, graph capture of EXTEND /
MIXED batches. Signatures followed: flashinfer-python 0.2.5 and 0.7.4 (the keyword subset
used here is common to both).

Output: each wrapper's ``run(out=)`` writes the caller's ``forward(out=)`` buffer itself where FlashInfer can
(:func:`output_kwargs`: flashinfer>=0.2.2, the query's dtype, a contiguous buffer but for MLA, which takes strided
rows), so the layer's output needs no copy; elsewhere the base class copies FlashInfer's result into the buffer.

The environment probe (is FlashInfer installed, where would its kernels come from) is
:mod:`hal.devices.cuda.flashinfer_env`; the host-side page tables and the merge rule are
:mod:`hal.devices.cuda.flashinfer_layout`. Both names stay importable from here.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from hal.backend import AttentionBackend
from hal.batch import ForwardBatch, ForwardMode, host_lens
from hal.capability import DeviceCapability, library_version
from hal.errors import ConfigError, GraphCaptureError, UnsupportedError, expect
from hal.kernels.reference import KVIndices, kv_csr
from hal.kv_cache import paged_view
from hal.kv_dtypes import kv_scaled
from hal.validation import check_request_tables

from .flashinfer_env import MIN_SM, _flashinfer_missing, _sm, flashinfer_kernels, import_flashinfer
from .flashinfer_layout import PagedKV, build_paged_kv, indptr_from_lens, merge_states_base2, paged_kv_layout

__all__ = [
    "FlashInferBackend",
    "LayerVariant",
    "PagedKV",
    "WORKSPACE_ENV",
    "build_paged_kv",
    "flashinfer_kernels",
    "import_flashinfer",
    "indptr_from_lens",
    "merge_states_base2",
    "paged_kv_layout",
]

MIN_SM_BF16 = 80  # bf16 tensor cores
HEAD_DIMS = frozenset({64, 128, 256})  # FlashInfer's DISPATCH_HEAD_DIM set (utils.cuh); vLLM declares the same
# The float workspace of every wrapper, sized as vLLM 0.32 sizes FlashInfer's: max(394 MiB, max_num_batched_tokens x
# q_heads x head_dim x 16 bytes) (vllm/envs.py VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE = 394 MiB; vllm/v1/attention/
# backends/flashinfer.py, vllm-project/vllm#48428 "size FlashInfer prefill workspace to batch head footprint": the
# fixed size overflows for wide-head models at an 8192-token chunk on sm_120, where FlashInfer hard-errors on
# batch_prefill_tmp_v instead of growing). hal takes the token count from the engine (the max_num_tokens option, or
# init_cuda_graph_state's) and the heads from the model; SGLang's fixed 384 MB is below that floor.
WORKSPACE_MB = 394
_WORKSPACE_BYTES_PER_TOKEN_HEAD_DIM = 16
WORKSPACE_ENV = "HAL_FLASHINFER_WORKSPACE_MB"
_MERGE_STATE_MAX_THREADS = 1024  # the merge kernels' CUDA block is (head_dim / vec_size) x num_heads threads
MLA_SHAPE = (512, 64)  # (kv_lora_rank, qk_rope_head_dim): the latent shape FlashInfer's MLA kernels serve
SINKS_REASON = (
    "FlashInfer's FA2 wrappers take no sink logits (run(sinks=), flashinfer>=0.2.10, is read by the "
    "trtllm-gen backend only; FA2 needs a JIT AttentionWithSink variant)"
)


# ----------------------------------------------------------------------------- MLA


MLA_BACKEND = "fa2"  # the MLA wrapper's kernel (see _wrapper)
# flashinfer-python releases hal's calls are written for: mask_indptr_buf (qk_indptr_buf in 0.2.0) and flashinfer.mla
# arrived in 0.2.1 (flashinfer/prefill.py, flashinfer/mla.py at tag v0.2.1); pyproject's cuda extra pins the same.
MIN_FLASHINFER = "0.2.1"
# The newest release whose source hal's calls were read against (the 0.7.4 wheel from the registry); the pin's upper
# bound (pyproject's cuda extra: <0.7.5). A newer install is noted, not refused: the calls are read from signatures.
MAX_CHECKED_FLASHINFER = "0.7.4"


def _older_than(version: str | None, minimum: str) -> str | None:
    """``version`` when it is a release below ``minimum`` (numeric parts compared), else None."""
    if not version:
        return None
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3]]
    return version if parts < [int(p) for p in minimum.split(".")] else None


@functools.cache  # asked on every run() call: the signature is read once per class
def _newer_than(version: str | None, newest: str) -> str | None:
    """``version`` when it is a release above ``newest`` (numeric parts compared), else None."""
    if not version:
        return None
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3]]
    return version if parts > [int(p) for p in newest.split(".")] else None


def _takes(cls, name: str, method: str = "__init__") -> bool:
    """Whether ``cls.<method>`` has a parameter ``name`` (the installed FlashInfer's signature, not its version)."""
    try:
        return name in inspect.signature(getattr(cls, method)).parameters
    except (TypeError, ValueError):  # a C extension type without a signature
        return False


def mla_structural(wrapper) -> bool:
    """Whether the MLA ``wrapper`` takes flashinfer 0.7's call form: ``plan(metadata=MLAPlanMetadata.csr(...), ...)``
    and ``run(query=(q_nope, q_pe), kv_cache=(ckv, kpe))`` by keyword (flashinfer/mla/_batch_mla/_wrapper.py in the
    0.7.0 and 0.7.4 wheels, where positional arguments, flat plan metadata and the q_nope/ckv_cache tensors each warn
    DeprecationWarning). Read from the signature, so a release that keeps the form is served without a version list."""
    return _takes(type(wrapper), "metadata", "plan") and _takes(type(wrapper), "query", "run")


def output_kwargs(wrapper, out: torch.Tensor | None, q_in: torch.Tensor, strided_rows: bool = False) -> dict:
    """``{"out": out}`` where ``wrapper.run`` can write the caller's ``[T, Hq, Dv]`` buffer itself, else ``{}``
    (FlashInfer allocates its output and the base class copies it into ``out``).

    ``run(out=)`` (flashinfer>=0.2.2; 0.2.1 has none) checks the buffer's shape, dtype (the planned output dtype: the
    query's) and device only (``check_shape_dtype_device``, flashinfer/decode.py, prefill.py, mla.py). Its decode and
    prefill kernels write ``o`` densely from its data pointer (csrc/batch_decode.cu, batch_prefill.cu:
    ``params.o = o.data_ptr()``, no output strides): they take only a contiguous buffer, a view with padded rows
    would be written wrong without an error. The MLA kernel writes through ``o.stride(0)`` / ``o.stride(1)``
    (csrc/batch_mla_run.cu): ``strided_rows``."""
    if out is None or out.dtype != q_in.dtype or not (strided_rows or out.is_contiguous()):
        return {}
    return {"out": out} if _takes(type(wrapper), "out", "run") else {}


def host_scales(layer) -> tuple[float, float]:
    """``(k_scale, v_scale)`` as host floats for ``wrapper.run``, read without a device sync: SGLang's
    ``k_scale_float`` / ``v_scale_float`` when the layer has them, a float or a CPU tensor otherwise. A device-tensor
    scale is refused (``float()`` on it would sync the stream and break CUDA-graph capture): give the layer its
    ``k_scale_float`` as SGLang's RadixAttention and vLLM's Attention (``_k_scale_float``) do."""

    def one(kind: str) -> float:
        for name in (f"{kind}_scale_float", f"_{kind}_scale_float", f"{kind}_scale"):
            value = getattr(layer, name, None)
            if value is None:
                continue
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                raise UnsupportedError(
                    f"flashinfer: layer {getattr(layer, 'layer_id', '?')} {name} is a {value.device} tensor: reading "
                    f"it as a float syncs the stream (and breaks graph capture); give the layer {kind}_scale_float"
                )
            return float(value)
        return 1.0

    return one("k"), one("v")


def mla_rank(layer) -> int:
    """The latent width of an MLA layer (its ``kv_lora_rank``; a layer without the field but with
    ``v_head_dim != head_dim`` is taken as MLA with the value the latent, as SGLang's); 0: not MLA."""
    rank = getattr(layer, "kv_lora_rank", 0) or 0
    return rank or (layer.v_head_dim if layer.v_head_dim != layer.head_dim else 0)


def mla_reasons(
    rank: int, head_dim: int, kv_heads: int, *, window: int, logit_cap: float, custom_mask: bool, fp8: bool
) -> list[str]:
    """Why ``BatchMLAPagedAttentionWrapper`` cannot serve this MLA layer (empty: it can)."""
    reasons = []
    if (rank, head_dim - rank) != MLA_SHAPE or kv_heads != 1:
        reasons.append(
            f"MLA latent {rank} + rope {head_dim - rank} (v_head_dim {rank}, head_dim {head_dim}) over {kv_heads} "
            "KV heads not supported: FlashInfer's MLA "
            f"kernels serve kv_lora_rank {MLA_SHAPE[0]} + qk_rope_head_dim {MLA_SHAPE[1]} over one latent head "
            "(DeepSeek-V2/V3)"
        )
    for wanted, what in (
        (window >= 0, "a sliding window"),
        (logit_cap > 0, "a logit cap"),
        (custom_mask, "a custom mask (TARGET_VERIFY)"),
    ):
        if wanted:
            reasons.append(f"MLA with {what} not supported: flashinfer.mla.BatchMLAPagedAttentionWrapper has none")
    if fp8:
        reasons.append(
            "MLA over an fp8 KV cache not supported: FlashInfer's MLA wrapper reads fp8 only at flashinfer>=0.6 "
            "on SM90, e4m3 with bf16 queries (run(ckv_scale=, kpe_scale=)), which hal does not plan"
        )
    return reasons


# ----------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class LayerVariant:
    """What a FlashInfer plan depends on in a layer."""

    q_heads: int
    kv_heads: int
    head_dim: int
    scale: float
    logit_cap: float
    window: int  # -1: none
    causal: bool
    kv_lora_rank: int = 0  # MLA's latent width (the value); 0: not MLA

    @classmethod
    def of(cls, layer) -> LayerVariant:
        return cls(
            q_heads=layer.tp_q_head_num,
            kv_heads=layer.tp_k_head_num,
            head_dim=layer.head_dim,
            scale=float(layer.scaling),
            logit_cap=float(layer.logit_cap),
            window=int(layer.sliding_window_size),
            causal=bool(layer.causal),
            kv_lora_rank=mla_rank(layer),
        )

    @property
    def rope_dim(self) -> int:
        return self.head_dim - self.kv_lora_rank

    @property
    def use_tensor_cores(self) -> bool:
        """Decode on tensor cores (the prefill kernel) from a GQA group of 4 up, as SGLang does for fp16/bf16.

        The CUDA-core decode kernel is compiled for groups 1, 2, 3, 4, 8 only (0.2.5; 0.7.4 adds
        6 and 16); the tensor-core path takes any group, so every group size is served.
        """
        return self.q_heads // self.kv_heads >= 4


@dataclass
class FlashInferMetadata:
    """One step's host-side plan inputs, and the wrappers planned for it (``(kind, variant)`` keys).

    ``kind``: ``decode``; ``ragged`` (new tokens) + ``prefix`` (cached prefix, paged);
    ``paged`` (prefix + new, paged); ``verify`` (paged with the custom mask).
    """

    mode: ForwardMode
    batch_size: int
    num_tokens: int
    dtype: torch.dtype  # the KV cache's
    page_size: int
    graph_static: bool
    qo_indptr: torch.Tensor  # int32 host [B + 1]
    kv_lens: list[int]
    prefix_lens: list[int]
    req_to_token: torch.Tensor | None  # the batch's request table: req_to_token, or (None) req_to_page
    req_pool_indices: torch.Tensor
    custom_mask: torch.Tensor | None = None
    req_to_page: torch.Tensor | None = None
    q_dtype: torch.dtype | None = None  # the queries' (None: the cache's)
    wrappers: dict[tuple[str, LayerVariant], Any] = field(default_factory=dict)
    _kv: PagedKV | None = None
    _prefix: PagedKV | None = None

    @property
    def has_prefix(self) -> bool:
        return any(self.prefix_lens)

    @property
    def fp8(self) -> bool:
        return kv_scaled(self.dtype)

    # SGLang's names (its attention kit and tools inspect them), over keys rather than pages, built when read.
    @property
    def kv_indptr(self) -> torch.Tensor:
        """int32 ``[B + 1]`` on the request table's device: 0, then the running sum of ``kv_lens``."""
        return self._csr(self.kv_lens, per_page=False).indptr.to(self.req_pool_indices.device)

    @property
    def kv_indices(self) -> torch.Tensor:
        """int32: the KV slot of every key, request after request (CSR over ``kv_indptr``)."""
        return self._csr(self.kv_lens, per_page=False).indices

    def _csr(self, lens: list[int], per_page: bool) -> KVIndices:
        return kv_csr(
            lens,
            self.req_pool_indices,
            req_to_token=self.req_to_token,
            req_to_page=None if self.req_to_token is not None else self.req_to_page,
            page_size=self.page_size,
            per_page=per_page,
        )

    def kv(self) -> PagedKV:
        """Page table over every key a query sees (prefix + query tokens)."""
        if self._kv is None:
            self._kv = PagedKV(*self._csr(self.kv_lens, per_page=True))
        return self._kv

    def prefix(self) -> PagedKV:
        """Page table over the cached prefixes only (extend modes)."""
        if self._prefix is None:
            self._prefix = PagedKV(*self._csr(self.prefix_lens, per_page=True))
        return self._prefix


@dataclass
class _GraphState:
    """Fixed buffers shared by every captured wrapper (all batch sizes, all variants).

    Decode wrappers take ``indptr`` / ``indices`` / ``last_page_len``; TARGET_VERIFY (paged prefill)
    wrappers those and ``qo_indptr``, ``custom_mask`` (FlashInfer's packed bits, sized as SGLang's
    ``max_num_tokens * max_context_len`` bytes) and ``mask_indptr``.
    """

    max_bs: int
    max_tokens: int
    indptr: torch.Tensor  # int32 [max_bs + 1]
    last_page_len: torch.Tensor  # int32 [max_bs]
    kv_lens: torch.Tensor  # int32 [max_bs], MLA decode's kv_len_arr
    qo_indptr: torch.Tensor  # int32 [max_bs + 1]
    mask_indptr: torch.Tensor  # int32 [max_bs + 1]
    indices: torch.Tensor | None = None  # int32 [max_bs * pages per req_to_token row], sized lazily
    custom_mask: torch.Tensor | None = None  # uint8 [max_tokens * max_context_len], sized lazily
    pages_per_row: int = 0


def workspace_mb_option(workspace_mb: int | None) -> int | None:
    """The float workspace in MB asked for: ``workspace_mb``, else ``HAL_FLASHINFER_WORKSPACE_MB``, else None (sized
    as vLLM sizes it: :func:`workspace_bytes_for`)."""
    source, value = "workspace_mb", workspace_mb
    if value is None:
        raw = os.environ.get(WORKSPACE_ENV)
        if raw is None or raw == "":
            return None
        source = WORKSPACE_ENV
        try:
            value = int(raw)
        except ValueError:
            value = raw
    expect(
        isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1 << 20,
        ConfigError,
        source,
        value,
        f"a whole number of MB in [1, {1 << 20}] (FlashInfer's float workspace; default as vLLM sizes it, at least "
        f"{WORKSPACE_MB})",
    )
    return value


def workspace_bytes_for(max_num_tokens: int | None, q_heads_x_head_dim: int) -> int:
    """FlashInfer's float workspace as vLLM 0.32 sizes it: ``max(394 MiB, max_num_tokens * q_heads * head_dim * 16)``
    (``max_num_tokens`` None: the floor)."""
    return max(WORKSPACE_MB << 20, (max_num_tokens or 0) * q_heads_x_head_dim * _WORKSPACE_BYTES_PER_TOKEN_HEAD_DIM)


class FlashInferBackend(AttentionBackend):
    """FlashInfer on NVIDIA GPUs (sm_75+; bf16 from sm_80). See the module docstring for the call plan.

    Keyword arguments: ``layers`` (the model's ``AttentionLayer``s, planned from the first
    step; otherwise learnt from forwards), ``max_context_len`` (sizes the graph page
    buffer; default: the ``req_to_token`` width of the first captured batch),
    ``workspace_mb`` (FlashInfer's float workspace in MB; default ``HAL_FLASHINFER_WORKSPACE_MB``, else sized as
    vLLM sizes it: ``max(394 MiB, max_num_tokens * q_heads * head_dim * 16)``), ``max_num_tokens`` (the engine's
    tokens per step, ``max_num_batched_tokens``; ``init_cuda_graph_state`` also gives it),
    ``extend_strategy`' (``"auto"``:
    ragged + paged prefix + merge, one paged call for windowed layers; ``"paged"``: one
    paged call over prefix + new for every layer), ``prefill_backend`` (FlashInfer's
    prefill implementation, ``"fa2"`` as SGLang pins it, or ``"auto"``).
    """

    name = "flashinfer"
    supports_padding_slots = True  # -1 in out_cache_loc: no KV written (docs/porting.md)
    dtypes = frozenset({"fp16", "bf16"})
    kv_cache_dtypes = frozenset({"fp16", "bf16", "fp8_e4m3", "fp8_e5m2"})  # kv_data_type, run(k_scale, v_scale)
    page_sizes = None  # any power of two: FlashInfer takes page_size at plan time
    head_dims = HEAD_DIMS
    supports_sliding_window = True  # window_left
    supports_logit_cap = True  # logits_soft_cap
    supports_non_causal = True  # causal=False
    supports_custom_mask = True  # custom_mask (prefill wrappers)
    supports_graph = True  # DECODE and TARGET_VERIFY
    supports_mla = True  # latent 512 + rope 64 only, through flashinfer.mla (see mla_reasons)
    supports_sinks = False  # SINKS_REASON
    needs_cpu_seq_lens = True

    requires_page_aligned_slots = True  # paged kernels read whole pages through page ids
    reads_tables = frozenset({"token", "page"})  # page ids from a block table, or from req_to_token's page starts
    option_defaults = {
        "layers": None,  # the model's AttentionLayers, to plan every variant up front (default: config.layers)
        "max_context_len": None,  # sizes the graph page buffer (default: config.max_context_len)
        "workspace_mb": None,  # FlashInfer's float workspace (default: HAL_FLASHINFER_WORKSPACE_MB, else as vLLM)
        "max_num_tokens": None,  # the engine's tokens per step: sizes the workspace as vLLM does
        "extend_strategy": "auto",
        "prefill_backend": "fa2",
    }

    def __init__(self, capability: DeviceCapability, config=None, **options):
        super().__init__(capability, config, **options)
        layers, max_context_len, workspace_mb, max_num_tokens, extend_strategy, prefill_backend = (
            self.options[k] for k in self.declaration().option_defaults
        )
        self._heads_x_dim = 0  # the widest layer's q_heads * head_dim, which the workspace scales with
        if config is not None:
            layers = layers if layers is not None else (config.layers or None)
            max_context_len = max_context_len or config.max_context_len
            self._heads_x_dim = config.tp_q_head_num * config.head_dim
        expect(
            extend_strategy in ("auto", "paged"),
            ConfigError,
            "extend_strategy",
            extend_strategy,
            "'auto' or 'paged'",
        )
        self.max_context_len = max_context_len
        self._workspace_asked = workspace_mb_option(workspace_mb)
        self.max_num_tokens = max_num_tokens
        self._heads_x_dim = max([self._heads_x_dim] + [x.tp_q_head_num * x.head_dim for x in layers or ()])
        self.workspace_bytes = (
            self._workspace_asked << 20
            if self._workspace_asked is not None
            else workspace_bytes_for(max_num_tokens, self._heads_x_dim)
        )
        self.extend_strategy = extend_strategy
        self.prefill_backend = prefill_backend
        self.variants: dict[LayerVariant, None] = {}  # an ordered set
        self._fi_module = None
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple, Any] = {}  # (kind, variant, graph batch size or None) -> wrapper
        self._graph: _GraphState | None = None
        self.forward_metadata: FlashInferMetadata | None = None
        if layers is not None:
            self.register_layers(layers)

    # -- selection ---------------------------------------------------------------------
    @classmethod
    def unavailable_reasons(cls, capability: DeviceCapability) -> list[str]:
        reasons = []
        missing = _flashinfer_missing()
        if missing:
            reasons.append(missing)
        elif capability.type == "cuda" and capability.reasons.get("flashinfer"):
            reasons.append(capability.reasons["flashinfer"])  # installed, but no kernels it can run
        old = _older_than(library_version("flashinfer-python"), MIN_FLASHINFER)
        if old:
            reasons.append(
                f"flashinfer-python {old} is older than {MIN_FLASHINFER}: hal passes mask_indptr_buf (0.2.0 names it "
                "qk_indptr_buf) and uses flashinfer.mla (from 0.2.1)"
            )
        arch = capability.arch or ""
        if capability.type != "cuda":
            reasons.append(f"FlashInfer runs on NVIDIA CUDA devices only, not {capability.type!r}")
        elif arch.lower().startswith("gfx") or "amd" in (capability.vendor or "").lower():
            reasons.append(f"FlashInfer has no ROCm build (device {arch or capability.vendor})")
        else:
            sm = _sm(arch)
            if sm is not None and sm < MIN_SM:
                reasons.append(f"FlashInfer needs sm_{MIN_SM} or newer; this GPU is {arch}")
        return reasons

    @classmethod
    def notes(cls, capability: DeviceCapability) -> list[str]:
        kernels = capability.libraries.get("flashinfer_kernels", "")
        notes = super().notes(capability)
        if kernels.startswith("jit"):
            notes.append(
                f"no prebuilt kernels ({kernels}): each kernel variant compiles at its first plan(), "
                "minutes per variant; pip install flashinfer-jit-cache to avoid it"
            )
        elif kernels:
            notes.append(f"kernels {kernels}")
        newer = _newer_than(library_version("flashinfer-python"), MAX_CHECKED_FLASHINFER)
        if newer:
            notes.append(
                f"flashinfer-python {newer} is newer than {MAX_CHECKED_FLASHINFER}, the newest release hal's calls "
                "were read against (pyproject's cuda extra pins <0.7.5)"
            )
        return notes

    @classmethod
    def unsupported_reasons(cls, config, capability: DeviceCapability) -> list[str]:
        reasons = []
        mla = getattr(config, "kv_lora_rank", 0) > 0 or config.v_head_dim != config.head_dim
        for reason in super().unsupported_reasons(config, capability):
            if reason.startswith("dtype fp32"):
                reason += ": FlashInfer compiles attention for fp16/bf16 (and fp8 KV) only, no fp32 kernels"
            elif reason.startswith("head_dim"):
                if mla:
                    continue  # MLA's head dims are checked by mla_reasons
                reason += ": FlashInfer's dispatched head dims"
            elif reason.startswith("attention sinks"):
                reason += f": {SINKS_REASON}"
            reasons.append(reason)
        if mla:
            reasons += mla_reasons(
                getattr(config, "kv_lora_rank", 0) or config.v_head_dim,
                config.head_dim,
                config.tp_k_head_num,
                window=config.sliding_window_size,
                logit_cap=config.logit_cap,
                custom_mask=config.custom_mask,
                fp8=getattr(config, "kv_cache_dtype_name", "").startswith("fp8"),
            )
        sm = _sm(capability.arch)
        if config.dtype_name == "bf16" and sm is not None and sm < MIN_SM_BF16 and capability.type == "cuda":
            why = f"FlashInfer's bf16 kernels need sm_{MIN_SM_BF16}+; this GPU is {capability.arch}"
            if not any("bf16" in r for r in reasons):
                reasons.append(why)
        return reasons

    def support_triton(self) -> bool:
        return True

    def register_layers(self, layers: Iterable) -> None:
        """Make ``out_graph`` plan for these layers from the next step on."""
        for layer in layers:
            self.check_layer(layer)
            self.variants.setdefault(LayerVariant.of(layer), None)

    # -- FlashInfer objects ------------------------------------------------------------
    def _fi(self):
        if self._fi_module is None:
            self._fi_module = import_flashinfer()
        return self._fi_module

    @property
    def workspace_mb(self) -> int:
        """The float workspace in MiB (rounded up)."""
        return -(-self.workspace_bytes // (1 << 20))

    def _workspace_buffer(self) -> torch.Tensor:
        if self._workspace is None:  # zeroed: the decode wrapper wants it so on first use
            self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        return self._workspace

    def _wrapper(self, kind: str, variant: LayerVariant, graph_bs: int | None, page_size: int = 1):
        key = (kind, variant, graph_bs)
        wrapper = self._wrappers.get(key)
        if wrapper is not None:
            return wrapper
        fi, ws = self._fi(), self._workspace_buffer()
        if kind == "mla":
            kw = {}
            if graph_bs is not None:  # decode graphs: plan() copies into these, replays read them
                g = self._graph
                kw = dict(
                    use_cuda_graph=True,
                    qo_indptr=g.qo_indptr[: graph_bs + 1],
                    kv_indptr=g.indptr[: graph_bs + 1],
                    kv_indices=g.indices,
                    kv_len_arr=g.kv_lens[:graph_bs],
                )
            # backend= explicitly: "auto" resolves to fa3 on sm90, which no hal test or GPU run has covered; fa2 is the
            # kernel every version from 0.2.1 has (flashinfer/mla.py, BatchMLAPagedAttentionWrapper.__init__).
            wrapper = fi.mla.BatchMLAPagedAttentionWrapper(ws, backend=MLA_BACKEND, **kw)
        elif kind == "decode":
            kw: dict[str, Any] = {"use_tensor_cores": variant.use_tensor_cores}
            if variant.use_tensor_cores and _takes(fi.BatchDecodeWithPagedKVCacheWrapper, "backend"):
                # 0.6.0-0.6.3 resolve "auto" to fa3 on sm90 for the tensor-core decode, and fa3 has no bf16/fp16
                # query over an fp8 cache; 0.6.4 picks fa2 (flashinfer #2530, #2536). hal names fa2 on every
                # version with the argument (0.2.9+); before it the tensor-core decode is fa2 (flashinfer/decode.py).
                kw["backend"] = "fa2"
            if graph_bs is not None:
                g = self._graph
                kw.update(
                    use_cuda_graph=True,
                    paged_kv_indptr_buffer=g.indptr[: graph_bs + 1],
                    paged_kv_indices_buffer=g.indices,
                    paged_kv_last_page_len_buffer=g.last_page_len[:graph_bs],
                )
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **kw)
        elif kind == "verify" and graph_bs is not None:  # plan() copies into these; replays read them
            g = self._graph
            if g.custom_mask is None:  # packed bits, sized generously as SGLang does (max tokens x row width)
                width = g.pages_per_row * page_size
                g.custom_mask = torch.zeros(g.max_tokens * width, dtype=torch.uint8, device=self.device)
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                ws,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=g.qo_indptr[: graph_bs + 1],
                paged_kv_indptr_buf=g.indptr[: graph_bs + 1],
                paged_kv_indices_buf=g.indices,
                paged_kv_last_page_len_buf=g.last_page_len[:graph_bs],
                custom_mask_buf=g.custom_mask,
                mask_indptr_buf=g.mask_indptr[: graph_bs + 1],
                backend=self.prefill_backend,
            )
        elif kind == "ragged":
            wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=self.prefill_backend)
        else:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=self.prefill_backend)
        self._wrappers[key] = wrapper
        return wrapper

    def _kinds(self, meta: FlashInferMetadata, variant: LayerVariant) -> list[str]:
        if variant.kv_lora_rank:  # no custom mask: an MLA layer's TARGET_VERIFY is refused (check_inputs)
            return [] if meta.mode.is_target_verify() else ["mla"]
        if meta.mode.is_decode():
            return ["decode"]
        if meta.mode.is_target_verify():
            return ["verify"]
        if variant.window >= 0 or self.extend_strategy == "paged" or meta.fp8:  # fp8: new tokens as stored
            return ["paged"]
        return ["ragged", "prefix"] if meta.has_prefix else ["ragged"]

    def _plan(self, meta: FlashInferMetadata, kind: str, variant: LayerVariant):
        """``plan`` one wrapper for this step (host work: outside any graph)."""
        graph_bs = meta.batch_size if (meta.graph_static and kind in ("decode", "verify", "mla")) else None
        wrapper = self._wrapper(kind, variant, graph_bs, meta.page_size)
        hq, hkv, dim, ps = variant.q_heads, variant.kv_heads, variant.head_dim, meta.page_size
        common = dict(
            sm_scale=variant.scale,
            logits_soft_cap=variant.logit_cap,
            q_data_type=meta.q_dtype or meta.dtype,
            kv_data_type=meta.dtype,
        )
        if kind == "mla":  # prefix + new keys, causal bottom-right aligned (decode: one query sees all)
            kv = meta.kv()
            # hal: allow-host-data plan() runs outside capture only (_wrapper refuses it in one)
            csr = (meta.qo_indptr, kv.indptr, kv.indices, torch.tensor(meta.kv_lens, dtype=torch.int32))
            shape = dict(
                num_heads=hq,
                head_dim_ckv=variant.kv_lora_rank,
                head_dim_kpe=variant.rope_dim,
                page_size=ps,
                causal=variant.causal and not meta.mode.is_decode(),
                sm_scale=variant.scale,
                q_data_type=common["q_data_type"],
                kv_data_type=meta.dtype,
            )
            if mla_structural(wrapper):  # 0.7+: canonical metadata by keyword; split query and caches, as hal runs
                metadata = self._fi().mla.MLAPlanMetadata.csr(*csr)
                wrapper.plan(metadata=metadata, query_layout="split", kv_cache_layout="split", **shape)
            else:  # 0.2.1-0.6: the flat positional form (0.7 keeps it, deprecated)
                wrapper.plan(*csr, *shape.values())
        elif kind == "decode":
            kv = meta.kv()
            wrapper.plan(
                kv.indptr,
                kv.indices,
                kv.last_page_len,
                hq,
                hkv,
                dim,
                ps,
                pos_encoding_mode="NONE",
                window_left=variant.window,
                **common,
            )
        elif kind == "ragged":  # the new tokens' own K/V: kv_indptr == qo_indptr
            wrapper.plan(
                meta.qo_indptr,
                meta.qo_indptr,
                hq,
                hkv,
                dim,
                causal=variant.causal,
                pos_encoding_mode="NONE",
                window_left=-1,
                **common,
            )
        elif kind == "prefix":  # every prefix key precedes every query: no mask
            kv = meta.prefix()
            wrapper.plan(
                meta.qo_indptr,
                kv.indptr,
                kv.indices,
                kv.last_page_len,
                hq,
                hkv,
                dim,
                ps,
                causal=False,
                pos_encoding_mode="NONE",
                window_left=-1,
                **common,
            )
        elif kind == "paged":
            kv = meta.kv()
            wrapper.plan(
                meta.qo_indptr,
                kv.indptr,
                kv.indices,
                kv.last_page_len,
                hq,
                hkv,
                dim,
                ps,
                causal=variant.causal,
                pos_encoding_mode="NONE",
                window_left=variant.window,
                **common,
            )
        elif kind == "verify":
            # The custom mask is packed on its device with an indptr derived from these
            # three; FlashInfer 0.2.x puts that indptr on qo_indptr's device, so all go there.
            kv, device = meta.kv(), meta.custom_mask.device
            wrapper.plan(
                meta.qo_indptr.to(device),
                kv.indptr.to(device),
                kv.indices,
                kv.last_page_len.to(device),
                hq,
                hkv,
                dim,
                ps,
                custom_mask=meta.custom_mask,
                causal=False,
                pos_encoding_mode="NONE",
                window_left=variant.window,
                **common,
            )
        else:  # pragma: no cover - internal
            raise AssertionError(kind)
        meta.wrappers[(kind, variant)] = wrapper
        return wrapper

    def _planned(self, meta: FlashInferMetadata, kind: str, variant: LayerVariant):
        wrapper = meta.wrappers.get((kind, variant))
        if wrapper is None:
            if self._capturing():
                raise GraphCaptureError(
                    f"flashinfer: layer variant {variant} met for the first time inside a graph capture, "
                    "where plan() cannot run; run the batch eagerly once first (the graph runner's warm-up "
                    "does) or pass the layers to the backend (layers= / register_layers)"
                )
            self.variants.setdefault(variant, None)
            wrapper = self._plan(meta, kind, variant)
        return wrapper

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    # -- metadata ----------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self._workspace is None and self._workspace_asked is None:  # the engine's token count, as vLLM sizes it
            self.max_num_tokens = max(self.max_num_tokens or 0, max_num_tokens)
            self.workspace_bytes = workspace_bytes_for(self.max_num_tokens, self._heads_x_dim)
        # Wrappers of an earlier capture hold the old buffers' addresses: drop them.
        self._wrappers = {key: w for key, w in self._wrappers.items() if key[2] is None}
        self._graph = _GraphState(
            max_bs=max_bs,
            max_tokens=max(max_bs, max_num_tokens),
            indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            last_page_len=torch.ones(max_bs, dtype=torch.int32, device=self.device),
            kv_lens=torch.ones(max_bs, dtype=torch.int32, device=self.device),
            qo_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            mask_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
        )
        if self.max_context_len is not None:
            self._graph_indices(self.max_context_len, 1)

    def _graph_indices(self, max_context_len: int, page_size: int) -> None:
        """Allocate the fixed page-id buffer once: every captured wrapper holds its address."""
        g = self._graph
        pages = -(-max_context_len // page_size)
        if g.indices is None:
            g.pages_per_row = pages
            g.indices = torch.zeros(g.max_bs * pages, dtype=torch.int32, device=self.device)
        elif pages > g.pages_per_row:
            raise GraphCaptureError(
                f"flashinfer graph page buffer holds {g.pages_per_row} pages per request, a batch needs "
                f"{pages}: pass max_context_len= to the backend before init_cuda_graph_state"
            )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def plan_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        mode = fb.forward_mode
        if mode.is_idle():
            self.plan.set_metadata(None, fb)
            return
        graph_static = self.plan.is_graph_batch(fb, in_capture)
        if graph_static:
            expect(
                mode.is_decode() or mode.is_target_verify(),
                GraphCaptureError,
                "forward_mode under graph capture",
                mode.name,
                "DECODE or TARGET_VERIFY (the flashinfer backend captures those)",
            )
            expect(
                self._graph is not None and fb.batch_size <= self._graph.max_bs,
                GraphCaptureError,
                "graph batch size",
                fb.batch_size,
                "at most init_cuda_graph_state's max_bs (call it first)",
            )
            self._graph_indices(check_request_tables(fb)[2], fb.token_to_kv_pool.page_size)
        lens = host_lens(fb)
        pool = fb.token_to_kv_pool
        tokens, pages = getattr(fb, "req_to_token_pool", None), getattr(fb, "req_to_page_pool", None)
        meta = FlashInferMetadata(
            mode=mode,
            batch_size=fb.batch_size,
            num_tokens=fb.out_cache_loc.shape[0],
            dtype=pool.dtype,
            # an fp8 cache: the queries stay in the model dtype (the config's; bf16 without one)
            q_dtype=(self.config.dtype if self.config is not None else torch.bfloat16)
            if kv_scaled(pool.dtype)
            else None,
            page_size=pool.page_size,
            graph_static=graph_static,
            qo_indptr=indptr_from_lens(lens.query),
            kv_lens=lens.kv,
            prefix_lens=list(lens.prefix),
            req_to_token=tokens.req_to_token if pages is None else None,  # a block table is read as it is
            req_to_page=pages.req_to_page if pages is not None else None,
            req_pool_indices=fb.req_pool_indices,
            # a graph's static batch holds the step's flat mask at the start of a larger fixed buffer
            custom_mask=(
                fb.spec_info.custom_mask.reshape(-1)[: sum(q * n for q, n in zip(lens.query, lens.kv))]
                if mode.is_target_verify()
                else None
            ),
        )
        self.plan.set_metadata(meta, fb)
        for variant in self.variants:
            for kind in self._kinds(meta, variant):
                self._plan(meta, kind, variant)

    def plan_in_graph(self, fb: ForwardBatch) -> None:
        """Nothing: FlashInfer's kernels read the buffers ``plan`` filled in ``out_graph``."""

    # -- forward -----------------------------------------------------------------------
    def check_layer(self, layer) -> None:
        rank = mla_rank(layer)
        if not rank:
            return
        why = mla_reasons(
            rank,
            layer.head_dim,
            layer.tp_k_head_num,
            window=layer.sliding_window_size,
            logit_cap=layer.logit_cap,
            custom_mask=False,
            fp8=False,
        )
        expect(
            not why,
            ConfigError,
            "MLA layer (kv_lora_rank, head_dim, kv heads, window, logit cap)",
            (rank, layer.head_dim, layer.tp_k_head_num, layer.sliding_window_size, layer.logit_cap),
            "; ".join(why),
        )

    def check_inputs(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        """The base checks, and (before the prologue writes anything) no TARGET_VERIFY for an MLA layer."""
        out = super().check_inputs(q, k, v, layer, forward_batch, save_kv_cache)
        expect(
            not (mla_rank(layer) and forward_batch.forward_mode.is_target_verify()),
            UnsupportedError,
            "forward_mode of an MLA layer",
            forward_batch.forward_mode.name,
            "not TARGET_VERIFY: flashinfer.mla.BatchMLAPagedAttentionWrapper has no custom mask",
        )
        return out

    def _begin(self, q, layer, fb: ForwardBatch):
        """The run inputs after the prologue (which wrote the KV: the paged calls read the new tokens
        back): ``(meta, variant, q in the kernels' dtype, (k_cache, v_cache))``."""
        meta = self.forward_metadata
        paged = paged_view(fb.token_to_kv_pool, layer.layer_id)
        return meta, LayerVariant.of(layer), q.to(meta.q_dtype or meta.dtype).contiguous(), paged

    def _run_paged(self, meta: FlashInferMetadata, kind: str, variant: LayerVariant, q_in, paged, layer, out):
        """One paged wrapper's ``run``, into ``out`` where it can (:func:`output_kwargs`); an fp8 cache with the
        layer's scales (``k_scale`` folds into the softmax scale, ``v_scale`` multiplies the output in place: the
        read is ``stored * scale``)."""
        wrapper = self._planned(meta, kind, variant)
        kwargs = output_kwargs(wrapper, out, q_in)
        if meta.fp8:
            kwargs["k_scale"], kwargs["v_scale"] = host_scales(layer)
        return wrapper.run(q_in, paged, **kwargs)

    def _run_mla(self, meta: FlashInferMetadata, variant: LayerVariant, q_in, paged, out):
        """MLA: ``q`` split into its latent and rope parts, the caches as views of the one latent buffer; the
        output into ``out`` where it can (its kernel takes strided rows)."""
        rank, (k_cache, _) = variant.kv_lora_rank, paged  # [pages, page_size, 1, rank + rope]
        ckv, kpe = k_cache[:, :, 0, :rank], k_cache[:, :, 0, rank:]
        wrapper = self._planned(meta, "mla", variant)
        kwargs = output_kwargs(wrapper, out, q_in, strided_rows=True)
        if mla_structural(wrapper):  # 0.7+: query= / kv_cache= pairs (q_nope/ckv_cache are deprecated there)
            return wrapper.run(query=(q_in[..., :rank], q_in[..., rank:]), kv_cache=(ckv, kpe), **kwargs)
        return wrapper.run(q_in[..., :rank], q_in[..., rank:], ckv, kpe, **kwargs)

    def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, out=None, **kwargs):
        """Returns ``[T, Hq, Dv]``: the caller's ``out`` where FlashInfer wrote it (:func:`output_kwargs`)."""
        meta, variant, q_in, paged = self._begin(q, layer, forward_batch)
        if variant.kv_lora_rank:
            return self._run_mla(meta, variant, q_in, paged, out)
        return self._run_paged(meta, "decode", variant, q_in, paged, layer, out)

    def run_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, out=None, **kwargs):
        """Returns ``[T, Hq, Dv]``: the caller's ``out`` where FlashInfer wrote it (:func:`output_kwargs`; the
        ragged + prefix pair merges the prefix's state into the ragged call's output in place)."""
        meta, variant, q_in, paged = self._begin(q, layer, forward_batch)
        kinds = self._kinds(meta, variant)
        if kinds == ["mla"]:
            return self._run_mla(meta, variant, q_in, paged, out)
        if kinds[0] != "ragged":
            return self._run_paged(meta, kinds[0], variant, q_in, paged, layer, out)
        k_in, v_in = (t.to(meta.dtype).contiguous() for t in (k, v))
        ragged = self._planned(meta, "ragged", variant)
        if kinds == ["ragged"]:
            return ragged.run(q_in, k_in, v_in, **output_kwargs(ragged, out, q_in))
        o_new, lse_new = ragged.run(q_in, k_in, v_in, return_lse=True, **output_kwargs(ragged, out, q_in))
        o_pre, lse_pre = self._planned(meta, "prefix", variant).run(q_in, paged, return_lse=True)
        return self._merge(o_new, lse_new, o_pre, lse_pre)

    def run_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, out=None, **kwargs):
        return self.run_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, out=out, **kwargs)

    def _merge(self, v_a, s_a, v_b, s_b) -> torch.Tensor:
        """The state ``(v_a, s_a)`` (contiguous ``[T, H, D]``, base-2 LSE ``[T, H]``) merged with ``(v_b, s_b)``:
        in place into ``v_a`` (and ``s_a``) by ``merge_state_in_place`` (flashinfer>=0.2.1; its kernel checks that
        ``v`` is contiguous, csrc/cascade.cu), else a new tensor where FlashInfer's block would exceed its thread
        limit or the library has no merge (hal's torch merge)."""
        merge_in_place = getattr(self._fi(), "merge_state_in_place", None)
        heads, dim = v_a.shape[1], v_a.shape[2]
        bdx = dim // max(16 // v_a.element_size(), dim // 32)  # threads per head in the merge kernels' block
        if merge_in_place is not None and heads * bdx <= _MERGE_STATE_MAX_THREADS:
            merge_in_place(v_a, s_a, v_b, s_b)
            return v_a
        return merge_states_base2(v_a, s_a, v_b, s_b)[0]
