"""Deprecated home of the Triton backend: it is shared by every Triton device, in ``hal.devices.triton_backend``."""

from hal.deprecation import moved_names

__getattr__ = moved_names(__name__, {"TritonBackend": "hal.devices.triton_backend:TritonBackend"})
