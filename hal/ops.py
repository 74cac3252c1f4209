"""Deprecated (0.2.0): the helper ops are the kernel packages' own functions.

``AttentionBackend.helper_ops`` returns :mod:`hal.kernels.triton` when ``support_triton()`` and
the device's Triton target allow, else :mod:`hal.kernels.reference`; both have ``write_kv``,
``build_kv_indices`` and ``compute_positions``. The old names below still work, with a warning.
"""

from typing import TYPE_CHECKING

from hal.deprecation import moved_names

if TYPE_CHECKING:  # the new homes, for the import contracts (moved_names imports them on first use)
    from hal import kernels, prologue  # noqa: F401

__getattr__ = moved_names(
    __name__,
    {
        "TORCH_OPS": "hal.kernels:reference",
        "TRITON_OPS": "hal.kernels:triton",
        "helper_ops_for": "hal.prologue:helper_ops_for",
    },
)
