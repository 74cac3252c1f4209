"""Old public names, kept for one minor release with a ``DeprecationWarning`` naming the new one.

The policy (README, "Versions and deprecation"): a renamed or moved public name keeps working
for at least one minor release after the one that renamed it, and every use warns with the
replacement. ``CHANGELOG.md`` lists each rename.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping

__all__ = ["warn_renamed", "moved_names", "REMOVED_IN"]

# The first release a deprecated name may be gone in: the one after this release (a test holds it to
# hal.__version__). Names deprecated two releases ago that older plugin APIs still use stay until then.
REMOVED_IN = "0.5.0"


def warn_renamed(old: str, new: str, stacklevel: int = 3, since: str = "0.2.0") -> None:
    """Warn that ``old`` is deprecated (since hal ``since``) and ``new`` replaces it."""
    removed_in = max(_next_minor(since), REMOVED_IN, key=_release)
    warnings.warn(
        f"{old} is deprecated since hal {since} and goes in {removed_in}: use {new} (see CHANGELOG.md)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _next_minor(version: str) -> str:
    """``"0.3.0"`` -> ``"0.4.0"``: a name deprecated in one minor release goes in the next."""
    major, minor, _ = version.split(".")
    return f"{major}.{int(minor) + 1}.0"


def moved_names(module: str, moved: Mapping[str, str], since: str = "0.2.0") -> Callable[[str], object]:
    """A module ``__getattr__`` serving ``moved`` (old name -> ``"new.module:new_name"``) with a warning (deprecated
    since hal ``since``). The new module is imported on first use: a moved name may point up its package (an old
    name kept on a module the new home imports) without an import circle."""

    def __getattr__(name: str):
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        target_module, _, target = moved[name].partition(":")
        warn_renamed(f"{module}.{name}", f"{target_module}.{target}", since=since)
        return getattr(importlib.import_module(target_module), target)

    return __getattr__


def accept_renamed_kwargs(cls: type, renamed: Mapping[str, str], error: type[Exception]) -> type:
    """Let ``cls(...)`` take the old keyword names in ``renamed`` (old -> new) with a warning.

    Giving both an old name and its replacement is ``error``. Each old name also stays readable
    as an attribute (``obj.old`` -> ``obj.new``), with the same warning.
    """
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        for old, new in renamed.items():
            if old in kwargs:
                if new in kwargs:
                    raise error(f"{cls.__name__}({old}=..., {new}=...): expected only {new} ({old} is its old name)")
                warn_renamed(f"{cls.__name__}({old}=...)", f"{cls.__name__}({new}=...)")
                kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)

    __init__.__wrapped__ = init
    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__
    for old, new in renamed.items():
        setattr(cls, old, _renamed_attribute(cls.__name__, old, new))
    return cls


def _renamed_attribute(owner: str, old: str, new: str) -> property:
    def get(self):
        warn_renamed(f"{owner}.{old}", f"{owner}.{new}")
        return getattr(self, new)

    return property(get, doc=f"Deprecated (0.2.0): use ``{new}``.")
