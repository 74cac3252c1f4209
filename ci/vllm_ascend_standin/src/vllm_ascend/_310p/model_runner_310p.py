"""STAND-IN of ``vllm_ascend/_310p/model_runner_310p.py`` (upstream commit 182b75ea84ff13ece27b57391331ef8935410aea):
the 310P runner's KV caches, ``_allocate_kv_cache_tensors`` L721-811: per attention layer a ``(k_cache, v_cache)``
pair of the runner backend's ``get_kv_cache_shape(...)[1:]`` (FRACTAL_NZ on 310P), at the first kernel block size
with ``block_size * head_size <= 128 * 128`` (L771-777). Upstream allocates them with
``torch_npu.empty_with_format(..., acl_format=ACL_FORMAT_FRACTAL_NZ)`` (L792-797); on the CPU the chip is hal's NPU
emulation, whose torch_npu records a tensor's format when ``npu_format_cast`` makes it (and keeps the memory plain)."""

import torch

from vllm_ascend.utils import ACL_FORMAT_FRACTAL_NZ, empty_with_format
from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

_ATTENTION_BLOCK_SIZE_LIMIT = 128 * 128  # L65


class NPUModelRunner310(NPUModelRunner):
    def _layer_kv_caches(self, kv_cache_config) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        kv_cache = {}
        for layer_name, _, spec in self._attention_layers(kv_cache_config):
            num_blocks = kv_cache_config.num_blocks
            supported_sizes = [
                support_size
                for support_size in self.attn_backend.get_supported_kernel_block_sizes()
                if support_size * spec.head_size <= _ATTENTION_BLOCK_SIZE_LIMIT
            ]
            block_size = supported_sizes[0] if supported_sizes else spec.block_size
            if block_size != spec.block_size:
                raise ValueError(
                    f"vllm-ascend STAND-IN: the 310P runner splits {spec.block_size}-token blocks into "
                    f"{block_size}-token kernel blocks, which vLLM 0.32's block tables do not; set --block-size to "
                    f"{block_size}"
                )
            kv_cache_shape = self.attn_backend.get_kv_cache_shape(
                num_blocks, block_size, spec.num_kv_heads, spec.head_size
            )
            k_shape = kv_cache_shape[1:]
            v_shape = k_shape
            k_cache = empty_with_format(
                size=k_shape, dtype=spec.dtype, device=self.device, acl_format=ACL_FORMAT_FRACTAL_NZ
            )
            v_cache = empty_with_format(
                size=v_shape, dtype=spec.dtype, device=self.device, acl_format=ACL_FORMAT_FRACTAL_NZ
            )
            kv_cache[layer_name] = (k_cache, v_cache)
        return kv_cache
