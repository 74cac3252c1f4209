"""Bugs planted in the integrations' graph and bind paths, as a pytest plugin (``-p integration_mutants``).

With ``HAL_INTEGRATION_MUTANT=<name>`` set, the plugin patches one of :data:`MUTANTS` into hal before any test
runs; ``tests/test_mutants.py`` runs the tests that drive that path (each mutant's ``tests``) under it and requires
them to fail, and runs them without a mutant, where they must pass. Each mutant is one realistic mistake in hal's
own integration code (``hal.integrations.vllm_steps``: the static steps of vLLM's full decode graphs, the binding
of vLLM's and vllm-ascend's per-layer caches), not in a backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

ENV = "HAL_INTEGRATION_MUTANT"
GRAPH_TESTS = ("tests/test_vllm_graph_steps.py",)
BIND_TESTS = (
    "tests/test_vllm_ascend.py",
    "tests/test_vllm_integration.py::test_pool_write_goes_to_vllms_tensor_and_checks_block_size",
)


@dataclass(frozen=True)
class Mutant:
    """``plant()`` patches the bug into hal; ``tests``: the pytest node ids that drive its path (and must fail)."""

    doc: str
    tests: tuple[str, ...]
    plant: Callable[[], None]


def _refill_counted(fill):
    """``GraphDecodeSteps.fill`` wrapped to pass ``(steps, size, builds of that size before this one)`` to ``fill``."""

    def wrapped(self, cm, step):
        builds = self.__dict__.setdefault("_mutant_builds", {})
        size = int(cm.num_reqs)
        before = builds.get(size, 0)
        builds[size] = before + 1
        return fill(self, cm, step, before)

    return wrapped


def _static_table_reallocated() -> None:
    from hal.integrations.vllm_steps import GraphDecodeSteps
    from hal.kv_cache import ReqToPagePool

    original = GraphDecodeSteps.fill

    def fill(self, cm, step):
        static = original(self, cm, step)
        fresh = static.req_to_page_pool.req_to_page.clone()  # a new block table per build, not the captured one
        static.req_to_page_pool = ReqToPagePool.from_tensor(fresh, self.block_size)
        return static

    GraphDecodeSteps.fill = fill


def _stale_field(name: str) -> Callable[[], None]:
    """A static step whose ``name`` tensor is filled at the capture's build only: every replay reads the captured
    batch's values."""

    def plant() -> None:
        from hal.integrations.vllm_steps import GraphDecodeSteps

        original = GraphDecodeSteps.fill

        def fill(self, cm, step, earlier_builds):
            kept = getattr(self, name).clone()
            static = original(self, cm, step)
            if earlier_builds:
                getattr(self, name).copy_(kept)
            return static

        GraphDecodeSteps.fill = _refill_counted(fill)

    return plant


def _pair_swapped() -> None:
    from hal.integrations import vllm_steps

    for layout, views in list(vllm_steps._POOL_VIEWS.items()):

        def swapped(kv_cache, *args, _views=views, **kwargs):
            if isinstance(kv_cache, (tuple, list)):  # vllm-ascend's (k_cache, v_cache) pair, unpacked V first
                kv_cache = (kv_cache[1], kv_cache[0])
            return _views(kv_cache, *args, **kwargs)

        vllm_steps._POOL_VIEWS[layout] = swapped


def _block_size_from_lane_groups() -> None:
    from hal.integrations import vllm_steps
    from hal.kv_layouts import FRACTAL_NZ

    original = vllm_steps.vllm_block_size

    def block_size(kv_cache, kv_layout=vllm_steps.TOKEN_MAJOR):
        if kv_layout == FRACTAL_NZ:  # [blocks, lane groups, block_size, 16]: the wrong axis read
            return int(kv_cache[0].shape[1])
        return original(kv_cache, kv_layout)

    vllm_steps.vllm_block_size = block_size


def _block_size_unchecked() -> None:
    from hal.integrations import vllm_steps

    original = vllm_steps.VllmKVPool.bind

    def bind(self, layer_id, kv_cache):  # takes the builder's block size on trust instead of reading the cache's
        read = vllm_steps.vllm_block_size
        vllm_steps.vllm_block_size = lambda cache, layout=vllm_steps.TOKEN_MAJOR: self.page_size
        try:
            original(self, layer_id, kv_cache)
        finally:
            vllm_steps.vllm_block_size = read

    vllm_steps.VllmKVPool.bind = bind


MUTANTS: dict[str, Mutant] = {
    "StaticBlockTableReallocated": Mutant(
        "each build of a full-graph decode step gives the static step a new block table tensor instead of refilling "
        "the captured one in place (a replay reads the capture's table)",
        GRAPH_TESTS,
        _static_table_reallocated,
    ),
    "StaleSeqLensOnReplay": Mutant(
        "the static step's device seq_lens are filled at the capture's build only (the host lengths are refilled): "
        "every replay reads the captured batch's lengths",
        GRAPH_TESTS,
        _stale_field("seq_lens"),
    ),
    "StaleOutCacheLocOnReplay": Mutant(
        "the static step's out_cache_loc is filled at the capture's build only: replays write the new tokens' KV to "
        "the captured batch's slots",
        GRAPH_TESTS,
        _stale_field("out_cache_loc"),
    ),
    "BoundPairSwapped": Mutant(
        "bind unpacks a (k_cache, v_cache) pair (vllm-ascend's per-layer caches) V first", BIND_TESTS, _pair_swapped
    ),
    "NzBlockSizeFromLaneGroups": Mutant(
        "bind reads a FRACTAL_NZ cache's block size from its lane-group axis (vllm-ascend's 310P caches)",
        BIND_TESTS,
        _block_size_from_lane_groups,
    ),
    "BindBlockSizeUnchecked": Mutant(
        "bind takes the block size the metadata builder was made for instead of the bound cache's (a cache of "
        "another block size is read with the wrong page size)",
        BIND_TESTS,
        _block_size_unchecked,
    ),
}


def pytest_configure(config) -> None:
    name = os.environ.get(ENV, "")
    if name:
        MUTANTS[name].plant()
