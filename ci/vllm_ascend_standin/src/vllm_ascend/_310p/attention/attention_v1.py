"""STAND-IN of ``vllm_ascend/_310p/attention/attention_v1.py`` (upstream commit
182b75ea84ff13ece27b57391331ef8935410aea): ``AscendAttentionBackend310``'s declarations, L47-99 (the 310P's
FRACTAL_NZ cache shape and kernel block sizes); impl and builder refuse as the base class's."""

from vllm_ascend.attention.attention_v1 import AscendAttentionBackend


class AscendAttentionBackend310(AscendAttentionBackend):
    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_type: str = ""):
        return (2, num_blocks, (num_kv_heads * head_size) // 16, block_size, 16)  # L55-81

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:  # L97-99
        return [128, 64]
