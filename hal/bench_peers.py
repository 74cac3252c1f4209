"""Deprecated since hal 0.4.0: ``hal.bench_peers`` is :mod:`hal.commands.bench_peers`.

The same module object under its old name: what is set on one is set on the other.
"""

import sys

import hal.commands.bench_peers as _moved
from hal.deprecation import warn_renamed

warn_renamed("hal.bench_peers", "hal.commands.bench_peers", since="0.4.0")
sys.modules[__name__] = _moved
