"""STAND-IN of ``vllm_ascend/platform.py`` (upstream commit 182b75ea84ff13ece27b57391331ef8935410aea).

``NPUPlatform`` subclasses vLLM's CPU platform so that vLLM's CPU engine runs it (device type ``cpu``; the NPU is
hal's emulation, chosen with ``HAL_DEVICE=npu HAL_NPU_EMULATION=1``). What it keeps of upstream's is what decides the
attention backend and the runner: ``get_attn_backend_cls`` and the worker class.
"""

from vllm.platforms.cpu import CpuPlatform

from vllm_ascend.utils import is_310p


class NPUPlatform(CpuPlatform):
    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads: int | None = None):
        """Upstream L216-242, as it is but for FA3 (L220-221: only with ``rl_config.enable_training_consistency``,
        which the stand-in has not): ``selected_backend`` is ignored; class paths keyed by (MLA, sparse,
        compressed); on 310P every key maps to the 310P backend."""
        use_compress = getattr(attn_selector_config, "use_compress", False)
        key = (attn_selector_config.use_mla, attn_selector_config.use_sparse)

        backend_map = {
            (True, False, False): "vllm_ascend.attention.mla_v1.AscendMLABackend",
            (False, False, False): "vllm_ascend.attention.attention_v1.AscendAttentionBackend",
            (True, True, False): "vllm_ascend.attention.sfa_v1.AscendSFABackend",
            (True, False, True): "vllm_ascend.attention.dsa_v1.AscendDSABackend",
        }
        backend_map_310 = {
            (False, False): "vllm_ascend._310p.attention.attention_v1.AscendAttentionBackend310",
        }

        if is_310p():
            return backend_map_310.get(key, backend_map_310[(False, False)])

        return backend_map[(attn_selector_config.use_mla, attn_selector_config.use_sparse, use_compress)]

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        """The worker class as upstream's ``_setup_worker_and_scheduler`` chooses it (L1124-1131, Xlite aside), then
        vLLM's CPU platform's own checks."""
        parallel_config = vllm_config.parallel_config
        if parallel_config and parallel_config.worker_cls == "auto":
            if is_310p():
                parallel_config.worker_cls = "vllm_ascend._310p.worker_310p.NPUWorker310"
            else:
                parallel_config.worker_cls = "vllm_ascend.worker.worker.NPUWorker"
        super().check_and_update_config(vllm_config)
