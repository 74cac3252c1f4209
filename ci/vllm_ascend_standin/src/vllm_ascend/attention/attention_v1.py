"""STAND-IN of ``vllm_ascend/attention/attention_v1.py`` (upstream commit 182b75ea84ff13ece27b57391331ef8935410aea):
``AscendAttentionBackend``'s declarations, L73-149. Its impl and builder run torch_npu's kernels, which are not here:
they refuse. (Upstream's ``@register_backend(AttentionBackendEnum.CUSTOM, "ASCEND")``, L73, is left out: on vLLM
0.32 it would point ``CUSTOM`` at the class path ``"ASCEND"``; the enum member only names the backend there.)"""

from vllm.v1.attention.backend import AttentionBackend

NOT_HERE = (
    "vllm-ascend STAND-IN: {what} runs torch_npu's kernels, which are not here; with HAL_VLLM=1 hal serves this "
    "layer (hal.integrations.vllm_ascend)"
)


class AscendAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True  # L75

    @staticmethod
    def get_name() -> str:  # L77-79
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        raise RuntimeError(NOT_HERE.format(what="AscendAttentionBackendImpl"))

    @staticmethod
    def get_builder_cls():
        raise RuntimeError(NOT_HERE.format(what="AscendAttentionMetadataBuilder"))

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = ""
    ) -> tuple[int, ...]:  # L109-117
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:  # L147-149
        return [128]
