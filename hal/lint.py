"""Deprecated since hal 0.4.0: ``hal.lint`` is :mod:`hal.commands.lint`.

The same module object under its old name: what is set on one is set on the other.
"""

import sys

import hal.commands.lint as _moved
from hal.deprecation import warn_renamed

warn_renamed("hal.lint", "hal.commands.lint", since="0.4.0")
sys.modules[__name__] = _moved
