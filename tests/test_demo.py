"""``hal demo``: the page allocator, the serving loop, the HF check, tensor parallelism, bad input."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

import hal
from hal.cli import main
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
        [sys.executable, "-m", "hal.cli", "demo", *TINY, *args],
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
    from hal.demo.model import random_weights
    from hal.demo.reference import check_against_hf

    args, engine, requests = serve("--requests", "1", "--max-new-tokens", "3", "--check", record_logits=True)
    requests[0].logits[0] = requests[0].logits[0] + 1.0
    shape = _shape(args)
    report = check_against_hf(shape, random_weights(shape, args.seed), requests, torch.float32, torch.device("cpu"))
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
