"""``HybridBackend``: one backend for prefill and another for decode (SGLang's ``HybridAttnBackend``).

:meth:`hal.selection.Selection.create` builds one when the two phases chose different backends.
"""

from __future__ import annotations

from hal.backend import AttentionBackend

__all__ = ["HybridBackend"]


class HybridBackend(AttentionBackend):
    """One backend for prefill (extend, mixed, verify) and another for decode, as SGLang's ``HybridAttnBackend``."""

    name = "hybrid"
    runs_prologue = False  # its forward edges delegate: the chosen backend runs its own checks, once

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend):
        super().__init__(prefill.capability, prefill.config, validate=prefill.validation)
        self.prefill, self.decode = prefill, decode
        self.needs_cpu_seq_lens = prefill.needs_cpu_seq_lens or decode.needs_cpu_seq_lens

    def _for(self, fb) -> AttentionBackend:
        return self.decode if fb.forward_mode.is_decode_or_idle() else self.prefill

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self._for(fb).init_forward_metadata_out_graph(fb, in_capture)

    def init_forward_metadata_in_graph(self, fb):
        self._for(fb).init_forward_metadata_in_graph(fb)

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.decode.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.decode.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        self.decode.on_after_cuda_graph_warmup()

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, out=None, **kwargs):
        """The phase's backend's own ``forward`` (its routing and checks)."""
        return self._for(forward_batch).forward(q, k, v, layer, forward_batch, save_kv_cache, out=out, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, out=None, **kwargs):
        return self.decode.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, out=out, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, out=None, **kwargs):
        return self.prefill.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, out=out, **kwargs)

    def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, out=None, **kwargs):
        return self.prefill.forward_mixed(q, k, v, layer, forward_batch, save_kv_cache, out=out, **kwargs)

    def support_triton(self) -> bool:
        return self.prefill.support_triton() and self.decode.support_triton()
