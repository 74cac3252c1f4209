"""The graph contract: the runner's call order, padding, and the CPU guard that fails like a real graph."""

from __future__ import annotations

import pytest
import torch

from hal.capability import interpreter_enabled
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


def _set(t, index, value):
    t[index] = value
    return t + 1


@pytest.mark.parametrize(
    "body",
    [
        lambda x, i: _set(x, 0, 0),  # select + copy_ of a host 0-dim tensor: H2D on CUDA
        lambda x, i: _set(x, (1,), 2.5),
        lambda x, i: _set(x.view(3, 1), (2, 0), 1),
        lambda x, i: _set(x, i, 1.0),  # index_put_ with a host value
        lambda x, i: x.index_put_((i,), torch.tensor(1.0)),
        lambda x, i: x.copy_(torch.tensor([1.0, 2.0, 3.0])),
        lambda x, i: torch.tensor(3.0, device=x.device) + x,
        lambda x, i: torch.as_tensor([1, 2, 3], device=x.device),
        lambda x, i: torch.tensor(2.0).to(x.device) * x,
        lambda x, i: x[:1].copy_(torch.tensor(2.0).view(1)),
    ],
    ids=["int-index", "tuple-index", "2d-index", "tensor-index", "index_put_", "copy_", "tensor-device",
         "as_tensor-device", "to-device", "copy_-1d"],
)  # fmt: skip
def test_eager_graph_rejects_host_data_written_into_a_device_tensor(body):
    x, i = torch.zeros(3), torch.tensor([0, 2])
    with pytest.raises(GraphCaptureError, match="host"):
        EagerGraph().capture(lambda: body(x, i))


@pytest.mark.parametrize(
    "body",
    [
        lambda x: _set(x, slice(1, 3), 3.0),  # fill_ of a sliced view: the number is a kernel argument
        lambda x: _set(x, Ellipsis, 1),
        lambda x: x.fill_(0.0) + x.zero_(),
        lambda x: x.fill_(torch.tensor(2.0)),
        lambda x: x + torch.tensor(2.0),  # a CPU scalar operand of a pointwise op
        lambda x: torch.where(x > 0, x, 0.0).masked_fill(x < 0, 1.0).clamp(min=0),
        lambda x: torch.full((3,), 7.0) + torch.zeros_like(x),
    ],
    ids=["slice", "ellipsis", "fill_-zero_", "fill_-0dim", "scalar-operand", "where-masked_fill", "full"],
)
def test_eager_graph_allows_constants_that_are_kernel_arguments(body):
    """On CUDA these pass the number to a kernel (fill_ with a CPU 0-dim value reads it on the host): no copy."""
    x = torch.zeros(3)
    graph = EagerGraph()
    graph.capture(lambda: body(x))
    graph.replay()


def test_eager_graph_rejects_a_python_number_that_changes_after_capture():
    x, n = torch.ones(3), [2.0]
    graph = EagerGraph()
    graph.capture(lambda: x * n[0])
    graph.replay()  # the same number: fine
    n[0] = 3.0
    with pytest.raises(GraphCaptureError, match="replays the Python numbers"):
        graph.replay()


def test_eager_graph_rejects_a_host_scalar_refilled_outside_the_graph():
    """A host 0-dim tensor made per step in out_graph is a kernel argument frozen at capture."""
    x, state = torch.zeros(3), {}
    graph = EagerGraph()
    with graph.outside():
        state["total"] = torch.tensor(5)
    graph.capture(lambda: x.fill_(state["total"]) + 1)
    with graph.outside():
        state["total"] = torch.tensor(6)
    with pytest.raises(GraphCaptureError, match="replays the Python numbers"):
        graph.replay()


def test_eager_graph_rejects_host_tensors_made_outside_the_graph():
    x, state = torch.zeros(3, dtype=torch.int64), {}
    graph = EagerGraph()
    with graph.outside():
        lens = torch.tensor([3, 1, 2])  # host data
        state["indptr"] = torch.cumsum(lens, 0)  # computed from host data only: host data too
    with pytest.raises(GraphCaptureError, match="host tensor of shape"):
        graph.capture(lambda: x.copy_(state["indptr"]) + 1)


def test_eager_graph_accepts_device_tensors_made_outside_the_graph_once():
    """Built from host data but moved to the device (once, then reused): a device tensor, not host data."""
    x, state = torch.zeros(3, dtype=torch.int64), {}
    graph = EagerGraph()
    with graph.outside():
        state["a"] = torch.tensor([3, 1, 2], device=x.device)
        state["b"] = torch.tensor([1, 1, 1]).to(x.device)
    graph.capture(lambda: x.copy_(state["a"] + state["b"]) + 1)
    graph.replay()


class _Scratch(CompiledBackend):
    """A torch backend whose in_graph copies ``source(self, fb)`` into a device buffer."""

    def __init__(self, capability, source, host_side=None):
        super().__init__(capability)
        self.source, self.host_side = source, host_side

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        self.scratch = torch.zeros(max_bs, dtype=torch.int64)

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        super().init_forward_metadata_out_graph(fb, in_capture)
        if self.host_side is not None:
            self.host_side(self, fb)

    def init_forward_metadata_in_graph(self, fb):
        super().init_forward_metadata_in_graph(fb)
        self.scratch[: fb.batch_size].copy_(self.source(self, fb))


@pytest.mark.parametrize(
    "source, host_side",
    [
        (lambda self, fb: fb.seq_lens_cpu, None),  # the batch's host mirror
        (lambda self, fb: self.lens, lambda self, fb: setattr(self, "lens", torch.tensor(fb.lens.kv))),
    ],
    ids=["seq_lens_cpu", "built-in-out_graph"],
)
def test_a_backend_that_copies_host_tensors_in_graph_fails_capture(source, host_side):
    built = build(GRAPH_CASES[0])
    with pytest.raises(GraphCaptureError, match="host tensor"):
        _runner(_Scratch(CAP, source, host_side), built).capture()


def test_a_backend_that_reads_device_metadata_in_graph_passes():
    built = build(GRAPH_CASES[0])
    runner = _runner(_Scratch(CAP, lambda self, fb: fb.seq_lens), built)
    runner.capture()
    torch.testing.assert_close(runner.run(built.batch, built.q, built.k, built.v)[0], built.expected)


@torch.library.custom_op("hal_test::gather_rows", mutates_args=("out",))
def _gather_rows(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """A stand-in for a compiled kernel registered as a custom op: the dispatcher sees every tensor argument."""
    out.copy_(src[rows])


def test_the_address_check_covers_the_tensor_arguments_of_custom_ops():
    """Metadata rebuilt per step outside the graph and read only by a custom op: a stale address on a GPU."""
    src, out, state = torch.arange(8.0), torch.zeros(3), {}

    def out_graph(rows):
        state["rows"] = torch.tensor(rows, device=src.device)  # fresh every step

    def step():
        _gather_rows(src, state["rows"], out)
        return out * 1

    graph = EagerGraph()
    out_graph([1, 2, 3])
    graph.capture(step)
    out_graph([4, 5, 6])
    with pytest.raises(GraphCaptureError, match="stale data"):
        graph.replay()
    state["rows"].copy_(torch.tensor([1, 2, 3]))  # refilled in place instead: the captured address, fine
    rows = state["rows"]
    graph = EagerGraph()
    graph.capture(step)
    rows.copy_(torch.tensor([4, 5, 6]))
    graph.replay()
    assert graph.output.tolist() == [4.0, 5.0, 6.0]


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


@pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 set before the session (tox -e triton)")
@pytest.mark.parametrize(
    "case", [GRAPH_CASES[0], next(c for c in GRAPH_CASES if c.mode.is_target_verify())], ids=lambda c: c.name
)
def test_the_triton_backend_graph_path_passes_the_eager_guard(case):
    """Capture and replay through the Triton backend's in_graph metadata (kv_indptr, kv_indices, qo_indptr)."""
    from hal.devices.triton_backend import TritonBackend

    built = build(case)
    fb = built.batch
    draft = case.requests[0][1] if case.mode.is_target_verify() else None
    runner = GraphRunner(
        TritonBackend(CAP), [built.layer], fb.req_to_token_pool, fb.token_to_kv_pool, EagerGraph, (4,), case.dtype,
        draft_token_num=draft,
    )  # fmt: skip
    runner.capture()
    for _ in range(2):
        torch.testing.assert_close(runner.run(fb, built.q, built.k, built.v)[0], built.expected)
