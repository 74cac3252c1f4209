"""The forward prologue of :class:`hal.backend.AttentionBackend`: what runs before a backend's ``forward_*``.

Every ``forward_decode`` / ``forward_extend`` / ``forward_mixed`` a backend class defines is wrapped
(``__init_subclass__``) so that a call runs, in order and once per call (``forward`` -> ``forward_decode``,
``forward_extend`` -> ``forward_mixed`` and ``super().forward_*`` inside it do not repeat it):

1. the batch fields the prologue reads are checked (:func:`hal.validation.check_forward_fields`: presence and
   type only, an ``InvalidBatchError`` naming the field and SGLang's);
2. :meth:`ForwardPrologue.check_model_features` (sinks, an fp8 pool), :meth:`check_layer`, the metadata stamp
   (:meth:`metadata_for`);
3. either the backend's **fused call** (:meth:`ForwardPrologue.forward_fused`: inputs checked, KV written and
   attention in one call) where the base class allows it (:meth:`ForwardPrologue.forward_paths`), or the
   **checked path**: :meth:`check_inputs` (nothing is written before it passes), :meth:`save_kv` (or, with
   ``save_kv_cache=False``, :meth:`new_kv_from_cache`), then the backend's ``forward_*``;
4. the output as ``[T, q_heads * v_head_dim]`` in ``q.dtype`` (:func:`forward_output`, the one reshape).

The fused call runs only where nothing it stands in for is overridden (computed once per class), no torch
dispatch or function mode watches (the eager graph guard of :mod:`hal.graph`, a profiler, FakeTensor), the KV
is to be written (``save_kv_cache``, ``k``/``v`` given), :func:`fused_forward_disabled` is not in force and
``HAL_FUSED_FORWARD`` is not ``0``; it returns None where its kernel does not take the inputs, having written
nothing, and the checked path then serves them or names what is wrong.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hal.capability import DTYPE_NAMES
from hal.errors import ConfigError, InvalidBatchError, UnsupportedError, expect
from hal.kernels.reference import dequantize_kv, kv_scales, shares_storage, write_kv
from hal.kv_cache import kv_cache_dtype_name
from hal.kv_dtypes import kv_scaled
from hal.validation import check_forward_fields

if TYPE_CHECKING:
    from hal.batch import ForwardBatch
    from hal.layer import AttentionLayer

__all__ = [
    "ForwardPrologue",
    "fused_forward_disabled",
    "fused_forward_enabled",
    "fused_forward_env",
    "forward_output",
    "FORWARD_METHODS",
    "PROLOGUE_HOOKS",
]

FORWARD_METHODS = ("forward_decode", "forward_extend", "forward_mixed")
# What a fused call stands in for: a class that overrides one of these below the class offering forward_fused
# takes the checked path (check_model_features, check_layer and metadata_for run on both paths).
PROLOGUE_HOOKS = ("prepare_forward", "check_inputs", "save_kv", "new_kv_from_cache", *FORWARD_METHODS)
PATH_FUSED, PATH_CHECKED = "fused", "checked"

_FUSED_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("hal_fused_forward_off", default=False)


def fused_forward_env() -> bool:
    """``HAL_FUSED_FORWARD``: ``1`` (or unset) lets fused calls run, ``0`` forces the checked path."""
    raw = os.environ.get("HAL_FUSED_FORWARD", "").strip()
    expect(raw in ("", "0", "1"), ConfigError, "HAL_FUSED_FORWARD", raw, "0 (checked path only) or 1 (default)")
    return raw != "0"


def fused_forward_enabled() -> bool:
    """Whether fused calls may run now: ``HAL_FUSED_FORWARD`` is not ``0`` (``ConfigError`` for a value other
    than 0/1) and no :func:`fused_forward_disabled` is in force."""
    return fused_forward_env() and not _FUSED_OFF.get()


@contextlib.contextmanager
def fused_forward_disabled() -> Iterator[None]:
    """Within the block (this thread or task), every backend takes the checked prologue path: no fused call
    runs. The conformance suite uses it to run every case family on the checked path of a backend whose
    :meth:`~ForwardPrologue.forward_paths` has ``"fused"``."""
    token = _FUSED_OFF.set(True)
    try:
        yield
    finally:
        _FUSED_OFF.reset(token)


def _torch_mode_watching() -> bool:
    """Whether a torch dispatch or function mode is active in this thread (the graph guard of ``hal.graph`` is
    one): a fused kernel call would hide its tensor reads and writes from it."""
    return torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled()


def forward_output(out: torch.Tensor, q: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """A ``forward_*`` result (``[T, q_heads, v_head_dim]`` or ``[T, q_heads * v_head_dim]``, any float dtype) as
    the contract returns it: ``[T, q_heads * v_head_dim]`` in ``q.dtype``. The one place the output is shaped."""
    width = layer.tp_q_head_num * layer.v_head_dim
    if out.dim() != 2 or out.shape[1] != width:
        out = out.reshape(q.shape[0], width)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _fused_owner(cls: type) -> type | None:
    """The class of ``cls``'s MRO whose ``forward_fused`` ``cls`` runs, if it may: None where that is the base
    class's (no fused call) or where ``cls`` overrides below it a hook the fused call stands in for."""
    owner = next(k for k in cls.__mro__ if "forward_fused" in k.__dict__)
    if owner is ForwardPrologue:
        return None
    covered = PROLOGUE_HOOKS + tuple(getattr(owner, "fused_forward_covers", ()))
    if any(getattr(cls, name, None) is not getattr(owner, name, None) for name in covered):
        return None
    return owner


def _with_prologue(method):
    """``method`` (a ``forward_*``) preceded by the prologue (see the module docstring) unless a caller on this
    backend already ran it for this call; its output through :func:`forward_output`."""

    @functools.wraps(method)
    def forward_with_prologue(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if self.__dict__.get("_in_prologue_call"):
            return method(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        check_forward_fields(forward_batch)
        self.check_model_features(layer, forward_batch, kwargs.get("sinks"))  # sinks= / an fp8 pool: declared?
        if self._may_fuse(k, v, save_kv_cache):
            self.check_layer(layer)
            self.metadata_for(forward_batch)
            out = self.forward_fused(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            if out is not None:
                return forward_output(out, q, layer)
        q, k, v = self.prepare_forward(q, k, v, layer, forward_batch, save_kv_cache)
        self._in_prologue_call = True
        try:
            out = method(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        finally:
            self._in_prologue_call = False
        return forward_output(out, q, layer)

    forward_with_prologue._hal_prologue = True
    return forward_with_prologue


class _ClassOrInstanceMethod:
    """A method callable on the class (``cls`` bound) and on an instance (the instance bound)."""

    def __init__(self, func):
        self.func = func
        functools.update_wrapper(self, func)

    def __get__(self, instance, owner=None):
        return functools.partial(self.func, owner if instance is None else instance)


class ForwardPrologue:
    """The prologue half of :class:`hal.backend.AttentionBackend` (see the module docstring)."""

    runs_prologue: ClassVar[bool] = True  # False: forward_* only delegate to backends that run their own
    reads_new_kv: ClassVar[bool] = True  # False: forward_* read the new tokens from the cache, never from k/v
    # Methods of the class offering forward_fused that the fused call also stands in for, beyond PROLOGUE_HOOKS
    # (e.g. the attention its checked forward_* call): a subclass overriding one takes the checked path.
    fused_forward_covers: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._hal_fused_owner = ...  # per class, computed at its first forward (methods may be set after creation)
        if not cls.runs_prologue or cls.__dict__.get("_hal_contract", False):  # the contract's own stubs: as is
            return
        for name in FORWARD_METHODS:
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "_hal_prologue", False):
                setattr(cls, name, _with_prologue(method))

    # -- the fused call -------------------------------------------------------------------
    def forward_fused(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs) -> torch.Tensor | None:
        """Optional: one layer's whole forward in one call, standing in for :meth:`check_inputs`, :meth:`save_kv`
        and the backend's ``forward_*`` (the base class has already run :meth:`check_model_features`,
        :meth:`check_layer` and :meth:`metadata_for`). Receives the caller's ``q``/``k``/``v`` as given
        (``[T, H * D]`` or ``[T, H, D]``, tensors, ``save_kv_cache`` True); must check them against the layer
        and pool as :meth:`check_inputs` would, write the new tokens' KV at ``out_cache_loc`` and return the
        output (``[T, q_heads, v_head_dim]`` or ``[T, q_heads * v_head_dim]``), or return None, having written
        nothing, for inputs it does not take (the checked path then runs and names what is wrong).

        Called only where the base class allows it: see :meth:`forward_paths`. Default: None (no fused call)."""
        return None

    def fused_forward_ready(self) -> bool:
        """Whether this instance can take its class's :meth:`forward_fused` at all (its kernels were built...);
        asked before every fused call, so keep it a cheap attribute read. Default True."""
        return True

    @_ClassOrInstanceMethod
    def forward_paths(self) -> list[str]:
        """The forward paths this backend (class or instance) can take: ``["fused", "checked"]`` where its class
        offers :meth:`forward_fused`, overrides none of what that stands in for below the class offering it
        (``PROLOGUE_HOOKS`` and ``fused_forward_covers``) and (on an instance) :meth:`fused_forward_ready`;
        else ``["checked"]``. Which one a call takes is then decided per call (torch modes, ``save_kv_cache``,
        :func:`fused_forward_disabled`, ``HAL_FUSED_FORWARD``, the inputs its kernel takes)."""
        cls = self if isinstance(self, type) else type(self)
        fused = _fused_owner(cls) is not None and (isinstance(self, type) or self.fused_forward_ready())
        return [PATH_FUSED, PATH_CHECKED] if fused else [PATH_CHECKED]

    def _may_fuse(self, k, v, save_kv_cache: bool) -> bool:
        """Whether this call may take :meth:`forward_fused` (see the module docstring); cheap per call."""
        cls = type(self)
        owner = cls._hal_fused_owner
        if owner is ...:
            owner = cls._hal_fused_owner = _fused_owner(cls)
        return (
            owner is not None
            and save_kv_cache
            and k is not None
            and v is not None
            and self.__dict__.get("_fused_env", True)
            and not _FUSED_OFF.get()
            and not _torch_mode_watching()
            and self.fused_forward_ready()
        )

    # -- the checked path -----------------------------------------------------------------
    def prepare_forward(
        self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch, save_kv_cache: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The checked prologue, in order: :meth:`check_layer`, :meth:`check_inputs` (nothing is
        written before both pass), :meth:`metadata_for`, then :meth:`save_kv` (or, with
        ``save_kv_cache=False``, the new tokens read back from the cache in place of k/v when the
        backend ``reads_new_kv``: the caller wrote the cache, and k/v may be None or stale).
        Returns ``q, k, v`` as ``[T, heads, dim]``, k/v in ``q.dtype``.
        """
        self.check_layer(layer)
        q, k, v = self.check_inputs(q, k, v, layer, forward_batch, save_kv_cache)
        self.metadata_for(forward_batch)
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        elif self.reads_new_kv:
            k, v = (t.to(q.dtype) for t in self.new_kv_from_cache(layer, forward_batch))
        return q, k, v

    def check_layer(self, layer: AttentionLayer) -> None:
        """Raise ``UnsupportedError`` (or ``ConfigError``) for a layer feature this backend cannot run;
        the first step of the prologue. Default: nothing (selection already checked the config)."""

    def check_model_features(self, layer: AttentionLayer, forward_batch: ForwardBatch, sinks) -> None:
        """``UnsupportedError`` for ``sinks`` or an fp8 KV pool this backend does not declare; ``InvalidBatchError``
        for sinks that are not a float ``[q_heads]`` tensor on the pool's device."""
        if sinks is not None:
            expect(
                self.supports_sinks, UnsupportedError, "sinks", "a tensor", f"None: {self.name} has no attention sinks"
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
            declared = self.kv_cache_dtypes if self.kv_cache_dtypes is not None else self.dtypes
            name = kv_cache_dtype_name(dtype)
            expect(
                name in declared, UnsupportedError, "KV cache dtype", name, f"one of {self.name}'s {sorted(declared)}"
            )

    # -- the metadata stamp ---------------------------------------------------------------
    def set_forward_metadata(self, metadata: Any, forward_batch: ForwardBatch) -> None:
        """Make ``metadata`` (built in ``out_graph`` for ``forward_batch``) the current one, stamped with this step."""
        self._step += 1
        self.forward_metadata = metadata
        self._metadata_stamp = (forward_batch.forward_mode.name, forward_batch.batch_size, self._step)
        try:
            forward_batch._hal_metadata_step = (id(self), self._step)
        except AttributeError:  # a batch with __slots__: the mode/size stamp still guards it
            pass

    def metadata_for(self, forward_batch: ForwardBatch) -> Any:
        """The current metadata, checked (cheaply) to belong to ``forward_batch``'s step.

        Any view of the step's batch passes (SGLang prepares metadata on one and runs forward
        with another); metadata never prepared, prepared for another mode or batch size, or for
        an earlier step of this very batch object is an ``InvalidBatchError``.
        """
        stamp = self._metadata_stamp
        mode, bs = forward_batch.forward_mode.name, forward_batch.batch_size
        owner, step = getattr(forward_batch, "_hal_metadata_step", (None, None))
        ok = stamp is not None and stamp[:2] == (mode, bs) and (owner != id(self) or step == stamp[2])
        expect(
            ok,
            InvalidBatchError,
            "forward_metadata",
            "missing" if stamp is None else f"prepared for {stamp[0]} x {stamp[1]} (step {stamp[2]})",
            f"this batch's ({mode} x {bs}): call init_forward_metadata(forward_batch) before forward",
        )
        return self.forward_metadata

    # -- the KV write and read-back -------------------------------------------------------
    def save_kv(self, layer: AttentionLayer, forward_batch: ForwardBatch, k: torch.Tensor, v) -> None:
        """Write the new tokens' ``k``/``v`` (``[T, kv_heads, dim]``) at ``out_cache_loc``.

        An fp8 pool stores them quantised with the layer's scales, an MLA pool the key only
        (``v`` may be None), both as ``hal.kernels.reference.write_kv``; else the backend's
        ``helper_ops.write_kv`` (Triton or torch, as ``support_triton()`` says).
        """
        pool = forward_batch.token_to_kv_pool
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        if kv_scaled(k_buffer.dtype) or shares_storage(k_buffer, v_buffer):
            write_kv(k_buffer, v_buffer, forward_batch.out_cache_loc, k, v, *kv_scales(layer))
            return
        self.helper_ops.write_kv(k_buffer, v_buffer, forward_batch.out_cache_loc, k, v)

    def new_kv_from_cache(
        self, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query tokens' keys and values read back from the cache (``save_kv_cache=False``), in the cache
        dtype (an fp8 cache: dequantised to float32). A padding token (slot -1) reads slot 0 (its row is
        unspecified)."""
        pool, loc = forward_batch.token_to_kv_pool, forward_batch.out_cache_loc.long().clamp(min=0)
        k, v = pool.get_key_buffer(layer.layer_id)[loc], pool.get_value_buffer(layer.layer_id)[loc]
        if not kv_scaled(k.dtype):
            return k, v
        k_scale, v_scale = kv_scales(layer)
        return dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)

    # -- the input checks -----------------------------------------------------------------
    def check_inputs(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        """Check ``q``/``k``/``v`` against the layer, batch and pool; return them as ``[T, heads, dim]``.

        Each must be exactly ``[T, heads * dim]`` or ``[T, heads, dim]`` of the layer, one
        float dtype, on the pool's device; ``k``/``v`` may be None only with
        ``save_kv_cache=False``, ``v`` alone with an MLA pool (the value is the key's latent).
        Shapes only: no device read. Runs once per layer call, so
        the passing path builds no message.
        """
        tokens = forward_batch.out_cache_loc.shape[0]
        pool = forward_batch.token_to_kv_pool
        k_buffer = pool.get_key_buffer(layer.layer_id)  # the pool checks layer_id
        v_buffer = pool.get_value_buffer(layer.layer_id)
        kv_heads, head_dim, v_dim = layer.tp_k_head_num, layer.head_dim, layer.v_head_dim
        specs = ((q, layer.tp_q_head_num, head_dim), (k, kv_heads, head_dim), (v, layer.tp_v_head_num, v_dim))
        ok = (k_buffer.shape[1], k_buffer.shape[2], v_buffer.shape[2]) == (kv_heads, head_dim, v_dim)
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
        if not ok or dtype not in DTYPE_NAMES or not q.is_floating_point():
            self._explain_bad_inputs(q, k, v, layer, tokens, k_buffer, v_buffer, save_kv_cache)
        return shaped

    @staticmethod
    def _explain_bad_inputs(q, k, v, layer, tokens, k_buffer, v_buffer, save_kv_cache) -> None:
        """Raise the ``InvalidBatchError`` that names what :meth:`check_inputs` found wrong."""
        expect(
            (k_buffer.shape[1], k_buffer.shape[2], v_buffer.shape[2])
            == (layer.tp_k_head_num, layer.head_dim, layer.v_head_dim),
            InvalidBatchError,
            "layer (kv heads, head_dim, v_head_dim)",
            (layer.tp_k_head_num, layer.head_dim, layer.v_head_dim),
            f"the KV pool's {(k_buffer.shape[1], k_buffer.shape[2], v_buffer.shape[2])}",
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
            expect(
                t.dtype in DTYPE_NAMES and t.is_floating_point(),
                InvalidBatchError,
                f"{name}.dtype",
                t.dtype,
                "float32, bfloat16 or float16",
            )
            expect(t.device == k_buffer.device, InvalidBatchError, f"{name}.device", t.device, str(k_buffer.device))
        expect(
            False,
            InvalidBatchError,
            "q/k/v dtypes",
            (q.dtype, getattr(k, "dtype", None), getattr(v, "dtype", None)),
            "one dtype",
        )
