"""What bench/gpu.sh needs before it starts, with no network: standard library only (runs before anything is installed).

    python bench/gpu_preflight.py --requirements           the wheelhouse's pip requirements, one a line
    python bench/gpu_preflight.py --check [--wheelhouse DIR] [--json]

``--check`` exits 0 when every requirement is installed, 3 when some are missing but the
wheelhouse holds a wheel for each (then prints their requirement strings, one a line, for
``pip install --no-index --find-links DIR``), and 2 when something cannot be had here:
torch or Triton missing or too old (never carried: they come with the machine), or a
package that is neither installed nor in the wheelhouse. Every line on stderr names the
package, the version found and the version needed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import sys

# (distribution, minimum version, why). The first two must come with the machine.
PREINSTALLED = (
    ("torch", "2.11", "hal's kernels and tensors (the machine's CUDA build)"),
    ("triton", "3.6", "the triton backend's kernels"),
)
WHEELHOUSE = (
    ("pytest", "8", "hal check runs the conformance suite as a pytest plugin; the tests"),
    ("hypothesis", "6.100", "hal check --fuzz and the property tests"),
    ("setuptools", "77", "builds hal (pyproject's build-system, installed with --no-build-isolation)"),
    ("numpy", "1.24", "hal's declared dependency"),
    ("ninja", "1.11", "torch's C++ extension builds (the CPU kernels)"),
)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def installed(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_in(wheelhouse: str | None, dist: str, minimum: str) -> str | None:
    """The newest wheel of ``dist`` at least ``minimum`` in ``wheelhouse``, or None."""
    if not wheelhouse or not os.path.isdir(wheelhouse):
        return None
    best = None
    for name in os.listdir(wheelhouse):
        if not name.endswith(".whl"):
            continue
        wheel_dist, version = name.split("-")[:2]
        if _normalise(wheel_dist) == _normalise(dist) and _version_tuple(version) >= _version_tuple(minimum):
            if best is None or _version_tuple(version) > _version_tuple(best.split("-")[1]):
                best = name
    return best


def check(wheelhouse: str | None) -> dict:
    """``{"ok": [...], "install": [...], "missing": [...]}``; each entry names the package, found and needed."""
    report = {"ok": [], "install": [], "missing": []}
    for group, carried in ((PREINSTALLED, False), (WHEELHOUSE, True)):
        for dist, minimum, why in group:
            found = installed(dist)
            entry = {"package": dist, "found": found, "needed": f">={minimum}", "why": why}
            if found is not None and _version_tuple(found) >= _version_tuple(minimum):
                report["ok"].append(entry)
            elif carried and (wheel := wheel_in(wheelhouse, dist, minimum)):
                report["install"].append({**entry, "wheel": wheel})
            else:
                where = (
                    f"the wheelhouse {wheelhouse!r} has no wheel of it" if carried else "it must come with the machine"
                )
                report["missing"].append({**entry, "where": where})
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requirements", action="store_true", help="print the wheelhouse's requirements")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--wheelhouse", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.requirements:
        print("\n".join(f"{dist}>={minimum}" for dist, minimum, _ in WHEELHOUSE))
        return 0
    report = check(args.wheelhouse)
    if args.json:
        print(json.dumps(report, indent=2))
    for entry in report["missing"]:
        found = entry["found"] or "not installed"
        print(
            f"MISSING {entry['package']} {entry['needed']} ({found}; {entry['where']}): needed for {entry['why']}",
            file=sys.stderr,
        )
    if report["missing"]:
        return 2
    if report["install"]:
        if not args.json:
            print("\n".join(f"{e['package']}{e['needed']}" for e in report["install"]))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
