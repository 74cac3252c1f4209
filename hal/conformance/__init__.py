"""The conformance suite: one set of tests every (device, backend) pair must pass.

Run it with ``hal check`` or ``pytest --pyargs hal.conformance.suite``; the pytest plugin
(``hal.conformance.plugin``, loaded through the ``pytest11`` entry point) parametrizes
every test over the available pairs and adds ``--hal-device`` / ``--hal-backend`` /
``--hal-family`` / ``--hal-fuzz N`` / ``--hal-seed S``. Cases run at the page sizes each
backend declares (``cases_for``); ``check_cache`` / ``check_output`` say what differs.
A vendor's port is done when ``hal check --device <theirs>`` passes.
"""

from hal.conformance.cases import CASES, GRAPH_CASES, Case, build, cases_for, check_cache, check_output, tolerance

__all__ = [
    "CASES",
    "GRAPH_CASES",
    "Case",
    "Target",
    "available_targets",
    "build",
    "cases_for",
    "check_cache",
    "check_output",
    "tolerance",
]


def __getattr__(name: str):
    # the pytest plugin's names, imported on use: the cases serve `hal demo` and `hal bench` without pytest
    if name in ("Target", "available_targets"):
        from hal.conformance import plugin

        return getattr(plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
