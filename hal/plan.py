"""``backend.plan``: one backend's plan state and the helpers its plan steps call (:class:`Plan`).

A step is planned by the engine-facing edges of :class:`hal.backend.AttentionBackend`
(``init_forward_metadata_out_graph`` / ``_in_graph``), which call the backend's ``plan_out_graph`` /
``plan_in_graph``. What those steps need of hal lives here, on the backend's :class:`Plan` (``self.plan``): the
batch check (:meth:`Plan.check_batch`, run by the edge), whether a batch is a captured graph's
(:meth:`Plan.is_graph_batch`), the request tables the backend reads (:class:`hal.batch.RequestTables`), and the
step's metadata with its stamp (:meth:`Plan.set_metadata`, which every plan ends with, and
:meth:`Plan.metadata_for`, which the run steps read back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hal.batch import RequestTables, validate_batch
from hal.deprecation import warn_renamed
from hal.errors import InvalidBatchError, expect
from hal.prologue import PATH_CHECKED, PATH_FUSED, fused_forward_off, step_facts
from hal.validation import check_batch_fields

if TYPE_CHECKING:
    from hal.batch import ForwardBatch

__all__ = ["Plan"]


class Plan:
    """The plan state of ``backend``: the current step's metadata, its stamp and the graph batches it has seen."""

    def __init__(self, backend):
        """``backend``: the :class:`hal.backend.AttentionBackend` whose plan this is (it holds this object)."""
        self.backend = backend
        self.tables = RequestTables(backend.declaration().reads_tables)
        self.stamp: tuple | None = None  # (mode name, batch size, step, fused) of the current metadata
        self.step = 0
        self.graph_batches: set[tuple[str, int]] = set()

    def check_batch(self, forward_batch: ForwardBatch) -> None:
        """Validate ``forward_batch`` at the backend's level (``validate=`` option), with what the backend declares it
        needs (page-aligned slots, padding slots). The plan edge runs it before the backend's plan; hal's own batches
        already passed their construction level, so only an engine's batch or a stricter level costs anything."""
        backend = self.backend
        level = backend.validation
        declared = backend.declaration()
        stricter = declared.requires_page_aligned_slots or not declared.supports_padding_slots
        if getattr(forward_batch, "validate", None) == level and not (level == "full" and stricter):
            check_batch_fields(forward_batch)  # presence and types only: a field changed since construction
            return
        validate_batch(
            forward_batch,
            level,
            page_aligned=declared.requires_page_aligned_slots,
            padding_slots=None if declared.supports_padding_slots else declared.name,
        )

    def is_graph_batch(self, forward_batch: ForwardBatch, in_capture: bool = False) -> bool:
        """Whether ``forward_batch`` is a captured graph's static batch (use the fixed graph buffers).

        hal's ``GraphRunner`` marks its batches (``graph_static``); an engine's runner is recognised by
        ``in_capture=True`` at capture, and at replay by the (mode, batch size) it captured.
        """
        key = (forward_batch.forward_mode.name, forward_batch.batch_size)
        if in_capture:
            self.graph_batches.add(key)
            return True
        marked = getattr(forward_batch, "graph_static", None)
        return marked if marked is not None else key in self.graph_batches

    def set_metadata(self, metadata: Any, forward_batch: ForwardBatch, fused: bool | None = None) -> None:
        """Make ``metadata`` (what ``plan_out_graph`` built for ``forward_batch``) the current one, stamped with this
        step; the backend's ``forward_metadata`` is then it. ``fused``: whether this step's layers may take the
        backend's ``run_fused`` (the fast path, chosen here); None: wherever its class offers one and
        ``fused_forward_ready()``. Either way only where ``HAL_FUSED_FORWARD`` is not 0 and no
        :func:`hal.prologue.fused_forward_disabled` is in force."""
        backend = self.backend
        possible = step_facts(type(backend)).fused
        if fused is None:
            fused = possible and backend.fused_forward_ready()
        fused = bool(fused) and possible and backend.__dict__.get("_fused_env", True) and not fused_forward_off()
        self.step += 1
        backend.forward_metadata = metadata
        self.stamp = (forward_batch.forward_mode.name, forward_batch.batch_size, self.step, fused)
        try:
            forward_batch._hal_metadata_step = (id(backend), self.step)
        except AttributeError:  # a batch with __slots__: the mode/size stamp still guards it
            pass

    def metadata_for(self, forward_batch: ForwardBatch) -> Any:
        """The current metadata, checked (cheaply) to belong to ``forward_batch``'s step.

        Any view of the step's batch passes (SGLang prepares metadata on one and runs forward with another);
        metadata never prepared, prepared for another mode or batch size, or for an earlier step of this very batch
        object is an ``InvalidBatchError``.
        """
        stamp = self.stamp
        mode, bs = forward_batch.forward_mode.name, forward_batch.batch_size
        owner, step = getattr(forward_batch, "_hal_metadata_step", (None, None))
        ok = stamp is not None and stamp[:2] == (mode, bs) and (owner != id(self.backend) or step == stamp[2])
        expect(
            ok,
            InvalidBatchError,
            "forward_metadata",
            "missing" if stamp is None else f"prepared for {stamp[0]} x {stamp[1]} (step {stamp[2]})",
            f"this batch's ({mode} x {bs}): call init_forward_metadata(forward_batch) before forward",
        )
        return self.backend.forward_metadata

    def __call__(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        """Deprecated (0.4.0): ``PlainTorchBackend.plan(fb)``, the torch backend's host plan, is its
        ``plan_out_graph(fb)`` (every backend's plan hook); ``backend.plan`` is this object."""
        backend = self.backend
        warn_renamed(
            f"{type(backend).__qualname__}.plan(fb)", f"{type(backend).__qualname__}.plan_out_graph(fb)", since="0.4.0"
        )
        backend.plan_out_graph(forward_batch, in_capture)

    def path(self) -> str:
        """The path the current step's plan chose: ``"fused"`` or ``"checked"`` (a call may still fall back)."""
        return PATH_FUSED if self.stamp is not None and self.stamp[3] else PATH_CHECKED
