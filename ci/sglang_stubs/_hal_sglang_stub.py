"""Import-only stand-ins for packages SGLang imports at module level but never calls on
the attention path (hal's ``sglang`` tox env puts this folder on ``PYTHONPATH``).

THESE ARE NOT THE REAL PACKAGES. ``import torchvision`` (or fastapi, uvicorn, any
submodule, any attribute) succeeds; calling or instantiating anything from them raises
``RuntimeError`` naming the stand-in. Why they exist: PyPI's Linux torchvision wheels
are CUDA builds that break the CPU torch the env pins, and fastapi / uvicorn are server
dependencies the attention kit never runs. Each stand-in ships a ``*.dist-info`` so that
``importlib.metadata`` (which transformers consults) sees a version; the version carries
the local label ``+hal.importstub``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

MARK = "hal import-only stand-in"


class _StubMeta(type):
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _stub_class(f"{cls.__qualname__}.{attr}")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__qualname__} was called, but it is a {MARK} (see ci/sglang_stubs/)")


def _stub_class(qualname: str) -> type:
    """A class standing for ``qualname``: subclassable and attribute-chainable; calling it raises."""
    return _StubMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": qualname})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str):
        self.root = root

    def find_spec(self, name, path, target=None):
        if name.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name, f"{MARK} for {spec.name}")
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


def _module_getattr(name: str):
    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _stub_class(f"{name}.{attr}")

    return __getattr__


def stub_package(name: str, namespace: dict, version: str) -> None:
    """Make the package ``name`` (whose ``globals()`` is ``namespace``) an import-only stand-in."""
    namespace["__version__"] = version
    namespace["__getattr__"] = _module_getattr(name)
    namespace["HAL_IMPORT_STUB"] = True
    if not any(isinstance(f, _Finder) and f.root == name for f in sys.meta_path):
        sys.meta_path.append(_Finder(name))
