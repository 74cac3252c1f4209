"""What the Ascend backend's plan records for a step: :class:`AscendMetadata`, with the :class:`StepFacts` that
``routing`` reads. A module that imports nothing of the backend's, so that ``routing`` and the backend both read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hal.kernels.reference import KVIndices, kv_csr

__all__ = ["AscendMetadata", "MaskKey", "StepFacts"]

MaskKey = tuple[str, int]  # (kind: "causal" | "full" | "custom" | "tree", sliding window or -1)


@dataclass(frozen=True)
class StepFacts:
    """The facts of a step that choose a layer's route besides the layer (hashable: routes are memoised on it)."""

    generation: str | None  # the chip generation (hal.kernels.npu.GENERATIONS); None: unknown
    page_size: int
    dtype: torch.dtype  # the KV cache dtype, which the ops compute in
    op_dtype: torch.dtype  # the dtype whose op limits apply (the emulation computes fp32 where the ops take bf16)
    long_kv: bool = False  # some request reads more keys than FIA takes at one query token (contracts: "kv_len")


@dataclass
class AscendMetadata:
    """One step's metadata. Host lists per request; device tensors filled in ``in_graph``."""

    batch_size: int
    num_tokens: int
    max_blocks: int  # block-table columns (a host int: static under graph capture)
    query_lens: list[int]  # query tokens per request (splitfuse ``seq_len``)
    kv_lens: list[int]  # KV tokens per request, the new ones included (``context_lens``)
    dtype: torch.dtype  # the KV cache dtype, which the ops compute in
    graph_static: bool = False
    custom_mask: torch.Tensor | None = None  # TARGET_VERIFY: hal's flat bool mask (device)
    block_table: torch.Tensor | None = None  # int32 [B, max_blocks] (device)
    masks: dict[MaskKey, torch.Tensor] = field(default_factory=dict)  # splitfuse masks [T, W] (device)
    page_size: int = 1
    # int64 [B * max_blocks * page_size]: when the batch's slots are not page-aligned, the pool slot of every
    # slot of a scratch paged cache that is (request b's pages at b * max_blocks ...); None when they are.
    relayout: torch.Tensor | None = None
    # 310P: the pool pages of the batch (int32 [B, max_blocks]) copied into the NZ cache that block_table numbers
    source_table: torch.Tensor | None = None
    facts: StepFacts | None = None  # what routes this step's layers (routing.attention_route...)
    step: str = ""  # the forward mode's step (routing.step_of): "decode", "extend", "mixed" or "target_verify"
    taken: list[str] = field(default_factory=list)  # "step:op" of every op this step ran (route_of)

    # SGLang's names for the same data (its attention kit and tools inspect them), built when read.
    @property
    def kv_indptr(self) -> torch.Tensor | None:
        """int32 ``[B + 1]``: 0, then the running sum of ``kv_lens``."""
        if self.block_table is None:
            return None
        return self._kv_csr().indptr.to(self.block_table.device)

    @property
    def kv_indices(self) -> torch.Tensor | None:
        """int32: the KV slot the ops read for every key (block table page * page_size + offset), CSR over
        ``kv_indptr``."""
        if self.block_table is None:
            return None
        return self._kv_csr().indices

    def _kv_csr(self) -> KVIndices:
        rows = torch.arange(self.block_table.shape[0], device=self.block_table.device)
        return kv_csr(self.kv_lens, rows, req_to_page=self.block_table, page_size=self.page_size)
