"""vLLM's full decode graphs as hal serves them (``GraphDecodeSteps``), on the CPU without vLLM.

The steps come from the stand-in of vLLM's ``CommonAttentionMetadata`` over the simulated engine of
``tests/test_vllm_integration.py``; each build refills the one static step of its padded size in place
(``GraphDecodeSteps.fill``), the backend's ``out_graph`` runs outside the graph and ``in_graph`` with the forward
inside it, as the vLLM builder does. The graph is hal's strict eager guard (``EagerGraph``: a replay must read the
captured tensors at the captured addresses, no host data reaches the step's tensors), captured once over a padded
batch and replayed for other decode batches; every replay equals dense attention and an eager forward of the same
batch. ``tests/test_mutants.py`` plants bugs in ``GraphDecodeSteps`` that these tests must fail.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_vllm_integration import SimulatedEngine

import hal
from hal.graph_capture import EagerGraph
from hal.integrations.vllm_steps import GraphDecodeSteps, StepTranslator, VllmKVPool, vllm_layer
from hal.kv_layouts import HEAD_MAJOR, TOKEN_MAJOR

SIZE = 4  # the captured batch size; replays pad to it
# decode batches replayed after the capture: other requests, fewer of them, a request that joined after the capture
REPLAYS = ([(2, 1), (0, 1), (1, 1)], [(1, 1)], [(0, 1), (1, 1), (2, 1), (3, 1)], [(3, 1), (2, 1)])


@pytest.mark.parametrize("kernels", ["1", "0"], ids=["compiled", "plain-torch"])
@pytest.mark.parametrize("kv_layout", [TOKEN_MAJOR, HEAD_MAJOR])
def test_static_decode_steps_replay_under_the_graph_guard(kv_layout, kernels, monkeypatch):
    monkeypatch.setenv("HAL_CPU_KERNELS", kernels)
    engine = SimulatedEngine(kv_layout=kv_layout)
    layer = vllm_layer(0, engine.heads, engine.kv_heads, engine.head_dim, 0.2)
    limits = {"max_context_len": engine.max_blocks * engine.block_size, "max_batch_size": engine.max_reqs}
    config = hal.AttentionConfig.from_layers([layer], dtype=torch.float32, page_size=engine.block_size, **limits)
    config = dataclasses.replace(config, kv_layout=kv_layout)
    selection = hal.select(config, device="cpu")
    backend, eager_backend = selection.create(), selection.create()
    pool = VllmKVPool(engine.block_size, torch.float32, "cpu", engine.head_dim, kv_layout=kv_layout)
    pool.bind(layer.layer_id, engine.cache)
    translator = StepTranslator(pool, engine.block_size, engine.max_reqs, engine.max_blocks, "cpu")
    backend.init_cuda_graph_state(SIZE, SIZE)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    steps = GraphDecodeSteps(pool, engine.block_size, SIZE, engine.max_blocks, fill)
    graph = EagerGraph()

    def eager(cm, q, k, v):
        step = translator.translate(cm)
        eager_backend.init_forward_metadata(step)
        n = step.num_tokens
        return eager_backend.forward(q[:n], k[:n], v[:n], layer, step)

    eager(*engine.step([(0, 20), (1, 9), (2, 5)]))  # prefills: the KV the decodes read
    q_in, k_in, v_in = (torch.zeros(SIZE, h, engine.head_dim) for h in (engine.heads, engine.kv_heads, engine.kv_heads))
    out = torch.zeros(SIZE, engine.heads, engine.head_dim)
    static = steps.static_step(SIZE)

    def load(schedule, capture=False):
        n = len(schedule)
        cm, q, k, v = engine.step(schedule, pad_reqs=SIZE - n, pad_tokens=SIZE - n)
        with graph.outside(static):  # vLLM's build: on the host, outside the graph
            filled = steps.fill(cm, translator.translate(cm))
            backend.init_forward_metadata_out_graph(filled, in_capture=capture)
        assert filled is static  # the captured step, refilled in place
        for buffer, given in ((q_in, q), (k_in, k), (v_in, v)):
            buffer.copy_(given)
        return cm, q, k, v

    def forward():
        backend.init_forward_metadata_in_graph(static)
        return backend.forward(q_in, k_in, v_in, layer, static, out=out)

    load([(0, 1), (1, 1)], capture=True)
    graph.warmup(forward)  # vLLM's warm-up runs of the size before its capture (scratch buffers sized there)
    graph.capture(forward)
    for schedule in REPLAYS:
        if 3 in dict(schedule) and 3 not in engine.qkv:
            eager(*engine.step([(3, 12)]))  # a request joins between replays (a prefill runs eagerly)
        cm, q, k, v = load(schedule)
        graph.replay()
        n = len(schedule)
        replayed = out[:n].reshape(n, -1).clone()
        torch.testing.assert_close(replayed, engine.dense(schedule, layer), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(replayed, eager(cm, q, k, v), atol=2e-5, rtol=2e-5)
