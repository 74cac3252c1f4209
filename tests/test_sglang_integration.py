"""``hal.integrations.sglang``: hal's backends under SGLang's own objects.

The first tests run everywhere (SGLang absent: a clear hal error; nothing else in hal
imports SGLang). The rest need SGLang (``tox -e sglang``) and drive hal through SGLang's
real ``ModelRunner`` mock, ``ForwardBatch``, ``RadixAttention``, ``ReqToTokenPool`` and
``MHATokenToKVPool`` from its attention kit; SGLang's whole kit runs in ``ci/sglang_kit.py``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import hal

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)


def test_import_without_sglang_is_a_hal_error():
    done = _python(
        "import sys; sys.modules['sglang'] = None\n"  # as if SGLang were not installed
        "from hal.errors import MissingDependencyError\n"
        "try:\n"
        "    import hal.integrations.sglang\n"
        "except MissingDependencyError as exc:\n"
        "    assert isinstance(exc, ImportError), exc\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "needs SGLang" in done.stdout and "docs/sglang.md" in done.stdout


def test_the_rest_of_hal_never_imports_sglang():
    done = _python(
        "import sys, pkgutil, importlib; sys.modules['sglang'] = None\n"
        "import hal, hal.devices, hal.kernels\n"
        "names = [m.name for pkg in (hal, hal.devices, hal.kernels)\n"
        "         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.') if '.integrations.' not in m.name]\n"
        "for name in names:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as exc:  # an optional library (triton) this env lacks is fine\n"
        "        if (exc.name or '').split('.')[0] == 'sglang':\n"
        "            raise\n"
        "print(len(names))\n"
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 30
    for path in [*ROOT.glob("hal/**/*.py"), *ROOT.glob("devices/**/*.py"), *ROOT.glob("kernels/**/*.py")]:
        if "integrations" not in path.parts:
            assert "import sglang" not in path.read_text() and "from sglang" not in path.read_text(), path


@pytest.mark.parametrize("backend_name", ["torch", "ascend"])
def test_metadata_is_exposed_under_sglangs_names(monkeypatch, backend_name):
    """SGLang's kit and tools read ``forward_metadata.kv_indptr`` / ``kv_indices``: every key's slot, CSR."""
    from hal.batch import ForwardMode
    from hal.conformance.cases import Case, build
    from hal.selection import select

    monkeypatch.setenv("HAL_NPU_EMULATION", "1")
    case = Case("names", ForwardMode.EXTEND, ((0, 20), (14, 5), (40, 1)), page_size=16)
    built = build(case)
    config = hal.AttentionConfig(tp_q_head_num=4, tp_k_head_num=2, head_dim=64, dtype=torch.float32, page_size=16)
    backend = select(config, device="npu" if backend_name == "ascend" else "cpu", backend=backend_name).create()
    backend.init_forward_metadata(built.batch)
    meta = backend.forward_metadata
    kv = [p + n for p, n in case.requests]
    assert meta.kv_indptr.tolist() == [0, *itertools.accumulate(kv)]
    table, rows = built.batch.req_to_token_pool.req_to_token, built.batch.req_pool_indices.tolist()
    assert meta.kv_indices.tolist() == [s for r, n in zip(rows, kv) for s in table[r, :n].tolist()]


def test_flashinfer_metadata_is_exposed_under_sglangs_names_too():
    from hal.devices.cuda.flashinfer_backend import FlashInferMetadata

    table = torch.arange(4 * 8, dtype=torch.int32).view(4, 8) + 100
    meta = FlashInferMetadata(
        mode=hal.ForwardMode.DECODE,
        batch_size=2,
        num_tokens=2,
        dtype=torch.float32,
        page_size=1,
        graph_static=False,
        qo_indptr=torch.tensor([0, 1, 2], dtype=torch.int32),
        kv_lens=[3, 5],
        prefix_lens=[2, 4],
        req_to_token=table,
        req_pool_indices=torch.tensor([2, 1]),
    )
    assert meta.kv_indptr.tolist() == [0, 3, 8]
    assert meta.kv_indices.tolist() == table[2, :3].tolist() + table[1, :5].tolist()


# ----------------------------------------------------------------------------- under SGLang (tox -e sglang)


@pytest.fixture(scope="module")
def kit():
    """SGLang's dense-attention kit with hal registered as ``hal`` (skips where SGLang is not installed)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (tox -e sglang installs it)")
    sys.path.insert(0, str(ROOT / "ci"))
    try:
        import sglang_kit
    finally:
        sys.path.remove(str(ROOT / "ci"))
    sglang_kit.set_environment(sglang_kit.parse_args([]))  # stand-ins for torchvision & co when missing
    k = sglang_kit.Kit()
    import hal.integrations.sglang as hal_sglang

    hal_sglang.register("hal")
    sglang_kit.register_backend(k, "hal", "hal")
    k.module = sglang_kit
    return k


def _kit_case(cls, kit, mode_name, prefix, extend, page_size=16, **fields):
    """A case of one of the kit's attention methods (``cls``: its case class), 4 query heads, named for hal."""
    mode = getattr(kit.ForwardMode, mode_name)
    common = dict(name="t", backend="hal", forward_mode=mode, num_heads=4, page_size=page_size)
    return cls(prefix_lens=prefix, extend_lens=extend, **common, **fields)


def _fixture(kit, mode_name="DECODE", prefix=(14, 15, 16), extend=(), page_size=16, window=None, **kw):
    d = kit.dense
    fields = dict(num_kv_heads=2, sliding_window_size=window)
    case = _kit_case(d.DenseAttentionCase, kit, mode_name, prefix, extend, page_size, **fields)
    with torch.no_grad():  # the prefix KV goes in as SGLang's runner writes it: no autograd
        return d.build_dense_attention_fixture(kit.module._TestCase(), case, dtype=torch.float32, device="cpu", **kw)


def test_register_puts_hal_in_sglangs_registry_and_choices(kit):
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    import hal.integrations.sglang as hal_sglang

    hal_sglang.sglang_plugin()
    for name in ("hal", "hal_torch", "hal_triton", "hal_ascend", "hal_flashinfer"):
        assert name in ATTENTION_BACKENDS and name in ATTENTION_BACKEND_CHOICES, name
    (entry,) = [e for e in importlib.metadata.entry_points(group="sglang.srt.plugins") if e.name == "hal"]
    assert entry.value == "hal.integrations.sglang:sglang_plugin"
    with pytest.raises(hal.ConfigError):
        hal_sglang.register("")


def test_the_backend_is_sglangs_and_serves_its_runner_pools_in_place(kit):
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend as SGLangBackend

    fx = _fixture(kit, window=4)
    backend, runner = fx.backend, fx.runner
    assert isinstance(backend, SGLangBackend) and backend.swa_decode_rule == "extend_window"
    assert backend.selection.device == "cpu" and backend.selection.backend == "torch"
    config = backend.config
    assert (config.tp_q_head_num, config.tp_k_head_num, config.head_dim, config.page_size) == (4, 2, 16, 16)
    assert (config.sliding_window_size, config.max_context_len, config.max_batch_size) == (4, 64, 3)
    assert backend.token_to_kv_pool is runner.token_to_kv_pool
    assert backend.req_to_token_pool is runner.req_to_token_pool
    k_buffer = runner.token_to_kv_pool.get_key_buffer(0)
    pointer = k_buffer.data_ptr()
    out = kit.dense.run_dense_fixture_eager(fx)
    torch.testing.assert_close(out, kit.dense.expected_dense_fixture_output(fx), atol=1e-5, rtol=1e-5)
    assert runner.token_to_kv_pool.get_key_buffer(0).data_ptr() == pointer  # written in place, never copied
    _, k, _ = fx.actual_module.project_qkv(fx.input_hidden)
    loc = fx.forward_batch.out_cache_loc
    torch.testing.assert_close(k_buffer[loc], k.view(-1, 2, 16))


@torch.no_grad()
def test_sglangs_production_graph_padding_replays_correctly(kit):
    """A decode step replayed at a captured batch of 4 with SGLang's padding rows: request 0, seq_len =
    the fill value, slot 0. The real rows match the eager step."""
    import types

    fx = _fixture(kit, prefix=(14, 15, 16), runner_batch_size=4)
    backend, fb = fx.backend, fx.forward_batch
    q, k, v = fx.actual_module.project_qkv(fx.input_hidden)
    layer = fx.actual_module.attn
    backend.init_forward_metadata(fb)
    eager = backend.forward(q, k, v, layer, fb)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    padded = types.SimpleNamespace(
        forward_mode=fb.forward_mode,
        batch_size=4,
        req_pool_indices=torch.cat([fb.req_pool_indices.long(), torch.zeros(1, dtype=torch.long)]),
        seq_lens=torch.cat([fb.seq_lens.long(), torch.full((1,), fill)]),
        seq_lens_cpu=torch.cat([fb.seq_lens_cpu.long(), torch.full((1,), fill)]),
        seq_lens_sum=fb.seq_lens_sum + fill,
        out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(1, dtype=fb.out_cache_loc.dtype)]),
        positions=None,
        spec_info=None,
        encoder_lens=None,
    )
    backend.init_cuda_graph_state(4, 4)
    backend.init_forward_metadata_out_graph(padded, in_capture=True)
    backend.init_forward_metadata_in_graph(padded)
    pad = lambda t: torch.cat([t, torch.zeros_like(t[:1])])  # noqa: E731
    backend.forward(pad(q), pad(k), pad(v), layer, padded)  # capture (warm-up)
    # SGLang's replay view (build_replay_fb_view) keeps the live batch's unpadded out_cache_loc
    replay = types.SimpleNamespace(**{**vars(padded), "out_cache_loc": fb.out_cache_loc})
    backend.init_forward_metadata_out_graph(replay)  # replay
    backend.init_forward_metadata_in_graph(replay)
    replayed = backend.forward(pad(q), pad(k), pad(v), layer, padded)
    torch.testing.assert_close(replayed[:3], eager, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_what_hal_does_not_compute_is_refused_with_a_hal_error(kit):
    import types

    fx = _fixture(kit)
    backend, fb = fx.backend, fx.forward_batch
    q, k, v = fx.actual_module.project_qkv(fx.input_hidden)
    backend.init_forward_metadata(fb)
    for refused, why in (("PREBUILT", "never runs a model forward"), ("DLLM_EXTEND", "bidirectionally")):
        batch = types.SimpleNamespace(forward_mode=getattr(kit.ForwardMode, refused), batch_size=3)
        with pytest.raises(hal.UnsupportedError, match=f"{refused}.*{why}"):
            backend.init_forward_metadata(batch)
    runner = fx.runner
    pool = runner.token_to_kv_pool
    scaled = types.SimpleNamespace(**vars(pool), get_key_buffer=pool.get_key_buffer)
    scaled.is_quantized_kv_cache = True  # SGLang's FP4 / MXFP8 pools: per-block scales beside the values
    import hal.integrations.sglang as hal_sglang

    with pytest.raises(hal.UnsupportedError, match="per-block scales"):
        hal_sglang.HalAttnBackend(types.SimpleNamespace(**{**vars(runner), "token_to_kv_pool": scaled}))


def _fp8_fixture(kit, fp8_dtype, k_scale, v_scale, cpu_quant_method=False, **kw):
    """A dense fixture whose runner holds SGLang's own fp8 ``MHATokenToKVPool`` (``dtype`` float8, stored as
    uint8), its prefix written by SGLang's ``set_kv_buffer`` with the layer's scales, and the layer carrying
    them as SGLang's fp8 KV quant method sets them (``k_scale`` / ``v_scale`` tensors, ``*_scale_float``).
    ``cpu_quant_method``: the pool SGLang's CPU engine builds for fp8_e4m3 instead (its quant method
    ``cpu_fp8_e4m3``: float8 buffers, stored as float8, no scale buffers; kv_cache_configurator.py
    ``_build_mha_quant_method``)."""
    import types

    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import get_kv_cache_quant_method
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    extra = {"quant_method": get_kv_cache_quant_method("cpu_fp8_e4m3")} if cpu_quant_method else {}
    fx = _fixture(kit, **kw)
    src, layer = fx.runner.token_to_kv_pool, fx.actual_module.attn
    layer.k_scale, layer.v_scale = torch.tensor(k_scale), torch.tensor(v_scale)
    layer.k_scale_float, layer.v_scale_float = k_scale, v_scale
    pool = MHATokenToKVPool(
        size=src.size,
        page_size=src.page_size,
        dtype=fp8_dtype,
        head_num=src.head_num,
        head_dim=src.head_dim,
        layer_num=src.layer_num,
        device="cpu",
        enable_memory_saver=False,
        **extra,
    )
    assert pool.store_dtype == (fp8_dtype if cpu_quant_method else torch.uint8)
    assert pool.get_key_buffer(0).dtype == fp8_dtype and pool.is_quantized_kv_cache == cpu_quant_method
    with torch.no_grad():  # the prefix: every slot the fp32 pool holds, quantised by SGLang
        used = torch.nonzero(src.get_key_buffer(0).abs().sum((1, 2))).flatten()
        k, v = src.get_key_buffer(0)[used].clone(), src.get_value_buffer(0)[used].clone()
        pool.set_kv_buffer(layer, used, k, v, layer.k_scale, layer.v_scale)
    runner = types.SimpleNamespace(**{**vars(fx.runner), "token_to_kv_pool": pool, "dtype": torch.float32})
    return fx, runner, pool, layer


@torch.no_grad()
@pytest.mark.parametrize("fp8_name", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3-cpu"])
def test_sglangs_fp8_kv_pool_is_served_with_the_layers_scales(kit, fp8_name):
    """``--kv-cache-dtype fp8_*``: hal's torch backend reads and writes SGLang's fp8 pool in place, quantising the
    new tokens exactly as SGLang's ``set_kv_buffer`` does with the layer's ``k_scale`` / ``v_scale``, and
    its output is hal's fp8 reference (``batch_attention`` over those fp8 entries). ``-cpu``: the pool SGLang's
    CPU engine builds (quant method ``cpu_fp8_e4m3``; its writes are that method's ``quantize_and_store``)."""
    import hal.integrations.sglang as hal_sglang
    from hal.kernels.reference import batch_attention
    from hal.kv_dtypes import KV_STORAGE_DTYPES

    fp8 = KV_STORAGE_DTYPES[fp8_name.removesuffix("-cpu")]
    fx, runner, pool, layer = _fp8_fixture(
        kit, fp8, 0.05, 0.08, fp8_name.endswith("-cpu"), mode_name="EXTEND", prefix=(3, 17), extend=(5, 2)
    )
    backend = hal_sglang.HalAttnBackend(runner)
    assert backend.config.kv_cache_dtype == fp8_name.removesuffix("-cpu") and backend.config.dtype == torch.float32
    fb = fx.forward_batch
    q, k, v = fx.actual_module.project_qkv(fx.input_hidden)
    twin = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)
    # what SGLang's own pool writes for these tokens with these scales, byte for byte
    loc = fb.out_cache_loc
    pool.k_buffer[0], written_k = twin[0], pool.k_buffer[0].clone()
    pool.v_buffer[0], written_v = twin[1], pool.v_buffer[0].clone()
    pool.set_kv_buffer(layer, loc, k.view(-1, 2, 16).clone(), v.view(-1, 2, 16).clone(), layer.k_scale, layer.v_scale)
    assert torch.equal(written_k, pool.k_buffer[0]) and torch.equal(written_v, pool.v_buffer[0])
    described = backend.hal_layer(layer)  # hal's descriptor carries SGLang's scales
    assert (described.k_scale, described.v_scale) == (0.05, 0.08)
    expected = batch_attention(q, pool.get_key_buffer(0), pool.get_value_buffer(0), described, backend.hal_batch(fb))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_an_fp8_pool_with_scales_beside_its_values_is_refused(kit):
    """SGLang's MXFP8 pool stores float8 values *and* per-block scale buffers: served as the per-tensor fp8 pool it
    would be read wrong, so it is refused; the same pool without the scale buffers (the CPU engine's
    ``cpu_fp8_e4m3``) is served."""
    import types

    import hal.integrations.sglang as hal_sglang

    _, runner, pool, _ = _fp8_fixture(kit, torch.float8_e4m3fn, 1.0, 1.0, cpu_quant_method=True)
    hal_sglang.HalAttnBackend(runner)
    blocked = types.SimpleNamespace(**vars(pool), get_key_buffer=pool.get_key_buffer, is_quantized_kv_cache=True)
    blocked.k_scale_buffer = [torch.ones(pool.size, 1)]
    with pytest.raises(hal.UnsupportedError, match="per-block scales"):
        hal_sglang.HalAttnBackend(types.SimpleNamespace(**{**vars(runner), "token_to_kv_pool": blocked}))


def test_sglangs_fp8_kv_pool_is_refused_with_the_reason_where_a_backend_has_no_fp8(kit, monkeypatch):
    """The ascend backend declares no fp8 KV (its kv_cache_dtypes): SGLang's fp8 pool is refused when SGLang
    builds the backend, with that backend's reason."""
    import hal.integrations.sglang as hal_sglang

    monkeypatch.setenv("HAL_NPU_EMULATION", "1")
    monkeypatch.setenv("HAL_DEVICE", "npu")
    monkeypatch.setenv("HAL_ATTENTION_BACKEND", "ascend")
    _, runner, _, _ = _fp8_fixture(kit, torch.float8_e4m3fn, 1.0, 1.0)
    with pytest.raises(hal.NoBackendError, match="fp8_e4m3"):
        hal_sglang.HalAttnBackend(runner)


def _mla_fixture(kit, prefix=(0, 0), extend=(5, 3), rope=0):
    m = kit.mla
    case = _kit_case(m.MLAAttentionCase, kit, "EXTEND", prefix, extend)
    test = kit.module._TestCase()
    with torch.no_grad():
        return m.build_mla_attention_fixture(test, case, dtype=torch.float32, device="cpu", qk_rope_head_dim=rope)


@torch.no_grad()
def test_sglangs_mla_pool_is_served_in_place(kit):
    """SGLang's ``MLATokenToKVPool`` (one latent buffer per layer, the value its view) is hal's MLA cache."""
    fx = _mla_fixture(kit, prefix=(5, 17), extend=(3, 2))
    backend, pool, m = fx.backend, fx.runner.token_to_kv_pool, kit.mla
    assert type(pool).__name__ == "MLATokenToKVPool" and backend.token_to_kv_pool is pool
    config = backend.config
    assert config.is_mla and (config.tp_k_head_num, config.head_dim, config.v_head_dim) == (1, 32, 32)
    assert backend.hal_layer(fx.actual_module.attn_mqa).is_mla
    # SGLang's DeepSeek models pick their attention method by backend name: hal's names take the latent path
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    assert AttentionBackendRegistry.get_handler("hal")(None, fx.forward_batch) == AttnForwardMethod.MLA
    pointer = pool.kv_buffer[0].data_ptr()
    out = m.run_mla_fixture_eager(fx)  # the kit writes the latent; hal reads it with save_kv_cache=False
    torch.testing.assert_close(out, m.expected_mla_fixture_output(fx), atol=1e-5, rtol=1e-5)
    assert pool.kv_buffer[0].data_ptr() == pointer


@torch.no_grad()
def test_hal_writes_the_latent_and_rope_rows_of_sglangs_mla_pool(kit):
    """As DeepSeek's absorbed path calls it (``attn_mqa(q, k, k_nope)``, hal saving the KV): the row written
    is latent ++ rope, in SGLang's buffer; the output matches the kit's reference. No prefix: the kit would
    write one with SGLang's Triton ``set_mla_kv_buffer``."""
    fx = _mla_fixture(kit, rope=16)
    backend, pool, module, fb = fx.backend, fx.runner.token_to_kv_pool, fx.actual_module, fx.forward_batch
    assert (backend.config.head_dim, backend.config.v_head_dim, backend.config.qk_rope_head_dim) == (48, 32, 16)
    q_nope, k_nope, q_rope, k_rope = module.forward_absorb_prepare(fx.input_hidden)
    q, k = torch.cat([q_nope, q_rope], dim=-1), torch.cat([k_nope, k_rope], dim=-1)
    backend.init_forward_metadata(fb)
    out = backend.forward(q.flatten(1, 2), k, k_nope, module.attn_mqa, fb)
    torch.testing.assert_close(pool.kv_buffer[0][fb.out_cache_loc], k)
    latent = torch.bmm(out.view(-1, 4, 32).transpose(0, 1), module.w_vc).transpose(0, 1)
    expected = kit.mla.expected_mla_fixture_output(fx)
    torch.testing.assert_close(module.o_proj(latent.flatten(1, 2)), expected, atol=1e-5, rtol=1e-5)


def test_mla_pools_hal_does_not_describe_are_refused(kit):
    import types

    import hal.integrations.sglang as hal_sglang

    rows = types.SimpleNamespace(kv_lora_rank=32, qk_rope_head_dim=16, get_key_buffer=lambda i: torch.zeros(4, 1, 48))
    assert hal_sglang.mla_dims(rows) == (32, 16)
    assert hal_sglang.mla_dims(types.SimpleNamespace()) is None
    with pytest.raises(hal.UnsupportedError, match="DSA"):
        hal_sglang.mla_dims(types.SimpleNamespace(**{**vars(rows), "use_dsa": True}))
    packed = types.SimpleNamespace(**{**vars(rows), "get_key_buffer": lambda i: torch.zeros(4, 1, 29)})
    with pytest.raises(hal.UnsupportedError, match="rows of 29"):
        hal_sglang.mla_dims(packed)
    from test_npu_sglang_pool import NPUMLATokenToKVPool  # SGLang's NPU MLA pool: latent and rope apart

    assert hal_sglang.mla_dims(NPUMLATokenToKVPool(32, 16, 512, 64)) == (512, 64)


@torch.no_grad()
def test_sinks_reach_hals_backend_and_are_refused_where_it_has_none(kit, monkeypatch):
    """gpt-oss's ``sinks=`` (RadixAttention passes it through) is computed by hal's torch backend and refused,
    with a hal error, by one that declares no sinks (ascend)."""
    fx = _fixture(kit, window=4)
    q, k, v = fx.actual_module.project_qkv(fx.input_hidden)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    fx.backend.init_forward_metadata(fx.forward_batch)
    with forward_context(ForwardContext(attn_backend=fx.backend)):
        out = fx.actual_module.attn(q, k, v, fx.forward_batch, sinks=sinks)
    expected = kit.module.sinks_reference(kit, fx, sinks).float()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("HAL_NPU_EMULATION", "1")
    monkeypatch.setenv("HAL_DEVICE", "npu")
    monkeypatch.setenv("HAL_ATTENTION_BACKEND", "ascend")
    fx = _fixture(kit)
    assert fx.backend.selection.backend == "ascend" and not fx.backend.config.attention_sinks
    q, k, v = fx.actual_module.project_qkv(fx.input_hidden)
    fx.backend.init_forward_metadata(fx.forward_batch)
    with pytest.raises(hal.UnsupportedError, match="sinks"):
        fx.backend.forward(q, k, v, fx.actual_module.attn, fx.forward_batch, sinks=sinks)


@torch.no_grad()
@pytest.mark.parametrize("mode_name", ["MIXED", "DRAFT_EXTEND_V2", "SPLIT_PREFILL"])
def test_sglangs_other_extend_modes_route_as_hal_defines_them(kit, mode_name):
    """MIXED (chunked prefills with decodes), SGLang's DRAFT_EXTEND_V2 (hal's DRAFT_EXTEND) and
    SPLIT_PREFILL (PD multiplexing's layer-sliced prefill: an extend per layer)."""
    fx = _fixture(kit, mode_name, prefix=(0, 15, 33), extend=(20, 1, 3))
    out = kit.dense.run_dense_fixture_eager(fx)
    torch.testing.assert_close(out, kit.dense.expected_dense_fixture_output(fx), atol=1e-5, rtol=1e-5)
    assert fx.backend.hal_batch(fx.forward_batch).forward_mode.name == (
        "DRAFT_EXTEND" if mode_name == "DRAFT_EXTEND_V2" else mode_name
    )


def test_cross_attention_layers_are_refused(kit):
    from sglang.srt.layers.radix_attention import RadixAttention

    import hal.integrations.sglang as hal_sglang

    layer = RadixAttention(4, 16, 0.25, 2, layer_id=0, is_cross_attention=True)
    with pytest.raises(hal.UnsupportedError, match="cross attention"):
        hal_sglang.hal_layer(layer)


def test_the_config_takes_each_layers_window_and_cap_from_the_models_radix_attention(kit):
    import types

    from sglang.srt.layers.radix_attention import RadixAttention

    import hal.integrations.sglang as hal_sglang

    runner = _fixture(kit).runner
    model = torch.nn.ModuleList(
        [
            RadixAttention(4, 16, 0.25, 2, layer_id=0, sliding_window_size=8),
            RadixAttention(4, 16, 0.25, 2, layer_id=1, logit_cap=30.0),
        ]
    )
    config = hal_sglang.attention_config(types.SimpleNamespace(**{**vars(runner), "model": model}))
    assert [x.sliding_window_size for x in config.layers] == [8, -1]
    assert (config.sliding_window_size, config.logit_cap, config.layer_num) == (8, 30.0, 2)


# ----------------------------------------------------------------------------- SGLang 0.5.21's base class


def test_hal_follows_sglangs_base_class_member_for_member(kit):
    """Every public member of the installed SGLang's ``AttentionBackend`` is on hal's base class (the seed's members)
    plus the SGLang members mixin (later releases') and on ``HalAttnBackend``, with the same kind (method / property /
    attribute), and the older members stay."""
    import inspect

    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend as SGLangBackend

    import hal.integrations.sglang as hal_sglang

    def kind(cls, name):
        raw = inspect.getattr_static(cls, name)
        return "method" if callable(raw) and not isinstance(raw, type) else "data"  # a property reads as data

    from hal.integrations.sglang_members import SGLangMembers

    members = [n for n in vars(SGLangBackend) if not n.startswith("_")]
    assert {"verify_mask", "shared_read_ends", "validate_elastic_cuda_graph_recapture"} <= set(members)

    class WithMembers(SGLangMembers, hal.AttentionBackend):  # the core plus the integration's mixin (issue 23)
        pass

    # the core with its SGLang mixin has every member but the newest release's, which the integration answers
    core = [n for n in members if n not in hal_sglang.SGLANG_0523_MEMBERS]
    for cls, names in ((WithMembers, core), (hal_sglang.HalAttnBackend, members)):
        missing = [n for n in names if not hasattr(cls, n)]
        assert not missing, (cls, missing)
        wrong = [(n, kind(SGLangBackend, n), kind(cls, n)) for n in names if kind(SGLangBackend, n) != kind(cls, n)]
        assert not wrong, (cls, wrong)
    # the integration answers them itself: none is left to SGLang's base class
    own = {n for klass in hal_sglang.HalAttnBackend.__mro__ if klass is not SGLangBackend for n in vars(klass)}
    assert not set(hal_sglang.SGLANG_0523_MEMBERS) - own
    for cls in (hal.AttentionBackend, hal_sglang.HalAttnBackend):
        for older in (
            "get_verify_buffers_to_fill_after_draft",
            "init_forward_metadata_for_breakable_cuda_graph_capture",
        ):
            assert hasattr(cls, older), (cls, older)


def test_the_0521_questions_are_answered_by_hals_backend(kit):
    from sglang.srt.layers.attention.base_attn_backend import SharedReadEnds

    fx = _fixture(kit)
    backend, fb = fx.backend, fx.forward_batch
    for mode in (kit.ForwardMode.DECODE, kit.ForwardMode.EXTEND, kit.ForwardMode.TARGET_VERIFY):
        assert backend.shared_read_ends(mode) is SharedReadEnds.UNKNOWN  # hal's forward reads req_to_token again
    assert backend.verify_mask is None and backend.get_verify_buffers_to_fill_after_draft() == [None, None]
    assert backend.draft_extend_metadata_captured_in_graph() is False
    for name in (
        "supports_draft_extend_metadata_staging",
        "supports_full_cuda_graph_chunked_prefix",
        "supports_prefill_cuda_graph_max_context_size",
        "extend_dummy_seqs_capped_by_req_pool",
    ):
        assert getattr(backend, name) is False, name
    backend.init_forward_metadata(fb)
    backend.prepare_prefill_shared_read_snapshot(fb, num_qo_tokens=3)  # a no-op: nothing declared PRE_REPLAY
    backend.validate_elastic_cuda_graph_recapture()  # the torch backend captures graphs
    with pytest.raises(hal.UnsupportedError, match="chunked-prefix"):
        backend.prepare_full_cuda_graph_chunked_prefix(fb, in_capture=True)
    assert backend.data_type == torch.float32 and backend.kv_cache_dtype == torch.float32


def test_the_0523_questions_are_answered_by_the_integration(kit):
    """SGLang 0.5.23's runners ask these (answered on every release: an older SGLang never asks)."""
    fx = _fixture(kit, mode_name="EXTEND", prefix=(0, 5), extend=(4, 3))
    backend, fb = fx.backend, fx.forward_batch
    assert backend.folds_encoder_swa_replay is False and backend.skips_prefill_metadata_on_idle_dp_rank is False
    assert backend.prefill_cuda_graph_max_batch_size is None and backend.prefill_cuda_graph_default_max_seq_len is None
    assert backend.dllm_attention is None and backend.late_layer_num_tokens(fb) is None
    assert backend.get_fused_kv_write_buffers(fx.actual_module.attn, fb) is None  # hal writes the KV in forward
    for why in (backend.glue_target_verify_metadata(), backend.glue_draft_metadata()):
        assert isinstance(why, str) and "host" in why  # a reason: SGLang logs it and keeps the prep eager
    backend.init_forward_metadata(fb)
    ends = backend.resolve_prefill_shared_read_ends(fb, num_qo_tokens=7)
    assert ends is backend.shared_read_ends(fb.forward_mode) and ends.name == "UNKNOWN"
    assert backend.resolve_prefill_shared_read_ends(fb, num_qo_tokens=7, build_snapshot=False).name == "UNKNOWN"
    out = kit.dense.run_dense_fixture_eager(fx)  # and the step still computes
    torch.testing.assert_close(out, kit.dense.expected_dense_fixture_output(fx), atol=1e-5, rtol=1e-5)


def test_hal_refuses_sglangs_unserved_modes_on_its_own_batches_too():
    assert hal.ForwardMode.DRAFT_EXTEND_V2 is hal.ForwardMode.DRAFT_EXTEND
    assert hal.ForwardMode.SPLIT_PREFILL.is_extend() and hal.ForwardMode.SPLIT_PREFILL.refusal() is None
    for name in ("PREBUILT", "DLLM_EXTEND"):
        assert not getattr(hal.ForwardMode, name).is_extend() and getattr(hal.ForwardMode, name).refusal()


# ----------------------------------------------------------------------------- SGLang's name-based decisions


def test_sglangs_support_triton_follows_the_hal_backend_built_under_the_name(kit):
    """SGLang's ``support_triton(name)`` (read by name in forward_batch_info, allocation and mrope) is
    hal's answer for hal's names once the plugin's hooks are applied, as SGLang's plugin loader does."""
    from sglang.srt.model_executor import forward_batch_info
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.utils import common

    import hal.integrations.sglang as hal_sglang

    # SGLang's own answers for its own names (0.5.23 also asks the platform: no Triton on the CPU platform)
    own = {name: common.support_triton(name) for name in ("triton", "torch_native")}
    hal_sglang.sglang_plugin()
    HookRegistry.apply_hooks()
    for module in (common, forward_batch_info):
        assert {name: module.support_triton(name) for name in own} == own and not own["torch_native"]
    factory = hal_sglang.register("hal_gating_test")
    assert common.support_triton("hal_gating_test") is False  # nothing built under the name yet
    built = factory(_fixture(kit).runner)
    assert built.support_triton() is False  # hal's torch backend on the CPU: no compiled Triton target
    assert forward_batch_info.support_triton("hal_gating_test") is False
    # SGLang's position helper takes its torch path for hal, where its Triton kernel has no CPU driver
    positions, start = forward_batch_info.compute_position(
        "hal_gating_test", torch.tensor([0, 5]), torch.tensor([3, 2]), 5
    )
    assert positions.tolist() == [0, 1, 2, 5, 6] and start.tolist() == [0, 3]
    # SGLang's paged allocation asks get_last_loc, which chooses Triton unless a half is *named* ascend or
    # torch_native: with a hal half it follows hal's answer
    from sglang.srt import runtime_context
    from sglang.srt.mem_cache import allocation

    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    original = runtime_context.attention_backends
    runtime_context.attention_backends = lambda: ("hal_gating_test", "hal_gating_test")
    try:
        last = allocation.get_last_loc(table, torch.tensor([2, 0, 3]), torch.tensor([3, 0, 10]))
    finally:
        runtime_context.attention_backends = original
    assert last.tolist() == [22, -1, 39]
    built.support_triton = lambda: True  # a hal backend that allows Triton (e.g. on CUDA) is believed
    assert common.support_triton("hal_gating_test") is True
