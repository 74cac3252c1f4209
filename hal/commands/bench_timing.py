"""Timing on a device, and what a device tells ``hal bench`` about itself (:func:`device_facts`): shared by the
workloads of :mod:`hal.commands.bench` and the step workload of :mod:`hal.commands.step_bench`."""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["FACT_DEFAULTS", "device_facts", "time_ms"]


def _sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work through its torch module (``torch.<type>.synchronize``), where it has one."""
    sync = getattr(getattr(torch, device.type, None), "synchronize", None)
    if callable(sync):
        sync(device)


# What a device's bench_facts() may say, and the default of each key for a device that says nothing.
FACT_DEFAULTS: dict = {
    "meta": {},  # recorded in the report's meta (e.g. CPU features, kernel path, results file name)
    "ceilings": None,  # () -> {name: GFLOP/s}: arithmetic peaks of the path that serves, sampled like the limits
    # dtype tag ("fp32", "bf16") -> the ceiling its kernels can reach; "<kind>_<dtype>" ("extend_bf16") overrides it
    # for one kind of workload (decode, extend, mixed, mixed_part_extend...)
    "ceiling_for_dtype": {},
    "in_process_peers": False,  # whether hal.commands.bench_peers' torch peers mean something here
    "time_reference": False,  # whether timing hal.kernels.reference (decode) means something here
    "matmul_size": 8192,  # side of the square matmul that measures the matmul rates
    "copy_bw": True,  # whether to measure a device-to-device copy beside the read bandwidth
}


def device_facts(device) -> dict:
    """What ``hal bench`` records and measures on ``device`` (a :class:`hal.registry.Device`): its
    ``bench_facts()`` over :data:`FACT_DEFAULTS`. Commands get device facts from the device, never by its name."""
    ask = getattr(device, "bench_facts", None)
    return {**FACT_DEFAULTS, **(ask() if callable(ask) else {})}


def time_ms(fn, device: torch.device, repeats: int, warmup: int) -> dict:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "repeats": repeats}
