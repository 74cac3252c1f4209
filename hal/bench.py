"""Deprecated since hal 0.4.0: ``hal.bench`` is :mod:`hal.commands.bench`.

The same module object under its old name: what is set on one is set on the other.
"""

import sys

import hal.commands.bench as _moved
from hal.deprecation import warn_renamed

warn_renamed("hal.bench", "hal.commands.bench", since="0.4.0")
sys.modules[__name__] = _moved
