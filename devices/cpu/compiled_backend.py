"""``torch`` with compiled kernels: the CPU device's default backend (``hal.kernels.cpu``).

It keeps the ``torch`` backend's name and contract and replaces its attention by the
compiled paged kernels, which read K/V straight from the pool (token-major buffers or head-major pages, vLLM's CPU
layout) through ``req_to_token`` or a block table ``req_to_page``, whichever the batch carries (no gathered copy), one
task per (request, KV head) with the GQA group together for decode and verify, and
matrix-sized ``at::mm`` tiles for extend; see ``hal.kernels.cpu``. The backend's two paths are two plans,
chosen when a step is planned: a :class:`CompiledMetadata` (the kernels: a layer's forward is one kernel call,
:meth:`CompiledBackend.run_fused` / ``write_and_attend``, wherever the base class lets the fused call run, else
``paged_attention`` after the checked steps), or the plain torch path's ``TorchMetadata`` (:class:`PlainTorchBackend`,
which this class extends) where no kernels could be built (no compiler or ninja, ``HAL_CPU_KERNELS=0``, a failed
build: with a warning when a build was tried and failed; ``hal info`` says which path runs and why) or the step's
pool is fp8. Each plan runs its own attention (``attend``), so nothing asks which plan it holds.

MLA and attention sinks run in the kernels (MLA: one latent KV head, ``head_dim`` 576 /
``v_head_dim`` 512 or any other, the value read through the pool's strided latent view;
sinks: ``sinks=`` ``[q_heads]``, one more logit per row in the softmax's sum). The kernels
read no fp8: a step over an fp8 pool runs the plain torch path, chosen when its metadata is
prepared.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch

from hal.batch import device_lens, host_lens
from hal.deprecation import warn_renamed
from hal.kernels import cpu as cpu_kernels
from hal.kernels import reference as reference_kernels
from hal.kv_cache import kv_storage
from hal.kv_dtypes import kv_dtype, kv_scaled
from hal.kv_layouts import AMX_PACKED, HEAD_MAJOR, TOKEN_MAJOR, pool_kv_layout

from .torch_backend import PlainTorchBackend, _indptr

__all__ = ["CompiledBackend"]


@dataclass
class CompiledMetadata:
    """Per-step metadata: per-request lengths and offsets, int64 ``[B]`` contiguous (built in_graph, in the form
    the kernels read, so a layer's forward converts nothing)."""

    path: ClassVar[str] = "compiled"
    rows: torch.Tensor | None = None  # req_pool_indices
    q_lens: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None
    q_start: torch.Tensor | None = None  # first query row of each request
    mask_start: torch.Tensor | None = None  # first custom-mask entry of each request (TARGET_VERIFY)
    custom_mask: torch.Tensor | None = None  # flat bool (TARGET_VERIFY)
    # The request table the kernels read, as the batch carries it: req_to_token (int32 [rows, context]), else the
    # block table req_to_page (int32 [rows, max_pages]) of page_size slots a page.
    req_to_token: torch.Tensor | None = None
    req_to_page: torch.Tensor | None = None
    page_size: int = 1
    kv_layout: str = TOKEN_MAJOR  # the pool's (hal.kv_layouts): token_major, head_major or amx_packed

    # SGLang's names for the same data (its attention kit and tools inspect them), built when read.
    @property
    def kv_indptr(self) -> torch.Tensor | None:
        """int32 ``[B + 1]``: 0, then the running sum of ``kv_lens``."""
        csr = self._csr()
        return None if csr is None else csr.indptr

    @property
    def kv_indices(self) -> torch.Tensor | None:
        """int32: the KV slot of every key, request after request (CSR over ``kv_indptr``)."""
        csr = self._csr()
        return None if csr is None else csr.indices

    def _csr(self):
        if self.kv_lens is None or (self.req_to_token is None and self.req_to_page is None):
            return None
        tables = {"req_to_token": self.req_to_token, "req_to_page": self.req_to_page, "page_size": self.page_size}
        return reference_kernels.kv_csr(self.kv_lens, self.rows, **tables)

    def _layout_args(self) -> dict:
        """The kernels' ``kv_layout`` / ``table`` / ``page_size`` keywords for this plan."""
        table = "req_to_token" if self.req_to_token is not None else "req_to_page"
        return {"kv_layout": self.kv_layout, "table": table, "page_size": self.page_size}

    @property
    def qo_indptr(self) -> torch.Tensor | None:
        """int32 ``[B + 1]``: 0, then the running sum of ``q_lens``."""
        return None if self.q_lens is None else _indptr(self.q_lens)

    def fill(self, fb) -> None:
        """The in-graph half of the plan: the tensors above, from the batch's device tensors only."""
        q_lens, kv_lens = device_lens(fb)
        self.q_lens, self.kv_lens = q_lens.contiguous(), kv_lens.contiguous()
        self.rows = fb.req_pool_indices.long().contiguous()
        tokens = getattr(fb, "req_to_token_pool", None)
        pool = fb.token_to_kv_pool
        self.req_to_token = None if tokens is None else tokens.req_to_token
        self.req_to_page = None if tokens is not None else fb.req_to_page_pool.req_to_page
        self.page_size, self.kv_layout = pool.page_size, pool_kv_layout(pool)
        self.q_start = torch.cumsum(self.q_lens, 0) - self.q_lens
        if fb.forward_mode.is_target_verify():
            sizes = self.q_lens * self.kv_lens
            self.mask_start = torch.cumsum(sizes, 0) - sizes
            self.custom_mask = fb.spec_info.custom_mask.reshape(-1).to(torch.bool).contiguous()
        else:
            self.mask_start = self.custom_mask = None

    def attend(self, q, k_buffer, v_buffer, layer, scratch=None, sinks=None, out=None) -> torch.Tensor:
        """The checked path's attention: :func:`hal.kernels.cpu.paged_attention` over this plan, ``q``
        ``[T, Hq, D]`` -> ``[T, Hq, Dv]`` in q's dtype (``out`` where given: the kernel writes a float32 one in
        place, a bfloat16 one gets its result cast in once)."""
        return cpu_kernels.paged_attention(
            q,
            k_buffer,
            v_buffer,
            self.req_to_token if self.req_to_token is not None else self.req_to_page,
            self.rows,
            self.kv_lens,
            self.q_lens,
            scale=layer.scaling,
            logit_cap=layer.logit_cap,
            sliding_window=layer.sliding_window_size,
            causal=layer.causal,
            custom_mask=self.custom_mask,
            q_start=self.q_start,
            mask_start=self.mask_start,
            sinks=sinks,
            out=out,
            **self._layout_args(),
        )

    def write_and_attend(self, q, k, v, layer, fb, sinks=None, out=None) -> torch.Tensor:
        """The fused call: :func:`hal.kernels.cpu.write_and_attend` (checks, KV write, attention) over this plan,
        into ``out`` (``[T, q_heads, v_head_dim]`` in q's dtype, rows written in place) where given."""
        k_buffer, v_buffer, _ = kv_storage(fb.token_to_kv_pool, layer.layer_id)
        return cpu_kernels.write_and_attend(
            q,
            k,
            v,
            fb.out_cache_loc,
            k_buffer,
            v_buffer,
            self.req_to_token if self.req_to_token is not None else self.req_to_page,
            self.rows,
            self.kv_lens,
            self.q_lens,
            self.q_start,
            (layer.tp_q_head_num, layer.tp_k_head_num, layer.tp_v_head_num, layer.head_dim, layer.v_head_dim),
            layer.scaling,
            layer.logit_cap,
            layer.sliding_window_size,
            layer.causal,
            self.custom_mask,
            self.mask_start,
            sinks=sinks,
            out=out,
            **self._layout_args(),
        )

    def routes(self, layer, fb) -> list[str]:
        """The task shapes the kernel chose (attention.cpp, ``paged_attention``): a request whose query rows
        (tokens x GQA group) reach ``TILE_ROWS`` goes through tiles; the others are row tasks, taking every KV
        head at once when there are at least 4 per thread (``HAL_HEADS_PER_TASK`` overrides)."""
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


def amx_packed_reasons(kv_cache_dtype: str) -> list[str]:
    """Why this process would not read AMX-packed pages of ``kv_cache_dtype`` (a name: ``bf16``...) through AMX
    tiles (empty: it would). Other paths read them correctly, a page at a time unpacked, and slower than the
    layouts they read in place: selection prefers those there."""
    ok, why = cpu_kernels.status()
    if not ok:
        return [f"kv_layout amx_packed is read by the compiled kernels' amx path, and there are none here: {why}"]
    reasons = []
    path = cpu_kernels.isa()
    if path not in ("amx", "amx_emulated"):
        reasons.append(f"kv_layout amx_packed is read through AMX tiles, which the {path} path this CPU runs has not")
    if kv_cache_dtype != "bf16":
        reasons.append(f"kv_layout amx_packed holds bf16 for AMX tiles, not {kv_cache_dtype}")
    return reasons


class CompiledBackend(PlainTorchBackend):
    """The ``torch`` backend with its attention compiled; the plain path where no kernels could be built."""

    name = "torch"
    # Pools of every layout and either request table are read in place by the kernels; the plain torch plans
    # (fp8 pools, no kernels) gather from any layout and derive slots from a block table. AMX-packed pages first:
    # where the amx path runs a bf16 pool of pages of 32 (unsupported_reasons), its tiles read them straight from
    # the pool; elsewhere token-major.
    kv_layouts = (AMX_PACKED, TOKEN_MAJOR, HEAD_MAJOR)
    reads_tables = frozenset({"token", "page"})

    @classmethod
    def unsupported_reasons(cls, config, capability) -> list[str]:
        """The declared reasons, and for AMX-packed pools what the tiles that read them need: the amx path
        (``amx_emulated`` too, which tests it) and bfloat16 pages."""
        reasons = super().unsupported_reasons(config, capability)
        if getattr(config, "kv_layout", None) == AMX_PACKED:
            reasons += amx_packed_reasons(config.kv_cache_dtype_name)
        return reasons

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
        self._fusable = self.kernels is not None and self.steps.helper_ops is reference_kernels

    def fused_forward_ready(self) -> bool:
        """Whether this instance's kernels were built and the torch helper ops would write its KV."""
        return self._fusable

    @property
    def fused_forward(self) -> bool:
        """Deprecated (0.3.0): ``"fused" in backend.forward_paths()``."""
        warn_renamed("CompiledBackend.fused_forward", '"fused" in backend.forward_paths()', since="0.3.0")
        return "fused" in self.steps.forward_paths()

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
        """The routes the step's plan took: the kernel's task shapes, or ``plain_torch``."""
        if self.kernels is None or fb.forward_mode.is_idle():
            return []
        meta = self.forward_metadata
        return meta.routes(layer, fb) if meta.path == "compiled" else ["plain_torch"]

    # -- metadata ----------------------------------------------------------------------
    def plain_path(self, fb) -> bool:
        """Whether ``fb``'s step runs the plain torch path: no kernels, or an fp8 pool."""
        return self.kernels is None or kv_scaled(fb.token_to_kv_pool.dtype)

    def plan_out_graph(self, fb, in_capture: bool = False) -> None:
        """The plan: the plain torch path's (:meth:`PlainTorchBackend.plan`) for a step the kernels do not read,
        else a :class:`CompiledMetadata`, whose layers take the fused call where this instance can."""
        if self.plain_path(fb):
            return super().plan_out_graph(fb, in_capture)
        meta = None if fb.forward_mode.is_idle() else CompiledMetadata()
        self.plan.set_metadata(meta, fb, fused=self._fusable)

    # -- run: the checked path's attention is the plan's own (PlainTorchBackend.run_*); the fused call ----------
    def run_fused(self, q, k, v, layer, fb, save_kv_cache=True, sinks=None, out=None, **kwargs) -> torch.Tensor | None:
        """One layer's forward as one kernel call (:meth:`CompiledMetadata.write_and_attend`: checks ``q``/``k``/``v``
        against the layer and pool, writes the new tokens' KV, attends): ``[T, q_heads * v_head_dim]``, or ``out``
        (the caller's ``[T, q_heads, v_head_dim]`` view, written in place) where given, or None (nothing written)
        where another keyword argument asks for what the kernel does not do."""
        if any(value is not None for value in kwargs.values()):
            return None
        return self.forward_metadata.write_and_attend(q, k, v, layer, fb, sinks, out)
