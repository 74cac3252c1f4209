"""``python -m hal``: the ``hal`` command (:func:`hal.cli.main`)."""

import sys

from hal.cli import main

if __name__ == "__main__":
    sys.exit(main())
