"""Fakes of the hardware stacks hal meets on GPU and NPU hosts, for CPU tests. Nothing here is real.

* :func:`fake_torch_npu` - a ``torch_npu`` whose ATB ops are op-plugin's lazy wrappers
  (present whether or not NNAL loads) and whose ``torch_npu.op_plugin.atb._atb_ops._register_atb_extensions``
  fails the way op-plugin's does when ``libatb.so`` is missing (``OSError`` naming NNAL's ``set_env.sh``).
* :func:`fake_flashinfer_stack` - an installed-looking flashinfer-python on ``sys.path`` (a package
  directory and its ``.dist-info``), optionally with flashinfer-jit-cache / flashinfer-cubin, an
  ``nvcc`` under a fake ``CUDA_HOME`` and a ``ninja``; or a flashinfer whose import fails.
* :class:`FakeGraphModule` - ``torch.cuda``'s graph API (``CUDAGraph``, ``graph``, ``graph_pool_handle``,
  ``Stream``, ``stream``, ``current_stream``) recording which pool and stream each capture used.
"""

from __future__ import annotations

import contextlib
import stat
import sys
import types
import warnings
from pathlib import Path

import torch

from hal.kernels.npu import OP_NAMES

# ----------------------------------------------------------------------------- torch_npu without ATB

NNAL_OSERROR = (
    "Please check that the nnal package is installed. Please run 'source set_env.sh' in the NNAL installation path."
)


def fake_torch_npu(monkeypatch, *, atb_loads: bool) -> dict:
    """Install a fake ``torch_npu`` (one visible Ascend910B3) in ``sys.modules``; returns a call log."""
    log = {"register": 0, "op_calls": 0}
    module = types.ModuleType("torch_npu")
    module.__version__ = "2.5.1.fake"

    def lazy(name):
        def op(*args, **kwargs):  # op-plugin's lazy wrapper: loads ATB on first call, which fails without NNAL
            log["op_calls"] += 1
            register()
            raise AssertionError(f"the fake {name} has no kernel")

        op.__name__ = name
        return op

    for name in OP_NAMES:
        setattr(module, name, lazy(name))
    module.npu = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        get_device_name=lambda index=0: "Ascend910B3",
        get_soc_version=lambda: 223,  # an A2 (vllm-ascend's 220-225 range)
        get_device_properties=lambda index=0: types.SimpleNamespace(total_memory=64 << 30),
        NPUGraph=object,
    )

    def register():
        log["register"] += 1
        if not atb_loads:
            cause = OSError("libatb.so: cannot open shared object file: No such file or directory")
            raise OSError(2, NNAL_OSERROR) from cause

    atb_ops = types.ModuleType("torch_npu.op_plugin.atb._atb_ops")
    atb_ops._register_atb_extensions = register
    for name, mod in (
        ("torch_npu", module),
        ("torch_npu.op_plugin", types.ModuleType("torch_npu.op_plugin")),
        ("torch_npu.op_plugin.atb", types.ModuleType("torch_npu.op_plugin.atb")),
        ("torch_npu.op_plugin.atb._atb_ops", atb_ops),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    return log


# ----------------------------------------------------------------------------- flashinfer's install states


def _dist(site: Path, dist: str, version: str) -> None:
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


def _executable(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def fake_flashinfer_stack(
    monkeypatch,
    tmp_path: Path,
    *,
    version: str = "0.7.4",
    jit_cache: str | None = None,
    cubin: str | None = None,
    nvcc: bool = False,
    ninja: bool = True,
    import_error: str | None = None,
) -> Path:
    """A fake flashinfer-python ``version`` on ``sys.path``; returns the site directory.

    ``jit_cache`` / ``cubin``: versions of flashinfer-jit-cache / flashinfer-cubin to install
    beside it. ``nvcc``: a ``CUDA_HOME`` with ``bin/nvcc``. ``PATH`` holds only a ``ninja``
    (when ``ninja``), so the host's own toolchain never leaks in. ``import_error``: ``import
    flashinfer`` raises ``RuntimeError(import_error)``, as flashinfer's ``jit/env.py`` does on a
    version mismatch of its kernel packages.
    """
    site = tmp_path / "site"
    pkg = site / "flashinfer"
    pkg.mkdir(parents=True)
    body = f"__version__ = {version!r}\n"
    if import_error:
        body = f"raise RuntimeError({import_error!r})\n"
    (pkg / "__init__.py").write_text(body)
    _dist(site, "flashinfer-python", version)
    for dist, dist_version in (("flashinfer-jit-cache", jit_cache), ("flashinfer-cubin", cubin)):
        if dist_version:
            mod = site / dist.replace("-", "_")
            mod.mkdir()
            (mod / "__init__.py").write_text(f"__version__ = {dist_version!r}\n")
            _dist(site, dist, dist_version)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if ninja:
        _executable(bin_dir / "ninja")
    monkeypatch.setenv("PATH", str(bin_dir))
    for var in ("CUDA_HOME", "CUDA_PATH", "FLASHINFER_NVCC"):
        monkeypatch.delenv(var, raising=False)
    if nvcc:
        cuda_home = tmp_path / "cuda"
        _executable(cuda_home / "bin" / "nvcc")
        monkeypatch.setenv("CUDA_HOME", str(cuda_home))
    monkeypatch.syspath_prepend(str(site))
    packages = ("flashinfer", "flashinfer_jit_cache", "flashinfer_cubin")
    for name in [m for m in sys.modules if m.split(".")[0] in packages]:
        monkeypatch.delitem(sys.modules, name)
    return site


# ----------------------------------------------------------------------------- torch.cuda's graph API


class FakeGraphModule:
    """Stands in for ``torch.cuda``: captures run the function eagerly and are recorded, replays re-run it."""

    def __init__(self):
        self.captures: list[dict] = []  # per capture: pool, stream
        self.pools: list[object] = []
        self.streams: list[object] = []
        self.current = "default"
        module = self

        class CUDAGraph:
            def __init__(self):
                self.fn = None

            def replay(self):
                pass

            def pool(self):
                return self.capture_pool

        class Stream:
            def __init__(self):
                module.streams.append(self)

            def wait_stream(self, other):
                pass

        self.CUDAGraph = CUDAGraph
        self.Stream = Stream

    def graph_pool_handle(self):
        handle = ("pool", len(self.pools))
        self.pools.append(handle)
        return handle

    def current_stream(self):
        return types.SimpleNamespace(wait_stream=lambda other: None, name=self.current)

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    @contextlib.contextmanager
    def graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        cuda_graph.capture_pool = pool
        self.captures.append({"pool": pool, "stream": stream})
        before, self.current = self.current, "capture"
        try:
            yield
        finally:
            self.current = before


__all__ = [
    "fake_torch_npu",
    "fake_flashinfer_stack",
    "FakeGraphModule",
    "NNAL_OSERROR",
    "flashinfer_write_out",
    "flashinfer_merge_state_in_place",
    "flashinfer_mla_07",
    "FlashInferMLAPlanMetadata",
]


# ----------------------------------------------------------------------------- flashinfer's API per release range

# The releases of flashinfer-python hal supports (pyproject's cuda extra: >= 0.2.1), cut where a signature or a
# behaviour hal depends on changes; each range is faked by its first release (tests/test_flashinfer_backend.py).
# Read from the flashinfer repository's tags:
# * 0.2.1: flashinfer.mla.BatchMLAPagedAttentionWrapper (with backend=), BatchPrefillWithPagedKVCacheWrapper's
#   mask_indptr_buf (0.2.0: qk_indptr_buf); BatchDecodeWithPagedKVCacheWrapper takes no backend=, its tensor-core
#   path is the fa2 prefill kernel (flashinfer/decode.py at v0.2.8).
# * 0.2.2: the wrappers' run() take out= (flashinfer/decode.py, prefill.py, mla.py at v0.2.2; 0.2.1 has none).
# * 0.2.9: the decode wrapper takes backend= ("auto" / "fa2" / "fa3"; flashinfer/decode.py at v0.2.9).
# * 0.6.0-0.6.3: the decode wrapper's "auto" with use_tensor_cores resolves through determine_attention_backend to
#   fa3 on sm90, which has no fp16/bf16 query over an fp8 cache; fixed in 0.6.4 (flashinfer #2530 "pick fa2 for
#   BatchDecodeWithPagedKVCacheWrapper auto backend", #2536 "fallback to fa2 ... (bf16 Q, Fp8 KV)").
# * 0.7.0: the MLA wrapper's canonical form, by keyword: plan(metadata=MLAPlanMetadata.csr(...), query_layout=,
#   kv_cache_layout=, ...), run(query=(q_nope, q_pe), kv_cache=(ckv, kpe)); positional arguments, flat plan metadata
#   and the q_nope/ckv_cache tensor arguments each warn DeprecationWarning (flashinfer/mla/_batch_mla/_wrapper.py in
#   the 0.7.0 wheel; the git tags read end at 0.6.18).
# * 0.7.4 (the registry's newest, pyproject's upper bound): the FA2 MLA run raises ValueError ("Current tensor layout
#   is unsupported by the selected fa2 MLA backend.") unless every query, cache and output tensor is 3-D, dense in its
#   last dimension, with a 16-byte aligned data pointer and 16-byte outer strides
#   (flashinfer/mla/_batch_mla/_backends/_fa_common.py _prepare_planned_inputs; 0.7.0 has no such check).
FLASHINFER_RANGES = {
    "0.2.1": "0.2.1",
    "0.2.2-0.2.8": "0.2.2",
    "0.2.9-0.5.x": "0.2.9",
    "0.6.0-0.6.3": "0.6.0",
    "0.6.4-0.6.18": "0.6.4",
    "0.7.0-0.7.3": "0.7.0",
    "0.7.4": "0.7.4",
}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:3])


def flashinfer_features(version: str) -> dict[str, bool]:
    """What the fake of ``version`` does: ``run_out`` (the wrappers' ``run`` take ``out=``), ``decode_backend_kw``
    (the decode wrapper takes ``backend=``), ``decode_auto_fa3`` (its tensor-core "auto" resolves to fa3 on sm90,
    which refuses an fp8 cache)."""
    v = _release(version)
    return {
        "run_out": v >= (0, 2, 2),
        "decode_backend_kw": v >= (0, 2, 9),
        "decode_auto_fa3": (0, 6, 0) <= v < (0, 6, 4),
        "mla_structural": v >= (0, 7, 0),
        "mla_align16": v >= (0, 7, 4),
    }


class FlashInferMLAPlanMetadata:
    """``flashinfer.mla.MLAPlanMetadata`` (0.7+): ``csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr)``."""

    def __init__(self, **fields):
        self.fields = fields

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)


_MLA_PLAN_FLAT = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")
_MLA_PLAN_SHAPE = (
    "num_heads", "head_dim_ckv", "head_dim_kpe", "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type",
)  # fmt: skip
_MLA_RUN_LEGACY = ("q_nope", "q_pe", "ckv_cache", "kpe_cache")
# 0.7's warnings, word for word (flashinfer/mla/_batch_mla/_wrapper.py)
_MLA_POSITIONAL = "Positional MLA arguments are deprecated; pass plan() and run() arguments by keyword instead."
_MLA_FLAT_PLAN = (
    "Passing flat BatchMLAPagedAttentionWrapper.plan metadata tensors is deprecated; pass "
    "metadata=flashinfer.mla.MLAPlanMetadata.csr(...) or metadata=flashinfer.mla.MLAPlanMetadata.dense(...)."
)
_MLA_LEGACY_TENSORS = (
    "Legacy MLA tensor arguments q_nope/q_pe and ckv_cache/kpe_cache are deprecated; pass query= and kv_cache= "
    "structural values instead."
)


def flashinfer_mla_07(legacy: type, *, align16: bool) -> type:
    """The 0.7 contract of ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` over ``legacy`` (a fake of the 0.2-0.6
    wrapper, whose ``plan(qo_indptr, ..., kv_data_type)`` / ``run(q_nope, q_pe, ckv_cache, kpe_cache, out=, ...)``
    compute): the canonical keyword form served silently, the deprecated forms served with their warnings, and
    (``align16``, 0.7.4) the FA2 run's ``ValueError`` for a tensor without 16-byte aligned pointers and outer
    strides."""

    class MLA07(legacy):
        def plan(self, *args, metadata=None, query_layout=None, kv_cache_layout=None, **kw):
            if args:
                warnings.warn(_MLA_POSITIONAL, DeprecationWarning, stacklevel=2)
            names = _MLA_PLAN_FLAT + _MLA_PLAN_SHAPE
            kw.update(zip(names, args))
            if metadata is None:
                warnings.warn(_MLA_FLAT_PLAN, DeprecationWarning, stacklevel=2)
                query_layout, kv_cache_layout = query_layout or "split", kv_cache_layout or "split"
            else:
                assert not set(_MLA_PLAN_FLAT) & set(kw), "metadata= and flat metadata tensors together"
                kw.update(metadata.fields)
            # canonical metadata defaults to packed query and cache; hal passes split pairs
            assert (query_layout or "packed") == "split" and (kv_cache_layout or "packed") == "split"
            return super().plan(**{name: kw.pop(name) for name in names}, **kw)

        def run(self, *args, query=None, kv_cache=None, out=None, lse=None, return_lse=False, **kw):
            if args:
                warnings.warn(_MLA_POSITIONAL, DeprecationWarning, stacklevel=2)
            kw.update(out=out, lse=lse, return_lse=return_lse)
            kw.update(zip(_MLA_RUN_LEGACY + ("out", "lse", "return_lse"), args))
            legacy_form = [name for name in _MLA_RUN_LEGACY if kw.get(name) is not None]
            if legacy_form:
                warnings.warn(_MLA_LEGACY_TENSORS, DeprecationWarning, stacklevel=2)
                query = (kw.pop("q_nope"), kw.pop("q_pe"))
                kv_cache = (kw.pop("ckv_cache"), kw.pop("kpe_cache"))
            for tensor in (*query, *kv_cache, kw.get("out")) if align16 else ():
                if tensor is None or tensor.numel() == 0:
                    continue
                if (
                    tensor.ndim != 3
                    or tensor.stride(-1) != 1
                    or tensor.data_ptr() % 16
                    or any(tensor.shape[a] > 1 and tensor.stride(a) * tensor.element_size() % 16 for a in (0, 1))
                ):
                    raise ValueError("Current tensor layout is unsupported by the selected fa2 MLA backend.")
            return super().run(*query, *kv_cache, **kw)

    return MLA07


def flashinfer_write_out(result, out, *, strided_rows: bool = False):
    """What a FlashInfer wrapper's ``run(..., out=)`` (flashinfer>=0.2.2) does with ``out``: ``result`` (the
    attention output in the planned output dtype, ``[T, Hq, Dv]``) where it is None; else the checks of
    ``check_shape_dtype_device`` (flashinfer/utils.py: shape, dtype, device, each a ``ValueError``), then the
    kernel's write into ``out``, which ``run`` returns.

    The decode and prefill kernels write ``o`` densely from its data pointer (csrc/batch_decode.cu,
    batch_prefill.cu: ``params.o = o.data_ptr()``, no output strides) and ``run`` checks no strides: a buffer that is
    not contiguous would be written wrong without an error, so the fake fails on it. The MLA kernel writes through
    ``o.stride(0)`` / ``o.stride(1)`` (csrc/batch_mla_run.cu): ``strided_rows``, the last dimension still dense."""
    if out is None:
        return result
    for what, got, want in (
        ("shape", tuple(out.shape), tuple(result.shape)),
        ("dtype", out.dtype, result.dtype),
        ("device", out.device, result.device),
    ):
        if got != want:
            raise ValueError(f"Invalid {what} of out: expected {want}, got {got}")
    dense = out.stride(-1) == 1 and (strided_rows or out.is_contiguous())
    assert dense, f"FlashInfer's kernel would write out {list(out.shape)} stride {out.stride()} densely: wrong rows"
    out.copy_(result)
    return out


def flashinfer_merge_state_in_place(merge, v, s, v_other, s_other) -> None:
    """``flashinfer.merge_state_in_place(v, s, v_other, s_other)`` with ``merge`` (the base-2 merge rule): the
    kernel's checks (csrc/cascade.cu: ``CHECK_INPUT``, contiguous tensors; ``v``/``v_other`` and ``s``/``s_other``
    of one shape each, ``s`` float32 ``[T, H]``), then ``v`` and ``s`` overwritten with the merged state."""
    assert all(t.is_contiguous() for t in (v, s, v_other, s_other)), "merge_state_in_place: CHECK_INPUT (contiguous)"
    assert v.shape == v_other.shape and s.shape == s_other.shape == v.shape[:2] and s.dtype == torch.float32
    merged_v, merged_s = merge(v, s, v_other, s_other)
    v.copy_(merged_v)
    s.copy_(merged_s)
