"""The ``hal`` command: ``info``, ``check``, ``demo``, ``bench``, ``lint``, ``report``."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import hal
from hal.capability import DeviceCapability
from hal.config import AttentionConfig
from hal.errors import ConfigError, DeviceUnavailableError, HalError
from hal.kv_dtypes import KV_DTYPE_TABLE, kv_dtype
from hal.plugin_compat import API1_NOTE
from hal.registry import get_registry, probe_device, runs_as_api
from hal.selection import backend_report, select


def info(config: AttentionConfig | None = None) -> dict:
    """Every registered device (available or not) with its reasons, capability and backends."""
    config = config or AttentionConfig()
    reg = get_registry()
    try:
        chosen = select(config)
        selection = {"device": chosen.device_name, "backend": chosen.backend, "trace": chosen.trace}
    except HalError as exc:
        chosen, selection = None, {"device": None, "backend": None, "error": str(exc)}
    devices = []
    for device in reg.ordered():
        try:
            cap = probe_device(device)
        except ConfigError as exc:  # shown here; select() above raised it to the caller too
            cap = DeviceCapability(type=device.name, available=False, reasons={"device": f"ConfigError: {exc}"})
        devices.append(
            {
                "name": device.name,
                "available": cap.available,
                "emulated": cap.emulated,
                "priority": device.priority,
                "plugin_api": runs_as_api(device),
                "reasons": dict(cap.reasons),
                "capability": cap.to_dict(),
                "backends": backend_report(device, cap, config, chosen),
            }
        )
    for name, error in sorted(reg.errors.items()):
        devices.append(
            {
                "name": name,
                "available": False,
                "emulated": False,
                "priority": None,
                "plugin_api": None,
                "reasons": {"plugin": error},
                "capability": None,
                "backends": [],
            }
        )
    return {
        "hal_version": hal.__version__,
        "torch_version": torch.__version__,
        "config": config.to_dict(),
        "selection": selection,
        "devices": devices,
    }


def _print_info(data: dict) -> None:
    print(f"hal {data['hal_version']}  torch {data['torch_version']}")
    cfg = data["config"]
    print(
        f"model: {cfg['tp_q_head_num']}/{cfg['tp_k_head_num']} heads, head_dim {cfg['head_dim']}, {cfg['dtype']}, "
        f"page {cfg['page_size']}"
    )
    for dev in data["devices"]:
        cap = dev["capability"] or {}
        state = "available" + (" (emulated)" if dev["emulated"] else "") if dev["available"] else "unavailable"
        print(f"\n{dev['name']}: {state}  {cap.get('name', '')} {cap.get('arch', '')}".rstrip())
        if dev["plugin_api"] == 1:
            print(f"  {API1_NOTE}")
        if cap:
            print(f"  dtypes {cap['dtypes']}  graph {cap['graph']}  triton {cap['triton_target']}")
        for feature, why in dev["reasons"].items():
            print(f"  - {feature}: {why}")
        for b in dev["backends"]:
            mark = "*" if b["selected"] else " "
            print(f"  {mark} {b['name']}: " + ("ok" if not b["reasons"] else "; ".join(b["reasons"])))
            for note in b.get("notes", []):
                print(f"      note: {note}")
    sel = data["selection"]
    print(f"\nselected: {sel['device']}/{sel['backend']}" if sel["device"] else f"\nselected: none: {sel['error']}")
    for step in sel.get("trace", []):
        print(f"  {step}")


def _format_step(data: dict) -> str:
    lines = [f"step costs on {data['device']} / {data['backend']} (DECODE, context {data['results'][0]['context']})"]
    lines.append(
        f"{'batch':>6} {'build cheap':>12} {'build full':>11} {'meta cheap':>11} {'meta full':>10} {'reads':>6}"
    )
    for r in data["results"]:
        c, m = r["construct_ms"], r["init_forward_metadata_ms"]
        lines.append(
            f"{r['batch_size']:>6} {c['cheap']:>10.3f}ms {c['full']:>9.2f}ms {m['cheap']:>9.2f}ms {m['full']:>8.2f}ms"
            f" {r['host_reads']['outside_out_graph']:>6}"
        )
    lines.append(f"one layer's forward at batch 32, tiny shapes: {data['forward_us']:.1f} us")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    """``"1,2"`` -> ``[1, 2]`` (argparse type)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,2") from None


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="devices, capabilities, backends and the selection trace")
    p_info.add_argument("--json", action="store_true")
    p_info.add_argument(
        "--dtype", default="bf16", choices=[r.name for r in KV_DTYPE_TABLE if r.compute], help="the model's dtype"
    )
    p_info.add_argument("--page-size", type=int, default=1, help="the KV pool's page size (default 1)")
    p_info.add_argument("--head-dim", type=int, default=128)
    p_info.add_argument("--q-heads", type=int, default=32, help="query heads per rank (tp_q_head_num)")
    p_info.add_argument("--kv-heads", type=int, default=8, help="KV heads per rank (tp_k_head_num)")
    p_info.add_argument(
        "--arch", help="also the Triton kernels' launch plan for this GPU architecture (sm_80, sm_90...)"
    )
    p_check = sub.add_parser("check", help="run the conformance suite on this machine")
    p_check.add_argument("--device", action="append", default=[])
    p_check.add_argument("--backend", action="append", default=[])
    p_check.add_argument("--json", action="store_true")
    p_check.add_argument("-v", "--verbose", action="store_true")
    p_check.add_argument("--fuzz", type=int, default=0, metavar="N", help="also N random batches per backend")
    p_check.add_argument("--seed", type=int, default=0, help="seed of the random batches (with --fuzz)")
    p_check.add_argument(
        "--family", action="append", default=[], help="only this feature family (repeatable), e.g. fuzz, graph"
    )
    p_check.add_argument(
        "--path",
        action="append",
        default=[],
        metavar="NAME",
        help="only these of a backend's paths (repeatable): default, checked, isa=avx2, generation=A5... "
        "(default: every path it can take here)",
    )
    p_check.add_argument(
        "-j",
        "--jobs",
        type=_jobs,
        default=1,
        metavar="N",
        help="run the cases in N processes (pytest-xdist; auto: one per core), each with its share of the cores; "
        "the report is the same",
    )
    from hal.conformance.features import FEATURES, PROFILES

    p_check.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="FEATURE,...",
        help=f"fail a backend that declares any of these off (repeatable): {', '.join(FEATURES)}",
    )
    p_check.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        help="require what a deployment needs; serving: " + ", ".join(PROFILES["serving"]),
    )
    p_demo = sub.add_parser(
        "demo", help="serve a Llama, DeepSeek (MLA) or gpt-oss (sinks) model with continuous batching through hal"
    )
    from hal.demo import add_arguments

    add_arguments(p_demo)
    p_bench = sub.add_parser("bench", help="decode/extend speed as ratios to this machine's own limits")
    p_bench.add_argument("--device")
    p_bench.add_argument("--backend", action="append", default=[])
    p_bench.add_argument("--quick", action="store_true", help="small shapes, a smoke run")
    p_bench.add_argument("--repeats", type=int, default=7)
    p_bench.add_argument(
        "--peer-python",
        action="append",
        default=[],
        help="python of a venv with SGLang and/or vLLM: their kernels timed on the same shapes in the same run "
        "(bench/sglang_peer.py, bench/vllm_peer.py; repeatable)",
    )
    p_bench.add_argument(
        "--workload",
        action="append",
        default=[],
        choices=["decode", "extend", "mixed", "step"],
        help="repeatable (default: decode, extend, mixed); step, alone: per-step host costs (batch construction, "
        "metadata, host reads, per-layer forward time)",
    )
    p_bench.add_argument("--dtype", action="append", default=[], choices=["fp32", "bf16"], help="repeatable")
    p_bench.add_argument("--page-size", action="append", default=[], type=int, help="repeatable (default 1, 16, 128)")
    p_bench.add_argument(
        "--threads", type=_int_list, help="torch thread counts to run at, e.g. 1,2 (per-core ratios and scaling)"
    )
    p_bench.add_argument(
        "--peer",
        action="append",
        help="in-process peer to time beside hal (repeatable; default sdpa_gathered; flex_attention opt-in; 'none')",
    )
    p_bench.add_argument("--json", action="store_true")
    p_lint = sub.add_parser("lint", help="static check of backend sources for what breaks graph capture")
    p_lint.add_argument("paths", nargs="+", metavar="PATH", help="backend .py files or directories")
    p_lint.add_argument("--json", action="store_true")
    p_report = sub.add_parser("report", help="merge `hal check --json` files into one device x backend x family matrix")
    p_report.add_argument("results", nargs="+", metavar="RESULT.json")
    p_report.add_argument("--format", default="md", choices=["md", "html"])
    p_report.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    command_line = argv is None
    argv = sys.argv[1:] if command_line else list(argv)
    args = parser.parse_args(argv)
    if command_line and args.command == "bench" and args.peer_python and "step" not in args.workload:
        from hal.bench import turns_env

        env = turns_env(dict(os.environ))
        if env is not None:  # the same command again, hal and its engine peers under OMP_WAIT_POLICY=PASSIVE
            print(
                "hal bench: engine peers are timed in turns with hal: rerunning under OMP_WAIT_POLICY=PASSIVE "
                "(set OMP_WAIT_POLICY yourself to choose)",
                file=sys.stderr,
                flush=True,
            )
            os.execve(sys.executable, [sys.executable, "-m", "hal", *argv], env)
    try:
        if args.command == "info":
            dtype = kv_dtype(args.dtype).torch_dtype
            config = AttentionConfig(
                tp_q_head_num=args.q_heads,
                tp_k_head_num=args.kv_heads,
                head_dim=args.head_dim,
                dtype=dtype,
                page_size=args.page_size,
            )
            data = info(config)
            if args.arch:
                from hal.kernels.triton.sizing import format_plan, plan_for_config

                data["triton_plan"] = plan_for_config(args.arch, data["config"])
            print(json.dumps(data, indent=2)) if args.json else _print_info(data)
            if args.arch and not args.json:
                print("\n" + format_plan(data["triton_plan"]))
            return 0
        if args.command == "check":
            from hal.conformance.features import required_features
            from hal.conformance.runner import run_check

            required = required_features(args.require, args.profile)
            for name in args.device:  # an unknown or absent device is an error of its own, not an empty run
                cap = probe_device(get_registry().get(name))
                if not cap.available:
                    raise DeviceUnavailableError(f"device {name!r} is not available: {cap.reasons.get('device', '?')}")
            from hal.conformance.runner import format_report

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
        if args.command == "demo":
            from hal.demo import run_demo

            return run_demo(args, argv[argv.index("demo") + 1 :])
        if args.command == "bench" and "step" in args.workload:
            if args.workload != ["step"]:
                raise ConfigError(f"--workload {args.workload}: step runs alone (its report is of another kind)")
            from hal.step_bench import run_step_workload

            backend = args.backend[0] if args.backend else None
            data = run_step_workload(args.device, backend, repeats=5 if args.quick else 20)
            print(json.dumps(data, indent=2) if args.json else _format_step(data))
            return 0
        if args.command == "lint":
            from hal.lint import main as run_lint

            return run_lint(args.paths, as_json=args.json)
        if args.command == "report":
            from hal.report import main as run_report

            return run_report(args.results, args.format, args.output)
        if args.command == "bench":
            from hal.bench import run_bench

            return run_bench(
                args.device,
                args.backend,
                args.quick,
                args.json,
                args.peer_python or None,
                args.repeats,
                args.workload or None,
                args.dtype or None,
                args.page_size or None,
                args.threads,
                None if args.peer is None else [p for p in args.peer if p != "none"],
            )
    except HalError as exc:
        print(f"hal: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
