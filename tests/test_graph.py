"""The graph contract: the runner's call order, padding, and the CPU guard that fails like a real graph."""

from __future__ import annotations

import pytest
import torch

from hal.conformance.cases import GRAPH_CASES, build
from hal.devices.cpu import CompiledBackend, device
from hal.errors import GraphCaptureError, InvalidBatchError
from hal.graph import EagerGraph, GraphRunner

CAP = device.probe()


@pytest.mark.parametrize(
    "body, what",
    [
        (lambda x: x.sum().item(), "host sync"),
        (lambda x: x.tolist(), "host sync"),
        (lambda x: x.cpu(), "host sync"),
        (lambda x: x[x > 0], "data-dependent shape"),
        (lambda x: torch.nonzero(x), "data-dependent shape"),
        (lambda x: torch.unique(x), "data-dependent shape"),
        (lambda x: torch.repeat_interleave(x.long().abs()), "data-dependent shape"),
        (lambda x: x + torch.tensor([1.0, 2.0, 3.0]), "host data"),
    ],
)
def test_eager_graph_rejects_what_a_real_graph_cannot_record(body, what):
    x = torch.tensor([1.0, -2.0, 3.0])
    with pytest.raises(GraphCaptureError, match=what):
        EagerGraph().capture(lambda: body(x))


def test_eager_graph_rejects_a_shape_that_changes_between_capture_and_replay():
    n = [3]
    graph = EagerGraph()
    graph.capture(lambda: torch.zeros(n[0]) + 1)
    graph.replay()  # same shapes: fine
    n[0] = 4
    with pytest.raises(GraphCaptureError, match="depends on batch contents"):
        graph.replay()


def test_eager_graph_replay_refreshes_the_static_output():
    x = torch.tensor([1.0, 2.0])
    graph = EagerGraph()
    out = graph.capture(lambda: x * 2)
    x.copy_(torch.tensor([5.0, 7.0]))
    graph.replay()
    assert out.tolist() == [10.0, 14.0]


class Recording(CompiledBackend):
    def __init__(self, capability, log):
        super().__init__(capability)
        self.log = log

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.log.append(("out_graph", fb.batch_size, in_capture))
        super().init_forward_metadata_out_graph(fb, in_capture)

    def init_forward_metadata_in_graph(self, fb):
        self.log.append(("in_graph", fb.batch_size))
        super().init_forward_metadata_in_graph(fb)

    def on_after_cuda_graph_warmup(self):
        self.log.append(("warmup_done",))

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.log.append(("state", max_bs, max_num_tokens))
        super().init_cuda_graph_state(max_bs, max_num_tokens)


def _runner(backend, built, capture_bs=(1, 4)):
    fb = built.batch
    return GraphRunner(
        backend, [built.layer], fb.req_to_token_pool, fb.token_to_kv_pool, EagerGraph, capture_bs, built.case.dtype
    )


def test_runner_follows_the_protocol_and_pads_to_the_next_size():
    log: list = []
    built = build(GRAPH_CASES[0])  # 3 requests: replayed on the 4-request graph
    runner = _runner(Recording(CAP, log), built)
    runner.capture()
    capture_4 = [("out_graph", 4, True), ("in_graph", 4), ("warmup_done",), ("out_graph", 4, True), ("in_graph", 4)]
    assert log[0] == ("state", 4, 4)
    assert log[1:6] == capture_4, "warm-up, hook, then out_graph(in_capture=True) before in_graph inside capture"
    log.clear()
    out = runner.run(built.batch, built.q, built.k, built.v)
    assert log == [("out_graph", 4, False), ("in_graph", 4)], "replay: out_graph outside, in_graph replayed"
    torch.testing.assert_close(out[0], built.expected)


def test_verify_runner_captures_target_verify_at_a_fixed_draft_count():
    log: list = []
    case = next(c for c in GRAPH_CASES if c.mode.is_target_verify())  # 3 requests of 4 draft tokens
    built = build(case)
    fb = built.batch
    runner = GraphRunner(
        Recording(CAP, log), [built.layer], fb.req_to_token_pool, fb.token_to_kv_pool, EagerGraph, (1, 4),
        case.dtype, draft_token_num=4,
    )  # fmt: skip
    runner.capture()
    assert log[0] == ("state", 4, 16), "init_cuda_graph_state(max_bs, max_bs * draft)"
    static = runner.graphs[4][1]
    assert static.forward_mode.is_target_verify() and static.out_cache_loc.numel() == 16
    for _ in range(2):
        out = runner.run(fb, built.q, built.k, built.v)
        assert out.shape == (1, 12, built.expected.shape[1])
        torch.testing.assert_close(out[0], built.expected)
    decode = build(GRAPH_CASES[0])
    with pytest.raises(InvalidBatchError, match="TARGET_VERIFY batch of 4 draft tokens"):
        runner.run(decode.batch, decode.q, decode.k, decode.v)


def test_runner_rejects_what_it_did_not_capture():
    built = build(GRAPH_CASES[0])
    runner = _runner(CompiledBackend(CAP), built, capture_bs=(1, 2))
    with pytest.raises(GraphCaptureError, match="capture"):
        runner.run(_small_batch(), built.q[:1], built.k[:1], built.v[:1])
    runner.capture()
    with pytest.raises(InvalidBatchError, match="at most 2"):
        runner.run(built.batch, built.q, built.k, built.v)


def _small_batch():
    from hal.batch import ForwardMode
    from hal.conformance.cases import Case

    return build(Case("one", ForwardMode.DECODE, ((4, 1),))).batch


def test_a_backend_that_syncs_in_graph_fails_capture():
    class Syncing(CompiledBackend):
        def init_forward_metadata_in_graph(self, fb):
            super().init_forward_metadata_in_graph(fb)
            self.longest = int(fb.seq_lens.max())  # a host sync: belongs in out_graph

    built = build(GRAPH_CASES[0])
    with pytest.raises(GraphCaptureError, match="host sync"):
        _runner(Syncing(CAP), built).capture()


def test_a_scalar_literal_is_a_constant_not_host_data():
    x = torch.zeros(3)

    def body():
        x[0] = 0
        return x + 1

    EagerGraph().capture(body)


def test_runner_rejects_a_batch_of_other_pools_or_ill_shaped_inputs():
    built = build(GRAPH_CASES[0])
    runner = _runner(CompiledBackend(CAP), built)
    runner.capture()
    other = build(GRAPH_CASES[0])  # same shapes, its own pools
    before = [b.clone() for b in built.batch.token_to_kv_pool.k_buffer]
    with pytest.raises(InvalidBatchError, match="pools"):
        runner.run(other.batch, other.q, other.k, other.v)
    with pytest.raises(InvalidBatchError, match="q.shape"):
        runner.run(built.batch, built.q[:, :-1], built.k, built.v)
    with pytest.raises(InvalidBatchError, match="q.dtype"):
        runner.run(built.batch, built.q.bfloat16(), built.k.bfloat16(), built.v.bfloat16())
    assert all(torch.equal(a, b) for a, b in zip(before, built.batch.token_to_kv_pool.k_buffer))
