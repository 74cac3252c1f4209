"""``hal demo``: the small serving engine of :mod:`hal.demo`, which holds its arguments and its run."""

from __future__ import annotations

import argparse

HELP = "serve a Llama, DeepSeek (MLA) or gpt-oss (sinks) model with continuous batching through hal"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hal.demo import add_arguments

    add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """``args.argv``: the ``hal`` command line (the tensor-parallel ranks are started with what follows ``demo``)."""
    from hal.demo import run_demo

    return run_demo(args, args.argv[args.argv.index("demo") + 1 :])
