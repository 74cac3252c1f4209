"""The ``hal`` command: ``info``, ``check``, ``demo``, ``bench``, ``lint``, ``report``."""

from __future__ import annotations

import argparse
import os
import sys

from hal.commands import bench, check, demo, lint, report
from hal.commands import info as info_command
from hal.commands.info import info  # noqa: F401  (hal.cli.info: where hal 0.3 had it)
from hal.errors import HalError

# subcommand -> its module: HELP, add_arguments(parser), run(args) -> exit status; optional restart_env(args)
COMMANDS = {"info": info_command, "check": check, "demo": demo, "bench": bench, "lint": lint, "report": report}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``hal`` with ``argv`` (default: the command line, which a command may restart under another
    environment, e.g. ``hal bench`` with engine peers); returns the exit status, 2 for a hal error."""
    command_line = argv is None
    argv = sys.argv[1:] if command_line else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    command = COMMANDS[args.command]
    if command_line and hasattr(command, "restart_env"):
        env = command.restart_env(args)
        if env is not None:
            os.execve(sys.executable, [sys.executable, "-m", "hal", *argv], env)
    try:
        return command.run(args)
    except HalError as exc:
        print(f"hal: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
