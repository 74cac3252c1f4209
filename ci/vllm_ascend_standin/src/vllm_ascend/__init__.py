"""STAND-IN for vllm-ascend: not vllm-ascend. hal's CPU tests only (tests/test_vllm_ascend.py).

vllm-ascend (https://github.com/vllm-project/vllm-ascend) needs torch_npu and an Ascend NPU. This package keeps the
parts of its contract that decide how vLLM's engine meets an attention backend, each module under upstream's module
path and each piece citing the upstream lines it follows, at commit :data:`UPSTREAM_COMMIT`:

* ``vllm_ascend.platform.NPUPlatform``: upstream's ``get_attn_backend_cls`` selection and worker choice, over vLLM's
  CPU platform (so that vLLM's CPU engine runs);
* ``vllm_ascend.attention.attention_v1.AscendAttentionBackend`` and
  ``vllm_ascend._310p.attention.attention_v1.AscendAttentionBackend310``: upstream's declarations (name, cache
  shape, kernel block sizes, output buffer); their NPU kernels are not here, so their impl and builder refuse;
* ``vllm_ascend.attention.utils.AscendCommonAttentionMetadata``: upstream's per-step metadata fields;
* ``vllm_ascend.worker`` / ``vllm_ascend._310p``: the workers and model runners, as far as vLLM 0.32's CPU runner
  allows: per-layer ``(k_cache, v_cache)`` caches from the backend's ``get_kv_cache_shape`` (FRACTAL_NZ-shaped on
  310P) and the builder called as upstream calls it.

``register`` (upstream's ``vllm.platform_plugins`` entry point) activates the platform only when
``VLLM_ASCEND_STANDIN`` is ``A2`` (or ``1``) or ``310P`` (the chip the stand-in reports:
:func:`vllm_ascend.utils.is_310p`).
"""

import os

UPSTREAM_COMMIT = "182b75ea84ff13ece27b57391331ef8935410aea"
STANDIN_ENV = "VLLM_ASCEND_STANDIN"


def register() -> str | None:
    """vLLM's platform plugin (upstream ``vllm_ascend/__init__.py`` L64-67), active only under
    ``VLLM_ASCEND_STANDIN``."""
    if os.environ.get(STANDIN_ENV, "0").strip() in ("", "0"):
        return None
    return "vllm_ascend.platform.NPUPlatform"
