"""Deprecated since hal 0.4.0: ``hal.cli`` is :mod:`hal.commands.cli`, the same module object under its old name.

``python -m hal.cli`` still runs the ``hal`` command (as ``python -m hal`` does).
"""

import sys

import hal.commands.cli as _moved
from hal.deprecation import warn_renamed

warn_renamed("hal.cli", "hal.commands.cli", since="0.4.0")
if __name__ == "__main__":
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
