"""STAND-IN of ``vllm_ascend/worker/model_runner_v1.py`` (upstream commit 182b75ea84ff13ece27b57391331ef8935410aea)
over vLLM 0.32's CPU model runner: what upstream's runner hands an attention backend.

* The runner's own backend, selected once for the model (L385-392).
* KV caches (``initialize_kv_cache_tensors``, L3692-3736): each attention layer's K and V as two raw buffers
  (``_allocate_kv_cache_tensors``, L3994-4060), viewed as a ``(k_cache, v_cache)`` pair of the backend's
  ``get_kv_cache_shape(...)[1:]`` (``_reshape_kv_cache_tensors``, L4354-4410), bound to the layers as they are.
  vLLM 0.32 packs its cache tensors differently from the vLLM upstream builds on, so each layer's pair is sized from
  ``kv_cache_config.num_blocks`` pages here, where upstream splits each shared tensor by the K and V head sizes.
* Each step, vLLM's ``CommonAttentionMetadata`` as upstream's ``AscendCommonAttentionMetadata`` (its fields as
  L2929-2971 fills them: the whole ``positions`` buffer, ``seq_lens_cpu`` None under asynchronous speculative
  decoding, the host upper bound as ``_seq_lens_cpu``), handed to the builder with upstream's keywords
  (``build(common_prefix_len=..., common_attn_metadata=...)``, L3013-3022, or ``build_for_cudagraph_capture``).

Block sizes as upstream: the block table counts the kernel block size ``select_common_block_size`` picks
(``may_reinitialize_input_batch``, L4466-4489; vLLM 0.32's runner picks it by the same function), while the caches
are allocated in blocks of the KV manager's size (L4354-4359), or, with hybrid blocks (more than one attention group,
L3639), of the backend's first kernel block size (L4322-4330), which may differ from the table's.

Host lengths: upstream corrects ``optimistic_seq_lens_cpu`` under asynchronous speculative decoding for the backends
``issubclass(attn_backend, (AscendAttentionBackend, AscendMLABackend))`` names (L453-459, L1199-1211; hal's classes
are registered as upstream's by ``hal.integrations.vllm_ascend.install``); vLLM's CPU runner schedules synchronously,
so the host lengths here are exact either way.
"""

from dataclasses import fields
from functools import partial

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.selector import get_attn_backend
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.utils import bind_kv_cache

from vllm_ascend.attention.utils import AscendCommonAttentionMetadata

_BASE_FIELDS = tuple(f.name for f in fields(CommonAttentionMetadata) if f.init)


class NPUModelRunner(CPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        super().__init__(vllm_config, device)
        self.attn_backend = get_attn_backend(  # L385-392
            0,
            self.dtype,
            None,
            use_mla=self.model_config.use_mla,
            use_sparse=False,
            use_mm_prefix=self.model_config is not None and self.model_config.is_mm_prefix_lm,
        )
        self.use_hybrid_blocks = False  # L366-367; set when the caches are made (L3639)

    # -- KV caches -------------------------------------------------------------------------
    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context=None):
        self.use_hybrid_blocks = len(self.attn_groups) > 1  # L3639
        kv_caches = self._layer_kv_caches(kv_cache_config)
        for layer_name, target_layer_name in self.shared_kv_cache_layers.items():  # L3707-3710
            kv_caches[layer_name] = kv_caches[target_layer_name]
        bind_kv_cache(kv_caches, self.compilation_config.static_forward_context, self.kv_caches)  # L3725-3734
        return kv_caches

    def _layer_kv_caches(self, kv_cache_config) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return self._reshape_kv_cache_tensors(kv_cache_config, self._allocate_kv_cache_tensors(kv_cache_config))

    def _attention_layers(self, kv_cache_config):
        """(layer name, its attention backend, its spec) for every layer upstream's runner allocates a cache for."""
        for group in self._kv_cache_spec_attn_group_iterator():
            for layer_name in group.layer_names:
                if layer_name in self.runner_only_attn_layers:
                    continue
                spec = group.kv_cache_spec
                if not isinstance(spec, AttentionSpec):
                    raise ValueError(
                        f"vllm-ascend STAND-IN: {layer_name}: {type(spec).__name__} caches are not stood in"
                    )
                yield layer_name, group.backend, spec

    def _allocate_kv_cache_tensors(self, kv_cache_config) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """L3994-4060 (a dense attention layer): K and V as two int8 buffers, split by their head sizes."""
        raw = {}
        for layer_name, _, spec in self._attention_layers(kv_cache_config):
            size = kv_cache_config.num_blocks * spec.page_size_bytes
            k_size = size * spec.head_size // (spec.head_size + spec.head_size_v)
            raw[layer_name] = (
                torch.zeros(k_size, dtype=torch.int8, device=self.device),
                torch.zeros(size - k_size, dtype=torch.int8, device=self.device),
            )
        return raw

    def _reshape_kv_cache_tensors(self, kv_cache_config, raw) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """L4354-4410 (a dense attention layer): the pair as ``get_kv_cache_shape(...)[1:]`` views."""
        kv_caches = {}
        for layer_name, attn_backend, spec in self._attention_layers(kv_cache_config):
            raw_k_tensor, raw_v_tensor = raw[layer_name]
            num_blocks = (raw_k_tensor.numel() + raw_v_tensor.numel()) // spec.page_size_bytes
            assert num_blocks >= kv_cache_config.num_blocks
            block_size = spec.block_size
            if getattr(self, "use_hybrid_blocks", False):  # L4322-4330: the backend's first kernel block size
                block_size = attn_backend.get_supported_kernel_block_sizes()[0]
            kv_cache_shape = attn_backend.get_kv_cache_shape(
                num_blocks * (spec.block_size // block_size), block_size, spec.num_kv_heads, spec.head_size
            )
            k_shape = kv_cache_shape[1:]
            v_shape = (*kv_cache_shape[1:-1], spec.head_size_v)
            k_cache = raw_k_tensor.view(spec.dtype).view(k_shape)
            v_cache = raw_v_tensor.view(spec.dtype).view(v_shape)
            kv_caches[layer_name] = (k_cache, v_cache)
        return kv_caches

    # -- the builders' calls ---------------------------------------------------------------
    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes) -> None:
        super().initialize_metadata_builders(kv_cache_config, kernel_block_sizes)
        for groups in self.attn_groups:
            for group in groups:
                group.build_metadata = partial(self._build_as_upstream, group)
                group.build_metadata_for_cudagraph_capture = partial(self._build_as_upstream, group, capture=True)

    def _build_as_upstream(self, group, cm, ubatch_idx=0, common_prefix_len=0, capture=False, **kwargs):
        builder = group.get_metadata_builder(ubatch_idx)
        ascend_cm = self._ascend_common_metadata(group._with_kernel_block_table(cm, ubatch_idx))
        if capture:  # L3017
            return builder.build_for_cudagraph_capture(ascend_cm)
        return builder.build(common_prefix_len=common_prefix_len, common_attn_metadata=ascend_cm, **kwargs)  # L3019

    def _ascend_common_metadata(self, cm) -> AscendCommonAttentionMetadata:
        """vLLM's metadata with upstream's fields as L2929-2971 fills them."""
        num_reqs = cm.num_reqs
        async_spec = bool(getattr(self, "use_async_spec_decode", False))
        return AscendCommonAttentionMetadata(
            **{name: getattr(cm, name) for name in _BASE_FIELDS if name != "positions"},
            positions=self.positions,  # the whole buffer (L2960)
            seq_lens_cpu=None if async_spec else self.optimistic_seq_lens_cpu[:num_reqs],  # L2929-2932, L2943
            num_computed_tokens_cpu=None if async_spec else self.input_batch.num_computed_tokens_cpu_tensor[:num_reqs],
            _seq_lens_cpu=self.optimistic_seq_lens_cpu[:num_reqs],  # L2939
            num_input_tokens=cm.num_actual_tokens,  # no graph padding on the CPU
            decode_token_per_req=1 + (self.speculative_config.num_speculative_tokens if self.speculative_config else 0),
        )
