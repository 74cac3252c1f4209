"""hal's commands: one module per ``hal`` subcommand, each with its own arguments beside its code.

:mod:`hal.commands.cli` is the ``hal`` command (``python -m hal``): it builds the top-level parser from each
command module's ``HELP`` and ``add_arguments(parser)`` and dispatches to its ``run(args) -> int``. The
commands: ``info`` (:mod:`~hal.commands.info`), ``check`` (:mod:`~hal.commands.check`), ``demo``
(:mod:`~hal.commands.demo`), ``bench`` (:mod:`~hal.commands.bench`, with :mod:`~hal.commands.bench_peers` and
:mod:`~hal.commands.step_bench`), ``lint`` (:mod:`~hal.commands.lint`), ``report`` (:mod:`~hal.commands.report`).
"""
