"""Plugin API 1: the names an API 1 plugin reaches that the current API lacks, served with warnings.

A plugin that declares no plugin API is taken as API 1 and runs through these shims:

* ``ForwardBatch.prefix_lens_cpu`` / ``query_lens_cpu`` / ``kv_lens_cpu`` (per request: cached tokens before
  the query, query tokens, keys attended over) and the method ``ForwardBatch.device_lens()``, which the
  batch protocols lack; their values are :func:`hal.batch.host_lens` / :func:`hal.batch.device_lens`.
* An API 1 backend's ``init_forward_metadata_out_graph`` assigns ``self.forward_metadata`` (API 1 has no
  ``set_forward_metadata``), and its ``__init__`` takes the capability only; :func:`adapt_api1_backend` stamps
  such metadata for the step and passes the config the way hal constructs backends.

Every shim warns (``DeprecationWarning``) with the replacement; ``hal info`` says that the plugin
"runs as plugin API 1 (deprecated names)".
"""

from __future__ import annotations

import functools
import inspect

import torch

from hal.deprecation import warn_renamed
from hal.errors import ConfigError, PluginError
from hal.modes import device_lens, host_lens, step_kind
from hal.validation import validation_level

__all__ = ["Api1BatchNames", "adapt_backend", "API1_NOTE", "PLAN_HOOKS", "RUN_HOOKS"]

API1_NOTE = "runs as plugin API 1 (deprecated names)"


class Api1BatchNames:
    """Plugin API 1's derived lengths of ``ForwardBatch``, kept as deprecated read-only names (a mixin)."""

    @property
    def prefix_lens_cpu(self) -> list[int]:
        """Deprecated: ``hal.batch.host_lens(fb).prefix``, cached tokens before each request's query tokens."""
        warn_renamed("ForwardBatch.prefix_lens_cpu", "hal.batch.host_lens(forward_batch).prefix", since="0.3.0")
        return list(host_lens(self).prefix)

    @property
    def query_lens_cpu(self) -> list[int]:
        """Deprecated: ``hal.batch.host_lens(fb).query``, each request's query tokens."""
        warn_renamed("ForwardBatch.query_lens_cpu", "hal.batch.host_lens(forward_batch).query", since="0.3.0")
        return list(host_lens(self).query)

    @property
    def kv_lens_cpu(self) -> list[int]:
        """Deprecated: ``hal.batch.host_lens(fb).kv``, the keys each request attends over (query tokens included)."""
        warn_renamed("ForwardBatch.kv_lens_cpu", "hal.batch.host_lens(forward_batch).kv", since="0.3.0")
        return list(host_lens(self).kv)

    def device_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Deprecated: ``hal.batch.device_lens(fb)``, ``(query_lens, kv_lens)`` int64 ``[B]`` on the device."""
        warn_renamed("ForwardBatch.device_lens()", "hal.batch.device_lens(forward_batch)", since="0.3.0")
        return device_lens(self)


# Plugin API 3 -> 4: the plan steps a backend implements were the engine-facing names themselves.
PLAN_HOOKS = {"init_forward_metadata_out_graph": "plan_out_graph", "init_forward_metadata_in_graph": "plan_in_graph"}
# Plugin API 2 -> 3: the run steps a backend implements were the engine-facing names themselves.
RUN_HOOKS = {
    "forward_decode": "run_decode",
    "forward_extend": "run_extend",
    "forward_mixed": "run_mixed",
    "forward_fused": "run_fused",
}
_ADAPTED: dict[tuple[type, int | None], type] = {}
_OLD_EDGES: dict[type, type] = {}


def adapt_backend(cls: type, api: int | None = None) -> type:
    """The class hal runs for backend class ``cls`` written for plugin API ``api``: ``cls`` itself where it is
    written for this hal's API, else a subclass of it (same name) that serves the older API's names. Made once per
    class and API, at the door: when a device's backends are read (:func:`hal.registry.device_backends`, with the
    API the plugin declares) or a class that came through no door is first instantiated (``api=None``: the older
    names it defines say which).

    What the subclass serves, each with a ``DeprecationWarning`` naming the replacement:

    * API 3 -> 4: a class's ``init_forward_metadata_out_graph`` / ``_in_graph`` are its ``plan_out_graph`` /
      ``plan_in_graph``; the engine-facing names are hal's edges again (checks, request tables, then the plan);
    * API 2 -> 3: its ``forward_decode`` / ``_extend`` / ``_mixed`` / ``forward_fused`` are its ``run_*`` steps; a
      step calling a sibling ``forward_*`` of its own backend reaches that sibling's step (no second KV write); a
      step calling ``super().forward_*`` is a ``PluginError`` saying to call ``super().run_*``;
    * ``runs_prologue = False`` (a delegating backend, hal 0.2-0.3): its own ``forward_*`` (and plan names) stay
      the edges: ``forward`` routes by mode to them, with none of hal's checks (the backends it delegates to run
      theirs);
    * API 1 (:func:`adapt_api1_backend`): ``available`` / ``validate``, metadata by assignment, ``__init__(self,
      capability)``.

    A class declared for API 4 that defines an engine-facing name as a step is a ``PluginError`` naming the change.
    """
    if cls.__dict__.get("_hal_adapter"):
        return cls
    key = (cls, api)
    adapted = _ADAPTED.get(key)
    if adapted is None:
        adapted = _ADAPTED[key] = _adapter(cls, api)
    return adapted


def _contract(cls: type) -> type:
    """hal's base class in ``cls``'s MRO (``hal.AttentionBackend``)."""
    return next(k for k in cls.__mro__ if k.__dict__.get("_hal_contract"))


def _definers(cls: type, name: str, base: type) -> list[type]:
    """The classes of ``cls``'s MRO above ``base`` that define ``name`` themselves, most derived first."""
    return [k for k in cls.__mro__[: cls.__mro__.index(base)] if name in k.__dict__]


def _adapter(cls: type, api: int | None) -> type:
    base = _contract(cls)
    if getattr(cls, "runs_prologue", True) is False:
        return _delegating(cls, base)
    ns: dict = {}
    deepest: dict[str, type] = {}
    renames = [*PLAN_HOOKS.items(), *(RUN_HOOKS.items() if api is None or api <= 2 else ())]
    for old, new in renames:
        definers = _definers(cls, old, base)
        if not definers:
            continue
        if api is not None and api >= 4:
            raise PluginError(
                f"{cls.__qualname__} defines {old}: since plugin API 4 (hal 0.4) {old} is the engine-facing edge the "
                f"base class runs; implement {new} (docs/porting.md)"
            )
        both = [k.__qualname__ for k in definers if new in k.__dict__]
        if both:
            raise PluginError(
                f"{both[0]} defines both {old} and {new}: {old} is the engine-facing edge the base class runs "
                f"(checks, then {new}); implement {new} only"
            )
        warn_renamed(f"{cls.__qualname__}.{old} (a backend's own step)", f"{cls.__qualname__}.{new}", since="0.4.0")
        deepest[new] = definers[-1]
        ns[new] = _step(getattr(cls, old))
        if old in PLAN_HOOKS:
            ns[old] = base.__dict__[old]  # the edge again
    if any(new.startswith("run_") for new in deepest):  # API 2 steps: each forward_* reaches a sibling's step
        for old, new in list(RUN_HOOKS.items())[:3]:
            ns[old] = _sibling_edge(base, old, new)
    if api == 1:
        ns.update(adapt_api1_backend(cls, base, ns))
    if not ns:
        return cls
    return _subclass(cls, base, ns, _hal_deepest=deepest)


def _subclass(cls: type, base: type, ns: dict, **extra) -> type:
    """The adapter: ``cls`` with ``ns``, its MRO ending in :func:`_old_edges`, the engine-facing names the edges."""
    for name in (*PLAN_HOOKS, *list(RUN_HOOKS)[:3]):  # engine calls reach the edges, not what old super() calls reach
        if name not in ns and not _definers(cls, name, base):
            ns[name] = base.__dict__[name]
    ns.update(extra, _hal_adapter=True, __module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__)
    return type(cls.__name__, (cls, _old_edges(base)), ns)


def _step(old):
    """An old engine-facing method run as the step it was: while it runs, its backend is marked as inside a step
    (so that a sibling ``forward_*`` it calls reaches that sibling's step, as under plugin API 2)."""

    @functools.wraps(old)
    def step(self, *args, **kwargs):
        depth = self.__dict__.get("_hal_in_step", 0)
        self.__dict__["_hal_in_step"] = depth + 1
        try:
            return old(self, *args, **kwargs)
        finally:
            self.__dict__["_hal_in_step"] = depth

    return step


def _sibling_edge(base: type, old: str, new: str):
    """The engine-facing ``old`` (``forward_decode``...) of an API 2 class: the base class's edge, or, called from
    inside one of the class's own steps, the step ``new`` directly (plugin API 2 ran no second prologue there)."""
    edge = base.__dict__[old]

    @functools.wraps(edge)
    def forward_kind(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, out=None, **kwargs):
        if self.__dict__.get("_hal_in_step"):
            return getattr(self, new)(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return edge(self, q, k, v, layer, forward_batch, save_kv_cache, out=out, **kwargs)

    return forward_kind


def _delegating(cls: type, base: type) -> type:
    """A ``runs_prologue = False`` class (hal 0.2-0.3: a backend whose ``forward_*`` delegate to other backends,
    which run their own checks): its own names stay the edges, and ``forward``, unless it defines one, routes by
    mode to its ``forward_decode`` / ``forward_extend`` / ``forward_mixed`` as hal 0.3's did, running no check."""
    if _definers(cls, "forward", base):
        return cls

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, out=None, **kwargs):
        kind = step_kind(forward_batch.forward_mode, self.capability.fused_mixed)
        extra = {} if out is None else {"out": out}
        return getattr(self, f"forward_{kind}")(q, k, v, layer, forward_batch, save_kv_cache, **extra, **kwargs)

    forward.__doc__ = _delegating.__doc__
    return _subclass(cls, base, {"forward": forward}, _hal_deepest={})


def _old_edges(base: type) -> type:
    """The class an adapted class's MRO ends in above ``base``: where an old step's ``super()`` call of an
    engine-facing name lands (made once)."""
    edges = _OLD_EDGES.get(base)
    if edges is not None:
        return edges

    def out_graph(self, forward_batch, in_capture=False):
        """API 3: ``super().init_forward_metadata_out_graph`` from a plan step is the plan of the classes below it."""
        owner = self._hal_deepest.get("plan_out_graph", type(self))
        return super(owner, self).plan_out_graph(forward_batch, in_capture)

    def in_graph(self, forward_batch):
        """API 3: ``super().init_forward_metadata_in_graph`` from a plan step is the plan of the classes below it."""
        owner = self._hal_deepest.get("plan_in_graph", type(self))
        return super(owner, self).plan_in_graph(forward_batch)

    def recursing(kind: str):
        def forward_kind(self, *args, **kwargs):
            raise PluginError(
                f"{type(self).__qualname__}: forward_{kind} was called from inside its own run_{kind} (a plugin API 2 "
                f"forward_{kind} that calls super().forward_{kind}): since hal 0.4 forward_{kind} is the "
                f"engine-facing edge; call super().run_{kind} instead"
            )

        return forward_kind

    def fused(self, *args, **kwargs):
        """API 2: ``super().forward_fused`` from a step: the base's answer, no fused call."""
        return None

    @classmethod
    def available(cls, capability):
        """API 1: ``super().available`` from an override: the base class's reasons (none)."""
        return []

    @classmethod
    def validate(cls, config, capability):
        """API 1: ``super().validate`` from an override: what the declaration gives (``unsupported_reasons``)."""
        return cls._declared_unsupported_reasons(config, capability)

    ns = {
        "init_forward_metadata_out_graph": out_graph,
        "init_forward_metadata_in_graph": in_graph,
        "forward_fused": fused,
        "available": available,
        "validate": validate,
        "__module__": __name__,
        "__doc__": _old_edges.__doc__,
        **{f"forward_{kind}": recursing(kind) for kind in ("decode", "extend", "mixed")},
    }
    edges = _OLD_EDGES[base] = type("OlderPluginApis", (base,), ns)
    return edges


def adapt_api1_backend(cls: type, base: type, ns: dict) -> dict:
    """What a plugin API 1 backend class needs besides the renames (``ns``, the adapter's members so far): the
    members to add to its adapter.

    * ``available`` / ``validate`` (0.1's names of ``unavailable_reasons`` / ``unsupported_reasons``) overridden:
      answered through them, with a warning;
    * its plan step may assign ``self.forward_metadata`` instead of calling ``set_forward_metadata(meta,
      forward_batch)``: the assignment is stamped for the step, with a warning;
    * an ``__init__(self, capability)`` without the config gets ``self.config`` set after it runs.
    """
    added: dict = {}
    if _definers(cls, "available", base):

        def unavailable_reasons(klass, capability):
            warn_renamed(f"{cls.__qualname__}.available (overridden)", "unavailable_reasons")
            return list(klass.available(capability))

        added["unavailable_reasons"] = classmethod(unavailable_reasons)
    if _definers(cls, "validate", base):

        def unsupported_reasons(klass, config, capability):
            warn_renamed(f"{cls.__qualname__}.validate (overridden)", "unsupported_reasons")
            return list(klass.validate(config, capability))

        added["unsupported_reasons"] = classmethod(unsupported_reasons)
    plan = ns.get("plan_out_graph", cls.plan_out_graph)

    @functools.wraps(plan)
    def plan_out_graph(self, forward_batch, in_capture=False):
        step = self._hal_plan.step
        plan(self, forward_batch, in_capture)
        if self._hal_plan.step == step:  # nothing stamped: the API 1 way, self.forward_metadata = meta
            warn_renamed(
                f"{cls.__name__}: assigning self.forward_metadata in init_forward_metadata_out_graph",
                "self.set_forward_metadata(meta, forward_batch)",
                since="0.3.0",
            )
            self._hal_plan.set_metadata(self.forward_metadata, forward_batch)

    added["plan_out_graph"] = plan_out_graph
    init = cls.__init__
    if len(inspect.signature(init).parameters) == 2:  # (self, capability): API 1's constructor

        @functools.wraps(init)
        def __init__(self, capability, config=None, **options):
            validate = options.pop("validate", None)  # the base class's own option, not the backend's
            if options:
                raise ConfigError(
                    f"{cls.__name__} options {sorted(options)}: a plugin API 1 backend takes only hal's "
                    "validate= (its __init__ takes the capability only); declare plugin_api = 4 once it is ported"
                )
            init(self, capability)
            self.config = config
            if validate is not None:
                self.validation = validation_level(validate)

        added["__init__"] = __init__
    return added
