"""The steps of a forward call, in the order :meth:`hal.backend.AttentionBackend.forward` runs them.

A forward is *plan, then run* (FlashInfer's ``plan()`` / ``run()``, vLLM's metadata builder / impl):

* **plan**: the backend's ``plan_out_graph`` / ``plan_in_graph`` build the step's metadata and hand it to
  ``backend.plan.set_metadata`` (:class:`hal.plan.Plan`), saying there whether this step may take the backend's
  fused call (``fused=``): the fast path is chosen when the step is planned, not per layer;
* **run**: the engine-facing ``forward`` / ``forward_decode`` / ``forward_extend`` / ``forward_mixed`` (hal/backend.py)
  run, in order and in plain code: the batch fields (:func:`hal.validation.check_forward_fields`),
  :meth:`Steps.check_model_features`, the backend's ``check_layer``, the metadata stamp (``plan.metadata_for``),
  the input dtypes, the output buffer; then either the backend's fused call (``run_fused``: inputs checked, KV
  written and attention in one call) or the checked path (:meth:`Steps.prepare_forward`: the backend's
  ``check_inputs``, its ``save_kv`` or :meth:`Steps.new_kv_from_cache`, then its ``run_decode`` / ``run_extend``
  / ``run_mixed``); the result lands in the caller's ``out=`` or a new ``[T, q_heads * v_head_dim]`` tensor in
  ``q.dtype`` (:func:`write_output`, the one place).

:class:`ForwardSteps` holds the default hooks a backend may override (``run_fused``, ``fused_forward_ready``,
``check_layer``, ``check_inputs``, ``save_kv``); :class:`Steps` (``backend.steps``) the helpers the edges run
around them.

The fused call runs where the plan allowed it, the KV is to be written (``save_kv_cache``, ``k``/``v`` given), no
torch dispatch or function mode watches (the eager graph guard of :mod:`hal.graph`, a profiler, FakeTensor),
:func:`fused_forward_disabled` is not in force and ``HAL_FUSED_FORWARD`` is not ``0``; it returns None where its
kernel does not take the inputs, having written nothing, and the checked path then serves them or names what is
wrong. A class that overrides a step the fused call stands in for (:data:`FUSED_STANDS_IN_FOR`) below the class
that offers ``run_fused`` takes the checked path: its override is never skipped.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import torch

from hal.errors import ConfigError, InvalidBatchError, UnsupportedError, expect
from hal.kernels.reference import dequantize_kv, kv_scales, overlaps, quantize_kv, shares_storage, write_kv
from hal.kv_cache import kv_cache_dtype_name, kv_rows, kv_storage
from hal.kv_dtypes import COMPUTE_DTYPE_NAMES, kv_scaled
from hal.kv_layouts import TOKEN_MAJOR, kv_layout, pool_kv_layout
from hal.validation import check_input_dtypes, refuse_mixed_dtypes

if TYPE_CHECKING:
    from hal.batch import ForwardBatch
    from hal.layer import AttentionLayer

__all__ = [
    "ForwardSteps",
    "Steps",
    "forward_paths",
    "helper_ops_for",
    "fused_forward_off",
    "ForwardPrologue",
    "fused_forward_disabled",
    "fused_forward_enabled",
    "fused_forward_env",
    "forward_output",
    "write_output",
    "check_output_buffer",
    "FORWARD_KINDS",
    "FORWARD_METHODS",
    "RUN_METHODS",
    "FUSED_STANDS_IN_FOR",
    "PROLOGUE_HOOKS",
]

FORWARD_KINDS = ("decode", "extend", "mixed")
FORWARD_METHODS = tuple(f"forward_{kind}" for kind in FORWARD_KINDS)  # the engine-facing edges (the seed's names)
RUN_METHODS = tuple(f"run_{kind}" for kind in FORWARD_KINDS)  # what a backend implements
# The hooks the fused call stands in for: a class that overrides one below the class offering run_fused takes
# the checked path (check_layer and the checks of the edge run on both paths).
FUSED_STANDS_IN_FOR = ("check_inputs", "save_kv", *RUN_METHODS)
PROLOGUE_HOOKS = FUSED_STANDS_IN_FOR  # its name under plugin API 2
PATH_FUSED, PATH_CHECKED = "fused", "checked"

_FUSED_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("hal_fused_forward_off", default=False)


def fused_forward_env() -> bool:
    """``HAL_FUSED_FORWARD``: ``1`` (or unset) lets fused calls run, ``0`` forces the checked path."""
    raw = os.environ.get("HAL_FUSED_FORWARD", "").strip()
    expect(raw in ("", "0", "1"), ConfigError, "HAL_FUSED_FORWARD", raw, "0 (checked path only) or 1 (default)")
    return raw != "0"


def fused_forward_off() -> bool:
    """Whether a :func:`fused_forward_disabled` block is in force in this thread or task."""
    return _FUSED_OFF.get()


def fused_forward_enabled() -> bool:
    """Whether fused calls may run now: ``HAL_FUSED_FORWARD`` is not ``0`` (``ConfigError`` for a value other
    than 0/1) and no :func:`fused_forward_disabled` is in force."""
    return fused_forward_env() and not _FUSED_OFF.get()


@contextlib.contextmanager
def fused_forward_disabled() -> Iterator[None]:
    """Within the block (this thread or task), every backend takes the checked path: no fused call runs. The
    conformance suite uses it to run every case family on the checked path of a backend whose
    :meth:`~ForwardSteps.forward_paths` has ``"fused"``."""
    token = _FUSED_OFF.set(True)
    try:
        yield
    finally:
        _FUSED_OFF.reset(token)


def _torch_mode_watching() -> bool:
    """Whether a torch dispatch or function mode is active in this thread (the graph guard of ``hal.graph`` is
    one): a fused kernel call would hide its tensor reads and writes from it."""
    return torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled()


def check_output_buffer(out, q: torch.Tensor, layer: AttentionLayer, tokens: int, *others) -> torch.Tensor:
    """``out`` (the caller's output buffer) checked and returned as the ``[tokens, q_heads, v_head_dim]`` view the
    backend writes; rows past ``tokens`` are never touched.

    ``out`` must be a tensor of ``q.dtype`` on ``q``'s device, ``[R, q_heads * v_head_dim]`` or
    ``[R, q_heads, v_head_dim]`` with ``R >= tokens``, its last dimension contiguous, and share no memory with
    ``q`` or with ``others`` (``k``, ``v``, the layer's KV buffers): an ``InvalidBatchError`` names what is wrong.
    """
    heads, v_dim = layer.tp_q_head_num, layer.v_head_dim
    ok = (
        isinstance(out, torch.Tensor)
        and out.dtype == q.dtype
        and out.device == q.device
        and out.shape[0] >= tokens
        and tuple(out.shape[1:]) in ((heads * v_dim,), (heads, v_dim))
        and out.stride(-1) == 1
    )
    if ok:
        rows = out[:tokens]
        rows = rows.unflatten(1, (heads, v_dim)) if rows.dim() == 2 else rows
        if not any(overlaps(rows, t) for t in (q, *others)):
            return rows
    described = f"{out.dtype}{list(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out)
    expect(
        isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.device == q.device,
        InvalidBatchError,
        "out",
        described,
        f"a {q.dtype} tensor on {q.device} (the query's dtype and device)",
    )
    expect(
        out.shape[0] >= tokens and tuple(out.shape[1:]) in ((heads * v_dim,), (heads, v_dim)),
        InvalidBatchError,
        "out.shape",
        tuple(out.shape),
        f"[R, {heads * v_dim}] or [R, {heads}, {v_dim}] with R >= {tokens} (this step's tokens)",
    )
    expect(out.stride(-1) == 1, InvalidBatchError, "out.stride", out.stride(), "a contiguous last dimension")
    raise InvalidBatchError(
        "out shares memory with q, k, v or the layer's KV cache: the kernel would read what it overwrites "
        "(expected a buffer of its own)"
    )


def write_output(result: torch.Tensor, q: torch.Tensor, layer: AttentionLayer, out: torch.Tensor | None):
    """A run hook's result as the contract returns it. Without ``out``: ``[T, q_heads * v_head_dim]`` in
    ``q.dtype`` (``result`` may be ``[T, q_heads, v_head_dim]`` or flat, any float dtype). With ``out`` (the
    ``[T, q_heads, v_head_dim]`` view :func:`check_output_buffer` returned): ``result`` copied into it unless the
    hook wrote there itself, and that view returned flat where its strides allow. The one place the output is
    shaped."""
    tokens, width = q.shape[0], layer.tp_q_head_num * layer.v_head_dim
    if out is None:
        if result.dim() != 2 or result.shape[1] != width:
            result = result.reshape(tokens, width)
        return result if result.dtype == q.dtype else result.to(q.dtype)
    if result.data_ptr() != out.data_ptr() or result.stride() != out.stride()[: result.dim()]:
        out.copy_(result.reshape(out.shape))
    try:
        return out.view(tokens, width)
    except RuntimeError:  # rows strided past the heads (a padded engine buffer): the 3-D view is the answer
        return out


def forward_output(out: torch.Tensor, q: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """``write_output(out, q, layer, None)``: its name under plugin API 2."""
    return write_output(out, q, layer, None)


def _takes_out(method) -> bool:
    try:
        return "out" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def _fused_available(cls: type) -> bool:
    """Whether ``cls`` may take a fused call at all: some class of its MRO below ``ForwardSteps`` offers
    ``run_fused``, and ``cls`` overrides below that class none of :data:`FUSED_STANDS_IN_FOR`."""
    owner = next(k for k in cls.__mro__ if "run_fused" in k.__dict__)
    if owner is ForwardSteps:
        return False
    return all(getattr(cls, name, None) is getattr(owner, name, None) for name in FUSED_STANDS_IN_FOR)


class StepFacts(NamedTuple):
    """What the forward path reads of a backend class's run steps, read once per class (:func:`step_facts`)."""

    fused: bool  # it may take a fused call at all (:func:`_fused_available`)
    run_takes_out: dict[str, bool]  # per kind: its run_<kind> takes out=
    fused_takes_out: bool  # its run_fused takes out=


@functools.cache
def step_facts(cls: type) -> StepFacts:
    """:class:`StepFacts` of backend class ``cls`` (cached per class)."""
    return StepFacts(
        _fused_available(cls),
        {kind: _takes_out(getattr(cls, f"run_{kind}")) for kind in FORWARD_KINDS},
        _takes_out(cls.run_fused),
    )


class ForwardSteps:
    """The steps of a forward call, for :class:`hal.backend.AttentionBackend` (see the module docstring)."""

    # -- the run hooks a backend implements -------------------------------------------------
    def run_fused(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor | None:
        """Optional: one layer's whole forward in one call, standing in for :meth:`check_inputs`, :meth:`save_kv`
        and the ``run_*`` step (``check_model_features``, ``check_layer``, ``metadata_for``, the dtypes and the
        output buffer are checked before it). Receives the caller's ``q``/``k``/``v`` as given (``[T, H * D]`` or
        ``[T, H, D]``, tensors, ``save_kv_cache`` True); must check them against the layer and pool as
        :meth:`check_inputs` would, write the new tokens' KV at ``out_cache_loc`` and return the output
        (``[T, q_heads, v_head_dim]`` or flat; into ``out=`` ``[T, q_heads, v_head_dim]`` where it takes one), or
        return None, having written nothing, for inputs it does not take.

        Runs only where the step's plan allowed it (``set_forward_metadata(..., fused=True)``) and the call may
        take it (module docstring). Default: None (no fused call)."""
        return None

    def fused_forward_ready(self) -> bool:
        """Whether this instance can take its class's :meth:`run_fused` at all (its kernels were built...). Asked
        when a step is planned and by :meth:`forward_paths`. Default True."""
        return True

    # -- the checked path -----------------------------------------------------------------
    def check_layer(self, layer: AttentionLayer) -> None:
        """Raise ``UnsupportedError`` (or ``ConfigError``) for a layer feature this backend cannot run; the first
        step after the batch fields. Default: nothing (selection already checked the config)."""

    # -- the KV write and read-back -------------------------------------------------------
    def save_kv(self, layer: AttentionLayer, forward_batch: ForwardBatch, k: torch.Tensor, v) -> None:
        """Write the new tokens' ``k``/``v`` (``[T, kv_heads, dim]``) at ``out_cache_loc``.

        A pool in another layout than token-major (:mod:`hal.kv_layouts`) gets them written into its pages by the
        layout's ``write`` (quantised with the layer's scales for fp8); an fp8 pool stores them quantised with the
        layer's scales, an MLA pool the key only (``v`` may be None), both as ``hal.kernels.reference.write_kv``;
        else the backend's ``helper_ops.write_kv`` (Triton or torch, as ``support_triton()`` says).
        """
        pool = forward_batch.token_to_kv_pool
        layout = pool_kv_layout(pool)
        if layout != TOKEN_MAJOR:
            k_pages, v_pages, _ = kv_storage(pool, layer.layer_id)
            k_scale, v_scale = kv_scales(layer)
            write, loc = kv_layout(layout).write, forward_batch.out_cache_loc
            write(k_pages, loc, quantize_kv(k, k_pages.dtype, k_scale))
            write(v_pages, loc, quantize_kv(v, v_pages.dtype, v_scale))
            return
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        if kv_scaled(k_buffer.dtype) or shares_storage(k_buffer, v_buffer):
            write_kv(k_buffer, v_buffer, forward_batch.out_cache_loc, k, v, *kv_scales(layer))
            return
        self._hal_steps.helper_ops.write_kv(k_buffer, v_buffer, forward_batch.out_cache_loc, k, v)

    # -- the input checks -----------------------------------------------------------------
    def check_inputs(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        """Check ``q``/``k``/``v`` against the layer, batch and pool; return them as ``[T, heads, dim]``.

        Each must be exactly ``[T, heads * dim]`` or ``[T, heads, dim]`` of the layer, one
        float dtype, on the pool's device; ``k``/``v`` may be None only with
        ``save_kv_cache=False``, ``v`` alone with an MLA pool (the value is the key's latent).
        The pool's geometry (KV heads, dims) is read in its own layout (:func:`hal.kv_cache.kv_storage`); a pool
        laid out in a layout the backend does not declare in ``kv_layouts`` is an ``UnsupportedError``.
        Shapes only: no device read. Runs once per layer call, so
        the passing path builds no message.
        """
        tokens = forward_batch.out_cache_loc.shape[0]
        pool = forward_batch.token_to_kv_pool
        layout = pool_kv_layout(pool)
        if layout not in self._declared.kv_layouts:
            self._refuse_layout(layout)
        k_buffer, v_buffer, pool_dims = kv_storage(pool, layer.layer_id)  # the pool checks layer_id
        kv_heads, head_dim, v_dim = layer.tp_k_head_num, layer.head_dim, layer.v_head_dim
        specs = ((q, layer.tp_q_head_num, head_dim), (k, kv_heads, head_dim), (v, layer.tp_v_head_num, v_dim))
        ok = pool_dims == (kv_heads, head_dim, v_dim)
        latent_v = v is None and k is not None and shares_storage(k_buffer, v_buffer)  # MLA: v is k's latent
        ok = ok and (k is not None and v is not None or k is None and v is None and not save_kv_cache or latent_v)
        device, dtype = k_buffer.device, getattr(q, "dtype", None)
        shaped = []
        for t, heads, dim in specs:
            if t is None:
                shaped.append(None)
                continue
            if not (
                ok
                and isinstance(t, torch.Tensor)
                and t.dtype == dtype
                and t.device == device
                and (t.shape == (tokens, heads * dim) or t.shape == (tokens, heads, dim))
            ):
                ok = False
                break
            shaped.append(t.unflatten(1, (heads, dim)) if t.dim() == 2 else t)
        if not ok or dtype not in COMPUTE_DTYPE_NAMES:
            self._explain_bad_inputs(q, k, v, layer, tokens, k_buffer, v_buffer, pool_dims, save_kv_cache)
        return shaped

    def _refuse_layout(self, layout: str) -> None:
        """``UnsupportedError``: the step's KV pool is laid out in ``layout``, which this backend does not read."""
        declared = self._declared
        expect(
            False,
            UnsupportedError,
            "KV pool layout",
            layout,
            f"one of {declared.name}'s kv_layouts {list(declared.kv_layouts)} (a pool made by this backend's "
            "selection, Selection.create_kv_pool, is)",
        )

    @staticmethod
    def _explain_bad_inputs(q, k, v, layer, tokens, k_buffer, v_buffer, pool_dims, save_kv_cache) -> None:
        """Raise the ``InvalidBatchError`` that names what :meth:`check_inputs` found wrong (``pool_dims``: the
        pool's ``(kv heads, head_dim, v_head_dim)``)."""
        expect(
            pool_dims == (layer.tp_k_head_num, layer.head_dim, layer.v_head_dim),
            InvalidBatchError,
            "layer (kv heads, head_dim, v_head_dim)",
            (layer.tp_k_head_num, layer.head_dim, layer.v_head_dim),
            f"the KV pool's {pool_dims}",
        )
        if k is None or v is None:
            expect(
                k is None and v is None and not save_kv_cache or k is not None and shares_storage(k_buffer, v_buffer),
                InvalidBatchError,
                "k, v",
                "None",
                "tensors, or both None with save_kv_cache=False (the new tokens are then read from the cache)",
            )
        for name, t, heads, dim in (
            ("q", q, layer.tp_q_head_num, layer.head_dim),
            ("k", k, layer.tp_k_head_num, layer.head_dim),
            ("v", v, layer.tp_v_head_num, layer.v_head_dim),
        ):
            if t is None:
                continue
            expect(
                isinstance(t, torch.Tensor) and tuple(t.shape) in ((tokens, heads * dim), (tokens, heads, dim)),
                InvalidBatchError,
                f"{name}.shape",
                tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__,
                f"[{tokens}, {heads * dim}] or [{tokens}, {heads}, {dim}] ({tokens} tokens in this batch)",
            )
            expect(t.device == k_buffer.device, InvalidBatchError, f"{name}.device", t.device, str(k_buffer.device))
        refuse_mixed_dtypes(q, k, v, layer)  # what is left: the dtypes, worded where the forward's check words them
        expect(
            False,
            InvalidBatchError,
            "q/k/v dtypes",
            (q.dtype, getattr(k, "dtype", None), getattr(v, "dtype", None)),
            "one dtype",
        )


def forward_paths(backend) -> list[str]:
    """The forward paths ``backend`` (a backend class or instance) can take: ``["fused", "checked"]`` where its class
    offers ``run_fused``, overrides none of what that stands in for (:data:`FUSED_STANDS_IN_FOR`) below the class
    offering it and (an instance) its ``fused_forward_ready()``; else ``["checked"]``. Which one a step takes is
    decided by its plan, and a call may still fall back to the checked path (module docstring)."""
    cls = backend if isinstance(backend, type) else type(backend)
    fused = step_facts(cls).fused and (isinstance(backend, type) or backend.fused_forward_ready())
    return [PATH_FUSED, PATH_CHECKED] if fused else [PATH_CHECKED]


def helper_ops_for(backend) -> ModuleType:
    """The kernel package whose ``write_kv`` / ``build_kv_indices`` / ``compute_positions`` serve ``backend``:
    :mod:`hal.kernels.triton` when ``backend.support_triton()`` and its device has a Triton target,
    else :mod:`hal.kernels.reference`. The one place ``support_triton()`` is read."""
    if backend.support_triton() and backend.capability.triton_target:
        from hal.kernels import triton as ops
    else:
        from hal.kernels import reference as ops
    return ops


class Steps:
    """``backend.steps``: the helpers of one backend's forward steps, which the engine-facing edges of
    :class:`hal.backend.AttentionBackend` run around the backend's own hooks (``check_layer``, ``check_inputs``,
    ``save_kv``, ``run_*``, ``run_fused``): the model features and input dtypes checked, the checked path's
    steps before the run step (:meth:`prepare_forward`), the new tokens read back from the cache, the helper ops."""

    def __init__(self, backend):
        self.backend = backend

    @property
    def helper_ops(self) -> ModuleType:
        """The positions / kv-indices / KV-write ops for the backend: a kernel package (:func:`helper_ops_for`)."""
        return helper_ops_for(self.backend)

    def forward_paths(self) -> list[str]:
        """:func:`forward_paths` of the backend."""
        return forward_paths(self.backend)

    def fused_for(self, planned: bool, k, v, save_kv_cache: bool) -> bool:
        """Whether this call takes ``run_fused``: the plan said so and nothing of this call forbids it."""
        return (
            planned
            and save_kv_cache
            and k is not None
            and v is not None
            and not _FUSED_OFF.get()
            and not _torch_mode_watching()
        )

    def check_input_dtypes(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch) -> None:
        """``InvalidBatchError`` / ``UnsupportedError`` for a ``q``/``k``/``v`` dtype the layer, the backend's
        config and its declaration do not allow (runs before either path)."""
        backend = self.backend
        check_input_dtypes(
            q,
            k,
            v,
            layer=layer,
            config=backend.config,
            declaration=backend._declared,
            kv_dtype=forward_batch.token_to_kv_pool.dtype,
        )

    def prepare_forward(
        self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch, save_kv_cache: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The checked path's steps before the run hook: the backend's ``check_inputs`` (nothing is written before it
        passes), then its ``save_kv`` (or, with ``save_kv_cache=False``, the new tokens read back from the cache in
        place of k/v when the backend ``reads_new_kv``: the caller wrote the cache, and k/v may be None or stale).
        Returns ``q, k, v`` as ``[T, heads, dim]``, k/v in ``q.dtype``.
        """
        backend = self.backend
        q, k, v = backend.check_inputs(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache:
            backend.save_kv(layer, forward_batch, k, v)
        elif backend._declared.reads_new_kv:
            k, v = (t.to(q.dtype) for t in self.new_kv_from_cache(layer, forward_batch))
        return q, k, v

    def check_model_features(self, layer: AttentionLayer, forward_batch: ForwardBatch, sinks) -> None:
        """``UnsupportedError`` for ``sinks`` or a scaled (fp8) KV pool this backend does not declare;
        ``InvalidBatchError`` for sinks that are not a float ``[q_heads]`` tensor on the pool's device."""
        declared = self.backend._declared
        if sinks is not None:
            expect(
                declared.supports_sinks,
                UnsupportedError,
                "sinks",
                "a tensor",
                f"None: {declared.name} has no attention sinks",
            )
            heads, device = layer.tp_q_head_num, forward_batch.out_cache_loc.device
            expect(
                isinstance(sinks, torch.Tensor)
                and sinks.is_floating_point()
                and tuple(sinks.shape) == (heads,)
                and sinks.device == device,
                InvalidBatchError,
                "sinks",
                f"{sinks.dtype}{list(sinks.shape)} on {sinks.device}" if isinstance(sinks, torch.Tensor) else sinks,
                f"a float tensor [{heads}] (one logit per q head) on {device}",
            )
        dtype = forward_batch.token_to_kv_pool.dtype
        if kv_scaled(dtype):
            name = kv_cache_dtype_name(dtype)
            expect(
                name in declared.kv_cache_dtypes,
                UnsupportedError,
                "KV cache dtype",
                name,
                f"one of {declared.name}'s {sorted(declared.kv_cache_dtypes)}",
            )

    def new_kv_from_cache(
        self, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query tokens' keys and values read back from the cache (``save_kv_cache=False``), in the cache
        dtype (an fp8 cache: dequantised to float32), from the pool's pages in any layout. A padding token (slot -1)
        reads slot 0 (its row is unspecified)."""
        pool, loc = forward_batch.token_to_kv_pool, forward_batch.out_cache_loc.long().clamp(min=0)
        k, v = kv_rows(pool, layer.layer_id, loc)
        if not kv_scaled(k.dtype):
            return k, v
        k_scale, v_scale = kv_scales(layer)
        return dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)


ForwardPrologue = ForwardSteps  # its name under plugin API 2 (a base of AttentionBackend; plugins never named it)
