"""``torch`` with compiled kernels: the CPU device's default backend (``hal.kernels.cpu``).

It keeps the ``torch`` backend's name and contract and replaces its attention by the
compiled paged kernels, which read K/V straight from the pool through ``req_to_token`` (no gathered copy), one
task per (request, KV head) with the GQA group together for decode and verify, and
matrix-sized ``at::mm`` tiles for extend; see ``hal.kernels.cpu``. A layer's forward is one
kernel call (its :meth:`CompiledBackend.forward_fused`, ``write_and_attend``: inputs checked, KV written,
attention) wherever the base class lets the fused path run (``hal.prologue``); the per-request metadata it
reads is prepared once per step. The kernels are
compiled at first use; where that cannot happen (no compiler or ninja,
``HAL_CPU_KERNELS=0``, a failed build) the plain torch path (:class:`PlainTorchBackend`, which
this class extends) serves, with a warning when a build was tried and failed, and ``hal
info`` says which path runs and why.

MLA and attention sinks run in the kernels (MLA: one latent KV head, ``head_dim`` 576 /
``v_head_dim`` 512 or any other, the value read through the pool's strided latent view;
sinks: ``sinks=`` ``[q_heads]``, one more logit per row in the softmax's sum). The kernels
read no fp8: a step over an fp8 pool runs the plain torch path, chosen when its metadata is
prepared.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from hal.batch import device_lens, host_lens
from hal.deprecation import warn_renamed
from hal.kernels import cpu as cpu_kernels
from hal.kernels import reference as reference_kernels
from hal.kv_dtypes import kv_dtype, kv_scaled

from .torch_backend import PlainTorchBackend, _indptr

__all__ = ["CompiledBackend"]


@dataclass
class CompiledMetadata:
    """Per-step metadata: per-request lengths and offsets, int64 ``[B]`` contiguous (built in_graph, in the form
    the kernels read, so a layer's forward converts nothing)."""

    rows: torch.Tensor | None = None  # req_pool_indices
    q_lens: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None
    q_start: torch.Tensor | None = None  # first query row of each request
    mask_start: torch.Tensor | None = None  # first custom-mask entry of each request (TARGET_VERIFY)
    custom_mask: torch.Tensor | None = None  # flat bool (TARGET_VERIFY)
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


class CompiledBackend(PlainTorchBackend):
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
        # the fused call writes the KV itself: only where the torch helper ops would (support_triton() gates
        # the Triton ones, which must then run)
        self._fusable = self.kernels is not None and self.helper_ops is reference_kernels

    def fused_forward_ready(self) -> bool:
        """Whether this instance's kernels were built and the torch helper ops would write its KV."""
        return self._fusable

    @property
    def fused_forward(self) -> bool:
        """Deprecated (0.3.0): ``"fused" in backend.forward_paths()``."""
        warn_renamed("CompiledBackend.fused_forward", '"fused" in backend.forward_paths()', since="0.3.0")
        return "fused" in self.forward_paths()

    @fused_forward.setter
    def fused_forward(self, value: bool) -> None:
        warn_renamed(
            "setting CompiledBackend.fused_forward",
            "hal.backend.fused_forward_disabled() (or HAL_FUSED_FORWARD=0)",
            since="0.3.0",
        )
        self._fusable = bool(value) and self._fusable

    @classmethod
    def notes(cls, capability) -> list[str]:
        return super().notes(capability) + [
            "fp8 KV caches run the plain torch path (the compiled kernels read none); "
            "MLA and attention sinks run in the compiled kernels",
            cpu_kernels.describe(),
        ]

    # -- routes (hal check's coverage) -----------------------------------------------------
    @classmethod
    def routes(cls, config, capability) -> list[str]:
        """The kernel's task shapes: query tiles, row tasks of one KV head, row tasks of every KV head; and the
        plain torch path where the config has an fp8 cache."""
        if not cpu_kernels.status()[0]:
            return []
        plain = ["plain_torch"] if kv_dtype(config.kv_cache_dtype_name).scaled else []
        return ["tiles", "rows/one_head"] + (["rows/all_heads"] if config.tp_k_head_num > 1 else []) + plain

    def route_of(self, fb, layer) -> list[str]:
        """The task shapes the kernel chose (attention.cpp, ``paged_attention``): a request whose query rows
        (tokens x GQA group) reach ``TILE_ROWS`` goes through tiles; the others are row tasks, taking every KV
        head at once when there are at least 4 per thread (``HAL_HEADS_PER_TASK`` overrides)."""
        if self.kernels is None or fb.forward_mode.is_idle():
            return []
        if not isinstance(self.forward_metadata, CompiledMetadata):  # an fp8 cache: the plain path
            return ["plain_torch"]
        group = layer.tp_q_head_num // layer.tp_k_head_num
        query = host_lens(fb).query
        tiled = [n * group >= cpu_kernels.TILE_ROWS for n in query]
        row_requests = sum(n > 0 and not t for n, t in zip(query, tiled))
        heads = layer.tp_k_head_num if row_requests >= 4 * torch.get_num_threads() else 1
        heads = cpu_kernels.heads_per_task() or heads
        taken = ["tiles"] if any(tiled) else []
        if row_requests:
            taken.append("rows/all_heads" if min(heads, layer.tp_k_head_num) > 1 else "rows/one_head")
        return taken

    # -- metadata ----------------------------------------------------------------------
    def plain_path(self, fb) -> bool:
        """Whether ``fb``'s step runs the plain torch path: no kernels, or an fp8 pool."""
        return self.kernels is None or kv_scaled(fb.token_to_kv_pool.dtype)

    def init_forward_metadata_out_graph(self, fb, in_capture: bool = False) -> None:
        self.check_batch(fb)
        if self.plain_path(fb):
            return self.plan(fb, in_capture)
        self.set_forward_metadata(None if fb.forward_mode.is_idle() else CompiledMetadata(), fb)

    def init_forward_metadata_in_graph(self, fb) -> None:
        if not isinstance(self.forward_metadata, CompiledMetadata):  # the plain path's (or an IDLE step's)
            return super().init_forward_metadata_in_graph(fb)
        if fb.forward_mode.is_idle():
            return
        meta = self.metadata_for(fb)
        q_lens, kv_lens = device_lens(fb)
        meta.q_lens, meta.kv_lens = q_lens.contiguous(), kv_lens.contiguous()
        meta.rows = fb.req_pool_indices.long().contiguous()
        meta.req_to_token = fb.req_to_token_pool.req_to_token
        meta.q_start = torch.cumsum(meta.q_lens, 0) - meta.q_lens
        if fb.forward_mode.is_target_verify():
            sizes = meta.q_lens * meta.kv_lens
            meta.mask_start = torch.cumsum(sizes, 0) - sizes
            meta.custom_mask = fb.spec_info.custom_mask.reshape(-1).to(torch.bool).contiguous()
        else:
            meta.mask_start = meta.custom_mask = None

    # -- forward -----------------------------------------------------------------------
    # The base class's prologue takes forward_fused (write_and_attend: the whole forward in one kernel call) where
    # it may; everything else (save_kv_cache=False, other dtypes or layouts, bad input, a torch mode
    # watching, a subclass overriding a hook) takes the checked prologue and _forward, which name what is wrong.
    fused_forward_covers = ("_forward",)

    def forward_fused(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs) -> torch.Tensor | None:
        """One layer's forward as one kernel call (:func:`hal.kernels.cpu.write_and_attend`: checks ``q``/``k``/``v``
        against the layer and pool, writes the new tokens' KV, attends); ``[T, q_heads * v_head_dim]``, or None
        (nothing written) for a step of the plain path or inputs the kernel does not take."""
        meta = self.forward_metadata
        sinks = kwargs.pop("sinks", None)
        if not isinstance(meta, CompiledMetadata) or any(value is not None for value in kwargs.values()):
            return None
        pool = fb.token_to_kv_pool
        return cpu_kernels.write_and_attend(
            q,
            k,
            v,
            fb.out_cache_loc,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            meta.req_to_token,
            meta.rows,
            meta.kv_lens,
            meta.q_lens,
            meta.q_start,
            (layer.tp_q_head_num, layer.tp_k_head_num, layer.tp_v_head_num, layer.head_dim, layer.v_head_dim),
            layer.scaling,
            layer.logit_cap,
            layer.sliding_window_size,
            layer.causal,
            meta.custom_mask,
            meta.mask_start,
            sinks=sinks,
        )

    def _forward(self, q, k, v, layer, fb, save_kv_cache: bool, sinks=None) -> torch.Tensor:
        meta = self.forward_metadata
        if not isinstance(meta, CompiledMetadata):
            return super()._forward(q, k, v, layer, fb, save_kv_cache, sinks)
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
            sinks=sinks,
        )
        return out
