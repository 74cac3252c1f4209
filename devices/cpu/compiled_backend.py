"""``torch`` with compiled kernels: the CPU device's default backend (``hal.kernels.cpu``).

It keeps the ``torch`` backend's name and contract and replaces its attention by the
compiled paged kernels, which read K/V straight from the pool through ``req_to_token`` (no gathered copy), one
task per (request, KV head) with the GQA group together for decode and verify, and
matrix-sized ``at::mm`` tiles for extend; see ``hal.kernels.cpu``. The kernels are
compiled at first use; where that cannot happen (no compiler or ninja,
``HAL_CPU_KERNELS=0``, a failed build) the plain torch path (:class:`TorchBackend`, which
this class extends) serves, with a warning when a build was tried and failed, and ``hal
info`` says which path runs and why.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from hal.batch import device_lens
from hal.kernels import cpu as cpu_kernels

from .torch_backend import TorchBackend, _indptr

__all__ = ["CompiledBackend"]


@dataclass
class CompiledMetadata:
    """Per-step metadata: per-request lengths and offsets, int64 ``[B]`` (built in_graph)."""

    rows: torch.Tensor | None = None  # req_pool_indices
    q_lens: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None
    q_start: torch.Tensor | None = None  # first query row of each request
    mask_start: torch.Tensor | None = None  # first custom-mask entry of each request (TARGET_VERIFY)
    custom_mask: torch.Tensor | None = None
    req_to_token: torch.Tensor | None = None  # the request table the kernels read (for the names below)

    # SGLang's names for the same data (its attention kit and tools inspect them), built when read.
    @property
    def kv_indptr(self) -> torch.Tensor | None:
        """int32 ``[B + 1]``: 0, then the running sum of ``kv_lens``."""
        return None if self.kv_lens is None else _indptr(self.kv_lens)

    @property
    def kv_indices(self) -> torch.Tensor | None:
        """int32: the KV slot of every key, request after request (CSR over ``kv_indptr``)."""
        if self.kv_lens is None or self.req_to_token is None:
            return None
        rows = [self.req_to_token[r, :n] for r, n in zip(self.rows.tolist(), self.kv_lens.tolist())]
        return torch.cat(rows).to(torch.int32) if rows else self.req_to_token.new_zeros(0)

    @property
    def qo_indptr(self) -> torch.Tensor | None:
        """int32 ``[B + 1]``: 0, then the running sum of ``q_lens``."""
        return None if self.q_lens is None else _indptr(self.q_lens)


class CompiledBackend(TorchBackend):
    """The ``torch`` backend with its attention compiled; the plain path where no kernels could be built."""

    name = "torch"

    def __init__(self, capability, config=None, **options):
        super().__init__(capability, config, **options)
        self.kernels = None
        if cpu_kernels.status()[0]:
            try:
                self.kernels = cpu_kernels.load()
            except cpu_kernels.KernelBuildError as exc:
                warnings.warn(f"hal: {exc}", RuntimeWarning, stacklevel=2)

    @classmethod
    def notes(cls, capability) -> list[str]:
        return super().notes(capability) + [cpu_kernels.describe()]

    # -- metadata ----------------------------------------------------------------------
    def init_forward_metadata_out_graph(self, fb, in_capture: bool = False) -> None:
        if self.kernels is None:
            return super().init_forward_metadata_out_graph(fb, in_capture)
        self.check_batch(fb)
        self.set_forward_metadata(None if fb.forward_mode.is_idle() else CompiledMetadata(), fb)

    def init_forward_metadata_in_graph(self, fb) -> None:
        if self.kernels is None:
            return super().init_forward_metadata_in_graph(fb)
        if fb.forward_mode.is_idle():
            return
        meta = self.metadata_for(fb)
        meta.q_lens, meta.kv_lens = device_lens(fb)
        meta.rows = fb.req_pool_indices.long()
        meta.req_to_token = fb.req_to_token_pool.req_to_token
        meta.q_start = torch.cumsum(meta.q_lens, 0) - meta.q_lens
        if fb.forward_mode.is_target_verify():
            sizes = meta.q_lens * meta.kv_lens
            meta.mask_start = torch.cumsum(sizes, 0) - sizes
            meta.custom_mask = fb.spec_info.custom_mask
        else:
            meta.mask_start = meta.custom_mask = None

    # -- forward -----------------------------------------------------------------------
    def _forward(self, q, k, v, layer, fb, save_kv_cache: bool) -> torch.Tensor:
        if self.kernels is None:
            return super()._forward(q, k, v, layer, fb, save_kv_cache)
        q, k, v = self.check_inputs(q, k, v, layer, fb, save_kv_cache)
        meta = self.metadata_for(fb)
        if save_kv_cache:
            self.save_kv(layer, fb, k, v)
        pool = fb.token_to_kv_pool
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        out = cpu_kernels.paged_attention(
            q,
            k_buffer,
            v_buffer,
            fb.req_to_token_pool.req_to_token,
            meta.rows,
            meta.kv_lens,
            meta.q_lens,
            scale=layer.scaling,
            logit_cap=layer.logit_cap,
            sliding_window=layer.sliding_window_size,
            causal=layer.causal,
            custom_mask=meta.custom_mask,
            q_start=meta.q_start,
            mask_start=meta.mask_start,
        )
        return out.reshape(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
