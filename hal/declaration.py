"""What a backend declares: :class:`BackendDeclaration`, the plain data selection reads.

A backend class states what it supports as class attributes (``name``, ``dtypes``, ``page_sizes``,
``supports_*``...: plugin API 2, unchanged); :meth:`BackendDeclaration.of` reads them into one frozen
object, and selection, ``hal info`` and the registry's plugin checks read that object, never the
class's other members. The reasons a declaration gives against a config
(:meth:`BackendDeclaration.unsupported_reasons`) are the ones selection weighs and ``hal info`` shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from hal.errors import PluginError
from hal.kv_layouts import KV_LAYOUTS, TOKEN_MAJOR

if TYPE_CHECKING:
    from hal.capability import DeviceCapability
    from hal.config import AttentionConfig

__all__ = ["BackendDeclaration", "REQUEST_TABLES"]

# The request table forms a backend may read: "token" (req_to_token) and "page" (req_to_page, a block table).
REQUEST_TABLES = frozenset({"token", "page"})


@dataclass(frozen=True)
class BackendDeclaration:
    """One backend class's declared support: the frozen value selection, the forward path and ``hal info`` read
    (:meth:`hal.AttentionBackend.declaration`), from its class attributes of the same names (a field's default where
    the class sets none). ``reads_new_kv``: False where the run steps read the new tokens from the cache, never from
    k/v (so k/v may stay None with ``save_kv_cache=False``).

    ``dtypes``: compute dtype names (``fp32``, ``bf16``, ``fp16``); ``kv_cache_dtypes``: KV cache dtype names
    (the class's ``None`` resolved to ``dtypes``); ``page_sizes`` / ``head_dims``: None means any;
    ``supports_mla``: ``v_head_dim != head_dim``; ``requires_page_aligned_slots``: token ``i`` of a request at
    offset ``i % page_size`` of its page; ``supports_padding_slots``: ``out_cache_loc`` may hold -1 (a padding
    token whose KV is written nowhere; hal 0.3, False for a class that does not say); ``reads_tables``: the
    request table forms its metadata reads, ``"token"`` (``req_to_token``) and/or ``"page"`` (``req_to_page``;
    hal 0.4, ``{"token"}`` for a class that does not say): hal derives the other form for it from a batch that
    carries only that one (:func:`hal.batch.tables_for`); ``kv_layouts``: the KV pool layouts its kernels read in
    place (:mod:`hal.kv_layouts`), preferred first (hal 0.4, ``("token_major",)`` for a class that does not say);
    ``option_defaults``: the constructor options and their defaults.
    """

    name: str
    dtypes: frozenset[str] = frozenset({"fp32", "bf16", "fp16"})
    kv_cache_dtypes: frozenset[str] | None = None  # None (as a class attribute): the same as ``dtypes``
    page_sizes: frozenset[int] | None = None  # None: any power of two
    head_dims: frozenset[int] | None = None  # None: any
    supports_sliding_window: bool = True
    supports_logit_cap: bool = True
    supports_non_causal: bool = True
    supports_custom_mask: bool = True
    supports_graph: bool = True
    supports_mla: bool = False
    supports_sinks: bool = False
    requires_page_aligned_slots: bool = False
    supports_padding_slots: bool = False
    reads_tables: frozenset[str] = frozenset({"token"})
    kv_layouts: tuple[str, ...] = (TOKEN_MAJOR,)
    option_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    reads_new_kv: bool = True

    @classmethod
    def of(cls, backend_cls: type) -> BackendDeclaration:
        """The declaration of ``backend_cls``, read from its class attributes; ``PluginError`` naming the
        attribute where one is not what it must be (a plugin's typo surfaces as a reason, not mid-selection)."""
        values = {f.name: getattr(backend_cls, f.name, _default(f)) for f in fields(cls)}
        for f in fields(cls):  # None where a default exists: what a class written before the field says
            if values[f.name] is None and f.name not in ("kv_cache_dtypes", "page_sizes", "head_dims"):
                values[f.name] = _default(f)
        owner = backend_cls.__qualname__

        def names(attr: str, value, item_type: type, optional: bool):
            if value is None and optional:
                return None
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise PluginError(f"{owner}.{attr} = {value!r}: expected a set of {item_type.__name__}")
            items = frozenset(value)
            bad = [v for v in items if not isinstance(v, item_type) or isinstance(v, bool)]
            if bad:
                raise PluginError(f"{owner}.{attr} holds {bad!r}: expected {item_type.__name__} items")
            return items

        if not isinstance(values["name"], str) or not values["name"]:
            raise PluginError(f"{owner}.name = {values['name']!r}: expected a non-empty str")
        values["dtypes"] = names("dtypes", values["dtypes"], str, False)
        kv = values["kv_cache_dtypes"]
        values["kv_cache_dtypes"] = values["dtypes"] if kv is None else names("kv_cache_dtypes", kv, str, False)
        values["page_sizes"] = names("page_sizes", values["page_sizes"], int, True)
        values["head_dims"] = names("head_dims", values["head_dims"], int, True)
        values["reads_tables"] = names("reads_tables", values["reads_tables"], str, False)
        if not values["reads_tables"] or not values["reads_tables"] <= REQUEST_TABLES:
            raise PluginError(
                f"{owner}.reads_tables = {set(values['reads_tables'])!r}: expected a non-empty subset of "
                f"{sorted(REQUEST_TABLES)}"
            )
        layouts = values["kv_layouts"]
        if isinstance(layouts, (str, bytes)) or not hasattr(layouts, "__iter__"):
            raise PluginError(f"{owner}.kv_layouts = {layouts!r}: expected a sequence of layout names, preferred first")
        values["kv_layouts"] = tuple(layouts)
        if not values["kv_layouts"] or len(set(values["kv_layouts"])) != len(values["kv_layouts"]):
            raise PluginError(f"{owner}.kv_layouts = {layouts!r}: expected one or more distinct layout names")
        unknown = [name for name in values["kv_layouts"] if name not in KV_LAYOUTS]
        if unknown:
            raise PluginError(f"{owner}.kv_layouts holds {unknown!r}: expected names of {sorted(KV_LAYOUTS)}")
        for f in fields(cls):
            if f.name.startswith(("supports_", "requires_", "reads_new")) and not isinstance(values[f.name], bool):
                raise PluginError(f"{owner}.{f.name} = {values[f.name]!r}: expected True or False")
        defaults = values["option_defaults"]
        if not isinstance(defaults, Mapping):
            raise PluginError(f"{owner}.option_defaults = {defaults!r}: expected a mapping of option -> default")
        values["option_defaults"] = MappingProxyType(dict(defaults))
        return cls(**values)

    def unsupported_reasons(self, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        """Every reason the declared support gives against serving ``config`` on ``capability`` (empty: none)."""
        reasons = []
        dtype = config.dtype_name
        if dtype not in self.dtypes:
            reasons.append(f"dtype {dtype} not supported (supports {sorted(self.dtypes)})")
        elif dtype not in capability.dtypes:
            reasons.append(f"device has no {dtype}: {capability.reasons.get(dtype, 'not listed')}")
        if self.page_sizes is not None and config.page_size not in self.page_sizes:
            reasons.append(f"page_size {config.page_size} not supported (supports {sorted(self.page_sizes)})")
        if self.head_dims is not None and config.head_dim not in self.head_dims:
            reasons.append(f"head_dim {config.head_dim} not supported (supports {sorted(self.head_dims)})")
        if config.v_head_dim != config.head_dim and not self.supports_mla:
            reasons.append(f"v_head_dim {config.v_head_dim} != head_dim {config.head_dim} not supported")
        for wanted, supported, what in (
            (config.sliding_window_size >= 0, self.supports_sliding_window, "sliding window"),
            (config.logit_cap > 0, self.supports_logit_cap, "logit cap"),
            (config.non_causal, self.supports_non_causal, "non-causal (encoder / cross) attention"),
            (config.custom_mask, self.supports_custom_mask, "custom mask (TARGET_VERIFY)"),
        ):
            if wanted and not supported:
                reasons.append(f"{what} not supported")
        layout = getattr(config, "kv_layout", None)
        if layout is not None and layout not in self.kv_layouts:
            reasons.append(f"kv_layout {layout} not read in place (reads {list(self.kv_layouts)})")
        elif layout is not None:
            dims = dict.fromkeys((config.head_dim, config.v_head_dim))
            row = KV_LAYOUTS[layout]
            whys = (row.unsupported(config.tp_k_head_num, d, config.page_size) for d in dims)
            reasons += [f"kv_layout {why}" for why in whys if why]
        return reasons

    def model_feature_reasons(self, config: AttentionConfig) -> list[str]:
        """Why ``config``'s attention sinks or KV cache dtype are not declared (empty: they are)."""
        reasons = []
        if getattr(config, "attention_sinks", False) and not self.supports_sinks:
            reasons.append("attention sinks not supported")
        kv_dtype = getattr(config, "kv_cache_dtype_name", config.dtype_name)
        if kv_dtype != config.dtype_name and kv_dtype not in self.kv_cache_dtypes:
            reasons.append(f"kv_cache_dtype {kv_dtype} not supported (supports {sorted(self.kv_cache_dtypes)})")
        return reasons

    def graph_reasons(self, config: AttentionConfig, capability: DeviceCapability) -> list[str]:
        """Why graph capture, when ``config`` wants it, is not served (the backend or the device)."""
        if config.graph and not self.supports_graph:
            return ["graph capture not supported"]
        if config.graph and not capability.graph:
            return [f"device has no graph capture: {capability.reasons.get('graph', 'not listed')}"]
        return []


def _default(f) -> object:
    """The default of declaration field ``f`` (what a class that does not set the attribute declares)."""
    if f.default is not MISSING:
        return f.default
    return None if f.default_factory is MISSING else f.default_factory()  # name: none, a class must give it
