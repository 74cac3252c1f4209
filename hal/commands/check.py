"""``hal check``: the conformance suite (:mod:`hal.conformance`) on this machine's devices and backends."""

from __future__ import annotations

import argparse
import json
import os

from hal.errors import DeviceUnavailableError
from hal.registry import get_registry, probe_device

HELP = "run the conformance suite on this machine"


def _jobs(text: str) -> int:
    """``"auto"`` -> the machine's cores, ``"3"`` -> 3 (argparse type: ``hal check --jobs``)."""
    if text.strip() == "auto":
        return os.cpu_count() or 1
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of processes >= 1, or auto")
    return jobs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", action="append", default=[])
    parser.add_argument("--backend", action="append", default=[])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--fuzz", type=int, default=0, metavar="N", help="also N random batches per backend")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random batches (with --fuzz)")
    parser.add_argument(
        "--family", action="append", default=[], help="only this feature family (repeatable), e.g. fuzz, graph"
    )
    parser.add_argument(
        "--path",
        action="append",
        default=[],
        metavar="NAME",
        help="only these of a backend's paths (repeatable): default, checked, isa=avx2, generation=A5... "
        "(default: every path it can take here)",
    )
    parser.add_argument(
        "-j",
        "--jobs",
        type=_jobs,
        default=1,
        metavar="N",
        help="run the cases in N processes (pytest-xdist; auto: one per core), each with its share of the cores; "
        "the report is the same",
    )
    from hal.conformance.features import FEATURES, PROFILES

    parser.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="FEATURE,...",
        help=f"fail a backend that declares any of these off (repeatable): {', '.join(FEATURES)}",
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        help="require what a deployment needs; serving: " + ", ".join(PROFILES["serving"]),
    )


def run(args: argparse.Namespace) -> int:
    from hal.conformance.features import required_features
    from hal.conformance.runner import format_report, run_check

    required = required_features(args.require, args.profile)
    for name in args.device:  # an unknown or absent device is an error of its own, not an empty run
        cap = probe_device(get_registry().get(name))
        if not cap.available:
            raise DeviceUnavailableError(f"device {name!r} is not available: {cap.reasons.get('device', '?')}")
    report = run_check(
        args.device,
        args.backend,
        args.verbose,
        args.fuzz,
        args.seed,
        args.family,
        require=required,
        paths=args.path,
        jobs=args.jobs,
    )
    if args.json:
        print(json.dumps({k: report[k] for k in ("results", "exit_code", "errors")}, indent=2))
    else:
        print(report["log"] if args.verbose else "", end="")
        print(format_report(report, args.verbose))
    failed = sum(r["failed"] for r in report["results"])
    return 1 if failed or report["exit_code"] not in (0, 5) or not report["results"] else 0
