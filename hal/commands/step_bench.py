"""``hal bench --workload step``: what hal costs a serving engine per scheduler step, besides attention.

For a DECODE step at each batch size (default 32 and 256 requests of ``context`` tokens):

* ``construct_ms``: building a validated ``hal.ForwardBatch`` (host mirrors given, as an
  engine has them), per validation level;
* ``init_forward_metadata_ms``: the backend's metadata for that batch, per level;
* ``host_reads``: device-to-host reads in ``cheap`` mode, counted by
  :class:`hal.graph.HostReadCounter` (on a CPU nothing syncs, so it counts the calls that
  would: ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``/``int()`` of a tensor,
  ``torch.equal``, ``nonzero`` and boolean-mask indexing), split into
  ``init_forward_metadata_out_graph`` (host work by contract) and everything else
  (construction, ``in_graph``, ``forward``: the target is 0);

and ``forward_us``: the host time of one layer's ``forward`` at batch 32 on tiny shapes
(1 KV head of dim 8, 16 tokens each), where the kernels' own work is negligible.

The KV pool is tiny (1 head, dim 8) so that batch 256 x 4k fits anywhere: these costs
depend on the number of requests and tokens, not on the model's width.
"""

from __future__ import annotations

import functools
import os

import torch

from hal.batch import ForwardBatch, ForwardMode
from hal.commands.bench_timing import device_facts, time_ms
from hal.config import AttentionConfig
from hal.graph import HostReadCounter
from hal.kv_cache import PagedKVPool, ReqToTokenPool
from hal.layer import AttentionLayer
from hal.registry import get_registry
from hal.selection import select

__all__ = ["run_step_workload"]

LEVELS = ("cheap", "full")


def _decode_step(batch: int, context: int, device: torch.device, page_size: int):
    """Pools and the fields of a DECODE step of ``batch`` requests of ``context`` tokens, slots scattered by page."""
    pages_per_req = -(-context // page_size)
    kv = PagedKVPool(batch * pages_per_req + 1, page_size, 1, 1, 8, device=device)
    rt = ReqToTokenPool(batch, context, device=device)
    gen = torch.Generator().manual_seed(0)
    pages = (torch.randperm(batch * pages_per_req, generator=gen) + 1).view(batch, pages_per_req)
    token = torch.arange(context)
    slots = pages[:, token // page_size] * page_size + token % page_size  # [batch, context]
    rt.req_to_token[1:] = slots.to(device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    fields = dict(
        forward_mode=ForwardMode.DECODE,
        batch_size=batch,
        req_pool_indices=torch.arange(1, batch + 1, device=device),
        seq_lens=seq_lens.to(device=device, dtype=torch.int32),
        seq_lens_cpu=seq_lens,
        seq_lens_sum=batch * context,
        out_cache_loc=slots[:, -1].to(device),
        req_to_token_pool=rt,
        token_to_kv_pool=kv,
    )
    return fields


def run_step_workload(
    device: str | None = None,
    backend: str | None = None,
    batch_sizes: tuple[int, ...] = (32, 256),
    context: int = 4096,
    page_size: int = 1,
    repeats: int = 20,
) -> dict:
    """Measure the per-step costs above; returns ``{"backend", "device", "results": [...], "forward_us"}``."""
    config = AttentionConfig(tp_q_head_num=2, tp_k_head_num=1, head_dim=8, dtype=torch.float32, page_size=page_size)
    selection = select(config, device=device, backend=backend)
    torch_device = selection.capability.torch_device
    # the machine, as hal bench's other workloads record it: what its device says (a CPU: its features, kernel path)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "loadavg_at_start": os.getloadavg()}
    meta.update(device_facts(get_registry().get(selection.device_name))["meta"])
    layer = AttentionLayer(0, 2, 1, 8)
    results = []
    for batch in batch_sizes:
        fields = _decode_step(batch, context, torch_device, page_size)
        row: dict = {"batch_size": batch, "context": context, "construct_ms": {}, "init_forward_metadata_ms": {}}
        for level in LEVELS:
            impl = selection.create(validate=level)
            build = functools.partial(ForwardBatch, **fields, validate=level)
            row["construct_ms"][level] = time_ms(build, torch_device, repeats, 1)["median_ms"]
            prepare = functools.partial(impl.init_forward_metadata, build())
            row["init_forward_metadata_ms"][level] = time_ms(prepare, torch_device, 5, 1)["median_ms"]
        impl = selection.create(validate="cheap")
        q, kv = torch.zeros(batch, 16, device=torch_device), torch.zeros(batch, 8, device=torch_device)
        mirrors = (fields["seq_lens_cpu"],)
        with HostReadCounter(host=mirrors) as elsewhere:
            fb = ForwardBatch(**fields, validate="cheap")
        with HostReadCounter(host=mirrors) as out_graph:
            impl.init_forward_metadata_out_graph(fb)
        with HostReadCounter(host=mirrors) as rest:
            impl.init_forward_metadata_in_graph(fb)
            impl.forward(q, kv, kv, layer, fb)
        row["host_reads"] = {
            "outside_out_graph": elsewhere.count + rest.count,
            "init_forward_metadata_out_graph": out_graph.count,
            "what": sorted({what for what, _ in elsewhere.reads + rest.reads + out_graph.reads}),
        }
        results.append(row)
    fields = _decode_step(32, 16, torch_device, page_size)
    impl = selection.create(validate="cheap")
    fb = ForwardBatch(**fields, validate="cheap")
    impl.init_forward_metadata(fb)
    q, kv = torch.randn(32, 16, device=torch_device), torch.randn(32, 8, device=torch_device)
    forward_ms = time_ms(lambda: impl.forward(q, kv, kv, layer, fb), torch_device, 10 * repeats, 1)["median_ms"]
    meta["loadavg_at_end"] = os.getloadavg()
    return {
        "meta": meta,
        "workload": "step",
        "device": str(torch_device),
        "backend": selection.backend,
        "results": results,
        "forward_us": 1e3 * forward_ms,
        "targets": {"host_reads_outside_out_graph": 0, "construct_ms_cheap_at_256": 0.2, "forward_us": 50},
    }


def format_step(data: dict) -> str:
    """The text report of :func:`run_step_workload`'s result."""
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
