"""SGLang 0.5.21's additions to the attention-backend contract, answered for hal's backends.

SGLang 0.5.21's ``AttentionBackend`` (``sglang/srt/layers/attention/base_attn_backend.py``) grew members beyond
the seed contract that hal's core keeps: declared attributes its runners read off any backend without
``getattr`` (``data_type``, ``kv_cache_dtype``, ``attn_backend_list``, ``kv_index_translator``, the
``supports_*`` / ``*_capped_*`` / ``prefer_*`` flags) and questions its runners ask (``shared_read_ends``,
``prepare_prefill_shared_read_snapshot``, ``prepare_full_cuda_graph_chunked_prefix``,
``validate_elastic_cuda_graph_recapture``, ``verify_mask``, ``draft_extend_metadata_captured_in_graph``).
They belong to the engine release, so they live here, with the SGLang integration, not in
:class:`hal.AttentionBackend`; this module imports no SGLang.

:class:`SGLangMembers` is the mixin holding hal's answers (none of SGLang's optional runner paths is taken).
:func:`sglang_members` applies it to a hal backend: a backend class that inherits the mixin (to answer one
question differently, e.g. ``shared_read_ends`` once its reads are audited) is its own answer; any other backend
is answered by the mixin's defaults, which read the backend's ``name`` and ``declaration()``.
``hal.integrations.sglang.HalAttnBackend`` asks here and hands SGLang the answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hal.errors import UnsupportedError
from hal.modes import SharedReadEnds

if TYPE_CHECKING:
    from hal.backend import AttentionBackend
    from hal.batch import ForwardBatch

__all__ = ["SGLangMembers", "sglang_members", "MEMBERS", "DECLARED"]

# The declared attributes SGLang 0.5.21 reads (all False for hal: SGLang takes its general paths).
DECLARED = (
    "supports_draft_extend_metadata_staging",
    "extend_dummy_seqs_capped_by_req_pool",
    "prefer_eager_mixed_prefill_under_dp_attention",
    "supports_prefill_cuda_graph_max_context_size",
    "supports_full_cuda_graph_chunked_prefix",
)


class SGLangMembers:
    """Mixin: SGLang 0.5.21's members with hal's answers (see the module docstring). ``self`` is a hal backend
    (it reads ``name`` and ``declaration()``)."""

    # Declared attributes (SGLang reads them off any backend without getattr).
    data_type: torch.dtype | None = None  # compute dtype (SGLang's fp8 fuse-rope checks); the model's
    kv_cache_dtype: torch.dtype | None = None  # KV cache dtype, likewise
    attn_backend_list: list | None = None  # a wrapper's children, for metadata snapshot/restore
    kv_index_translator = None  # SGLang's unified-pool translator: None, hal reads physical slots
    supports_draft_extend_metadata_staging: bool = False  # no staged DRAFT_EXTEND metadata
    extend_dummy_seqs_capped_by_req_pool: bool = False  # no per-request buffers sized at the request pool
    prefer_eager_mixed_prefill_under_dp_attention: bool = False
    supports_prefill_cuda_graph_max_context_size: bool = False  # no prefill graphs (max_seq_len_override)
    supports_full_cuda_graph_chunked_prefix: bool = False  # no chunked-prefix full-graph topology

    def draft_extend_metadata_captured_in_graph(self) -> bool:
        """Whether ``init_forward_metadata_in_graph`` alone rebuilds a replayed DRAFT_EXTEND step's metadata
        (a replaying runner could then skip ``out_graph``). False: hal prepares DRAFT_EXTEND outside graphs."""
        return False

    def shared_read_ends(self, forward_mode) -> SharedReadEnds:
        """Where this backend's reads of scheduler-shared buffers end for ``forward_mode`` (hal's or
        SGLang's ForwardMode): UNKNOWN for every mode, so the engine fences the whole forward.

        hal's ``forward_*`` may read the request table and ``seq_lens`` again (the torch and NPU
        paths gather keys through ``req_to_token``), so no earlier end is declared; a backend
        audited for one overrides this.
        """
        return SharedReadEnds.UNKNOWN

    def prepare_prefill_shared_read_snapshot(self, forward_batch: ForwardBatch, *, num_qo_tokens: int) -> None:
        """Copy late prefill reads before the engine publishes a PRE_REPLAY read-done; returns None.

        A no-op: it matters only to a backend that declares ``PRE_REPLAY`` (hal's do not).
        """

    def prepare_full_cuda_graph_chunked_prefix(self, forward_batch: ForwardBatch, *, in_capture: bool) -> None:
        """Chunked-prefix full-graph metadata; only for backends with ``supports_full_cuda_graph_chunked_prefix``."""
        raise UnsupportedError(
            f"{self.declaration().name}: chunked-prefix full CUDA graphs "
            "(supports_full_cuda_graph_chunked_prefix is False): run those prefills eagerly"
        )

    def validate_elastic_cuda_graph_recapture(self) -> None:
        """Check this backend can recapture its graphs at a new width (SGLang's elastic EP); returns None.

        A recapture reuses the buffers of ``init_cuda_graph_state``; a backend without graph support
        raises ``UnsupportedError``.
        """
        if not self.declaration().supports_graph:
            raise UnsupportedError(f"{self.declaration().name} does not capture graphs, so cannot recapture")

    @property
    def verify_mask(self):
        """The mask buffer a draft stage fills in place for TARGET_VERIFY, if the backend owns one: None,
        hal's backends read ``spec_info.custom_mask`` as the engine built it."""
        return None


# Every member the mixin holds (public names): what a hal backend still answers through AttentionBackend.__getattr__.
MEMBERS = frozenset(name for name in vars(SGLangMembers) if not name.startswith("_"))


class _Answers(SGLangMembers):
    """The mixin's answers for a backend whose class does not inherit it: its ``name`` and ``declaration()``."""

    def __init__(self, backend: AttentionBackend):
        self.backend = backend
        self.name, self.declaration = backend.declaration().name, backend.declaration


def sglang_members(backend: AttentionBackend) -> SGLangMembers:
    """``backend``'s answers to SGLang 0.5.21's members: the backend itself where its class inherits
    :class:`SGLangMembers` (it may override some), else the mixin's defaults for it."""
    return backend if isinstance(backend, SGLangMembers) else _Answers(backend)
