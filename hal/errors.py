"""The errors hal raises. Every message names what was wrong and what was expected."""

from __future__ import annotations

from typing import NoReturn

__all__ = [
    "HalError",
    "ConfigError",
    "InvalidBatchError",
    "KVCacheError",
    "PluginError",
    "DeviceUnavailableError",
    "NoBackendError",
    "UnsupportedError",
    "GraphCaptureError",
    "MissingDependencyError",
    "describe",
    "ranges",
]


class HalError(Exception):
    """Base class of every error hal raises on purpose."""


class ConfigError(HalError, ValueError):
    """A configuration value (an argument, an ``HAL_*`` environment variable) is invalid."""


class InvalidBatchError(HalError, ValueError):
    """A ``ForwardBatch`` or the tensors passed with it are inconsistent."""


class KVCacheError(HalError, ValueError):
    """A request-to-token or KV pool operation got out-of-range or ill-shaped input."""


class PluginError(HalError):
    """A device plugin failed to load or does not implement the device protocol."""


class DeviceUnavailableError(HalError):
    """A device was asked for that is not available here; the message says why."""


class NoBackendError(HalError):
    """No attention backend can serve a config; the message lists every backend and its reasons."""


class UnsupportedError(HalError, NotImplementedError):
    """A backend was asked for something it declared it does not support."""


class GraphCaptureError(HalError, RuntimeError):
    """Graph capture or replay broke the out_graph / in_graph contract."""


class MissingDependencyError(HalError, ImportError):
    """An optional part of hal (an engine integration) was imported without the package it adapts."""


def expect(condition: bool, error: type[HalError], field: str, value: object, expected: str) -> None:
    """Raise ``error`` saying ``field`` was ``value`` where ``expected`` was wanted, unless ``condition``."""
    if not condition:
        refuse(error, field, value, expected)


def refuse(error: type[HalError], field: str, value: object, expected: str) -> NoReturn:
    """Raise ``error`` saying ``field`` was ``value`` where ``expected`` was wanted (:func:`expect`'s message)."""
    raise error(f"{field} = {_short(value)}: expected {expected}")


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(value: object) -> str:
    """A value for a message: a tensor as ``dtype[shape] on device`` (``int32[4] on cpu``), else its type name."""
    dtype, shape, device = (getattr(value, a, None) for a in ("dtype", "shape", "device"))
    if dtype is not None and shape is not None and device is not None:
        return f"{str(dtype).removeprefix('torch.')}{list(shape)} on {device}"
    return type(value).__name__


def ranges(values, sep: str = "..") -> str:
    """Integers as runs, for a message: ``[5, 1, 2, 3]`` -> ``"1..3, 5"`` (``sep`` joins a run's ends)."""
    values = sorted(set(values))
    parts, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}{sep}{values[j]}")
        i = j + 1
    return ", ".join(parts)
