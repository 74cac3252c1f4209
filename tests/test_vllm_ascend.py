"""hal through vllm-ascend (``hal.integrations.vllm_ascend``), on the CPU.

vllm-ascend needs an NPU; these tests read its contract through the stand-in ``ci/vllm_ascend_standin`` (package
``vllm_ascend``: upstream's platform selection, backend declarations, runner cache allocation and builder call, each
citing the upstream lines it follows) and run hal's ``npu`` device under its emulation (``HAL_NPU_EMULATION``).

* Without vLLM: vllm-ascend's 310P cache pairs (FRACTAL_NZ) bound in place by hal's vLLM pool, and refused in any
  other form.
* With vLLM: the route is opt-in (``HAL_VLLM=1``) and keyed on upstream's answer (dense -> hal, MLA / sparse /
  encoder-only -> upstream's); hal's classes answer upstream's name, cache shape and block sizes; the stand-in
  runner's ``(k_cache, v_cache)`` pairs are hal's pool's memory; what the route does not serve is refused at start.
* With vLLM and the stand-in installed (``tox -e vllm-engine``): vLLM's CPU engine on the stand-in platform with
  hal's emulated NPU (A2, and 310P's NZ caches) gives greedy tokens identical to vLLM's own ``CPU_ATTN``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import random
import sys
import types

import pytest
import torch

from hal.conformance.vllm_standin import ascend_pair
from hal.errors import ConfigError, KVCacheError, UnsupportedError
from hal.integrations.vllm_steps import VllmKVPool, common_block_size, fractal_nz_views
from hal.kv_layouts import FRACTAL_NZ, KV_LAYOUTS, TOKEN_MAJOR

ROOT = pathlib.Path(__file__).resolve().parents[1]
STANDIN_SRC = ROOT / "ci" / "vllm_ascend_standin" / "src"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (tox -e vllm-engine)")


def _nz_pair(blocks: int, heads: int, block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vllm-ascend's 310P pair: two ``AscendAttentionBackend310.get_kv_cache_shape(...)[1:]`` tensors."""
    return ascend_pair(blocks, heads, block_size, head_size, FRACTAL_NZ)


# ----------------------------------------------------------------------------- no vLLM: the NZ pair in place


def test_nz_pairs_are_bound_in_place_and_written_there():
    k_cache, v_cache = _nz_pair(blocks=4, heads=2, block_size=16, head_size=32)
    pool = VllmKVPool(16, torch.float32, "cpu", 32, kv_layout=FRACTAL_NZ)
    pool.bind(3, (k_cache, v_cache))
    k_pages, v_pages = pool.get_kv_pages(3)
    assert k_pages.data_ptr() == k_cache.data_ptr() and v_pages.data_ptr() == v_cache.data_ptr()
    assert (pool.head_num, pool.num_slots, pool.kv_layout) == (2, 64, FRACTAL_NZ)
    loc = torch.tensor([17, 40, 63])
    k, v = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    pool.set_kv_buffer(3, loc, k, v)
    read = KV_LAYOUTS[FRACTAL_NZ].read
    assert torch.equal(read(k_cache, loc, 2), k) and torch.equal(read(v_cache, loc, 2), v)
    assert int(k_cache.count_nonzero()) == k.numel()  # nothing but those three slots was written
    with pytest.raises(KVCacheError, match="token-major buffers"):
        pool.get_key_buffer(3)  # an NZ pool has no [slots, heads, dim] buffer to hand out


def test_nz_pool_refuses_other_forms():
    pool = VllmKVPool(16, torch.float32, "cpu", 32, kv_layout=FRACTAL_NZ)
    token_major = (torch.zeros(4, 16, 2, 32), torch.zeros(4, 16, 2, 32))  # vllm-ascend's A2 pair, not NZ
    with pytest.raises(KVCacheError, match="FRACTAL_NZ"):
        pool.bind(0, token_major)
    with pytest.raises(KVCacheError, match="FRACTAL_NZ"):
        pool.bind(0, torch.zeros(2, 4, 4, 16, 16))  # one stacked tensor, not the pair
    k_cache, v_cache = _nz_pair(4, 2, 16, 32)
    with pytest.raises(KVCacheError, match="FRACTAL_NZ"):
        fractal_nz_views((k_cache, v_cache[:, :2]), 32)  # V of another geometry
    with pytest.raises(KVCacheError, match="block size"):
        VllmKVPool(32, torch.float32, "cpu", 32, kv_layout=FRACTAL_NZ).bind(0, (k_cache, v_cache))


def test_hybrid_blocks_are_read_in_place_as_the_tables_blocks():
    """vllm-ascend's hybrid blocks (``model_runner_v1.py`` L4322-4330 at 182b75e): caches of the backend's first
    kernel block size (128) under a block table of select_common_block_size's (256): token-major slots are the same
    memory, so hal's pool of the table's block size reads them in place; an NZ cache cannot be regrouped."""
    k_cache, v_cache = ascend_pair(4, 2, 128, 32)  # 2 table blocks of 256
    pool = VllmKVPool(256, torch.float32, "cpu", 32)
    pool.bind(0, (k_cache, v_cache))
    k_pages, _ = pool.get_kv_pages(0)
    assert k_pages.shape == (2, 256, 2, 32) and k_pages.data_ptr() == k_cache.data_ptr()
    pool.set_kv_buffer(0, torch.tensor([256 + 130]), torch.ones(1, 2, 32), torch.full((1, 2, 32), 2.0))
    assert torch.equal(k_cache[3, 2], torch.ones(2, 32)) and float(v_cache.sum()) == 2.0 * 64  # block 1's token 130
    pool = VllmKVPool(64, torch.float32, "cpu", 32)  # a table of smaller blocks: vLLM's non-hybrid split
    pool.bind(0, (k_cache, v_cache))
    assert pool.get_kv_pages(0)[0].shape == (8, 64, 2, 32)
    with pytest.raises(KVCacheError, match="block size"):
        VllmKVPool(96, torch.float32, "cpu", 32).bind(0, (k_cache, v_cache))  # neither a divisor nor a multiple
    with pytest.raises(KVCacheError, match="block size"):
        VllmKVPool(256, torch.float32, "cpu", 32, kv_layout=FRACTAL_NZ).bind(0, _nz_pair(4, 2, 128, 32))


def test_the_table_block_size_follows_vllms_rule():
    """vLLM's select_common_block_size for one backend: the manager's size where listed, else the largest listed
    size dividing it; none: refused, naming the sizes."""
    hal_sizes = [128, 16, 32, 64, 256, 512]  # HalAscendAttentionBackend's: upstream's first
    assert common_block_size(256, hal_sizes) == 256 and common_block_size(128, [128]) == 128
    assert common_block_size(256, [128]) == 128  # upstream's own backend: its table counts 128-token blocks
    assert common_block_size(1024, hal_sizes) == 512
    assert common_block_size(96, [types.SimpleNamespace(base=32)]) == 96  # vLLM's MultipleOf(32)
    with pytest.raises(ConfigError, match=r"\[128\]"):
        common_block_size(64, [128])


# ----------------------------------------------------------------------------- with vLLM: the route


@pytest.fixture
def standin(monkeypatch):
    """The stand-in's ``vllm_ascend`` package (installed, or from ci/ on sys.path); skips beside the real one."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (tox -e vllm-engine)")
    if importlib.util.find_spec("vllm_ascend") is None:
        monkeypatch.syspath_prepend(str(STANDIN_SRC))
    import vllm_ascend

    if not hasattr(vllm_ascend, "STANDIN_ENV"):
        pytest.skip("the real vllm-ascend is installed: these tests read its stand-in")
    return vllm_ascend


def _fresh_platform():
    """A subclass of the stand-in's NPUPlatform (install() wraps it, not the stand-in's own class)."""
    from vllm_ascend.platform import NPUPlatform

    return type("NPUPlatform", (NPUPlatform,), {"__module__": __name__})


def _selector(mla=False, sparse=False, attn_type="decoder", **extra):
    return types.SimpleNamespace(use_mla=mla, use_sparse=sparse, attn_type=attn_type, **extra)


@needs_vllm
def test_route_is_opt_in_and_keyed_on_upstreams_answer(standin, monkeypatch):
    from hal.integrations import vllm_ascend as route

    platform = _fresh_platform()
    monkeypatch.delenv("HAL_VLLM", raising=False)
    monkeypatch.delenv("VLLM_ASCEND_STANDIN", raising=False)
    assert not route.install(platform)
    assert platform.get_attn_backend_cls(None, _selector()) == route.UPSTREAM_DENSE  # installed, not asked: upstream's

    monkeypatch.setenv("HAL_VLLM", "1")
    assert route.install(platform) and route.install(platform)  # idempotent
    hal_dense = "hal.integrations.vllm_ascend.HalAscendAttentionBackend"
    assert (
        platform.get_attn_backend_cls("FLASH_ATTN", _selector()) == hal_dense
    )  # selected_backend ignored, as upstream
    assert platform.get_attn_backend_cls(None, _selector(mla=True)) == "vllm_ascend.attention.mla_v1.AscendMLABackend"
    assert platform.get_attn_backend_cls(None, _selector(mla=True, sparse=True)).endswith("AscendSFABackend")
    assert platform.get_attn_backend_cls(None, _selector(mla=True, use_compress=True)).endswith("AscendDSABackend")
    assert platform.get_attn_backend_cls(None, _selector(attn_type="encoder_only")) == route.UPSTREAM_DENSE
    assert platform.get_attn_backend_cls(None, _selector(use_mm_prefix=True)) == route.UPSTREAM_DENSE

    monkeypatch.setenv("VLLM_ASCEND_STANDIN", "310P")
    assert (
        platform.get_attn_backend_cls(None, _selector()) == "hal.integrations.vllm_ascend.HalAscend310PAttentionBackend"
    )
    assert platform.get_attn_backend_cls(None, _selector(mla=True)) == route.UPSTREAM_310P  # upstream's, not hal's

    from vllm.platforms.cpu import CpuPlatform

    assert not route.install(CpuPlatform)  # another platform: nothing wrapped (hal serves CPU_ATTN there)
    assert not hasattr(CpuPlatform.get_attn_backend_cls, "hal_upstream")


@needs_vllm
def test_the_runner_treats_hals_classes_as_upstreams(standin, monkeypatch):
    """install() makes hal's classes virtual subclasses of upstream's: vllm-ascend's runner then corrects its host
    lengths for them under asynchronous speculative decoding (model_runner_v1.py L453-459, L1199-1211), so hal's
    builder reads those instead of the device's seq_lens; its block table counts select_common_block_size's blocks."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from hal.integrations import vllm_ascend as route

    monkeypatch.setenv("HAL_VLLM", "1")
    spec_config = types.SimpleNamespace(num_speculative_tokens=3)
    monkeypatch.setitem(route._STATE, "registered", False)
    assert route.HalAscendMetadataBuilder.reads_device_seq_lens(spec_config)  # not registered: a sync per step
    assert route.install(_fresh_platform())
    for upstream_path, hal_cls in route.HAL_FOR_UPSTREAM.items():
        assert issubclass(hal_cls, resolve_obj_by_qualname(upstream_path))
    assert not route.HalAscendMetadataBuilder.reads_device_seq_lens(spec_config)
    manager = types.SimpleNamespace(block_size=256)
    assert route.HalAscendMetadataBuilder.table_block_size(manager, route.HalAscendAttentionBackend) == 256
    assert route.HalAscendMetadataBuilder.table_block_size(manager, route.HalAscend310PAttentionBackend) == 256


@needs_vllm
def test_hal_answers_upstreams_backend_contract(standin, monkeypatch):
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from hal.integrations.vllm_ascend import HAL_FOR_UPSTREAM

    monkeypatch.setenv("HAL_DEVICE", "npu")
    monkeypatch.setenv("HAL_NPU_EMULATION", "1")
    npu_page_sizes = {16, 32, 64, 128, 256, 512}  # the ascend backend's
    for upstream_path, hal_cls in HAL_FOR_UPSTREAM.items():
        upstream = resolve_obj_by_qualname(upstream_path)
        assert hal_cls.get_name() == upstream.get_name() == "CUSTOM"
        assert AttentionBackendEnum[hal_cls.get_name()] is not None
        assert hal_cls.accept_output_buffer and upstream.accept_output_buffer
        for geometry in ((7, 128, 2, 32), (3, 64, 8, 128), (1, 16, 1, 64)):
            assert hal_cls.get_kv_cache_shape(*geometry) == upstream.get_kv_cache_shape(*geometry), geometry
        sizes = hal_cls.get_supported_kernel_block_sizes()
        upstream_sizes = upstream.get_supported_kernel_block_sizes()
        assert sizes[: len(upstream_sizes)] == upstream_sizes and set(sizes) == npu_page_sizes
    assert (
        HAL_FOR_UPSTREAM["vllm_ascend._310p.attention.attention_v1.AscendAttentionBackend310"].allocated_kv_layout(
            types.SimpleNamespace()
        )
        == FRACTAL_NZ
    )  # vllm-ascend's runner ignores vLLM's layout table


@needs_vllm
def test_standin_runner_pairs_are_hals_pool_memory(standin):
    """The stand-in runner's caches (upstream's allocation over hal's class shapes) bind to hal's pool in place."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_ascend._310p.model_runner_310p import NPUModelRunner310
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    from hal.integrations.vllm_ascend import HalAscend310PAttentionBackend, HalAscendAttentionBackend

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32)
    config = types.SimpleNamespace(num_blocks=3)
    cases = (
        (NPUModelRunner, HalAscendAttentionBackend, TOKEN_MAJOR, (3, 128, 2, 32)),
        (NPUModelRunner310, HalAscend310PAttentionBackend, FRACTAL_NZ, (3, 4, 128, 16)),
    )
    for runner_cls, backend, layout, shape in cases:
        assert backend.allocated_kv_layout(None) == layout
        runner = types.SimpleNamespace(device=torch.device("cpu"), attn_backend=backend)
        runner._attention_layers = lambda _config, backend=backend: [("model.layers.0.self_attn.attn", backend, spec)]
        runner._allocate_kv_cache_tensors = types.MethodType(NPUModelRunner._allocate_kv_cache_tensors, runner)
        runner._reshape_kv_cache_tensors = types.MethodType(NPUModelRunner._reshape_kv_cache_tensors, runner)
        pair = runner_cls._layer_kv_caches(runner, config)["model.layers.0.self_attn.attn"]
        assert isinstance(pair, tuple) and [tuple(t.shape) for t in pair] == [shape, shape], runner_cls
        pool = VllmKVPool(128, torch.float32, "cpu", 32, kv_layout=layout)
        pool.bind(0, pair)
        pages = pool.get_kv_pages(0)
        assert [p.data_ptr() for p in pages] == [t.data_ptr() for t in pair], runner_cls
        pool.set_kv_buffer(0, torch.tensor([130]), torch.ones(1, 2, 32), torch.full((1, 2, 32), 2.0))
        assert int(pair[0].count_nonzero()) == 64 and float(pair[1].sum()) == 128.0  # written into vllm-ascend's pair


@needs_vllm
def test_what_the_route_does_not_serve_is_refused_at_start(standin):
    from hal.integrations.vllm import AttentionCGSupport
    from hal.integrations.vllm_ascend import (
        HalAscendAttentionImpl,
        HalAscendMetadataBuilder,
        refuse_unserved_ascend_features,
    )

    plain = types.SimpleNamespace(quant_config=None, additional_config={})
    refuse_unserved_ascend_features(plain)  # nothing to refuse
    c8 = types.SimpleNamespace(quant_config=types.SimpleNamespace(enable_c8_quant=True), additional_config=None)
    with pytest.raises(UnsupportedError, match="enable_c8_quant"):
        refuse_unserved_ascend_features(c8)
    fa = types.SimpleNamespace(quant_config=types.SimpleNamespace(enable_fa_quant=True), additional_config=None)
    with pytest.raises(UnsupportedError, match="KV-cache quantization"):
        refuse_unserved_ascend_features(fa)
    xlite = types.SimpleNamespace(quant_config=None, additional_config={"xlite_graph_config": {"enabled": True}})
    with pytest.raises(UnsupportedError, match="xlite"):
        refuse_unserved_ascend_features(xlite)
    with pytest.raises(UnsupportedError, match="xlite"):
        HalAscendMetadataBuilder(None, [], xlite, "cpu")  # the builder refuses before selecting
    assert HalAscendMetadataBuilder.get_cudagraph_support(plain, None) == AttentionCGSupport.NEVER
    with pytest.raises(UnsupportedError, match="update_full_graph_params"):
        HalAscendAttentionImpl.update_graph_params(None, None, 1, plain)


# ----------------------------------------------------------------------------- vLLM's engine on the stand-in

SEED = 4321


def _engine_standin_installed() -> bool:
    """Whether the stand-in is installed (vLLM's engine finds platforms through installed entry points only)."""
    try:
        importlib.metadata.distribution("hal-vllm-ascend-standin")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_standin_engine = pytest.mark.skipif(
    not HAS_VLLM or not _engine_standin_installed(),
    reason="vLLM's engine and the installed stand-in (pip install --no-deps -e ci/vllm_ascend_standin; tox -e "
    "vllm-engine)",
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """vLLM's engine on a small Llama (head dim 32) with 128-token blocks (vllm-ascend's), V1 runner, and a workload
    of continuous batching with chunked prefills; ``run(attention, **env)`` gives each configuration's result once."""
    sys.path.insert(0, str(ROOT / "ci"))
    import sglang_model
    import vllm_engine
    import vllm_model

    root = tmp_path_factory.mktemp("ascend")
    model = vllm_model.build_model(str(root / "llama"), "llama", seed=SEED)
    rng = random.Random(SEED)
    low = len(sglang_model.SPECIALS)
    prompts = [[rng.randrange(low, vllm_model.VOCAB) for _ in range(n)] for n in (1, 9, 70, 200, 140)]
    workload = [[{"prompt_token_ids": p, "max_tokens": 6 + 2 * i} for i, p in enumerate(prompts)]]
    args = {"block_size": 128}
    runs = {}

    def run(attention: str, **env) -> dict:
        key = (attention, tuple(sorted(env.items())))
        if key not in runs:
            env = {"VLLM_USE_V2_MODEL_RUNNER": "0", **env}
            runs[key] = vllm_engine.run_in_subprocess(model, attention, workload, str(root), args, env=env)
        return runs[key]

    return types.SimpleNamespace(run=run, workload=workload)


def _tokens(run: dict) -> list[list[int]]:
    return [r["output_ids"] for r in run["results"]]


@needs_standin_engine
@pytest.mark.parametrize("chip, emulation, cache", [("A2", "1", "token-major"), ("310P", "310P", "FRACTAL_NZ")])
def test_vllm_ascend_engine_on_hals_emulated_npu_equals_cpu_attn(engine, chip, emulation, cache):
    reference = engine.run("CPU_ATTN")
    served = engine.run("hal", VLLM_ASCEND_STANDIN=chip, HAL_DEVICE="npu", HAL_NPU_EMULATION=emulation)
    log = served["log"]
    assert "on vllm-ascend's platform (vllm_ascend.platform.NPUPlatform)" in log, log[-3000:]
    assert "hal device npu, backend ascend" in log, log[-3000:]
    assert "vllm-ascend's platform" not in reference["log"]  # the reference is vLLM's plain CPU engine
    want = [r["max_tokens"] for r in engine.workload[0]]
    assert [len(t) for t in _tokens(served)] == want
    assert _tokens(served) == _tokens(reference), f"{chip} ({cache} caches) vs CPU_ATTN"
