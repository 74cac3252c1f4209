"""Tensor parallelism for the demo: one process per rank over ``torch.distributed``.

Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` set) the demo joins the
group it was started in; otherwise ``--tp N`` starts ``N`` copies of itself as ranks
with the same variables (rank 0 keeps the terminal, the others run quietly). The
process-group backend is the device capability's ``collective_backend`` (gloo on the CPU and under
emulation, nccl on CUDA, hccl on an NPU, whatever a plugin device declares).
Each rank serves the same requests in lockstep: the scheduler is deterministic and the
logits after ``all_reduce`` are the same on every rank, so every rank samples the same
tokens.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch

from hal.capability import DeviceCapability
from hal.deprecation import warn_renamed
from hal.errors import ConfigError

__all__ = ["RankInfo", "rank_info", "launch", "init_group", "group_backend"]

_CHILD = "HAL_DEMO_TP_RANK_OF"


class RankInfo:
    def __init__(self, rank: int = 0, local_rank: int = 0, world: int = 1):
        self.rank, self.local_rank, self.world = rank, local_rank, world

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_info(tp: int) -> RankInfo | None:
    """This process's rank when it runs inside a group (torchrun or a rank the demo started), else None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise ConfigError(f"--tp = {tp}: expected the launcher's WORLD_SIZE ({world})")
    rank = int(os.environ["RANK"])
    return RankInfo(rank, int(os.environ.get("LOCAL_RANK", rank)), world)


def group_backend(device: DeviceCapability | str) -> str:
    """The ``torch.distributed`` backend of ``device``'s tensor-parallel group: its ``collective_backend``.
    A torch device type (the deprecated argument) still works, with a DeprecationWarning."""
    if isinstance(device, DeviceCapability):
        return device.collective_backend
    warn_renamed("hal.demo.tp.group_backend(torch_type)", "group_backend(capability)")
    from hal.registry import get_registry, probe_device

    for registered in get_registry().ordered():  # the device's own answer, not a table of device names here
        capability = probe_device(registered)
        if capability.available and capability.torch_type == device:
            return capability.collective_backend
    return "gloo"


def init_group(info: RankInfo, capability: DeviceCapability) -> None:
    """Join the process group of ``info`` on ``capability``'s device (the rank's local device index)."""
    module = getattr(torch, capability.torch_type, None)
    if hasattr(module, "set_device"):
        module.set_device(info.local_rank)
    torch.distributed.init_process_group(
        group_backend(capability),
        rank=info.rank,
        world_size=info.world,
        timeout=datetime.timedelta(seconds=120),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tp: int, argv: list[str]) -> int:
    """Run ``hal demo <argv>`` as ``tp`` ranks; rank 0's output is the demo's. Returns the worst exit status."""
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(tp)}
    procs, logs = [], [tempfile.TemporaryFile("w+") for _ in range(tp)]  # a pipe could fill and block a rank
    for rank in range(tp):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), _CHILD: str(os.getpid())}
        quiet = subprocess.DEVNULL if rank else None
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "hal", "demo", *argv],
                env=env,
                stdout=quiet,
                stderr=logs[rank] if rank else None,
                text=True,
            )
        )
    errors = [""] * tp
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.poll() for p in procs):
                failed_at = time.monotonic()
            # A rank that failed leaves the others waiting on it until the group times out: give them a grace.
            if failed_at is not None and time.monotonic() - failed_at > 30:
                for proc in procs:
                    if proc.poll() is None:
                        proc.terminate()
            time.sleep(0.05)
        for rank in range(1, tp):
            logs[rank].seek(0)
            errors[rank] = logs[rank].read()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    for rank in range(1, tp):
        if codes[rank] and codes[rank] != codes[0] and errors[rank]:
            print(f"hal demo: rank {rank} failed (exit {codes[rank]}):\n{errors[rank][-4000:]}", file=sys.stderr)
    return codes[0] or next((c for c in codes if c), 0)
