"""STAND-IN of ``vllm_ascend/attention/utils.py`` (upstream commit 182b75ea84ff13ece27b57391331ef8935410aea):
``AscendCommonAttentionMetadata``, L213-257, the fields vLLM 0.32's ``CommonAttentionMetadata`` lacks.
(``_seq_lens_cpu`` is a field of the vLLM base class upstream builds on; vLLM 0.32 has none, so it is declared here.)"""

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata


@dataclass
class AscendCommonAttentionMetadata(CommonAttentionMetadata):
    seq_lens_cpu: torch.Tensor = None
    num_computed_tokens_cpu: torch.Tensor = None
    decode_token_per_req: int = 1
    actual_seq_lengths_q: list[int] = field(default_factory=list)
    positions_cpu: torch.Tensor = None
    attn_state: Any = None
    graph_pad_size: int = -1
    num_input_tokens: int = 0
    context_parallel_metadata: Any = None
    _seq_lens_cpu: torch.Tensor = None
