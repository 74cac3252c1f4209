"""The paths a backend can take, each judged by the conformance suite (``hal check``).

A backend may serve one forward by more than one path: the CPU backend's fused one-call
forward and its checked prologue path, each compiled ISA path the CPU can run, each
generation an NPU backend routes for. A bug in a path the suite never takes passes
``hal check``, so the suite runs its case families on every path:

* the forward paths the backend declares (``backend.steps.forward_paths()``: ``"fused"`` and
  ``"checked"``); besides the default run (the backend's own choice, the fused path
  where it applies), the suite runs the ``checked`` path with the fused forward turned
  off (``hal.backend.fused_forward_disabled()`` / ``HAL_FUSED_FORWARD=0``);
* the paths the device supplies (``device.conformance_paths(backend_cls, capability)``:
  plain dicts ``{"name", "env", "families", "modes", "sample", "unreached"}``), e.g. ``isa=avx2`` run under
  ``HAL_CPU_ISA=avx2``; a path this machine cannot run is reported as unreached with
  the reason instead of being run; ``"sample": True`` runs a bounded share of its families' cases that meets
  every shape the whole set does (``hal.conformance.catalogue.one_per_shape``: every mode at every head-dim
  combination, request table and KV layout, every family, page size, dtype...), so a path the machine does not
  take by default meets the same shapes as the default one;
* the paths the backend supplies itself, in the same dicts (``backend_cls.conformance_paths(capability)``,
  where the class has it): a backend shared by several devices names its own kernel variants there, e.g. the
  Triton backend's forced tile choices (``tiles=16x32`` under ``HAL_TRITON_TILES``).

Each path runs with its environment set and its own capability (the device probed under
that environment). ``hal check`` reports, per backend, which paths ran which families and
which were unreached and why.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from hal.backend import fused_forward_disabled
from hal.prologue import forward_paths as prologue_forward_paths

__all__ = ["DEFAULT", "Path", "forward_paths", "paths_for"]


@dataclass(frozen=True)
class Path:
    """One path: ``name`` (``default``, ``checked``, ``isa=avx2``...), the environment it runs under, whether the
    fused forward is turned off, the case families and forward modes it runs (None: every one), ``unreached``: why
    this machine cannot take it ("" where it can), and ``sample``: whether it runs one case per shape of those
    (:func:`hal.conformance.catalogue.one_per_shape`) rather than each."""

    name: str = "default"
    env: tuple[tuple[str, str], ...] = ()
    checked: bool = False
    families: frozenset[str] | None = None
    unreached: str = ""
    modes: frozenset[str] | None = None
    sample: bool = False

    @property
    def is_default(self) -> bool:
        return self.name == "default"

    def runs(self, family: str, mode: str | None = None) -> bool:
        """Whether this path runs ``family`` (in forward mode ``mode``, a ``ForwardMode`` name). Random batches
        (``--fuzz``) run on the default path only; the checked path leaves out graphs, which take the checked path
        on every path."""
        if family == "fuzz":
            return self.is_default
        if family == "graph" and self.checked:
            return False
        if self.modes is not None and mode is not None and mode not in self.modes:
            return False
        return self.families is None or family in self.families

    @contextlib.contextmanager
    def active(self):
        """This path's environment (and, for ``checked``, the fused forward turned off) while the block runs."""
        env = dict(self.env)
        if self.checked:
            env["HAL_FUSED_FORWARD"] = "0"
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            with fused_forward_disabled() if self.checked else contextlib.nullcontext():
                yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


DEFAULT = Path()


def forward_paths(backend_cls, make=None) -> list[str]:
    """The forward paths ``backend_cls`` can take: :func:`hal.prologue.forward_paths` of it, or of the instance
    ``make`` returns (which also knows whether its kernels were built)."""
    return list(prologue_forward_paths(make() if make is not None else backend_cls))


def paths_for(device, backend_cls, capability, make=None) -> list[Path]:
    """Every path of ``backend_cls`` on ``device``: :data:`DEFAULT` first, then the checked path where the backend
    also has a fused one, then the device's (``conformance_paths``), then the backend's own, unreached ones
    included."""
    paths = [DEFAULT]
    if {"fused", "checked"} <= set(forward_paths(backend_cls, make)):
        paths.append(Path("checked", checked=True))  # every family: a refactor may move any onto it
    supplied = getattr(device, "conformance_paths", None)
    entries = list(supplied(backend_cls, capability) if supplied is not None else ())
    own = getattr(backend_cls, "conformance_paths", None)
    entries += own(capability) if own is not None else ()
    return paths + [_path(entry) for entry in entries]


def _path(entry: dict) -> Path:
    """A :class:`Path` from a ``conformance_paths`` dict."""
    families, modes = entry.get("families"), entry.get("modes")
    return Path(
        str(entry["name"]),
        tuple(sorted((entry.get("env") or {}).items())),
        bool(entry.get("checked", False)),
        None if families is None else frozenset(families),
        str(entry.get("unreached") or ""),
        None if modes is None else frozenset(modes),
        bool(entry.get("sample", False)),
    )
