"""Deprecated since hal 0.4.0: ``hal.report`` is :mod:`hal.commands.report`.

The same module object under its old name: what is set on one is set on the other.
"""

import sys

import hal.commands.report as _moved
from hal.deprecation import warn_renamed

warn_renamed("hal.report", "hal.commands.report", since="0.4.0")
sys.modules[__name__] = _moved
