#!/usr/bin/env python
"""SGLang's TorchNativeAttnBackend timed on hal bench's decode / extend shapes (the peer of ``hal bench``).

Run by ``hal bench --peer-python PYTHON`` with the interpreter of any venv that has SGLang
(tested: 0.5.21 with torch 2.13.0+cpu, installed ``--no-deps`` plus what its import chain
needs; see bench/README.md). It imports SGLang only; hal is not needed. Prints one JSON
object: ``{"meta": ..., "decode": {"fp32": {"sglang": {"median_ms": ..., "correct": ...}}}, ...}``; with
``--serve`` it answers ``hal bench`` call by call instead (``peer_common.serve``).

What is SGLang's own code: ``TorchNativeAttnBackend``, ``MHATokenToKVPool`` (page size 1,
CPU), ``ReqToTokenPool``, ``RadixAttention`` (the layer descriptor) and ``ForwardMode``.
What is stood in: the model runner (the three attributes the backend reads) and the
forward batch (a namespace with the fields it reads). KV slots are a random permutation
of the pool, as a serving engine leaves them; each timed call writes the step's K/V and
attends, as ``RadixAttention.forward`` issues it.

torchvision: PyPI's Linux wheels are CUDA builds that fail to load against a CPU torch,
and SGLang imports it at module level for multimodal code only; when no working one is
importable an import-only placeholder module is installed (calling anything in it raises).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import platform
import sys
import time
import types
from types import SimpleNamespace

import torch
from peer_common import DTYPES, first_call, run, shape_arguments, shapes


class _Missing:
    """A torchvision attribute: further attributes are placeholders too; calling one raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a placeholder here")


class _Placeholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import-only torchvision: every attribute is a :class:`_Missing`."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__, module.__version__ = [], "0.0.0+placeholder"

        def attr(name, _owner=spec.name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Missing(f"{_owner}.{name}")

        module.__getattr__ = attr
        return module

    def exec_module(self, module):
        pass


def _torchvision() -> str:
    if importlib.util.find_spec("torchvision") is not None:
        try:
            import torchvision  # noqa: F401

            return "real"
        except Exception:
            for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
                del sys.modules[name]
    sys.meta_path.append(_Placeholder())
    return "placeholder"


def _sglang():
    tv = _torchvision()
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the JSON
        import sglang
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
    return SimpleNamespace(
        version=getattr(sglang, "__version__", "?"),
        Backend=TorchNativeAttnBackend,
        RadixAttention=RadixAttention,
        KVPool=MHATokenToKVPool,
        ReqPool=ReqToTokenPool,
        ForwardMode=ForwardMode,
        torchvision=tv,
    )


def _batch(sg, mode: str, dtype, batch: int, prefix: int, new: int, heads: tuple[int, int, int], seed: int):
    """Pools with the prefixes written, a forward batch, and the step's q/k/v (new K/V written by the call)."""
    q_heads, kv_heads, dim = heads
    gen = torch.Generator().manual_seed(seed)
    total = prefix + new
    kv = sg.KVPool(
        size=batch * total + 1,
        page_size=1,
        dtype=dtype,
        head_num=kv_heads,
        head_dim=dim,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    req = sg.ReqPool(size=batch + 1, max_context_len=total, device="cpu", enable_memory_saver=False)
    slots = (torch.randperm(batch * total, generator=gen) + 1).view(batch, total)  # slot 0: padding
    req.req_to_token[1 : batch + 1] = slots.to(torch.int32)
    k_all = torch.randn(batch, total, kv_heads, dim, generator=gen).to(dtype)
    v_all = torch.randn(batch, total, kv_heads, dim, generator=gen).to(dtype)
    kbuf, vbuf = kv.get_key_buffer(0), kv.get_value_buffer(0)
    kbuf[slots[:, :prefix].reshape(-1)] = k_all[:, :prefix].reshape(-1, kv_heads, dim)
    vbuf[slots[:, :prefix].reshape(-1)] = v_all[:, :prefix].reshape(-1, kv_heads, dim)
    layer = sg.RadixAttention(num_heads=q_heads, head_dim=dim, scaling=dim**-0.5, num_kv_heads=kv_heads, layer_id=0)
    lens = torch.full((batch,), total, dtype=torch.int64)
    fb = SimpleNamespace(
        forward_mode=sg.ForwardMode.DECODE if mode == "decode" else sg.ForwardMode.EXTEND,
        batch_size=batch,
        req_pool_indices=torch.arange(1, batch + 1),
        seq_lens=lens,
        seq_lens_cpu=lens.clone(),
        seq_lens_sum=batch * total,
        out_cache_loc=slots[:, prefix:].reshape(-1),
        extend_prefix_lens=torch.full((batch,), prefix, dtype=torch.int64),
        extend_seq_lens=torch.full((batch,), new, dtype=torch.int64),
        extend_prefix_lens_cpu=[prefix] * batch,
        extend_seq_lens_cpu=[new] * batch,
        encoder_lens=None,
        encoder_out_cache_loc=None,
    )
    runner = SimpleNamespace(device="cpu", req_to_token_pool=req, token_to_kv_pool=kv)
    q = torch.randn(batch * new, q_heads * dim, generator=gen).to(dtype)
    k_new = k_all[:, prefix:].reshape(-1, kv_heads, dim)
    v_new = v_all[:, prefix:].reshape(-1, kv_heads, dim)
    return sg.Backend(runner), layer, fb, (q, k_new, v_new), (k_all, v_all)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    shape_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    sg = _sglang()
    heads = (32, 8, 128)
    meta = {
        "sglang": sg.version,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "torchvision": sg.torchvision,
        "import_s": round(time.perf_counter() - start, 2),
        "backend": "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend",
    }

    def prepare(mode: str, name: str, shape: dict | None = None) -> dict:
        """One variant, ``sglang``: its pool has page size 1, so it is compared with hal's page-1 rows only."""
        batch, prefix, new = shapes(args, mode, shape)
        backend, layer, fb, (q, k, v), (k_all, v_all) = _batch(
            sg, mode, DTYPES[name], batch, prefix, new, heads, args.seed
        )

        def step():
            backend.init_forward_metadata(fb)
            return backend.forward(q, k, v, layer, fb, save_kv_cache=True)

        shape = {"batch": batch, "prefix": prefix, "new": new, "heads": heads}
        facts = {"shape": shape, "page_size": 1, **first_call(step, q, k_all, v_all, prefix, new, heads)}
        return {"sglang": (step, facts)}

    return run(args, meta, prepare, "sglang")


if __name__ == "__main__":
    sys.exit(main())
