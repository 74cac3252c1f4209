"""The compiled CPU kernels (``hal.kernels.cpu``) and the ``torch`` backend's two paths.

The conformance suite runs the registered ``torch`` backend, i.e. the compiled path where
a compiler is; here every conformance case also goes through the kernel's extend tiles
(forced by a small ``tile_rows``) and through the plain torch path that serves where no
kernels can be built. Nothing here is timed: speed is ``hal bench``'s business.
"""

from __future__ import annotations

import pytest
import torch

from hal.batch import host_lens
from hal.conformance.cases import CASES, build, tolerance
from hal.devices.cpu import CompiledBackend, PlainTorchBackend, device
from hal.devices.cpu.capability import cpu_capability
from hal.errors import KVCacheError
from hal.kernels import cpu as cpu_kernels

CAP = cpu_capability()
BUILDABLE, WHY_NOT = cpu_kernels.status()
needs_kernels = pytest.mark.skipif(not BUILDABLE, reason=f"no compiled CPU kernels here: {WHY_NOT}")
CPU_CASES = [c for c in CASES if not CompiledBackend.unsupported_reasons(c.config(), CAP)]


def _kernel_out(built, tile_rows):
    fb, layer = built.batch, built.layer
    lens = host_lens(fb)
    k_buffer, v_buffer = fb.token_to_kv_pool.get_kv_buffer(0)
    k_buffer.copy_(built.expected_k)
    v_buffer.copy_(built.expected_v)
    out = cpu_kernels.paged_attention(
        built.q.view(lens.num_tokens, layer.tp_q_head_num, layer.head_dim),
        k_buffer,
        v_buffer,
        fb.req_to_token_pool.req_to_token,
        fb.req_pool_indices,
        torch.tensor(lens.kv),
        torch.tensor(lens.query),
        scale=layer.scaling,
        logit_cap=layer.logit_cap,
        sliding_window=layer.sliding_window_size,
        causal=layer.causal,
        custom_mask=fb.spec_info.custom_mask if fb.forward_mode.is_target_verify() else None,
        tile_rows=tile_rows,
    )
    return out.reshape(lens.num_tokens, -1)


@needs_kernels
@pytest.mark.parametrize(
    "tile_rows, heads_per_task", [(0, "1"), (0, "64"), (2, "1")], ids=["rows", "rows-all-heads", "tiles"]
)
@pytest.mark.parametrize("case", CPU_CASES, ids=[c.name for c in CPU_CASES])
def test_kernel_matches_reference_on_every_path(case, tile_rows, heads_per_task, monkeypatch):
    """tile_rows=0: every request on the row path, one task per (request, KV head) or per request
    (all its KV heads); 2: every request through at::mm tiles."""
    monkeypatch.setenv("HAL_HEADS_PER_TASK", heads_per_task)
    built = build(case)
    out = _kernel_out(built, tile_rows)
    assert out.dtype == built.q.dtype
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.name for c in CPU_CASES])
def test_plain_torch_path_matches_reference(case):
    """The path that serves where no kernels can be built stays correct."""
    built = build(case)
    backend = PlainTorchBackend(CAP)
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out.float(), built.expected.float(), **tolerance(case.dtype))


def test_without_kernels_the_torch_backend_falls_back(monkeypatch):
    monkeypatch.setenv("HAL_CPU_KERNELS", "0")
    ok, why = cpu_kernels.status()
    assert not ok and "HAL_CPU_KERNELS=0" in why
    backend = CompiledBackend(CAP)
    assert backend.kernels is None
    assert any("plain torch path" in note for note in CompiledBackend.notes(CAP))
    built = build(next(c for c in CPU_CASES if c.mode.is_decode()))
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    torch.testing.assert_close(out, built.expected, **tolerance(built.case.dtype))


def test_a_failed_build_is_a_hal_error_and_the_backend_warns(monkeypatch):
    def broken():
        raise cpu_kernels.KernelBuildError("no compiler in this test")

    monkeypatch.setattr(cpu_kernels, "load", broken)
    monkeypatch.setattr(cpu_kernels, "status", lambda: (True, None))
    with pytest.warns(RuntimeWarning, match="no compiler in this test"):
        backend = CompiledBackend(CAP)
    assert backend.kernels is None


def test_the_cpu_device_serves_torch_first_and_notes_its_features():
    assert device.backends()[0] is CompiledBackend and CompiledBackend.name == "torch"
    assert issubclass(CompiledBackend, PlainTorchBackend)
    features = cpu_kernels.cpu_features()
    assert set(features) >= {"flags", "torch_capability", "bf16_dot", "model"}
    assert CAP.to_dict()["features"] == list(features["flags"])
    assert any("CPU features" in note for note in CompiledBackend.notes(CAP))


@needs_kernels
@pytest.mark.parametrize(
    "rows, seq, ext, slot, match",
    [
        ([0, 7], [3, 3], [1, 1], 0, "req_pool_indices"),
        ([0, 1], [11, 3], [1, 1], 0, "query tokens over 11 keys"),
        ([0, 1], [3, 5], [1, 1], 5000, "slot 5000"),
        ([0, 1], [3, 5], [1, 2], 0, "run past"),
        ([0, 1], [3, 5], [1, 1], -2, "slot -2"),
    ],
)
def test_bad_input_is_a_kv_cache_error(rows, seq, ext, slot, match):
    k_buffer, v_buffer, q = torch.randn(100, 2, 8), torch.randn(100, 2, 8), torch.randn(2, 4, 8)
    req_to_token = torch.zeros(3, 10, dtype=torch.int32)
    req_to_token[1, 3] = slot
    with pytest.raises(KVCacheError, match=match):
        cpu_kernels.paged_attention(
            q, k_buffer, v_buffer, req_to_token, torch.tensor(rows), torch.tensor(seq), torch.tensor(ext), scale=1.0
        )


@needs_kernels
def test_scattered_long_decode_and_extend_match_the_reference():
    """Context lengths past several key blocks, scattered slots, bf16 and fp32, GQA 4."""
    from hal.kernels import reference

    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        k_buffer = torch.randn(3000, 2, 64, generator=gen).to(dtype)
        v_buffer = torch.randn(3000, 2, 64, generator=gen).to(dtype)
        req_to_token = torch.randperm(3000, generator=gen)[:2400].view(3, 800).to(torch.int32)
        rows, seq, ext = torch.tensor([2, 0, 1]), torch.tensor([700, 300, 513]), torch.tensor([1, 300, 40])
        q = torch.randn(int(ext.sum()), 8, 64, generator=gen).to(dtype)
        args = (q, k_buffer, v_buffer, req_to_token, rows, seq, ext)
        out = cpu_kernels.paged_attention(*args, scale=0.125, sliding_window=400)
        expected = reference.paged_attention(*args, scale=0.125, sliding_window=400)
        torch.testing.assert_close(out.float(), expected.float(), **tolerance(dtype))


@needs_kernels
def test_a_build_killed_midway_does_not_block_the_next_one():
    """torch's build lock is a plain file; a killed build leaves it behind. The next load must not wait on it."""
    import pathlib
    import subprocess
    import sys

    cpu_kernels.load()
    stale = pathlib.Path(cpu_kernels.build_record()["path"]) / "lock"
    stale.touch()
    code = "from hal.kernels import cpu; cpu.load(); print('loaded')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr
    assert not stale.exists()
