"""Choosing a device and a backend, and saying why.

``select(config, device=None, backend=None, prefill_backend=None, decode_backend=None)``
walks the devices (the one named, or the available ones, highest priority first) and
each device's backends in priority order; the first backend with no reasons against it
wins. ``backend`` forces one backend for both phases, ``prefill_backend`` /
``decode_backend`` one per phase (SGLang's split); a forced backend without a device
picks that backend's best available device. The variables ``HAL_DEVICE``,
``HAL_ATTENTION_BACKEND``, ``HAL_PREFILL_BACKEND`` and ``HAL_DECODE_BACKEND`` override the
arguments (an operator's word beats the code's). A forced backend that cannot serve the
config is an error with its reasons, never a silent fallback. ``Selection.trace``
records every step.

It also holds :func:`backend_report` (``hal info``'s row per backend): the same reasons
selection weighs, shown to a user, so both read them in one place. The hybrid backend a
split selection builds is :mod:`hal.hybrid`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from hal.backend import AttentionBackend
from hal.capability import DeviceCapability
from hal.config import AttentionConfig
from hal.deprecation import warn_renamed
from hal.errors import ConfigError, DeviceUnavailableError, NoBackendError, expect
from hal.hybrid import HybridBackend
from hal.kv_cache import MLAKVPool, PagedKVPool
from hal.kv_layouts import TOKEN_MAJOR
from hal.kv_layouts import kv_layout as layout_row
from hal.registry import Device, device_backends, get_registry, probe_device

__all__ = ["Selection", "select", "detect", "create_backend", "HybridBackend", "backend_report"]


@dataclass
class Selection:
    """The outcome of :func:`select`. ``trace`` lists each decision, in order, as text.

    ``device_name``: the chosen device's registry name (``cpu``, ``cuda``, a plugin's); its
    ``capability`` says which one (index, torch device).
    """

    device_name: str
    capability: DeviceCapability
    prefill_backend: type[AttentionBackend]
    decode_backend: type[AttentionBackend]
    trace: list[str] = field(default_factory=list)
    config: AttentionConfig = field(default_factory=AttentionConfig)

    @property
    def device(self) -> str:
        """Deprecated (0.2.0): :attr:`device_name` (elsewhere ``device`` is a ``Device`` or a torch device)."""
        warn_renamed("Selection.device", "Selection.device_name")
        return self.device_name

    @property
    def backend(self) -> str:
        p, d = self.prefill_backend.declaration().name, self.decode_backend.declaration().name
        return p if p == d else f"{p} (prefill) + {d} (decode)"

    def create(self, **options) -> AttentionBackend:
        """Instantiate the chosen backend(s) for ``self.config``, passing ``options`` (``validate``
        and the backend's own ``option_defaults``) to the constructor; two different backends are
        joined by :class:`HybridBackend`, each taking the options it knows."""
        if self.decode_backend is self.prefill_backend:
            backend = self.prefill_backend(self.capability, self.config, **options)
        else:
            known = _split_options(options, self.prefill_backend, self.decode_backend)
            backend = HybridBackend(
                self.prefill_backend(self.capability, self.config, **known[0]),
                self.decode_backend(self.capability, self.config, **known[1]),
            )
        backend.prefill_attention_backend_str = self.prefill_backend.declaration().name
        backend.decode_attention_backend_str = self.decode_backend.declaration().name
        return backend

    @property
    def kv_layout(self) -> str:
        """The KV pool layout for this selection (:mod:`hal.kv_layouts`): ``config.kv_layout`` when the config
        names one (selection checked that the backends read it), else the first of the prefill backend's
        ``kv_layouts`` (its preferred order) that leaves neither chosen backend a reason against the config here;
        token-major for an MLA config (hal's MLA pool, :class:`~hal.kv_cache.MLAKVPool`, has no other layout)."""
        if self.config.kv_layout is not None:
            return self.config.kv_layout
        if self.config.is_mla:
            return TOKEN_MAJOR
        preferred = self.prefill_backend.declaration().kv_layouts
        for layout in preferred:
            wanted = replace(self.config, kv_layout=layout)
            backends = dict.fromkeys((self.prefill_backend, self.decode_backend))
            if not any(cls.unsupported_reasons(wanted, self.capability) for cls in backends):
                return layout
        return preferred[0]

    def create_kv_pool(self, num_pages: int, layer_num: int | None = None, start_layer: int = 0) -> PagedKVPool:
        """hal's KV pool for this selection: ``num_pages`` pages (and the padding page) of ``config.page_size``
        slots for ``layer_num`` layers (default ``config.layer_num``) from ``start_layer``, with the config's KV
        heads, dims and KV cache dtype, on the chosen device, laid out in :attr:`kv_layout` and stored as the
        prefill backend's ``format_kv_pages`` makes it (an MLA config: :class:`~hal.kv_cache.MLAKVPool`)."""
        config, layout, cap = self.config, self.kv_layout, self.capability
        layer_num = config.layer_num if layer_num is None else layer_num
        dtype = config.kv_cache_torch_dtype
        if config.is_mla:
            expect(layout == TOKEN_MAJOR, ConfigError, "kv_layout", layout, f"{TOKEN_MAJOR} (hal's MLA pool)")
            args = (config.kv_lora_rank, config.qk_rope_head_dim, dtype, cap.torch_device, start_layer)
            return MLAKVPool(num_pages, config.page_size, layer_num, *args)
        fmt = self.prefill_backend.format_kv_pages if hasattr(self.prefill_backend, "format_kv_pages") else None
        return PagedKVPool(
            num_pages,
            config.page_size,
            layer_num,
            config.tp_k_head_num,
            config.head_dim,
            config.v_head_dim,
            dtype=dtype,
            device=cap.torch_device,
            start_layer=start_layer,
            kv_layout=layout,
            format_pages=None if fmt is None else lambda pages: fmt(cap, layout, pages),
        )


def _split_options(options: dict, *classes: type[AttentionBackend]) -> list[dict]:
    everyone = {"validate"}
    declared = [cls.declaration().option_defaults for cls in classes]
    unknown = sorted(set(options) - everyone - {k for defaults in declared for k in defaults})
    if unknown:
        names = sorted({"validate", *(k for defaults in declared for k in defaults)})
        raise ConfigError(f"options {unknown}: expected options of the chosen backends: {names}")
    return [{k: v for k, v in options.items() if k in everyone or k in defaults} for defaults in declared]


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _parse_device(requested: str, source: str) -> tuple[str, int | None]:
    """``"cuda:1"`` -> ``("cuda", 1)``; ``"npu"`` -> ``("npu", None)`` (the current device)."""
    name, _, index = requested.partition(":")
    if index:
        if not index.isdigit():
            raise ConfigError(f"{source} = {requested!r}: expected a device name with an optional index, e.g. cuda:1")
        return name, int(index)
    return name, None


def _device_order(
    requested: str | torch.device | None, trace: list[str], *, wanted_backend: str | None = None
) -> list[tuple[Device, DeviceCapability]]:
    """The devices to try, in order: the one requested (argument or ``HAL_DEVICE``), else every
    available one by priority (only those offering ``wanted_backend`` when a backend is forced)."""
    reg = get_registry()
    for name, error in reg.errors.items():
        trace.append(f"plugin {name}: failed to load: {error}")
    source = "HAL_DEVICE" if _env("HAL_DEVICE") else "device"
    argument = str(requested) if requested is not None else None
    requested = _env("HAL_DEVICE") or argument
    if requested:
        name, index = _parse_device(requested, source)
        if index is None and argument and source == "HAL_DEVICE":  # HAL_DEVICE=cuda keeps the argument's cuda:3
            arg_name, arg_index = _parse_device(argument, "device")
            index = arg_index if arg_name == name else None
        if name not in reg.devices:
            raise ConfigError(
                f"{source} = {requested!r}: expected one of the registered devices {sorted(reg.devices)}"
                + (f" (plugin failed: {reg.errors[name]})" if name in reg.errors else "")
            )
        device = reg.devices[name]
        cap = probe_device(device, index)
        if not cap.available:
            raise DeviceUnavailableError(f"device {requested!r} is not available: {cap.reasons.get('device', '?')}")
        shown = name if cap.on_host else f"{name}:{cap.index}"
        trace.append(f"device {shown}: chosen by {source}")
        return [(device, cap)]
    order = []
    for device in reg.ordered():
        cap = probe_device(device)
        if not cap.available:
            trace.append(f"device {device.name}: unavailable: {cap.reasons.get('device', '?')}")
            continue
        if wanted_backend is not None:
            classes, _ = device_backends(device)
            offered = [c for c in classes if c.declaration().name == wanted_backend]
            if not offered or offered[0].unavailable_reasons(cap):
                why = "has no such backend" if not offered else "; ".join(offered[0].unavailable_reasons(cap))
                trace.append(f"device {device.name}: skipped: backend {wanted_backend!r} {why}")
                continue
        trace.append(f"device {device.name}: available (priority {device.priority})")
        order.append((device, cap))
    return order


def _pick(
    device: Device,
    cap: DeviceCapability,
    config: AttentionConfig,
    forced: str | None,
    forced_by: str,
    phase: str,
    trace: list[str],
) -> tuple[type[AttentionBackend] | None, dict[str, list[str]]]:
    classes, error = device_backends(device)
    if error:
        trace.append(f"{device.name}: {error}")
        return None, {"(backends)": [error]}
    names = [b.declaration().name for b in classes]
    rejected: dict[str, list[str]] = {}
    if forced is not None and forced not in names:
        raise ConfigError(
            f"{forced_by} = {forced!r}: expected one of the {device.name} backends {names}"
            + ("" if os.environ.get("HAL_DEVICE") else " (name another device to force it there)")
        )
    for cls in classes:
        name = cls.declaration().name
        if forced is not None and name != forced:
            continue
        reasons = cls.unsupported_reasons(config, cap)
        if not reasons:
            how = f"forced by {forced_by}" if forced else "first in priority order with no reasons against it"
            trace.append(f"{device.name}/{name}: selected for {phase} ({how})")
            return cls, rejected
        rejected[name] = reasons
        trace.append(f"{device.name}/{name}: rejected for {phase}: " + "; ".join(reasons))
    return None, rejected


def _check_backend_name(name: str, source: str) -> None:
    """``ConfigError`` unless some registered device has a backend called ``name``."""
    offered = {}
    for dev in get_registry().ordered():
        classes, _ = device_backends(dev)
        offered[dev.name] = [c.declaration().name for c in classes]
    if not any(name in names for names in offered.values()):
        listing = ", ".join(f"{d} backends {names}" for d, names in offered.items())
        raise ConfigError(f"{source} = {name!r}: expected a backend of a registered device: {listing}")


def select(
    config: AttentionConfig | None = None,
    device: str | torch.device | None = None,
    backend: str | None = None,
    prefill_backend: str | None = None,
    decode_backend: str | None = None,
) -> Selection:
    """Choose the device and the prefill/decode backends for ``config`` (default: a 32/8-head, dim-128 bf16 model).

    ``device``: ``"cuda"`` (the current CUDA device), ``"cuda:1"``, ``"npu"``, ``"cpu"``, a
    plugin's name; None: the best available. ``backend`` / ``prefill_backend`` /
    ``decode_backend``: force backends by name. ``HAL_*`` variables override all four;
    ``HAL_KV_LAYOUT`` names the KV pool layout (:mod:`hal.kv_layouts`) of a config that names none.
    Raises ``ConfigError`` for a bad name or value, ``DeviceUnavailableError`` for a named
    device that is not here, ``NoBackendError`` listing every backend with its reasons
    when nothing can serve the config.
    """
    config = config or AttentionConfig()
    if config.kv_layout is None and _env("HAL_KV_LAYOUT"):  # the pools' layout where the caller names none
        config = replace(config, kv_layout=layout_row(_env("HAL_KV_LAYOUT"), ConfigError, "HAL_KV_LAYOUT").name)
    trace: list[str] = []
    forced = {}
    for phase, argument in (("prefill", prefill_backend), ("decode", decode_backend)):
        env_phase = f"HAL_{phase.upper()}_BACKEND"
        if _env(env_phase):
            forced[phase] = (_env(env_phase), env_phase)
        elif _env("HAL_ATTENTION_BACKEND"):
            forced[phase] = (_env("HAL_ATTENTION_BACKEND"), "HAL_ATTENTION_BACKEND")
        elif argument or backend:
            forced[phase] = (argument or backend, f"{phase}_backend" if argument else "backend")
        else:
            forced[phase] = (None, "")
    wanted = forced["prefill"][0] if forced["prefill"][0] == forced["decode"][0] else None
    named_device = bool(device or _env("HAL_DEVICE"))
    if wanted and not named_device:
        _check_backend_name(wanted, forced["prefill"][1])
    all_rejected: dict[str, dict[str, list[str]]] = {}
    order = _device_order(device, trace, wanted_backend=None if named_device else wanted)
    if wanted and not order and not named_device:
        raise NoBackendError(
            f"{forced['prefill'][1]} = {wanted!r} cannot serve this config on any device:\n  " + "\n  ".join(trace)
        )
    for dev, cap in order:
        chosen = {}
        for phase in ("prefill", "decode"):
            name, by = forced[phase]
            cls, rejected = _pick(dev, cap, config, name, by, phase, trace)
            all_rejected.setdefault(dev.name, {}).update(rejected)
            if cls is None and name is not None and "(backends)" not in rejected:
                raise NoBackendError(
                    f"{by} = {name!r} cannot serve this config on {dev.name}: " + "; ".join(rejected.get(name, []))
                )
            chosen[phase] = cls
        if chosen["prefill"] and chosen["decode"]:
            return Selection(dev.name, cap, chosen["prefill"], chosen["decode"], trace, config)
    lines = [f"  {d}/{b}: " + "; ".join(r) for d, per in all_rejected.items() for b, r in per.items()]
    if not all_rejected:
        lines = ["  no device is available:", *(f"    {step}" for step in trace)]
    raise NoBackendError(f"no attention backend can serve {config.to_dict()}:\n" + "\n".join(lines))


def detect(device: str | torch.device | None = None) -> DeviceCapability:
    """The capability of ``device`` (with its index), or of the device ``select`` would choose."""
    trace: list[str] = []
    order = _device_order(device, trace)
    if not order:
        raise DeviceUnavailableError("no device is available:\n  " + "\n  ".join(trace))
    return order[0][1]


def create_backend(
    config: AttentionConfig | None = None, device: str | torch.device | None = None, **options
) -> AttentionBackend:
    """``select(config, device).create(**options)``."""
    return select(config, device).create(**options)


def backend_report(
    device: Device, cap: DeviceCapability, config: AttentionConfig, chosen: Selection | None
) -> list[dict]:
    """For ``hal info``: each backend of ``device`` with its reasons, and whether ``chosen`` selected it."""
    rows = []
    classes, error = device_backends(device)
    if error:
        return [{"name": "?", "available": False, "selected": False, "reasons": [error]}]
    for cls in classes:
        if cap.available:
            reasons = cls.unsupported_reasons(config, cap)
        else:  # config checks against an absent device would only add noise
            reasons = [f"device unavailable: {cap.reasons.get('device', '?')}", *cls.unavailable_reasons(cap)]
        is_selected = (
            chosen is not None
            and chosen.device_name == device.name
            and cls in (chosen.prefill_backend, chosen.decode_backend)
        )
        rows.append(
            {
                "name": cls.declaration().name,
                "available": not cls.unavailable_reasons(cap) and cap.available,
                "selected": is_selected,
                "reasons": reasons,
                "notes": cls.notes(cap) if cap.available else [],
            }
        )
    return rows
