"""vLLM's general plugin (entry point group ``vllm.general_plugins``): hal's backends registered with vLLM
(:mod:`hal.integrations.vllm`), or on vllm-ascend's platform hal's route through its selection
(:mod:`hal.integrations.vllm_ascend`). Importing this module without vLLM raises
``hal.errors.MissingDependencyError``."""

from __future__ import annotations

import hal
from hal.integrations import vllm_ascend
from hal.integrations.vllm import ENV, enabled, logger, register

__all__ = ["vllm_plugin"]


def vllm_plugin() -> None:
    """vLLM's general plugin (entry point group ``vllm.general_plugins``, loaded in every vLLM process):
    ``CUSTOM`` -> hal always (used only when a user names it); ``CPU_ATTN`` -> hal only with ``HAL_VLLM=1``, except on
    vllm-ascend's platform, whose own selection hal's route wraps instead (:mod:`hal.integrations.vllm_ascend`)."""
    served = register(cpu=enabled() and not vllm_ascend.install())
    if "CPU_ATTN" in served:
        logger.info(
            "hal: %s=1: vLLM's %s attention is served by hal (hal %s); MLA models keep vLLM's CPU_MLA / AMX_MLA and "
            "encoder-only layers its CPU_ATTN",
            ENV,
            "/".join(served),
            hal.__version__,
        )
