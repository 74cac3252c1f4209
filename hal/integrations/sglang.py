"""hal inside SGLang: ``--attention-backend hal``.

``HalAttnBackend(model_runner)`` is an SGLang attention backend (a subclass of SGLang's
``AttentionBackend``, built the way SGLang's attention registry builds one: from the
model runner). It chooses hal's device and backend for the runner's device and the
model's attention shape, then serves SGLang's own ``ForwardBatch`` (and its graph
runners' views of one), ``RadixAttention`` layers, ``ReqToTokenPool`` and
``MHATokenToKVPool`` directly: the pools are read where they are, nothing is copied.

    import hal.integrations.sglang as hal_sglang
    hal_sglang.register()            # --attention-backend hal (also done by SGLang's plugin loader)

Choosing: the device is the runner's (``model_runner.device`` with ``gpu_id``), the
backend is hal's first that can serve the model; ``HAL_DEVICE`` /
``HAL_ATTENTION_BACKEND`` / ``HAL_PREFILL_BACKEND`` / ``HAL_DECODE_BACKEND`` override
as everywhere in hal, and SGLang's own split (``--prefill-attention-backend`` /
``--decode-attention-backend``) picks hal backends by registered name: ``register("hal_triton",
backend="triton")`` makes ``--decode-attention-backend hal_triton`` mean hal's triton
backend. Anything hal cannot serve is refused when the backend is built, with every
backend's reasons (``hal.NoBackendError``).

Importing this module without SGLang raises ``hal.errors.MissingDependencyError``; no
other hal module imports SGLang.
"""

from __future__ import annotations

from hal.errors import MissingDependencyError

try:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend as _SGLangAttentionBackend
except ImportError as _exc:  # not installed, or installed without what its import chain needs
    raise MissingDependencyError(
        "hal.integrations.sglang needs SGLang (tested with sglang 0.5.21 to 0.5.23): "
        f"importing it failed with {type(_exc).__name__}: {_exc}. Install SGLang, or on a CPU-only machine "
        "`pip install --no-deps sglang==0.5.23` plus hal's `sglang` extra (see docs/sglang.md)."
    ) from _exc

try:
    from sglang.srt.layers.attention.base_attn_backend import SharedReadEnds
except ImportError:  # SGLang before 0.5.21: nobody asks shared_read_ends
    SharedReadEnds = None

import torch  # noqa: E402  (after the SGLang guard: its error is the one to see)

# The SGLang releases hal supports and tests (tox -e sglang-0.5.21 / sglang): the oldest, and the newest plus one
# excluded. pyproject.toml's `sglang-gpu` extra declares the same range.
SUPPORTED_SGLANG = ("0.5.21", "0.5.24")


def _check_sglang_release() -> None:
    """A ``UserWarning`` when the installed SGLang is outside :data:`SUPPORTED_SGLANG` (it may work: tox -e
    sglang-latest tries the registry's newest; the integration was not tested there)."""
    import importlib.metadata
    import warnings

    try:
        from packaging.version import Version

        installed = importlib.metadata.version("sglang")
    except Exception:  # no packaging, or a source checkout without metadata: nothing to compare
        return
    low, high = SUPPORTED_SGLANG
    if not Version(low) <= Version(installed) < Version(high):
        warnings.warn(
            f"hal.integrations.sglang is tested with SGLang >= {low}, < {high}; sglang {installed} is installed",
            stacklevel=3,
        )


_check_sglang_release()

import hal  # noqa: E402
from hal.batch import REFUSED_MODES  # noqa: E402
from hal.errors import ConfigError, UnsupportedError  # noqa: E402
from hal.integrations.sglang_members import MEMBERS, sglang_members  # noqa: E402
from hal.integrations.sglang_pools import serve_pool  # noqa: E402
from hal.kernels.reference import kv_scales  # noqa: E402
from hal.selection import HybridBackend  # noqa: E402

__all__ = [
    "HalAttnBackend",
    "SGLangBatch",
    "register",
    "sglang_plugin",
    "install_hooks",
    "backend_supports_triton",
    "route_deepseek_to_latent_attention",
    "mla_dims",
    "attention_config",
    "hal_layer",
    "runner_device",
]

# SGLang's ForwardMode -> hal's, by name (SGLang has no DRAFT_EXTEND; its DRAFT_EXTEND_V2 is hal's DRAFT_EXTEND).
_MODES = {
    "EXTEND": hal.ForwardMode.EXTEND,
    "DECODE": hal.ForwardMode.DECODE,
    "MIXED": hal.ForwardMode.MIXED,
    "IDLE": hal.ForwardMode.IDLE,
    "TARGET_VERIFY": hal.ForwardMode.TARGET_VERIFY,
    "DRAFT_EXTEND_V2": hal.ForwardMode.DRAFT_EXTEND,
    "SPLIT_PREFILL": hal.ForwardMode.SPLIT_PREFILL,
}
# The backend attributes of SGLang 0.5.21's base class that answer a runner's question: HalAttnBackend
# gives hal's backend's answer.
_DECLARED = (
    "supports_draft_extend_metadata_staging",
    "extend_dummy_seqs_capped_by_req_pool",
    "prefer_eager_mixed_prefill_under_dp_attention",
    "supports_prefill_cuda_graph_max_context_size",
    "supports_full_cuda_graph_chunked_prefix",
    "supports_ragged_verify_graph",
    "use_captured_forward_metadata_for_breakable_cuda_graph",
)

# SGLang 0.5.23's base-class members that HalAttnBackend answers itself (hal's core contract does not have them).
SGLANG_0523_MEMBERS = (
    "folds_encoder_swa_replay",
    "get_fused_kv_write_buffers",
    "glue_target_verify_metadata",
    "glue_draft_metadata",
    "prefill_cuda_graph_max_batch_size",
    "skips_prefill_metadata_on_idle_dp_rank",
    "prefill_cuda_graph_default_max_seq_len",
    "dllm_attention",
    "resolve_prefill_shared_read_ends",
    "late_layer_num_tokens",
)

# name -> (hal backend, hal device) for names registered with register(); None: hal chooses.
_REGISTERED: dict[str, tuple[str | None, str | None]] = {}


# ----------------------------------------------------------------------------- the model


def runner_device(model_runner) -> str:
    """The runner's device for hal: ``cuda:<gpu_id>`` / ``npu:<gpu_id>``, or ``cpu``."""
    device = str(model_runner.device)
    gpu_id = getattr(model_runner, "gpu_id", None)
    if ":" not in device and device in ("cuda", "npu") and isinstance(gpu_id, int):
        return f"{device}:{gpu_id}"
    return device


def mla_dims(pool) -> tuple[int, int] | None:
    """``(kv_lora_rank, qk_rope_head_dim)`` of SGLang's latent-attention pool (``MLATokenToKVPool``: one
    ``[slots, 1, kv_lora_rank + qk_rope_head_dim]`` buffer per layer, the value its first ``kv_lora_rank``
    columns), None for any other pool. Refused (``UnsupportedError``): the DSA variants and rows of another
    width (the FP4 pool, DSA's fp8 rows with their scales), which hal's latent layout does not describe."""
    rank = getattr(pool, "kv_lora_rank", None)
    if rank is None:
        return None
    rope = int(getattr(pool, "qk_rope_head_dim", 0) or 0)
    if getattr(pool, "use_dsa", False):
        raise UnsupportedError(f"{type(pool).__name__} with use_dsa: DeepSeek sparse attention (DSA) is not in hal")
    if getattr(serve_pool(pool), "mla_split", False):  # SGLang's NPU MLA pool: latent and rope buffers apart
        return int(rank), rope
    width = pool.get_key_buffer(getattr(pool, "start_layer", 0) or 0).shape[-1]
    if width != rank + rope:
        raise UnsupportedError(
            f"{type(pool).__name__}: rows of {width} elements; hal's MLA cache rows are kv_lora_rank + "
            f"qk_rope_head_dim = {rank + rope} values of the cache dtype"
        )
    return int(rank), rope


def hal_layer(layer, mla: tuple[int, int] | None = None) -> hal.AttentionLayer:
    """hal's descriptor of a ``RadixAttention`` (same field names; refused: what hal does not compute).

    ``mla``: the pool's ``(kv_lora_rank, qk_rope_head_dim)`` (:func:`mla_dims`); a layer of that latent shape
    (one KV head, ``head_dim = kv_lora_rank + qk_rope_head_dim``, ``v_head_dim = kv_lora_rank``) is described as
    MLA. SGLang's ``RadixAttention`` does not carry the split itself."""
    attn_type = getattr(layer.attn_type, "value", layer.attn_type) if hasattr(layer, "attn_type") else "decoder"
    if attn_type not in ("decoder", "encoder_only"):
        raise UnsupportedError(f"layer {layer.layer_id}: attn_type {attn_type!r}: hal computes decoder, encoder_only")
    if getattr(layer, "is_cross_attention", False):
        raise UnsupportedError(
            f"layer {layer.layer_id}: cross attention reads the encoder's KV (SGLang's encoder_lens / "
            "encoder_out_cache_loc), which hal's batch does not describe"
        )
    method = getattr(layer, "logit_capping_method", "tanh")
    if (layer.logit_cap or 0) > 0 and method != "tanh":
        raise UnsupportedError(f"layer {layer.layer_id}: logit_capping_method {method!r}: hal caps with tanh")
    window = layer.sliding_window_size
    latent = mla is not None and (layer.tp_k_head_num, layer.head_dim, layer.v_head_dim) == (1, sum(mla), mla[0])
    k_scale, v_scale = kv_scales(layer)  # SGLang's k_scale_float / v_scale_float (set by its fp8 KV quant method)
    return hal.AttentionLayer(
        layer_id=layer.layer_id,
        tp_q_head_num=layer.tp_q_head_num,
        tp_k_head_num=layer.tp_k_head_num,
        head_dim=layer.head_dim,
        tp_v_head_num=layer.tp_v_head_num,
        v_head_dim=layer.v_head_dim,
        scaling=float(layer.scaling),
        logit_cap=float(layer.logit_cap or 0.0),
        sliding_window_size=-1 if window is None else int(window),
        attn_type=attn_type,
        kv_lora_rank=mla[0] if latent else 0,
        qk_rope_head_dim=mla[1] if latent else 0,
        k_scale=k_scale,
        v_scale=k_scale if latent else v_scale,  # MLA: the value is the key's latent, stored once
    )


def _radix_layers(model) -> list:
    if not isinstance(model, torch.nn.Module):
        return []
    from sglang.srt.layers.radix_attention import RadixAttention

    return [m for m in model.modules() if isinstance(m, RadixAttention)]


def _attention_tp_size(model_runner) -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_size)
    except Exception:  # an older SGLang, or a runner outside a server: the runner's own width
        return int(getattr(model_runner, "tp_size", 1) or 1)


def _server_args(model_runner):
    return getattr(model_runner, "server_args", None)


def _uses_graphs(model_runner) -> bool:
    config = getattr(_server_args(model_runner), "cuda_graph_config", None)
    decode = getattr(config, "decode", None)
    return decode is not None and getattr(decode, "backend", "disabled") != "disabled"


def _speculative(model_runner) -> bool:
    args = _server_args(model_runner)
    algorithm = getattr(model_runner, "spec_algorithm", None)
    is_none = getattr(algorithm, "is_none", None)
    return bool(getattr(args, "speculative_num_draft_tokens", 0)) or (callable(is_none) and not is_none())


def _has_sinks(model) -> bool:
    """Whether a model's attention modules hold learned sinks (gpt-oss: ``self_attn.sinks``, passed to
    ``RadixAttention`` as ``sinks=``)."""
    if not isinstance(model, torch.nn.Module):
        return False
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())


def _scales_beside_values(pool) -> str | None:
    """The name of the first buffer of scales or dequantised copies SGLang's pool keeps beside its values (its
    ``*_scale_buffer`` / ``dq_*_buffer`` attributes: FP4, MXFP8), or None where the values are all it stores."""
    names = ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer")
    return next((n for n in (*names, "dq_k_buffer", "dq_v_buffer") if getattr(pool, n, None) is not None), None)


def _pool_dtypes(model_runner, pool) -> tuple[torch.dtype, str | None]:
    """``(model dtype, KV cache dtype name or None)`` of SGLang's pool. An fp8 pool (``--kv-cache-dtype
    fp8_e4m3`` / ``fp8_e5m2``: ``dtype`` float8, ``store_dtype`` uint8 on SGLang's MHA pool, its buffers viewed as
    float8 by ``get_key_buffer``) keeps the model's dtype for queries and outputs; hal's selection then asks each
    backend whether it serves that KV dtype (``kv_cache_dtypes``). Refused (``UnsupportedError``): SGLang's
    quantised pools that store scales beside the values (FP4, MXFP8: ``is_quantized_kv_cache``) and any other
    dtype. SGLang's CPU engine builds its fp8_e4m3 pool with a quant method (``cpu_fp8_e4m3``,
    ``layers/quantization/fp4_kv_cache_quant_method.py`` ``CPUFP8KVCacheMethod``, 0.5.21 and 0.5.23) that is
    "quantised" in name only: float8 buffers ``[slots, heads, dim]`` of the values divided by the layer's
    per-tensor scale, no scale buffers, no dequantising read; that pool is served as the plain fp8 one."""
    from hal.kernels.reference import is_fp8
    from hal.kv_cache import kv_cache_dtype_name
    from hal.kv_dtypes import KV_STORAGE_DTYPES

    kv = pool.dtype
    store = getattr(pool, "store_dtype", kv)
    per_tensor_fp8 = is_fp8(kv) and store in (kv, torch.uint8) and _scales_beside_values(pool) is None
    if not per_tensor_fp8 and (getattr(pool, "is_quantized_kv_cache", False) or store != kv):
        raise UnsupportedError(
            f"{type(pool).__name__}: KV cache dtype {kv} stored as {store} with per-block scales: hal serves "
            f"{sorted(KV_STORAGE_DTYPES)} caches (fp8 with a per-layer k_scale / v_scale)"
        )
    if not is_fp8(kv):
        if kv not in KV_STORAGE_DTYPES.values():
            raise UnsupportedError(f"KV cache dtype {kv}: hal serves {sorted(KV_STORAGE_DTYPES)}")
        return kv, None
    model = getattr(model_runner, "dtype", None)
    if not isinstance(model, torch.dtype):
        model = getattr(model_runner.model_config, "dtype", None)
    if not isinstance(model, torch.dtype) or is_fp8(model):
        raise ConfigError(f"an fp8 KV cache ({kv}) needs the model's dtype from the runner; got {model!r}")
    return model, kv_cache_dtype_name(kv)


def attention_config(model_runner) -> hal.AttentionConfig:
    """The ``AttentionConfig`` of the model a runner serves: shape from its KV pool and model config
    (SGLang's ``MLATokenToKVPool``: latent MLA, :func:`mla_dims`), per-layer window / cap / causality from
    its ``RadixAttention`` layers (when the model has them), attention sinks from its modules, limits
    from its request table, and whether speculative verify and graphs will come."""
    pool = model_runner.token_to_kv_pool
    table = model_runner.req_to_token_pool
    model_config = model_runner.model_config
    model = getattr(model_runner, "model", None)
    layout = getattr(pool, "kv_cache_layout", "nhd")
    if layout != "nhd":
        raise UnsupportedError(f"KV cache layout {layout!r}: hal reads [slots, kv_heads, head_dim] (nhd) buffers")
    dtype, kv_cache_dtype = _pool_dtypes(model_runner, pool)
    mla = mla_dims(pool)
    layers = tuple(hal_layer(m, mla) for m in _radix_layers(model))
    if mla is not None:
        # DeepSeek's models also hold an MHA companion of each latent layer (attn_mha, for the prefill paths
        # of backends SGLang names); it writes nothing to the pool, and hal is never routed to it
        # (route_deepseek_to_latent_attention)
        layers = tuple(x for x in layers if x.is_mla)
    window = getattr(model_runner, "sliding_window_size", None)
    if window is None:
        window = getattr(model_config, "sliding_window_size", None)
    common = dict(
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        page_size=pool.page_size,
        custom_mask=_speculative(model_runner),
        graph=_uses_graphs(model_runner),
        max_context_len=int(table.req_to_token.shape[1]),
        max_batch_size=int(table.size),
        attention_sinks=_has_sinks(model),
    )
    if layers:
        return hal.AttentionConfig.from_layers(layers, **common)
    if mla is not None:
        shape = dict(tp_k_head_num=1, head_dim=sum(mla), kv_lora_rank=mla[0], qk_rope_head_dim=mla[1])
    else:
        shape = dict(
            tp_k_head_num=pool.head_num,
            head_dim=pool.head_dim,
            v_head_dim=getattr(pool, "v_head_dim", None) or pool.head_dim,
        )
    return hal.AttentionConfig(
        layer_num=pool.layer_num,
        tp_q_head_num=model_config.get_num_attention_heads(_attention_tp_size(model_runner)),
        sliding_window_size=-1 if window is None else int(window),
        non_causal=bool(getattr(model_config, "is_encoder_decoder", False)),
        **shape,
        **common,
    )


# ----------------------------------------------------------------------------- batches


class SGLangBatch:
    """SGLang's ``ForwardBatch`` (or a graph runner's view of one) as hal reads a batch.

    Every field is SGLang's own object, read through; this adds what SGLang keeps
    elsewhere: the pools (SGLang's backends hold them; its batches do not), hal's
    ``forward_mode`` (SGLang's ``DRAFT_EXTEND_V2`` is hal's ``DRAFT_EXTEND``) and
    ``graph_static`` (SGLang prepares a graph step with ``init_forward_metadata_out_graph``
    called directly, an eager one with ``init_forward_metadata``).
    """

    __slots__ = (
        "batch",
        "forward_mode",
        "req_to_token_pool",
        "req_to_page_pool",  # set only where a backend's plan step derives a block table (reads_tables)
        "req_pool_indices",  # likewise: an eager step's derived tables are rebased on it
        "token_to_kv_pool",
        "graph_static",
        "out_cache_loc",
        "spec_info",
    )

    def __init__(self, batch, req_to_token_pool, token_to_kv_pool, graph_static: bool):
        mode = batch.forward_mode
        name = getattr(mode, "name", None)
        hal_mode = _MODES.get(name)
        if hal_mode is None:
            reason = REFUSED_MODES.get(name) or f"hal serves {sorted(_MODES)}"
            raise UnsupportedError(f"forward_mode {name or mode!r}: {reason}")
        self.batch = batch
        self.forward_mode = hal_mode
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.graph_static = graph_static
        loc = batch.out_cache_loc
        if graph_static and loc is not None and (hal_mode.is_decode() or hal_mode.is_target_verify()):
            # SGLang's replay view pads the requests (batch_size, seq_lens...) but keeps the live batch's
            # out_cache_loc: its padding tokens write the padding slot 0, as in the captured batch.
            per_request = batch.spec_info.draft_token_num if hal_mode.is_target_verify() else 1
            missing = batch.batch_size * per_request - loc.shape[0]
            if missing > 0:
                loc = torch.nn.functional.pad(loc, (0, missing))
        self.out_cache_loc = loc
        spec = getattr(batch, "spec_info", None)
        self.spec_info = _VerifyInput.full_mask(batch, spec) if hal_mode.is_target_verify() else spec

    def __getattr__(self, name):
        return getattr(self.batch, name)


class _VerifyInput:
    """SGLang's verify input with hal's ``custom_mask`` layout, where SGLang's CPU engine sends its own.

    SGLang's CPU engine builds speculative verify masks as ``QLEN_ONLY`` trees: per request only the
    ``[draft, draft]`` block among the drafts, the prefix implied visible (``speculative/eagle_utils.py``
    ``default_tree_mask_mode``: QLEN_ONLY where ``is_cpu()``; ``speculative/ngram_worker.py``: the full mask only
    ``if USE_FULL_MASK and not _is_cpu``; SGLang 0.5.21 and 0.5.23), for ``intel_amx``'s kernel. hal's batch
    protocol, like SGLang's GPU backends, takes the full ``[draft, seq_len + draft]`` rows: :meth:`full_mask`
    prepends the ``seq_len`` ones once per step (host lengths, no device read). Every other field is SGLang's."""

    __slots__ = ("spec", "custom_mask")

    def __init__(self, spec, custom_mask: torch.Tensor):
        self.spec, self.custom_mask = spec, custom_mask

    def __getattr__(self, name):
        return getattr(self.spec, name)

    @classmethod
    def full_mask(cls, batch, spec):
        """``spec`` as is, or wrapped with the full mask when it carries SGLang's CPU ``QLEN_ONLY`` one
        (SGLang's ``is_cpu()``, and exactly ``batch_size * draft * draft`` entries)."""
        mask, draft = getattr(spec, "custom_mask", None), getattr(spec, "draft_token_num", None)
        seq = getattr(batch, "seq_lens_cpu", None)
        if not isinstance(mask, torch.Tensor) or not isinstance(draft, int) or seq is None or not _sglang_on_cpu():
            return spec
        seq = [int(n) for n in seq]
        if mask.numel() != len(seq) * draft * draft or mask.numel() == sum(draft * (n + draft) for n in seq):
            return spec
        rows = mask.view(len(seq), draft, draft).bool()
        ones = [torch.ones(draft, n, dtype=torch.bool, device=mask.device) for n in seq]
        return cls(spec, torch.cat([torch.cat([o, r], 1).flatten() for o, r in zip(ones, rows)]))


def _sglang_on_cpu() -> bool:
    from sglang.srt.utils import is_cpu

    return bool(is_cpu())


# ----------------------------------------------------------------------------- the backend

# kwargs SGLang's models may pass to forward that hal does not compute; None is accepted as absent.
# sinks= (gpt-oss) reaches hal's backend, which refuses it where it declares no sinks.
_KWARGS_REFUSED = ("attn_sink", "k_rope", "q_rope", "cos_sin_cache", "topk_indices", "score_mod", "rel_bias")


def _same_device(a, b) -> bool:
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class HalAttnBackend(_SGLangAttentionBackend):
    """An SGLang attention backend that runs hal's backend for the runner's device and model.

    ``HalAttnBackend(model_runner, backend=None, device=None, **options)``: ``backend``
    forces one hal backend for both phases (``HAL_ATTENTION_BACKEND`` still overrides it, as
    everywhere in hal); ``device`` replaces the runner's; ``options`` go to the backend's
    constructor. Raises ``hal.NoBackendError`` (every backend with its reasons) when hal cannot
    serve the model here, ``UnsupportedError`` for what hal does not compute at all (an fp8 or
    HND KV cache, SGLang's unified memory pool, DeepSeek's sparse attention...).

    ``hal_backend`` is the hal backend, ``selection`` how it was chosen (``selection.trace``),
    ``config`` the ``AttentionConfig`` derived from the runner (:func:`attention_config`).
    """

    # SGLang's attention kit knows two sliding-window decode rules; hal's is the extend rule for
    # every mode: a query at position p sees keys p - W .. p (W + 1 keys).
    swa_decode_rule = "extend_window"

    def __init__(self, model_runner, *, backend: str | None = None, device: str | None = None, **options):
        super().__init__()
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = serve_pool(model_runner.token_to_kv_pool)  # NPU pools' 4-D buffers as hal's
        translator = getattr(model_runner, "kv_index_translator", None)
        if getattr(translator, "is_translating", False):
            raise UnsupportedError(
                "SGLang's unified memory pool (a translating KVIndexTranslator): hal reads req_to_token slots as "
                "physical KV slots"
            )
        self.kv_index_translator = translator
        self.config = attention_config(model_runner)
        self._mla = (self.config.kv_lora_rank, self.config.qk_rope_head_dim) if self.config.is_mla else None
        self.selection = hal.select(
            self.config,
            device=device or runner_device(model_runner),
            prefill_backend=backend,
            decode_backend=backend,
        )
        cap = self.selection.capability
        pool_device = self.token_to_kv_pool.device
        if not _same_device(cap.torch_device, pool_device):
            raise ConfigError(
                f"hal chose device {self.selection.device_name!r} (tensors on {cap.torch_device}), but SGLang's KV "
                f"pool is on {pool_device}: set HAL_DEVICE to the runner's device"
            )
        self.hal_backend = self.selection.create(**options)
        self.hal_members = sglang_members(self.hal_backend)  # its answers to SGLang 0.5.21's members
        self.device = cap.torch_device
        self.needs_cpu_seq_lens = self.hal_backend.needs_cpu_seq_lens
        for name in _DECLARED:
            setattr(self, name, getattr(self.hal_members if name in MEMBERS else self.hal_backend, name, False))
        self.data_type = getattr(model_runner, "dtype", self.config.dtype)
        self.kv_cache_dtype = self.config.dtype
        self._layers: dict[int, tuple[object, hal.AttentionLayer]] = {}
        self._graph = False  # whether the current metadata was prepared for a graph step
        self._last: tuple[object, SGLangBatch] | None = None

    def __repr__(self) -> str:
        return f"HalAttnBackend({self.selection.device_name}/{self.selection.backend})"

    # -- what hal reads ----------------------------------------------------------------
    def hal_batch(self, forward_batch, graph_static: bool | None = None) -> SGLangBatch:
        """``forward_batch`` as hal reads it (the same view while SGLang passes the same object)."""
        graph_static = self._graph if graph_static is None else graph_static
        last = self._last
        if last is not None and last[0] is forward_batch and last[1].graph_static == graph_static:
            return last[1]
        view = SGLangBatch(forward_batch, self.req_to_token_pool, self.token_to_kv_pool, graph_static)
        self._last = (forward_batch, view)
        return view

    def hal_layer(self, layer) -> hal.AttentionLayer:
        """hal's descriptor of a ``RadixAttention``, built once per layer object."""
        entry = self._layers.get(id(layer))
        if entry is None or entry[0] is not layer:
            entry = (layer, layer if isinstance(layer, hal.AttentionLayer) else hal_layer(layer, self._mla))
            self._layers[id(layer)] = entry
        return entry[1]

    def _metadata_owner(self):
        backend, last = self.__dict__.get("hal_backend"), self.__dict__.get("_last")
        if isinstance(backend, HybridBackend) and last is not None:  # the phase of the current step
            return backend._for(last[1])
        return backend

    @property
    def forward_metadata(self):
        """The hal backend's current metadata (SGLang's field names where SGLang has one: ``kv_indptr``...)."""
        backend = self._metadata_owner()
        return None if backend is None else backend.forward_metadata

    @forward_metadata.setter
    def forward_metadata(self, value) -> None:  # SGLang's metadata snapshot / restore
        backend = self._metadata_owner()
        if backend is not None:
            backend.forward_metadata = value

    # -- SGLang's metadata contract --------------------------------------------------------
    def init_forward_metadata(self, forward_batch) -> None:
        """An eager step."""
        self._graph = False
        self.hal_backend.init_forward_metadata(self.hal_batch(forward_batch, False))

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """A graph step, before its capture (``in_capture``) or replay: hal's fixed-shape graph buffers."""
        self._graph = True
        self.hal_backend.init_forward_metadata_out_graph(self.hal_batch(forward_batch, True), in_capture)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        self.hal_backend.init_forward_metadata_in_graph(self.hal_batch(forward_batch))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.hal_backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.hal_backend.get_cuda_graph_seq_len_fill_value()

    def get_cpu_graph_seq_len_fill_value(self) -> int:
        return self.hal_backend.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self) -> None:
        self.hal_backend.on_after_cuda_graph_warmup()

    def support_triton(self) -> bool:
        """Whether SGLang may run its own Triton helper kernels (positions, ``req_to_token`` writes, the
        last KV slot of each request) on this backend's tensors: hal's backend allows Triton and hal's
        device has a compiled Triton target (not the CPU interpreter: SGLang's helpers pass raw pointers)."""
        cap = self.selection.capability
        return bool(self.hal_backend.support_triton() and cap.triton_target and not cap.triton_interpreted)

    def get_indexer_metadata(self, layer_id: int, forward_batch):
        return None

    # -- SGLang 0.5.21's additions: hal's backend answers ----------------------------------
    def shared_read_ends(self, fm) -> SharedReadEnds:
        """SGLang's ``SharedReadEnds`` member of the same name as hal's backend's answer."""
        ends = self.hal_members.shared_read_ends(fm)
        return ends if SharedReadEnds is None else SharedReadEnds[ends.name]

    def prepare_prefill_shared_read_snapshot(self, forward_batch, *, num_qo_tokens: int) -> None:
        view = self.hal_batch(forward_batch)
        self.hal_members.prepare_prefill_shared_read_snapshot(view, num_qo_tokens=num_qo_tokens)

    def draft_extend_metadata_captured_in_graph(self) -> bool:
        return self.hal_members.draft_extend_metadata_captured_in_graph()

    def prepare_full_cuda_graph_chunked_prefix(self, forward_batch, *, in_capture: bool) -> None:
        self.hal_members.prepare_full_cuda_graph_chunked_prefix(self.hal_batch(forward_batch), in_capture=in_capture)

    def validate_elastic_cuda_graph_recapture(self) -> None:
        self.hal_members.validate_elastic_cuda_graph_recapture()

    @property
    def verify_mask(self):
        return self.hal_members.verify_mask

    def get_verify_buffers_to_fill_after_draft(self) -> list:  # SGLang before 0.5.21 asks this instead
        return self.hal_backend.get_verify_buffers_to_fill_after_draft()

    # ======================================================================================= SGLang 0.5.23
    # SGLang 0.5.23's additions to its base class (python/sglang/srt/layers/attention/base_attn_backend.py),
    # answered here, not in hal's core contract: each is a question one of SGLang's runners asks the backend
    # object. The names are SGLANG_0523_MEMBERS. (0.5.23 also dropped prepare_prefill_shared_read_snapshot,
    # which stays above for 0.5.21's runners.) ForwardBatch's new fields need nothing from hal:
    # ``kv_loc_plan`` / ``out_cache_loc_is_physical`` (KVLocPlan.bind) translate slots only under the unified
    # pool, which __init__ refuses, so ``out_cache_loc`` is the pool's own slot ids; ``max_seq_len_host`` and
    # ``contains_last_prefill_chunk`` are read through SGLangBatch by whoever wants them (hal reads seq_lens_cpu).

    # DeepSeek-V4.1's encoder sliding-window replay folded into the extend (managers/tp_worker.py): hal serves
    # no DSV4 attention, so SGLang replays the window before the extend, as for every other backend.
    folds_encoder_swa_replay: bool = False
    # Prefill CUDA graphs (model_executor/runner/prefill_cuda_graph_runner.py): hal captures no prefill
    # metadata for breakable graphs (use_captured_forward_metadata_for_breakable_cuda_graph is False), so no
    # bound on the requests one replay carries; its graph buffers cover req_to_token's whole width, so no
    # context limit of its own; and an idle DP rank still prepares metadata (hal's forward reads it).
    prefill_cuda_graph_max_batch_size: int | None = None
    prefill_cuda_graph_default_max_seq_len: int | None = None
    skips_prefill_metadata_on_idle_dp_rank: bool = False
    # Diffusion LLM attention (the graph runners' dllm hooks): hal refuses DLLM_EXTEND (hal.batch.REFUSED_MODES).
    dllm_attention = None

    def get_fused_kv_write_buffers(self, layer, forward_batch):
        """None: no fused writer. SGLang's models that fuse RoPE with the KV write (models/mimo_v2.py) then write
        through the attention call as usual; hal writes the KV itself in ``forward`` (quantising fp8 with the
        layer's scales, in one call with the attention on the CPU) and takes no ``k=None`` call."""
        return None

    def glue_target_verify_metadata(self) -> str:
        """Why the target-verify metadata prep may not be captured into SGLang's glue graph (DSpark,
        decode_cuda_graph_runner.py): hal's ``init_forward_metadata_out_graph`` reads the batch's host lengths
        (``needs_cpu_seq_lens``); only ``init_forward_metadata_in_graph`` is recordable."""
        return "hal prepares verify metadata from host sequence lengths, outside the graph (out_graph)"

    def glue_draft_metadata(self) -> str:
        """Why the draft metadata prep may not be glued: hal is no draft backend (SGLang's multi-step draft
        decode needs one) and its out-of-graph prep reads host lengths."""
        return "hal is not a multi-step draft backend; its metadata prep reads host sequence lengths"

    def resolve_prefill_shared_read_ends(self, forward_batch, *, num_qo_tokens: int, build_snapshot: bool = True):
        """The prefill's read end SGLang may publish (eager_runner.py, prefill_cuda_graph_runner.py): hal's
        backends declare none earlier than the whole forward (``shared_read_ends``: UNKNOWN in every mode), so
        there is nothing to snapshot, whatever SGLang's WAR-barrier switches say."""
        return self.shared_read_ends(forward_batch.forward_mode)

    def late_layer_num_tokens(self, forward_batch) -> int | None:
        """None: no late-layer row switch (DeepSeek-V4.1's decoder SWA bounded replay, forward_batch_info.py)."""
        return None

    # ======================================================================================= end SGLang 0.5.23

    # -- forward -----------------------------------------------------------------------
    def _call(self, method: str, q, k, v, layer, forward_batch, save_kv_cache: bool, kwargs: dict):
        given = sorted(key for key in _KWARGS_REFUSED if kwargs.get(key) is not None)
        if given:
            raise UnsupportedError(f"hal's attention takes no {given} (layer {getattr(layer, 'layer_id', '?')})")
        batch = self.hal_batch(forward_batch)
        sinks = {} if kwargs.get("sinks") is None else {"sinks": kwargs["sinks"]}
        return getattr(self.hal_backend, method)(
            q, k, v, self.hal_layer(layer), batch, save_kv_cache=save_kv_cache, **sinks
        )

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """SGLang's ``forward``, routed by hal (MIXED goes to ``forward_mixed`` where the device fuses it)."""
        return self._call("forward", q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._call("forward_decode", q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._call("forward_extend", q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._call("forward_mixed", q, k, v, layer, forward_batch, save_kv_cache, kwargs)


# ----------------------------------------------------------------------------- registration


def register(name: str = "hal", *, backend: str | None = None, device: str | None = None):
    """Add ``name`` to SGLang's attention registry (and its ``--attention-backend`` choices).

    ``backend`` / ``device`` fix hal's choice for this name, so SGLang's own split works
    with hal backends: ``register("hal_triton", backend="triton")`` then
    ``--prefill-attention-backend hal --decode-attention-backend hal_triton``. Returns the
    factory SGLang calls with its model runner.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"name = {name!r}: expected a non-empty string")

    def factory(model_runner):
        built = HalAttnBackend(model_runner, backend=backend, device=device)
        _BUILT[name] = built
        if built.config.is_mla:
            route_deepseek_to_latent_attention(name)
        return built

    factory.__name__ = factory.__qualname__ = f"create_{name}_backend"
    factory.swa_decode_rule = HalAttnBackend.swa_decode_rule
    ATTENTION_BACKENDS[name] = factory
    try:
        from sglang.srt.arg_groups import choices
    except ImportError:  # an SGLang without extensible choice lists: the registry entry is what counts
        choices = None
    # Not a draft-model choice: SGLang's speculative draft decode needs multi-step draft backends.
    if choices is not None and name not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([name])
    _REGISTERED[name] = (backend, device)
    return factory


# ----------------------------------------------------------------------------- SGLang's name-based decisions
#
# SGLang decides some things by the attention backend's *name* rather than by asking the backend.
# For hal's names these hooks (SGLang's own HookRegistry, applied by its plugin loader in every
# process) answer from the hal backend built under that name. docs/sglang.md lists the rest.

_BUILT: dict[str, HalAttnBackend] = {}  # name -> the backend SGLang built under it in this process


def backend_supports_triton(name: str) -> bool:
    """SGLang's ``support_triton(name)`` for a name registered with :func:`register`.

    The answer of the ``HalAttnBackend`` built under ``name`` in this process
    (:meth:`HalAttnBackend.support_triton`: hal's backend and device). Before one is built, False:
    SGLang's torch helper paths run on every device.
    """
    built = _BUILT.get(name)
    return built is not None and built.support_triton()


def _support_triton_hook(original, backend, *args, **kwargs) -> bool:
    """Around ``sglang.srt.utils.common.support_triton``: hal's names answer from hal."""
    if backend in _REGISTERED:
        return backend_supports_triton(backend)
    return original(backend, *args, **kwargs)


def _get_last_loc_hook(original, req_to_token, req_pool_indices_tensor, prefix_lens_tensor):
    """Around ``sglang.srt.mem_cache.allocation.get_last_loc``, which picks its Triton kernel unless a
    half is named ``ascend`` or ``torch_native``: with a hal half it is Triton only where both halves
    support Triton."""
    from sglang.srt.mem_cache import allocation
    from sglang.srt.runtime_context import attention_backends
    from sglang.srt.utils import common

    names = attention_backends()
    if any(name in _REGISTERED for name in names) and not all(common.support_triton(name) for name in names):
        return allocation.get_last_loc_torch(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
    return original(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)


def _latent_attention_method(attn, forward_batch):
    """SGLang's DeepSeek attention-method handler for a hal name: the absorbed MLA path in every mode (hal's
    backend computes latent attention over the ``MLATokenToKVPool``; it never sees the MHA companion layer)."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    return AttnForwardMethod.MLA


def route_deepseek_to_latent_attention(name: str) -> None:
    """SGLang's DeepSeek models (``deepseek_common/attention_backend_handler.py``) choose their attention method
    by the backend's *name*, an unknown name getting Triton's choice: plain MHA over the MLA pool's
    ``attn_mha`` companion for prefills, which no latent cache describes. For ``name`` they take the absorbed
    latent path instead (:func:`_latent_attention_method`). Called when hal's backend is built for an MLA
    pool, so other models never import SGLang's DeepSeek code."""
    try:
        from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    except ImportError:  # an SGLang without the registry: its DeepSeek code asks nobody
        return
    AttentionBackendRegistry.register(name, _latent_attention_method)


# SGLang's dotted target -> hal's AROUND hook
NAME_DECISION_HOOKS = {
    "sglang.srt.utils.common.support_triton": _support_triton_hook,
    "sglang.srt.mem_cache.allocation.get_last_loc": _get_last_loc_hook,
}


def install_hooks() -> None:
    """Register :data:`NAME_DECISION_HOOKS` with SGLang's ``HookRegistry`` (its plugin loader applies
    them, and propagates each to every module that imported the original by name). Idempotent."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in NAME_DECISION_HOOKS.items():
        if not any(registered is hook for _, registered, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, HookType.AROUND)


def sglang_plugin() -> None:
    """SGLang's plugin hook (entry point group ``sglang.srt.plugins``): registers ``hal`` and
    ``hal_<backend>`` for every backend of every hal device, and hal's answers to SGLang's
    name-based decisions (:func:`install_hooks`)."""
    from hal.registry import device_backends, get_registry

    install_hooks()
    register("hal")
    for device in get_registry().devices.values():
        classes, _ = device_backends(device)
        for cls in classes:
            name = cls.declaration().name
            if f"hal_{name}" not in _REGISTERED:
                register(f"hal_{name}", backend=name)
