"""The eager graph's guards: what a CUDA / NPU graph cannot replay, refused on any machine (part of :mod:`hal.graph`).

``HostSyncGuard`` (a dispatch mode) fails on host syncs, data-dependent shapes, host data written into
device tensors, allocations whose shape differs from the capture's and a replay that reads other tensors
than the capture did; ``HostMethodGuard`` refuses ``.item()`` / ``.tolist()`` / ``.cpu()`` / ``.numpy()``;
``HostSide`` notes which tensors the host-side work of a step (``out_graph``) made, in ``HostTensors``;
``HostReadCounter`` counts device-to-host reads (``hal bench --workload step``).
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hal.errors import GraphCaptureError

__all__ = ["HostSyncGuard", "HostTensors", "HostReadCounter", "HostMethodGuard", "HostSide"]

_aten = torch.ops.aten
_DATA_DEPENDENT = {
    _aten._local_scalar_dense: "a host sync (.item() / .tolist() / int() of a tensor)",
    _aten.nonzero: "a data-dependent shape (nonzero or boolean-mask indexing)",
    _aten.masked_select: "a data-dependent shape (masked_select)",
    _aten.unique_dim: "a data-dependent shape (unique)",
    _aten._unique2: "a data-dependent shape (unique)",
    _aten.unique_consecutive: "a data-dependent shape (unique_consecutive)",
}
_LITERALS = {_aten.lift_fresh, _aten.lift, _aten.lift_fresh_copy}
_HOST_METHODS = {torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item}
# builders of a tensor from Python data: on the host, then copied to ``device=`` when one is given
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
# Where a 0-dim host tensor is a kernel argument, not a copy. On CUDA, TensorIterator reads a CPU
# scalar operand of a pointwise op on the host (no sync) and passes its value to the kernel, and
# fill_ / masked_fill with a CPU 0-dim value call value.item() on the host and launch a fill kernel
# (aten/src/ATen/native/Fill.cpp): graph-safe, the value frozen at capture like fill_(3.0)'s.
# Everywhere else (copy_, index_put_, _to_copy, ...) a host tensor on a device is a host-to-device
# copy with a stream sync, which torch refuses during CUDA graph capture.
_SCALAR_ARGUMENT_OPS = {_aten.fill_, _aten.fill, _aten.masked_fill_, _aten.masked_fill}
_STORAGES = (torch.UntypedStorage, torch.TypedStorage)


class HostTensors:
    """The host tensors a graph's step made or was given, weakly held by storage address.

    On a CPU-only machine every tensor is a CPU tensor, so "host data" cannot be read off the
    device: a tensor is host data when it was built from Python data (``torch.tensor(list)``,
    ``from_numpy``, the 0-dim tensor ``t[i] = 0`` builds) without a ``device=``, is a batch's
    ``*_cpu`` mirror, or was computed from host tensors only.
    """

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: object) -> None:
        ptr = _storage_ptr(t) if isinstance(t, torch.Tensor) else None
        if ptr is not None:
            self._refs[ptr] = weakref.ref(t)

    def __contains__(self, t: object) -> bool:
        ptr = _storage_ptr(t) if isinstance(t, torch.Tensor) else None
        ref = self._refs.get(ptr) if ptr is not None else None
        return ref is not None and ref() is not None

    def mark_results(self, inputs: list, out: object) -> None:
        """Mark ``out``'s tensors as host data when every tensor input is (host work makes host tensors)."""
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        if tensors and all(t in self for t in tensors):
            for t in tree_flatten(out)[0]:
                self.add(t)


def _moves_to_device(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to(...)`` call names a device (a device, a device string, or a tensor to match)."""
    targets = [*args[1:], kwargs.get("device"), kwargs.get("other")]
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in targets if a is not None)


def _constant(x: object) -> object:
    """What a graph freezes of a non-tensor op argument: a value; a storage's address; else just its type."""
    if x is None or isinstance(x, (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout)):
        return x
    if isinstance(x, torch.memory_format):
        return x
    return type(x).__name__  # a storage (Triton's interpreter calls set_(storage, ...)): its address is a read


class HostSyncGuard(TorchDispatchMode):
    """Fails on what a real graph cannot record, and records what a replay must repeat.

    Per op it records the shapes of its outputs (``shapes``), the addresses of the tensors it
    reads that the run did not produce (``reads``), and its constants (``constants``): the
    Python numbers and other non-tensor arguments, and the values of the 0-dim host tensors it
    takes as kernel arguments. ``host``: the host tensors the step made outside the graph.
    """

    def __init__(self, host: HostTensors | None = None):
        super().__init__()
        self.host = host if host is not None else HostTensors()
        self.shapes: list[tuple[str, tuple]] = []
        # (op index, argument index, data_ptr) of every input tensor (or storage) the run did not produce itself
        self.reads: list[tuple[int, int, int]] = []
        self.inputs: list = []  # those tensors, alive so that no later allocation takes their address
        self.constants: list[tuple] = []
        self._produced: set[int] = set()  # storages the run allocated
        self._external: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet in _DATA_DEPENDENT:
            raise GraphCaptureError(f"{func} inside a graph: {_DATA_DEPENDENT[packet]}; move it to out_graph")
        if packet is _aten.lift_fresh and args[0].dim() > 0:
            raise GraphCaptureError(
                "torch.tensor(<host data>) inside a graph: a real graph replays the values seen at capture; "
                "build it in out_graph into a buffer the graph reads"
            )
        if packet is _aten.repeat_interleave and kwargs.get("output_size") is None and len(args) == 1:
            raise GraphCaptureError("repeat_interleave without output_size inside a graph: a data-dependent shape")
        if packet in (_aten.index, _aten.index_put, _aten.index_put_) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None
        ):
            raise GraphCaptureError(f"{func} with a boolean mask inside a graph: a data-dependent shape (nonzero)")
        op = len(self.shapes)
        flat_in, _ = tree_flatten((args, kwargs))
        literal = packet in _LITERALS  # a Python literal (torch.tensor(3), the value of t[i] = 3): host data
        tensors = [x for x in flat_in if isinstance(x, torch.Tensor)]
        host = [t for t in tensors if literal or t in self.host]
        self._check_host_reads(func, host)
        with torch._C.DisableTorchFunction():  # reading a host scalar is no graph work
            values = tuple(t.item() for t in host if t.numel() == 1)
        self.constants.append((*(_constant(x) for x in flat_in if not isinstance(x, torch.Tensor)), *values))
        for i, x in enumerate(flat_in):
            if isinstance(x, _STORAGES):
                storage, address = x.data_ptr(), x.data_ptr()
            elif isinstance(x, torch.Tensor) and not (literal or x in self.host):
                storage, address = _storage_ptr(x), x.data_ptr()
            else:
                continue
            if storage is not None and storage not in self._produced:
                self._external.add(storage)
                self.reads.append((op, i, address))
                self.inputs.append(x)
        out = func(*args, **kwargs)
        flat, _ = tree_flatten(out)
        for t in flat:
            storage = _storage_ptr(t) if isinstance(t, torch.Tensor) else None
            if storage is not None and storage not in self._external:
                self._produced.add(storage)
        if literal:
            self.host.add(out)
        elif not func._schema.is_mutable:  # an in-place op returns the tensor it wrote: not new host data
            self.host.mark_results(tensors, out)
        self.shapes.append((str(func), tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))))
        return out

    @staticmethod
    def _check_host_reads(func, host: list[torch.Tensor]) -> None:
        """A host tensor inside a graph may only be a scalar kernel argument (see ``_SCALAR_ARGUMENT_OPS``)."""
        packet = func._overloadpacket
        if packet in _LITERALS:
            return
        for t in host:
            if t.dim() > 0:
                raise GraphCaptureError(
                    f"{func} inside a graph reads a host tensor of shape {tuple(t.shape)} (a batch's *_cpu "
                    "mirror, or one built from host data without device=): on a device that is a host-to-device "
                    "copy, or host work a replay does not repeat. Copy it into a device buffer in out_graph"
                )
            if packet not in _SCALAR_ARGUMENT_OPS and torch.Tag.pointwise not in func.tags:
                raise GraphCaptureError(
                    f"{func} inside a graph takes a host value (a Python number written with t[i] = x, or a "
                    "0-dim host tensor): on CUDA that is a host-to-device copy with a stream sync, which "
                    "capture refuses. Write constants with fill_ / zero_ (or a slice: t[i:i+1].fill_(x)), "
                    "or compute the value on the device"
                )


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if t.numel() else None
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, sparse, wrapper subclasses)
        return None


class _HostAwareMode(TorchFunctionMode):
    def __init__(self, host: HostTensors):
        super().__init__()
        self.host = host


class HostMethodGuard(_HostAwareMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_METHODS:
            raise GraphCaptureError(f"Tensor.{func.__name__}() inside a graph: a host sync; move it to out_graph")
        if func in _FROM_DATA and kwargs.get("device") is not None and not isinstance(args[0], torch.Tensor):
            raise GraphCaptureError(
                f"torch.{func.__name__}(<host data>, device=...) inside a graph: built on the host and copied to "
                "the device (a host-to-device copy, refused during capture); allocate it once in "
                "init_cuda_graph_state, or fill a device buffer in out_graph"
            )
        if func is torch.Tensor.to and args[0] in self.host and _moves_to_device(args, kwargs):
            raise GraphCaptureError(
                "Tensor.to(device) of a host tensor inside a graph: a host-to-device copy; copy it into a "
                "device buffer in out_graph"
            )
        return func(*args, **kwargs)


class HostSide(_HostAwareMode):
    """Notes the host tensors the host-side work of a step (``out_graph``) makes, for the eager graph's guard."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FROM_DATA or func is torch.from_numpy:
            if kwargs.get("device") is None and not (args and isinstance(args[0], torch.Tensor)):
                self.host.add(out)
        elif func is torch.Tensor.to and args[0] in self.host and _moves_to_device(args, kwargs):
            # on a device this is a new device tensor; the CPU returns the host tensor itself
            return out.clone() if out is args[0] else out
        elif func in (torch.Tensor.cpu, torch.Tensor.pin_memory) and _storage_ptr(out) != _storage_ptr(args[0]):
            self.host.add(out)
        elif not getattr(func, "__name__", "").endswith("_") and "out" not in kwargs:
            self.host.mark_results(tree_flatten((args, kwargs))[0], out)
        return out


_READS = {
    torch.Tensor.cpu: ".cpu()",
    torch.Tensor.numpy: ".numpy()",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.item: ".item()",
    torch.Tensor.__bool__: "bool()",
    torch.Tensor.__int__: "int()",
    torch.Tensor.__float__: "float()",
    torch.Tensor.__index__: "an index",
    torch.Tensor.equal: "equal()",
    torch.equal: "torch.equal",
    torch.Tensor.nonzero: "nonzero()",
    torch.nonzero: "torch.nonzero",
    torch.masked_select: "masked_select",
    torch.Tensor.masked_select: "masked_select",
    torch.unique: "torch.unique",
    torch.Tensor.unique: "unique()",
}


class HostReadCounter(TorchFunctionMode):
    """Counts the calls that read a device tensor back to the host (a stall per call on a GPU).

    ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``/``int()`` of a tensor, ``torch.equal``,
    ``nonzero`` and boolean-mask indexing, on any tensor but those in ``host`` (the host
    mirrors a caller passed, which live on the CPU anyway). On a CPU-only machine nothing
    syncs, so this counts what would. ``reads`` lists ``(what, shape)`` of each.
    """

    def __init__(self, host: tuple = ()):
        super().__init__()
        self.host = {id(t) for t in host if isinstance(t, torch.Tensor)}
        self.reads: list[tuple[str, tuple]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and id(first) not in self.host:
            what = _READS.get(func)
            if what is None and func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
                index = args[1] if isinstance(args[1], tuple) else (args[1],)
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                    what = "boolean-mask indexing"
            if what is not None:
                self.reads.append((what, tuple(first.shape)))
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        return len(self.reads)
