"""hal inside vllm-ascend: its engine's dense attention served by hal's ``npu`` device (or any NPU plugin).

vllm-ascend is vLLM's platform plugin for Ascend NPUs. Its ``NPUPlatform.get_attn_backend_cls`` ignores the
backend a user selects and returns its own class paths, keyed by (MLA, sparse, compressed) attention
(``vllm_ascend/platform.py`` L216-242 at :data:`UPSTREAM_COMMIT`), so neither ``--attention-backend CUSTOM`` nor an
override of an enum member reaches hal. With ``HAL_VLLM=1``, :func:`install` (run by hal's vLLM plugin in every
process) wraps that method on vllm-ascend's platform class: it asks upstream first and, where upstream answers with
its dense backend for a decoder layer hal serves, answers hal's class of the same contract instead:

* :data:`UPSTREAM_DENSE` (A2, A3, A5) -> :class:`HalAscendAttentionBackend`: ``get_name()`` ``CUSTOM``, caches of
  ``get_kv_cache_shape`` ``(2, num_blocks, block_size, kv_heads, head_size)``, which vllm-ascend's runner allocates
  as a per-layer ``(k_cache, v_cache)`` pair of ``shape[1:]`` (``vllm_ascend/worker/model_runner_v1.py``
  L4305-4410), read in place as token-major pages;
* :data:`UPSTREAM_310P` (Atlas 300I) -> :class:`HalAscend310PAttentionBackend`: ``(2, num_blocks, kv_heads *
  head_size // 16, block_size, 16)``, the pair allocated FRACTAL_NZ (``vllm_ascend/_310p/model_runner_310p.py``
  L764-801), read in place as hal's ``fractal_nz`` pages.

MLA, sparse (SFA), compressed (DSA) and FA3 attention, encoder-only layers and multimodal prefix models keep
upstream's answer. What hal's route does not serve on vllm-ascend is refused when the engine starts
(:func:`refuse_unserved_ascend_features`): ModelSlim KV-cache quantization (C8, FA quant), the Xlite worker, and,
as on every platform, context parallelism (hal.integrations.vllm). vllm-ascend's full graphs are not declared: its
FULL mode patches its own ops' parameters after each replay through ``impl_cls.update_graph_params``
(``vllm_ascend/compilation/acl_graph.py`` L279-296, called from ``model_runner_v1.py`` L2607-2627), which has no
counterpart for a foreign backend, so hal's builder answers ``AttentionCGSupport.NEVER`` and vLLM keeps piecewise
graphs with attention run eagerly.

Run on the CPU only: vLLM's CPU engine under a stand-in of vllm-ascend's platform and runner
(``ci/vllm_ascend_standin``) with hal's NPU emulation (``HAL_DEVICE=npu HAL_NPU_EMULATION=1``); see docs/vllm.md.
"""

from __future__ import annotations

from hal.errors import UnsupportedError, expect
from hal.integrations.vllm import (
    ENV,
    AttentionCGSupport,
    AttentionType,
    HalAttentionBackend,
    HalAttentionImpl,
    HalMetadataBuilder,
    enabled,
    logger,
)
from hal.integrations.vllm_steps import common_block_size
from hal.kv_layouts import FRACTAL_NZ, TOKEN_MAJOR

__all__ = [
    "UPSTREAM_COMMIT",
    "ASCEND_PLATFORM",
    "UPSTREAM_DENSE",
    "UPSTREAM_310P",
    "HalAscendAttentionBackend",
    "HalAscend310PAttentionBackend",
    "HalAscendMetadataBuilder",
    "HalAscendAttentionImpl",
    "is_ascend_platform",
    "install",
    "refuse_unserved_ascend_features",
]

UPSTREAM_COMMIT = "182b75ea84ff13ece27b57391331ef8935410aea"  # the vllm-ascend source this route is read against
ASCEND_PLATFORM = "vllm_ascend.platform.NPUPlatform"
UPSTREAM_DENSE = "vllm_ascend.attention.attention_v1.AscendAttentionBackend"
UPSTREAM_310P = "vllm_ascend._310p.attention.attention_v1.AscendAttentionBackend310"
_STATE = {"registered": False}  # install() made hal's classes virtual subclasses of upstream's


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _preferred_first(sizes: list, preferred: tuple[int, ...]) -> list:
    """``sizes`` with those of ``preferred`` first, in its order: vllm-ascend's runners take the first kernel block
    size a backend lists (``model_runner_v1.py`` L4323, ``model_runner_310p.py`` L771-777)."""
    first = [size for size in preferred if size in sizes]
    return first + [size for size in sizes if size not in first]


class HalAscendMetadataBuilder(HalMetadataBuilder):
    """hal's builder under vllm-ascend: refuses what the route does not serve before selecting, and declares no full
    graphs (vllm-ascend drives FULL mode through its own backends' ``update_graph_params``)."""

    cache_packing = "split"  # vllm-ascend's runner hands each layer a (k_cache, v_cache) pair

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device):
        refuse_unserved_ascend_features(vllm_config)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.NEVER

    @classmethod
    def table_block_size(cls, kv_cache_spec, backend_cls: type) -> int:
        """vllm-ascend makes its builders for the KV manager's block size (``model_runner_v1.py``
        ``create_attn_groups``, L4613-4625) while its block table counts the kernel block size
        ``select_common_block_size`` picks (L4466-4489): that one
        (:func:`~hal.integrations.vllm_steps.common_block_size`). The caches it allocates may use another (the
        backend's first, under hybrid blocks: L4322-4330), which hal's pool reads in place where token-major. The
        310P runner counts its table in the manager's size."""
        if backend_cls.hal_kv_layouts() != (TOKEN_MAJOR,):
            return kv_cache_spec.block_size
        return common_block_size(kv_cache_spec.block_size, backend_cls.get_supported_kernel_block_sizes())

    @classmethod
    def reads_device_seq_lens(cls, vllm_config) -> bool:
        """Not where vllm-ascend's runner corrects its host lengths for hal's classes (:func:`install` registers them
        as upstream's): it then does so under asynchronous speculative decoding (``model_runner_v1.py`` L453-459,
        L1199-1211), and the bound hal reads is exact (L2937-2942)."""
        return super().reads_device_seq_lens(vllm_config) and not _STATE["registered"]


class HalAscendAttentionImpl(HalAttentionImpl):
    """hal's impl under vllm-ascend: ``update_graph_params`` (what vllm-ascend's FULL graph mode calls after a
    replay) refuses, naming why, should a full graph ever be replayed over hal's layers."""

    @classmethod
    def update_graph_params(cls, *args, **kwargs) -> None:
        raise UnsupportedError(
            "vllm-ascend's full graph replay (update_full_graph_params) over hal's attention: hal declares "
            "AttentionCGSupport.NEVER there; serve with piecewise graphs (cudagraph_mode PIECEWISE) or --enforce-eager"
        )


class HalAscendAttentionBackend(HalAttentionBackend):
    """hal in place of vllm-ascend's ``AscendAttentionBackend`` (``vllm_ascend/attention/attention_v1.py`` L74-149):
    the same name (``CUSTOM``), cache shape ``(2, num_blocks, block_size, kv_heads, head_size)`` and output buffer;
    vllm-ascend's runner splits it into a token-major ``(k_cache, v_cache)`` pair, which hal reads in place."""

    accept_output_buffer = True
    upstream_block_sizes: tuple[int, ...] = (128,)  # AscendAttentionBackend.get_supported_kernel_block_sizes

    @staticmethod
    def get_builder_cls() -> type[HalAscendMetadataBuilder]:
        return HalAscendMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[HalAscendAttentionImpl]:
        return HalAscendAttentionImpl

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list:
        """The page sizes the hal device's backends take, upstream's own first (its runners take the first)."""
        return _preferred_first(
            HalAttentionBackend.get_supported_kernel_block_sizes(kv_cache_spec), cls.upstream_block_sizes
        )

    @classmethod
    def hal_kv_layouts(cls) -> tuple[str, ...]:
        return (TOKEN_MAJOR,)

    @classmethod
    def allocated_kv_layout(cls, vllm_config) -> str:
        """vllm-ascend's runner allocates from :meth:`get_kv_cache_shape` alone (``model_runner_v1.py`` L4305-4410),
        not from vLLM's layout table."""
        return cls.hal_kv_layouts()[0]


class HalAscend310PAttentionBackend(HalAscendAttentionBackend):
    """hal in place of vllm-ascend's ``AscendAttentionBackend310`` (``vllm_ascend/_310p/attention/attention_v1.py``
    L48-99): FRACTAL_NZ caches ``(2, num_blocks, kv_heads * head_size // 16, block_size, 16)``, which the 310P runner
    allocates as an NZ ``(k_cache, v_cache)`` pair of ``shape[1:]`` and hal reads in place (``fractal_nz`` pages: hal's
    selection then needs a backend that reads them, the npu device's on a 310P)."""

    upstream_block_sizes = (128, 64)  # AscendAttentionBackend310.get_supported_kernel_block_sizes

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads * head_size // 16, block_size, 16)

    @classmethod
    def hal_kv_layouts(cls) -> tuple[str, ...]:
        return (FRACTAL_NZ,)

    @classmethod
    def supported_kv_cache_layouts(cls) -> None:
        return None  # vLLM's layout table has no FRACTAL_NZ; vllm-ascend's 310P runner does not read it


HAL_FOR_UPSTREAM = {UPSTREAM_DENSE: HalAscendAttentionBackend, UPSTREAM_310P: HalAscend310PAttentionBackend}


def hal_serves(selector_config) -> bool:
    """Whether hal serves a layer of vLLM's ``AttentionSelectorConfig``: dense (no MLA, sparse or compressed
    attention) decoder attention, without a multimodal prefix (per-request causality)."""
    attn_type = getattr(selector_config, "attn_type", None) or AttentionType.DECODER
    return not (
        selector_config.use_mla
        or selector_config.use_sparse
        or getattr(selector_config, "use_compress", False)
        or getattr(selector_config, "use_mm_prefix", False)
        or attn_type != AttentionType.DECODER
    )


def is_ascend_platform(platform_cls: type) -> bool:
    """Whether ``platform_cls`` is vllm-ascend's ``NPUPlatform`` or a subclass of it (by name: vllm_ascend is not
    imported here)."""
    return any(_path(cls) == ASCEND_PLATFORM for cls in platform_cls.__mro__)


def install(platform_cls: type | None = None) -> bool:
    """With ``HAL_VLLM=1`` on vllm-ascend's platform (``platform_cls``, default vLLM's current one): wrap its
    ``get_attn_backend_cls`` so that the dense layers hal serves get hal's class (:data:`HAL_FOR_UPSTREAM`), every
    other answer upstream's unchanged. Returns whether the route is on. Idempotent."""
    if not enabled():
        return False
    if platform_cls is None:
        from vllm.platforms import current_platform

        platform_cls = type(current_platform)
    if not is_ascend_platform(platform_cls):
        return False
    upstream = platform_cls.get_attn_backend_cls
    if getattr(upstream, "hal_upstream", None) is not None:
        return True

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        path = upstream(selected_backend, attn_selector_config, num_heads=num_heads)
        hal_cls = HAL_FOR_UPSTREAM.get(path)
        if hal_cls is None or not hal_serves(attn_selector_config):
            return path
        return _path(hal_cls)

    get_attn_backend_cls.hal_upstream = upstream
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    _register_as_upstreams()
    logger.info(
        "hal: %s=1 on vllm-ascend's platform (%s): its dense attention (%s) is served by hal; MLA, sparse, compressed "
        "and FA3 attention keep vllm-ascend's backends",
        ENV,
        _path(platform_cls),
        ", ".join(path.rsplit(".", 1)[-1] for path in HAL_FOR_UPSTREAM),
    )
    return True


def _register_as_upstreams() -> None:
    """Make each hal class a virtual subclass of the upstream class it stands for (``ABCMeta.register``): vllm-ascend's
    runner asks ``issubclass(attn_backend, (AscendAttentionBackend, AscendMLABackend))`` to decide whether to correct
    its host sequence lengths under asynchronous speculative decoding (``model_runner_v1.py`` L453-459, L1199-1211)
    and its V2 speculator whether the model is GQA (``worker/v2/spec_decode/autoregressive/speculator.py``
    L195-204); hal's classes serve that contract, so they answer as upstream's."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    for upstream_path, hal_cls in HAL_FOR_UPSTREAM.items():
        try:
            upstream = resolve_obj_by_qualname(upstream_path)
        except (ImportError, AttributeError):  # a vllm-ascend without that class: nothing to stand for
            continue
        register = getattr(upstream, "register", None)  # ABCMeta's (vLLM's AttentionBackend is an ABC)
        if register is not None:
            register(hal_cls)
            _STATE["registered"] = True


def refuse_unserved_ascend_features(vllm_config) -> None:
    """Refuse, when the engine starts, what vllm-ascend may enable that hal's route does not serve:

    * ModelSlim KV-cache quantization (``fa_quant_type``, ``kv_cache_type: C8``, ``indexer_quant_type``): the runner
      then allocates int8 caches (``model_runner_v1.py`` L4391-4394) and the layers carry quantization methods hal's
      attention does not apply (``vllm_ascend/quantization/modelslim_config.py`` L741-751, L1035-1043);
    * the Xlite worker (``additional_config.xlite_graph_config.enabled``): it runs the model in openEuler's Xlite
      runtime from vllm-ascend's own attention metadata (``vllm_ascend/xlite/xlite.py`` L73), not hal's."""
    quant = getattr(vllm_config, "quant_config", None)
    kv_quant = [
        name for name in ("enable_fa_quant", "enable_c8_quant", "enable_indexer_quant") if getattr(quant, name, False)
    ]
    expect(
        not kv_quant,
        UnsupportedError,
        "vllm-ascend KV-cache quantization (quant_config)",
        kv_quant,
        "none: hal reads the model dtype or fp8 caches with per-tensor scales, not ModelSlim's int8 (C8 / FA quant) "
        f"caches; unset {ENV} to serve this model with vllm-ascend's own attention",
    )
    additional = getattr(vllm_config, "additional_config", None) or {}
    xlite = additional.get("xlite_graph_config") or {}
    expect(
        not (xlite.get("enabled") if isinstance(xlite, dict) else getattr(xlite, "enabled", False)),
        UnsupportedError,
        "additional_config.xlite_graph_config.enabled",
        True,
        f"False: the Xlite worker runs attention in its own runtime, not through hal; unset {ENV} to use Xlite",
    )
