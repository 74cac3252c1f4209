"""``python -m hal``: the ``hal`` command (:func:`hal.commands.cli.main`)."""

import sys

from hal.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
