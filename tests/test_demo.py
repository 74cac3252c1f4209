"""``hal demo``: the page allocator, the serving loop, the HF check, tensor parallelism, bad input."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import hal
from hal.commands.cli import main
from hal.demo import add_arguments
from hal.demo.engine import Request
from hal.demo.serve import _shape, build, make_requests
from hal.demo.tp import RankInfo
from hal.errors import KVCacheError

pytestmark = pytest.mark.usefixtures("cpu_only")

# A model small enough that every test here runs in a few seconds on two cores.
TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "128"]


def demo_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*TINY, *extra])


def serve(*extra: str, record_logits: bool = False):
    args = demo_args(*extra)
    selection, engine = build(args, _shape(args), RankInfo(), record_logits)
    requests = make_requests(args)
    for r in requests:
        engine.submit(r)
    with torch.inference_mode():
        engine.run()
    return args, engine, requests


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HAL_") and k != "TRITON_INTERPRET"}
    environ["HAL_PLUGINS"] = "cpu,npu"
    return subprocess.run(
        [sys.executable, "-m", "hal.commands.cli", "demo", *TINY, *args],
        capture_output=True,
        text=True,
        env={**environ, **(env or {})},
        timeout=1800,  # a hang guard only
    )


# -- the page allocator --------------------------------------------------------------------


def test_allocator_hands_out_lowest_pages_never_page_0_and_takes_them_back():
    alloc = hal.PageAllocator(num_pages=4, page_size=16)
    assert alloc.alloc(3) == [1, 2, 3]
    alloc.free([2])
    assert alloc.alloc(2) == [2, 4]
    assert alloc.num_free == 0 and alloc.num_used == 4
    alloc.free([1, 2, 3, 4])
    assert alloc.num_free == 4 and alloc.num_used == 0


def test_allocator_slots_put_token_i_at_offset_i_mod_page_size():
    alloc = hal.PageAllocator(num_pages=8, page_size=4)
    pages = [5, 2, 7]
    assert alloc.slots(pages, 0, 10).tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    assert alloc.slots(pages, 6, 9).tolist() == [10, 11, 28]
    assert alloc.slots(pages, 3, 3).tolist() == []
    assert alloc.pages_for(0) == 0 and alloc.pages_for(4) == 1 and alloc.pages_for(5) == 2


def test_allocator_covers_a_pool_but_its_padding_page():
    pool = hal.PagedKVPool(num_pages=6, page_size=16, layer_num=1, head_num=1, head_dim=8)
    alloc = hal.PageAllocator.for_pool(pool)
    assert alloc.num_pages == 6
    pages = alloc.alloc(6)
    assert 0 not in pages and max(pages) * 16 + 15 < pool.num_slots


def test_allocator_reservations_hold_pages_for_admitted_requests():
    alloc = hal.PageAllocator(num_pages=4, page_size=1)
    alloc.reserve(3)
    assert alloc.can_alloc(1) and not alloc.can_alloc(2)
    with pytest.raises(KVCacheError, match="free pages not reserved"):
        alloc.alloc(2)
    assert alloc.alloc(3, reserved=True) == [1, 2, 3]
    assert alloc.reserved == 0 and alloc.can_alloc(1)


@pytest.mark.parametrize(
    "action, message",
    [
        (lambda a: a.alloc(5), "free pages not reserved"),
        (lambda a: a.alloc(-1), "an int >= 0"),
        (lambda a: a.free([0]), "pages this allocator handed out"),
        (lambda a: a.free([1, 1]), "pages this allocator handed out|each page once"),
        (lambda a: a.reserve(9), "free pages not already reserved"),
        (lambda a: a.unreserve(1), "unreserve"),
        (lambda a: a.slots([1], 0, 17), "within the 1 pages held"),
    ],
)
def test_allocator_rejects_bad_input_and_changes_nothing(action, message):
    alloc = hal.PageAllocator(num_pages=4, page_size=16)
    alloc.alloc(1)
    with pytest.raises(KVCacheError, match=message):
        action(alloc)
    assert (alloc.num_free, alloc.num_used, alloc.reserved) == (3, 1, 0)


def test_allocator_refuses_a_double_free():
    alloc = hal.PageAllocator(num_pages=4, page_size=16)
    pages = alloc.alloc(2)
    alloc.free(pages)
    with pytest.raises(KVCacheError, match="not freed yet"):
        alloc.free(pages[:1])


# -- the serving loop ----------------------------------------------------------------------


def test_serving_loop_batches_continuously_and_frees_everything():
    args, engine, requests = serve(
        "--requests", "10", "--max-running", "4", "--chunk", "48", "--prompt-range", "10:90", "--max-new-tokens", "12"
    )
    assert [r.status for r in requests] == ["finished"] * 10
    assert all(len(r.output) == r.max_new_tokens for r in requests)
    assert len({r.max_new_tokens for r in requests}) > 1 and len({len(r.prompt) for r in requests}) > 1
    summary = engine.summary()
    assert set(summary["steps_by_mode"]) == {"EXTEND", "MIXED", "DECODE"}
    assert summary["max_batch_size"] == 4  # 10 requests through 4 seats: admitted as others finished
    # chunked prefill: no step took more than --chunk prompt tokens, and some prompt needed several
    assert max(s.prefill_tokens for s in engine.stats) <= 48
    assert engine.allocator.num_used == 0 and engine.allocator.reserved == 0
    assert sorted(engine.free_rows) == list(range(1, args.max_running + 1))  # row 0 is the padding row


def test_graph_replayed_decode_gives_the_same_tokens():
    common = ("--requests", "5", "--max-running", "4", "--max-new-tokens", "6", "--prompt-range", "5:30")
    _, eager, eager_reqs = serve(*common, "--graph", "off")
    _, graphed, graphed_reqs = serve(*common, "--graph", "on")
    assert eager.summary()["graph_steps"] == 0 and graphed.summary()["graph_steps"] > 0
    assert [r.output for r in eager_reqs] == [r.output for r in graphed_reqs]


def test_a_logit_error_past_the_tolerance_fails_the_check():
    pytest.importorskip("transformers")
    from hal.demo.families import family
    from hal.demo.reference import check_against_hf

    args, engine, requests = serve("--requests", "1", "--max-new-tokens", "3", "--check", record_logits=True)
    requests[0].logits[0] = requests[0].logits[0] + 1.0
    shape, llama = _shape(args), family("llama")
    weights = llama.random_weights(shape, args.seed)
    report = check_against_hf(llama, shape, weights, requests, torch.float32, torch.device("cpu"))
    assert not report["matches_reference"] and report["max_logit_diff"] >= 1.0


# -- bad input -----------------------------------------------------------------------------


def test_requests_that_cannot_be_served_are_rejected_and_the_others_served():
    args = demo_args("--context-len", "64", "--kv-pages", "3", "--page-size", "16")
    _, engine = build(args, _shape(args), RankInfo(), False)
    ok = Request(0, [1] * 10, 5)
    too_long = Request(1, [1] * 70, 5)  # longer than the context
    too_big = Request(2, [1] * 50, 10)  # 59 KV tokens: 4 pages, the pool has 3
    bad_token = Request(3, [1, 500], 2)
    assert [engine.submit(r) for r in (ok, too_long, too_big, bad_token)] == [True, False, False, False]
    assert "longer than the context (64 tokens)" in too_long.error
    assert "needs 4 KV pages of 16 tokens; the pool has 3" in too_big.error
    assert "outside the vocabulary" in bad_token.error
    engine.run()
    assert ok.status == "finished" and len(ok.output) == 5


def test_cli_bad_requests_get_a_message_no_traceback(capsys):
    code = main(["demo", *TINY, "--prompt-lens", "12,600,20", "--max-new-tokens", "3", "--json"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "request 1 rejected: prompt of 600 tokens" in err and "Traceback" not in err
    report = json.loads(out)
    assert report["requests"] == 2 and set(report["outputs"]) == {"0", "2"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp", "4"], "--tp = 4: expected a divisor of the model's 2 KV heads"),
        (["--device", "nosuch"], "nosuch"),
        (["--backend", "nosuch"], "nosuch"),
        (["--dtype", "fp16"], "never fp16"),
        (["--model", "mixtral"], "--model = 'mixtral': expected one of ['deepseek', 'gpt-oss', 'llama']"),
        (["--kv-dtype", "int4"], "--kv-dtype = 'int4': expected one of ['auto', 'fp8_e4m3', 'fp8_e5m2']"),
        (["--check", "--kv-dtype", "fp8_e4m3"], "an fp8 run reports its agreement with the unquantised run instead"),
        (["--model", "deepseek", "--tp", "2"], "tensor parallelism is implemented for llama only"),
    ],
)
def test_cli_bad_arguments_are_one_clear_error(capsys, args, message):
    assert main(["demo", *TINY, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# -- other backends, tensor parallelism, the HF check end to end -----------------------------

SMALL = ("--requests", "3", "--max-new-tokens", "4", "--prompt-range", "5:24", "--max-running", "2", "--json")


@pytest.fixture(scope="module")
def tp1_outputs():
    proc = run_cli(*SMALL)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["outputs"]


def test_tp2_over_gloo_gives_the_tp1_tokens(tp1_outputs):
    proc = run_cli(*SMALL, "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["tp"] == 2 and report["outputs"] == tp1_outputs


def test_npu_emulation_gives_the_same_tokens(tp1_outputs):
    proc = run_cli(*SMALL, "--device", "npu", env={"HAL_NPU_EMULATION": "1"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["backend"] == "ascend" and report["outputs"] == tp1_outputs


def test_interpreted_triton_gives_the_same_tokens(tp1_outputs):
    pytest.importorskip("triton")
    proc = run_cli(*SMALL, "--backend", "triton", env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["backend"] == "triton" and report["outputs"] == tp1_outputs


def test_check_json_reports_the_match_and_both_speeds():
    pytest.importorskip("transformers")
    proc = run_cli(*SMALL, "--check")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["matches_reference"] is True
    assert report["tokens_per_s"] > 0 and report["reference_tokens_per_s"] > 0


# -- DeepSeek (MLA), gpt-oss (sinks, windows), an fp8 KV cache -----------------------------

MODEL_RUN = ("--requests", "3", "--max-new-tokens", "6", "--prompt-range", "5:40", "--max-running", "2", "--json")


def demo_json(capsys, *args: str) -> tuple[int, dict]:
    code = main(["demo", *TINY, *MODEL_RUN, *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, json.loads(out)


@pytest.mark.parametrize("model", ["deepseek", "gpt-oss"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_new_models_match_transformers_generate(capsys, model, dtype):
    pytest.importorskip("transformers")
    code, report = demo_json(capsys, "--model", model, "--check", "--dtype", dtype)
    assert code == 0 and report["matches_reference"] is True, report
    assert report["model_family"] == model and report["backend"] == "torch"
    assert report["max_logit_diff"] <= report["logit_tolerance"]
    assert report["steps_by_mode"].get("DECODE", 0) > 0


def test_deepseek_serves_absorbed_mla_over_a_latent_pool():
    args = demo_args("--model", "deepseek", "--requests", "2", "--max-new-tokens", "3")
    _, engine = build(args, _shape(args), RankInfo(), False)
    pool, layer = engine.kv_pool, engine.model.attention_layers[0]
    assert isinstance(pool, hal.MLAKVPool) and pool.kv_lora_rank == 64 and pool.qk_rope_head_dim == 16
    assert layer.is_mla and (layer.tp_k_head_num, layer.head_dim, layer.v_head_dim) == (1, 80, 64)
    assert layer.scaling == pytest.approx((32 + 16) ** -0.5)  # HF's qk_head_dim, not the latent's width
    for r in make_requests(args):
        engine.submit(r)
    with torch.inference_mode():
        engine.run()
    assert pool.get_key_buffer(0)[16:].abs().sum() > 0  # the latent and rope part were written


def test_gpt_oss_layers_alternate_windows_and_pass_sinks():
    args = demo_args("--model", "gpt-oss")
    _, engine = build(args, _shape(args), RankInfo(), False)
    windows = [layer.sliding_window_size for layer in engine.model.attention_layers]
    assert windows == [15, -1]  # HF's window of 16 keys is hal's (and SGLang's) 15
    assert all(layer["sinks"].shape == (4,) for layer in engine.model.layers)


def _mutated_check(monkeypatch, capsys, model: str, target, name: str, value) -> dict:
    pytest.importorskip("transformers")
    monkeypatch.setattr(target, name, value)
    code, report = demo_json(capsys, "--model", model, "--check")
    assert code == 1
    return report


def test_check_catches_sinks_left_out(monkeypatch, capsys):
    from hal.demo import gpt_oss

    forward = gpt_oss.GptOssModel.attention

    def without_sinks(self, layer, x, cos, sin, fb):
        return forward(self, {**layer, "sinks": torch.full_like(layer["sinks"], -1e4)}, x, cos, sin, fb)

    report = _mutated_check(monkeypatch, capsys, "gpt-oss", gpt_oss.GptOssModel, "attention", without_sinks)
    assert report["matches_reference"] is False


def test_check_catches_mla_scaled_by_the_latent_width(monkeypatch, capsys):
    from hal.demo import deepseek

    descriptor = deepseek.DeepseekModel.layer_descriptor.__func__

    def latent_scaled(cls, shape, i, tp_size, k_scale, v_scale):
        layer = descriptor(cls, shape, i, tp_size, k_scale, v_scale)
        return dataclasses.replace(layer, scaling=layer.head_dim**-0.5)

    report = _mutated_check(
        monkeypatch, capsys, "deepseek", deepseek.DeepseekModel, "layer_descriptor", classmethod(latent_scaled)
    )
    assert report["max_logit_diff"] > report["logit_tolerance"]


@pytest.mark.parametrize("model", ["llama", "deepseek", "gpt-oss"])
def test_fp8_cache_reports_its_agreement_with_the_unquantised_run(capsys, model):
    code, report = demo_json(capsys, "--model", model, "--kv-dtype", "fp8_e4m3", "--dtype", "bf16")
    assert code == 0 and report["kv_cache_dtype"] == "fp8_e4m3"
    agreement, scales = report["kv_agreement"], report["kv_scales"]
    assert 0.0 <= agreement["token_match_rate"] <= 1.0
    assert agreement["generated_tokens"] == report["generated_tokens"]
    assert agreement["logit_compared_steps"] >= report["requests"]  # every request's first step at least
    assert 0 < agreement["mean_logit_err"] <= agreement["max_logit_err"] < 10  # quantised, and not garbage
    assert len(scales["k_scale"]) == 2 and all(0 < s < 1 for s in scales["k_scale"] + scales["v_scale"])
    assert "calibrated" in scales["method"]


def test_fp8_pool_holds_fp8_with_the_calibrated_scales():
    args = demo_args("--model", "deepseek")
    _, engine = build(args, _shape(args), RankInfo(), False, "fp8_e5m2", [(0.01, 0.01), (0.02, 0.02)])
    assert engine.kv_pool.dtype == torch.float8_e5m2
    assert [(x.k_scale, x.v_scale) for x in engine.model.attention_layers] == [(0.01, 0.01), (0.02, 0.02)]


def test_routing_near_ties_excuse_only_flips_on_a_boundary():
    from hal.demo.gpt_oss import route_choice
    from hal.demo.reference import routing_near_ties

    def req(rid, scores, chosen):
        return Request(rid, [1], 1, output=[5], routes=[[(torch.tensor(scores), torch.tensor(chosen))]])

    def hf(scores, chosen):
        return [(torch.tensor([scores]), torch.tensor([chosen]))]  # one MoE layer, one step

    agreeing = req(0, [0.51, 0.2, 0.48, 0.1], [0, 2])  # routed as HF, scores off by 0.01
    hf_agreeing = hf([0.50, 0.2, 0.49, 0.1], [0, 2])

    def ties(hal_scores, hal_chosen, hf_scores, hf_chosen, logit_diff=2.0):
        report = routing_near_ties(
            route_choice,
            [agreeing, req(1, hal_scores, hal_chosen)],
            [hf_agreeing, hf(hf_scores, hf_chosen)],
            [[0.1], [logit_diff]],
            0.5,
        )
        return [(t["request"], t["hal_experts"], t["hf_experts"]) for t in report["routing_near_ties"]]

    # experts 1 and 2 within 0.005 in HF, hal's scores within twice the 0.01 seen elsewhere: a tie
    assert ties([0.5, 0.495, 0.49, 0.1], [0, 1], [0.5, 0.485, 0.49, 0.1], [0, 2]) == [(1, [0, 1], [0, 2])]
    assert ties([0.5, 0.9, 0.49, 0.1], [0, 1], [0.5, 0.485, 0.49, 0.1], [0, 2]) == []  # scores far apart
    assert ties([0.5, 0.495, 0.49, 0.1], [0, 1], [0.5, 0.485, 0.49, 0.1], [0, 1]) == []  # no flip at all
    assert ties([0.5, 0.495, 0.49, 0.1], [0, 3], [0.5, 0.485, 0.49, 0.1], [0, 2]) == []  # hal broke the rule
    assert (
        ties([0.5, 0.495, 0.49, 0.1], [0, 1], [0.5, 0.485, 0.49, 0.1], [0, 2], logit_diff=0.2) == []
    )  # no excuse needed
