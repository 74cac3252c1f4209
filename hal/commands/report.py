"""``hal report``: merge ``hal check --json`` files from several machines into one device matrix.

    hal report results/*.json --format md >> "$GITHUB_STEP_SUMMARY"
    hal report results/*.json --format html -o matrix.html
    hal report --matrix --json matrix.json -o matrix.md [engine-cells.json ...]

``--matrix``: the compatibility matrix of engine paths x backends (``hal.conformance.matrix``), run here and merged
with the cells other machines or the engines' envs wrote (``--json``).

One row per (device, backend, machine), one column per case family, and in each cell
how many cases passed, failed and were skipped; a last column names the features the
backend declares off (and the cases each skipped), with every failure and skip reason listed
under the table. This is the per-device CI matrix a fleet operator reads.

The input: what ``hal check --json`` prints (the schema ``hal report`` reads)::

    {
      "machine":  {"hostname": str, "platform": str, "cpu": str},
      "versions": {"hal": str, "torch": str, "triton": str | null,
                   "flashinfer": str | null, "torch_npu": str | null},
      "exit_code": int,
      "errors": [str, ...],                       # collection errors
      "results": [                                # one per (device, backend)
        {
          "device": str, "backend": str,
          "passed": int, "failed": int, "skipped": int,
          "failures": [str, ...],
          "declared_off": {str: {"reason": str,   # optional: features the backend declares off
                                 "skipped": int}},  # and how many cases each skipped
          "machine": {...}, "versions": {...},    # optional: override the top level's
          "cases": [                              # optional (older hal check: counts only)
            {"id": str,                           # unique within the result, e.g. a test id
             "family": str,                       # column of the matrix: "decode", "verify", "graph"...
             "mode": str | null,                  # ForwardMode name
             "page_size": int | null,
             "dtype": str | null,                 # "fp32", "bf16", "fp16"
             "kv_dtype": str | null,              # optional: the KV cache's, "bf16", "fp8_e4m3"... (not read)
             "outcome": "passed" | "failed" | "skipped",
             "reason": str | null}                # why it failed or was skipped
          ]
        }
      ]
    }

Files without ``machine`` / ``versions`` / ``cases`` are still read: the row then shows
the result's totals only and says the file carried no per-case results. The same
(device, backend, machine) in several files is merged case by case, a case being its
(id, family, mode, page_size, dtype) (a failure wins over a pass, a pass over a skip).
"""

from __future__ import annotations

import argparse
import html
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hal.errors import ConfigError

__all__ = ["Row", "Matrix", "load", "merge", "render_markdown", "render_html", "main", "main_matrix", "load_matrix"]

OUTCOMES = ("passed", "failed", "skipped")
_RANK = {"failed": 2, "passed": 1, "skipped": 0}
TOTAL = "(all)"


@dataclass
class Row:
    """One (device, backend, machine): its cases by id, or only totals when a file had no ``cases``."""

    device: str
    backend: str
    machine: dict
    versions: dict
    sources: list[str] = field(default_factory=list)
    cases: dict[tuple, dict] = field(default_factory=dict)  # (id, family, mode, page_size, dtype) -> case
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    failures: list[str] = field(default_factory=list)
    has_cases: bool = False
    declared_off: dict[str, dict] = field(default_factory=dict)  # feature -> {reason, skipped}

    @property
    def key(self) -> tuple[str, str, str]:
        return self.device, self.backend, self.machine.get("hostname", "?")

    def cell(self, family: str) -> dict:
        """``{passed, failed, skipped, reasons: {reason: count}}`` for one family (``TOTAL``: every case)."""
        counts: dict = {**dict.fromkeys(OUTCOMES, 0), "reasons": {}}
        if family == TOTAL and not self.has_cases:
            counts.update(self.totals)
            for failure in self.failures:
                counts["reasons"][f"failed: {failure}"] = counts["reasons"].get(f"failed: {failure}", 0) + 1
            return counts
        for case in self.cases.values():
            if family != TOTAL and case["family"] != family:
                continue
            counts[case["outcome"]] += 1
            if case["outcome"] != "passed":
                reason = f"{case['outcome']}: {case.get('reason') or 'no reason given'}"
                counts["reasons"][reason] = counts["reasons"].get(reason, 0) + 1
        return counts


@dataclass
class Matrix:
    rows: list[Row]
    families: list[str]
    notes: list[str]


def _fail(path: str, problem: str) -> ConfigError:
    return ConfigError(f"hal report: {path}: {problem}")


def load(path: str) -> dict:
    """Read one ``hal check --json`` file; a hal ``ConfigError`` names the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise _fail(path, f"cannot read: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(path, f"not JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise _fail(path, "expected the object `hal check --json` prints, with a `results` list")
    for i, result in enumerate(data["results"]):
        if not isinstance(result, dict) or not all(isinstance(result.get(k), str) for k in ("device", "backend")):
            raise _fail(path, f"results[{i}]: expected an object with `device` and `backend` strings")
        for j, case in enumerate(result.get("cases") or []):
            outcome = case.get("outcome") if isinstance(case, dict) else None
            if outcome not in OUTCOMES or not isinstance(case.get("id"), str):
                raise _fail(path, f"results[{i}].cases[{j}]: expected an `id` and an `outcome` in {list(OUTCOMES)}")
    return data


def merge(documents: Iterable[tuple[str, dict]]) -> Matrix:
    """One matrix from ``(source name, hal check --json document)`` pairs."""
    rows: dict[tuple[str, str, str], Row] = {}
    families: list[str] = []
    notes: list[str] = []
    for source, data in documents:
        for error in data.get("errors") or []:
            notes.append(f"{source}: collection error: {str(error).splitlines()[-1] if error else '?'}")
        if not data["results"]:
            notes.append(f"{source}: no results (exit code {data.get('exit_code', '?')})")
        for result in data["results"]:
            machine = {**(data.get("machine") or {}), **(result.get("machine") or {})}
            versions = {**(data.get("versions") or {}), **(result.get("versions") or {})}
            row = Row(result["device"], result["backend"], machine, versions)
            row = rows.setdefault(row.key, row)
            row.sources.append(source)
            for outcome in OUTCOMES:
                row.totals[outcome] += int(result.get(outcome) or 0)
            row.failures += [str(f) for f in result.get("failures") or []]
            for feature, entry in (result.get("declared_off") or {}).items():
                entry = entry if isinstance(entry, dict) else {"reason": str(entry)}
                seen = row.declared_off.setdefault(str(feature), {"reason": entry.get("reason", ""), "skipped": 0})
                seen["skipped"] = max(seen["skipped"], int(entry.get("skipped") or 0))  # the same check twice
            cases = result.get("cases")
            if cases is None:
                notes.append(f"{source}: {result['device']}/{result['backend']}: no per-case results, totals only")
                continue
            row.has_cases = True
            for case in cases:
                family = str(case.get("family") or "other")
                if family not in families:
                    families.append(family)
                case = {**case, "family": family}
                key = (case["id"], family, case.get("mode"), case.get("page_size"), case.get("dtype"))
                old = row.cases.get(key)
                if old is None or _RANK[case["outcome"]] > _RANK[old["outcome"]]:
                    row.cases[key] = case
    ordered = sorted(rows.values(), key=lambda r: r.key)
    return Matrix(ordered, families, notes)


def _symbol(cell: dict) -> tuple[str, str]:
    """``(status, text)`` of a cell: status in fail / pass / skip / none."""
    p, f, s = cell["passed"], cell["failed"], cell["skipped"]
    if f:
        return "fail", f"FAIL {f}/{p + f + s}"
    if p:
        return "pass", f"pass {p}" + (f" (skip {s})" if s else "")
    if s:
        return "skip", f"skip {s}"
    return "none", "-"


def _row_name(row: Row) -> str:
    return f"{row.device} / {row.backend}"


def _off_text(row: Row) -> str:
    """The features a row's backend declares off, with the cases each skipped ("-": none)."""
    return ", ".join(f"{f} ({v['skipped']} skipped)" for f, v in sorted(row.declared_off.items())) or "-"


def _machine_text(row: Row) -> str:
    m = row.machine
    return ", ".join(str(m[k]) for k in ("platform", "cpu") if m.get(k)) or "unknown machine"


def _versions_text(row: Row) -> str:
    return ", ".join(f"{k} {v}" for k, v in row.versions.items() if v) or "versions not recorded"


def _details(matrix: Matrix) -> list[tuple[Row, str, dict]]:
    """Every cell with a failure or a skip: ``(row, family, cell)``."""
    out = []
    for row in matrix.rows:
        for family in matrix.families or [TOTAL]:
            cell = row.cell(family)
            if cell["reasons"]:
                out.append((row, family, cell))
        if not row.has_cases and row.cell(TOTAL)["reasons"] and matrix.families:
            out.append((row, TOTAL, row.cell(TOTAL)))
    return out


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(matrix: Matrix) -> str:
    """GitHub-flavoured markdown (a step summary): the matrix, the machines, then every failure and skip."""
    columns = [*matrix.families, TOTAL]
    lines = ["## hal device matrix", ""]
    if not matrix.rows:
        lines.append("No results.")
    else:
        lines.append("| device / backend | machine | " + " | ".join(map(_md_escape, columns)) + " | declared off |")
        lines.append("|---|---|" + "---|" * (len(columns) + 1))
        for row in matrix.rows:
            cells = []
            for family in columns:
                status, text = _symbol(row.cell(family) if (row.has_cases or family == TOTAL) else _EMPTY)
                cells.append(f"**{text}**" if status == "fail" else text)
            host = _md_escape(row.machine.get("hostname", "?"))
            off = _md_escape(_off_text(row))
            lines.append(f"| {_md_escape(_row_name(row))} | {host} | " + " | ".join(cells) + f" | {off} |")
        lines += ["", "### Machines", ""]
        seen = set()
        for row in matrix.rows:
            entry = f"- **{_md_escape(row.machine.get('hostname', '?'))}**: {_md_escape(_machine_text(row))}; "
            entry += _md_escape(_versions_text(row))
            if entry not in seen:
                seen.add(entry)
                lines.append(entry)
    off = [(row, f, v) for row in matrix.rows for f, v in sorted(row.declared_off.items())]
    if off:
        lines += ["", "### Declared off", ""]
        lines += [
            f"- {_md_escape(_row_name(r))}: {f}: {_md_escape(v['reason'])} ({v['skipped']} skipped)" for r, f, v in off
        ]
    details = _details(matrix)
    if details:
        lines += ["", "### Failures and skips", ""]
        for row, family, cell in details:
            lines.append(f"- {_md_escape(_row_name(row))} @ {_md_escape(row.machine.get('hostname', '?'))}, {family}:")
            for reason, count in sorted(cell["reasons"].items(), key=lambda item: (not item[0].startswith("f"), item)):
                lines.append(f"  - {_md_escape(reason)}" + (f" (x{count})" if count > 1 else ""))
    if matrix.notes:
        lines += ["", "### Notes", "", *(f"- {_md_escape(n)}" for n in matrix.notes)]
    return "\n".join(lines) + "\n"


_EMPTY = {**dict.fromkeys(OUTCOMES, 0), "reasons": {}}
_COLOURS = {"fail": "#f8d0d0", "pass": "#d4f0d4", "skip": "#eeeeee", "none": "#ffffff"}


def render_html(matrix: Matrix) -> str:
    """One self-contained HTML page: the matrix (reasons in each cell's tooltip), machines, failures and skips."""
    columns = [*matrix.families, TOTAL]
    esc = html.escape
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>hal device matrix</title>",
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}"
        "td,th{border:1px solid #999;padding:4px 8px;text-align:center}td.name{text-align:left}</style>",
        "</head><body><h1>hal device matrix</h1>",
    ]
    if not matrix.rows:
        out.append("<p>No results.</p>")
    else:
        out.append("<table><tr><th>device / backend</th><th>machine</th>")
        out += [f"<th>{esc(c)}</th>" for c in columns]
        out.append("<th>declared off</th></tr>")
        for row in matrix.rows:
            out.append(
                f"<tr><td class='name'>{esc(_row_name(row))}</td><td>{esc(row.machine.get('hostname', '?'))}</td>"
            )
            for family in columns:
                cell = row.cell(family) if (row.has_cases or family == TOTAL) else _EMPTY
                status, text = _symbol(cell)
                tip = "\n".join(f"{r} (x{n})" if n > 1 else r for r, n in cell["reasons"].items())
                out.append(
                    f"<td class='{status}' style='background:{_COLOURS[status]}' title='{esc(tip)}'>{esc(text)}</td>"
                )
            tip = "\n".join(f"{f}: {v['reason']}" for f, v in sorted(row.declared_off.items()))
            out.append(f"<td class='name' title='{esc(tip)}'>{esc(_off_text(row))}</td></tr>")
        out.append("</table><h2>Machines</h2><ul>")
        seen = set()
        for row in matrix.rows:
            entry = f"<li><b>{esc(row.machine.get('hostname', '?'))}</b>: {esc(_machine_text(row))}; "
            entry += f"{esc(_versions_text(row))}</li>"
            if entry not in seen:
                seen.add(entry)
                out.append(entry)
        out.append("</ul>")
    details = _details(matrix)
    if details:
        out.append("<h2>Failures and skips</h2><ul>")
        for row, family, cell in details:
            host = esc(row.machine.get("hostname", "?"))
            out.append(f"<li>{esc(_row_name(row))} @ {host}, {esc(family)}<ul>")
            out += [f"<li>{esc(r)}" + (f" (x{n})" if n > 1 else "") + "</li>" for r, n in cell["reasons"].items()]
            out.append("</ul></li>")
        out.append("</ul>")
    if matrix.notes:
        out.append("<h2>Notes</h2><ul>" + "".join(f"<li>{esc(n)}</li>" for n in matrix.notes) + "</ul>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def main_matrix(
    paths: list[str],
    output: str | None,
    json_out: str | None,
    run: bool,
    engines: str | None,
    known_failures: str | None = None,
    devices: str | None = None,
) -> int:
    """``hal report --matrix``: run the cells this machine can (unless ``run`` is False), merge the cells of the
    ``paths`` (JSON an engine env or another machine wrote with ``--json``), write Markdown to ``output`` (or
    stdout) and JSON to ``json_out``. 1 when a cell failed that ``known_failures`` (a file of
    :func:`load_known_failures`) does not list, or one it lists passed (the list is then out of date)."""
    from hal.conformance import matrix

    documents = [load_matrix(path) for path in paths]
    if run:
        wanted = set(devices.split(",")) if devices else None
        columns = None if wanted is None else (lambda column: column.device in wanted)
        documents.insert(0, matrix.run_matrix(tuple(engines.split(",")) if engines else None, columns))
    if not documents:
        raise ConfigError("hal report --matrix --no-run: give the matrix JSON files to read")
    doc = matrix.merge_cells(documents)
    known = load_known_failures(known_failures) if known_failures else {}
    unexpected = matrix.mark_known_failures(doc, known)
    _write(json_out, json.dumps(doc, indent=1) + "\n", "--json")
    text = matrix.render_markdown(doc)
    if output:
        _write(output, text, "-o")
    else:
        print(text, end="")
    return int(bool(unexpected))


def load_known_failures(path: str) -> dict[tuple[str, str, str], str]:
    """``--known-failures``: lines ``engine | path | column | why``; ``#`` comments and blank lines skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise _fail(path, f"cannot read: {exc.strerror or exc}") from exc
    known = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [part.strip() for part in line.split("|")]
        if len(parts) != 4 or not all(parts):
            raise _fail(path, f"line {n}: expected `engine | path | column | why`, got {line!r}")
        known[tuple(parts[:3])] = parts[3]
    return known


def load_matrix(path: str) -> dict:
    """One ``hal report --matrix --json`` file; a hal ``ConfigError`` names the file and what is wrong."""
    from hal.conformance.matrix import STATUSES

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(path, f"cannot read as JSON: {exc}") from exc
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list) or not all(
        isinstance(c, dict) and c.get("status") in STATUSES and all(isinstance(c.get(k), str) for k in _CELL_KEYS)
        for c in cells
    ):
        raise _fail(path, f"expected `hal report --matrix --json` output: `cells` with {list(_CELL_KEYS)} and a status")
    return data


_CELL_KEYS = ("engine", "path", "column")


def _write(path: str | None, text: str, option: str) -> None:
    if not path:
        return
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"hal report: {option} {path}: cannot write: {exc.strerror or exc}") from exc


def main(paths: list[str], fmt: str = "md", output: str | None = None) -> int:
    """Render the matrix of ``paths`` to ``output`` (or stdout); 0, or a ``ConfigError`` for a bad file."""
    matrix = merge((path, load(path)) for path in paths)
    text = render_html(matrix) if fmt == "html" else render_markdown(matrix)
    if output:
        try:
            Path(output).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"hal report: -o {output}: cannot write: {exc.strerror or exc}") from exc
    else:
        print(text, end="")
    return 0


HELP = "merge `hal check --json` files into one device x backend x family matrix"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="*", metavar="RESULT.json")
    parser.add_argument("--format", default="md", choices=["md", "html"])
    parser.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    matrix = parser.add_argument_group("the compatibility matrix (engine path x backend)")
    matrix.add_argument(
        "--matrix",
        action="store_true",
        help="run every engine path on every backend this machine can (hal.conformance.matrix), merge the cells of "
        "the RESULT.json files (written by --json elsewhere), and write the matrix as Markdown",
    )
    matrix.add_argument("--json", metavar="FILE", help="with --matrix: also write the cells as JSON (for CI)")
    matrix.add_argument("--no-run", action="store_true", help="with --matrix: only merge the RESULT.json files")
    matrix.add_argument("--engines", metavar="LIST", help="with --matrix: only these engines (hal,vllm,vllm-ascend)")
    matrix.add_argument("--devices", metavar="LIST", help="with --matrix: only the columns of these hal devices")
    matrix.add_argument(
        "--known-failures",
        metavar="FILE",
        help="with --matrix: cells known to fail (lines `engine | path | column | why`): shown with the reason, and "
        "the exit status is 1 only for a failed cell not listed or a listed one that passed",
    )


def run(args: argparse.Namespace) -> int:
    if args.matrix:
        options = (args.engines, args.known_failures, args.devices)
        return main_matrix(args.results, args.output, args.json, not args.no_run, *options)
    if not args.results:
        raise ConfigError("hal report: give the `hal check --json` files to merge (or --matrix)")
    return main(args.results, args.format, args.output)
