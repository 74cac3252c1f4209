"""Choosing a device and a backend, and saying why.

``select(config)`` walks the devices (``HAL_DEVICE`` or the available ones, highest
priority first) and each device's backends in priority order; the first backend with
no reasons against it wins. ``HAL_ATTENTION_BACKEND`` forces one backend for both
phases, ``HAL_PREFILL_BACKEND`` / ``HAL_DECODE_BACKEND`` one per phase (SGLang's split);
a forced backend that cannot serve the config is an error with its reasons, never a
silent fallback. ``Selection.trace`` records every step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hal.backend import AttentionBackend
from hal.capability import DeviceCapability
from hal.config import AttentionConfig
from hal.errors import ConfigError, DeviceUnavailableError, NoBackendError
from hal.registry import Device, device_backends, get_registry, probe_device

__all__ = ["Selection", "select", "detect", "create_backend", "HybridBackend", "backend_report"]


@dataclass
class Selection:
    """The outcome of :func:`select`. ``trace`` lists each decision, in order, as text."""

    device: str
    capability: DeviceCapability
    prefill_backend: type[AttentionBackend]
    decode_backend: type[AttentionBackend]
    trace: list[str] = field(default_factory=list)

    @property
    def backend(self) -> str:
        p, d = self.prefill_backend.name, self.decode_backend.name
        return p if p == d else f"{p} (prefill) + {d} (decode)"

    def create(self) -> AttentionBackend:
        """Instantiate the chosen backend(s); two different ones are joined by :class:`HybridBackend`."""
        prefill = self.prefill_backend(self.capability)
        if self.decode_backend is self.prefill_backend:
            backend = prefill
        else:
            backend = HybridBackend(prefill, self.decode_backend(self.capability))
        backend.prefill_attention_backend_str = self.prefill_backend.name
        backend.decode_attention_backend_str = self.decode_backend.name
        return backend


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _device_order(requested: str | None, trace: list[str]) -> list[tuple[Device, DeviceCapability]]:
    reg = get_registry()
    for name, error in reg.errors.items():
        trace.append(f"plugin {name}: failed to load: {error}")
    source = "argument" if requested else "HAL_DEVICE"
    requested = requested or _env("HAL_DEVICE")
    if requested:
        if requested not in reg.devices:
            raise ConfigError(
                f"{source} = {requested!r}: expected one of the registered devices {sorted(reg.devices)}"
                + (f" (plugin failed: {reg.errors[requested]})" if requested in reg.errors else "")
            )
        device = reg.devices[requested]
        cap = probe_device(device)
        if not cap.available:
            raise DeviceUnavailableError(f"device {requested!r} is not available: {cap.reasons.get('device', '?')}")
        trace.append(f"device {requested}: chosen by {source}")
        return [(device, cap)]
    order = []
    for device in reg.ordered():
        cap = probe_device(device)
        if cap.available:
            trace.append(f"device {device.name}: available (priority {device.priority})")
            order.append((device, cap))
        else:
            trace.append(f"device {device.name}: unavailable: {cap.reasons.get('device', '?')}")
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
    names = [b.name for b in classes]
    rejected: dict[str, list[str]] = {}
    if forced is not None and forced not in names:
        raise ConfigError(
            f"{forced_by} = {forced!r}: expected one of the {device.name} backends {names}"
            + ("" if os.environ.get("HAL_DEVICE") else " (set HAL_DEVICE to force another device)")
        )
    for cls in classes:
        if forced is not None and cls.name != forced:
            continue
        reasons = cls.validate(config, cap)
        if not reasons:
            how = f"forced by {forced_by}" if forced else "first in priority order with no reasons against it"
            trace.append(f"{device.name}/{cls.name}: selected for {phase} ({how})")
            return cls, rejected
        rejected[cls.name] = reasons
        trace.append(f"{device.name}/{cls.name}: rejected for {phase}: " + "; ".join(reasons))
    return None, rejected


def select(config: AttentionConfig | None = None, device: str | None = None) -> Selection:
    """Choose the device and the prefill/decode backends for ``config`` (default: a 32/8-head, dim-128 bf16 model).

    Raises ``ConfigError`` for a bad ``HAL_*`` value, ``DeviceUnavailableError`` for a
    forced device that is not here, ``NoBackendError`` listing every backend with its
    reasons when nothing can serve the config.
    """
    config = config or AttentionConfig()
    trace: list[str] = []
    both = _env("HAL_ATTENTION_BACKEND")
    forced = {
        "prefill": (
            _env("HAL_PREFILL_BACKEND") or both,
            "HAL_PREFILL_BACKEND" if _env("HAL_PREFILL_BACKEND") else "HAL_ATTENTION_BACKEND",
        ),
        "decode": (
            _env("HAL_DECODE_BACKEND") or both,
            "HAL_DECODE_BACKEND" if _env("HAL_DECODE_BACKEND") else "HAL_ATTENTION_BACKEND",
        ),
    }
    all_rejected: dict[str, dict[str, list[str]]] = {}
    for dev, cap in _device_order(device, trace):
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
            return Selection(dev.name, cap, chosen["prefill"], chosen["decode"], trace)
    lines = [f"  {d}/{b}: " + "; ".join(r) for d, per in all_rejected.items() for b, r in per.items()]
    if not all_rejected:
        lines = ["  no device is available:", *(f"    {step}" for step in trace)]
    raise NoBackendError(f"no attention backend can serve {config.to_dict()}:\n" + "\n".join(lines))


def detect(device: str | None = None) -> DeviceCapability:
    """The capability of ``device``, or of the device ``select`` would choose."""
    trace: list[str] = []
    order = _device_order(device, trace)
    if not order:
        raise DeviceUnavailableError("no device is available:\n  " + "\n  ".join(trace))
    return order[0][1]


def create_backend(config: AttentionConfig | None = None, device: str | None = None) -> AttentionBackend:
    """``select(config, device).create()``."""
    return select(config, device).create()


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
            reasons = cls.validate(config, cap)
        else:  # config checks against an absent device would only add noise
            reasons = [f"device unavailable: {cap.reasons.get('device', '?')}", *cls.available(cap)]
        is_selected = (
            chosen is not None
            and chosen.device == device.name
            and cls in (chosen.prefill_backend, chosen.decode_backend)
        )
        rows.append(
            {
                "name": cls.name,
                "available": not cls.available(cap) and cap.available,
                "selected": is_selected,
                "reasons": reasons,
                "notes": cls.notes(cap) if cap.available else [],
            }
        )
    return rows


class HybridBackend(AttentionBackend):
    """One backend for prefill (extend, mixed, verify) and another for decode, as SGLang's ``HybridAttnBackend``."""

    name = "hybrid"

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend):
        super().__init__(prefill.capability)
        self.prefill, self.decode = prefill, decode
        self.needs_cpu_seq_lens = prefill.needs_cpu_seq_lens or decode.needs_cpu_seq_lens

    def _for(self, fb) -> AttentionBackend:
        return self.decode if fb.forward_mode.is_decode_or_idle() else self.prefill

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self._for(fb).init_forward_metadata_out_graph(fb, in_capture)

    def init_forward_metadata_in_graph(self, fb):
        self._for(fb).init_forward_metadata_in_graph(fb)

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.decode.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.decode.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        self.decode.on_after_cuda_graph_warmup()

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.decode.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.prefill.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.prefill.forward_mixed(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def support_triton(self) -> bool:
        return self.prefill.support_triton() and self.decode.support_triton()
