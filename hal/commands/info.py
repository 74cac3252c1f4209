"""``hal info``: every registered device, its capability and backends, and the selection trace."""

from __future__ import annotations

import argparse
import json

import torch

import hal
from hal.capability import DeviceCapability
from hal.config import AttentionConfig
from hal.errors import ConfigError, HalError
from hal.kv_dtypes import COMPUTE_DTYPES, kv_dtype
from hal.plugin_compat import API1_NOTE
from hal.registry import get_registry, probe_device, runs_as_api
from hal.selection import backend_report, select

HELP = "devices, capabilities, backends and the selection trace"


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dtype", default="bf16", choices=list(COMPUTE_DTYPES), help="the model's dtype")
    parser.add_argument("--page-size", type=int, default=1, help="the KV pool's page size (default 1)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--q-heads", type=int, default=32, help="query heads per rank (tp_q_head_num)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads per rank (tp_k_head_num)")
    parser.add_argument(
        "--arch", help="also the Triton kernels' launch plan for this GPU architecture (sm_80, sm_90...)"
    )


def run(args: argparse.Namespace) -> int:
    config = AttentionConfig(
        tp_q_head_num=args.q_heads,
        tp_k_head_num=args.kv_heads,
        head_dim=args.head_dim,
        dtype=kv_dtype(args.dtype).torch_dtype,
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
