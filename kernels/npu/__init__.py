"""Thin wrappers over torch_npu's attention ops, plus a CPU emulation of their contracts.

``hal.kernels.npu.ops`` holds the wrappers (re-exported here); ``hal.kernels.npu.emulation``
the plain-torch emulation (``emulation.torch_npu`` stands in for the ``torch_npu`` module).
"""

from . import contracts, emulation
from .ops import (
    FIA_TND_HEAD_DIMS,
    GENERATIONS,
    MLA_OP_NAMES,
    OP_NAMES,
    block_tables,
    buffer_pages,
    fia_causal_mask,
    generation_of_arch,
    generation_of_soc,
    is_emulation,
    load_atb,
    load_torch_npu,
    mla_attention,
    mla_decode,
    mla_unsupported_reasons,
    nz_mask,
    nz_pages,
    paged_attention_sinks,
    paged_decode,
    paged_mixed,
    paged_prefill,
    resolve_ops,
    scatter_rows,
    sink_unsupported_reasons,
    splitfuse_mask,
    splitfuse_mask_value,
    unsupported_reasons,
    write_kv,
    write_latent,
)

__all__ = [
    "emulation",
    "contracts",
    "FIA_TND_HEAD_DIMS",
    "GENERATIONS",
    "generation_of_arch",
    "generation_of_soc",
    "OP_NAMES",
    "MLA_OP_NAMES",
    "mla_attention",
    "mla_decode",
    "mla_unsupported_reasons",
    "write_latent",
    "paged_attention_sinks",
    "sink_unsupported_reasons",
    "block_tables",
    "fia_causal_mask",
    "is_emulation",
    "load_atb",
    "load_torch_npu",
    "paged_decode",
    "paged_mixed",
    "paged_prefill",
    "buffer_pages",
    "resolve_ops",
    "splitfuse_mask",
    "splitfuse_mask_value",
    "unsupported_reasons",
    "write_kv",
    "scatter_rows",
    "nz_pages",
    "nz_mask",
]


def __getattr__(name: str):
    if name == "paged_view":  # deprecated (0.2.0): ops' __getattr__ warns and names buffer_pages
        from . import ops

        return ops.paged_view
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
