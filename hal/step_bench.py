"""Deprecated since hal 0.4.0: ``hal.step_bench`` is :mod:`hal.commands.step_bench`.

The same module object under its old name: what is set on one is set on the other.
"""

import sys

import hal.commands.step_bench as _moved
from hal.deprecation import warn_renamed

warn_renamed("hal.step_bench", "hal.commands.step_bench", since="0.4.0")
sys.modules[__name__] = _moved
