"""Mutants of the ascend backend's MLA and sinks paths: one realistic porting mistake each, over the CPU emulation.

Each is ``AscendBackend`` with one hook changed the way a port from the upstream callers goes wrong; ``hal check``
(families ``mla`` and ``sinks``) must fail every one and pass the unchanged backend. The mistakes:

* ``MlaVerifyAsCausal``: SGLang's NPU ``forward_mtp`` runs MLA verify with ``sparse_mode=3`` whatever the draft
  tree (right for a linear MTP chain only); hal's verify masks are trees.
* ``MlaTreeMaskInverted``: FIA's tree mask is 1 = hidden; passing SGLang's custom mask bits (1 = visible) as is.
* ``BandFromVllmWindow``: vLLM's ``sliding_window`` counts the current token, SGLang's ``sliding_window_size``
  does not; ``pre_tokens = window - 1`` ported from the vLLM side drops one key of every window.
* ``MlaSplitWithoutBlockTable``: the latent/rope split copies the pool's first pages, not the batch's.
* ``SinksDroppedInDecode``: ``forward_decode`` without the sinks hook: decodes take the MHA op, no sink.
"""

from __future__ import annotations

import dataclasses

import pytest

from hal.conformance.runner import run_check
from hal.devices.npu import AscendBackend, npu_capability
from hal.kernels.npu import load_torch_npu
from hal.registry import Device, get_registry, register_device, unregister_device

pytestmark = pytest.mark.skipif(load_torch_npu()[0] is not None, reason="a real NPU is visible: no emulation")


class MlaVerifyAsCausal(AscendBackend):
    def _tree_mask(self, meta):
        return None


class MlaTreeMaskInverted(AscendBackend):
    def _tree_mask(self, meta):
        return ~super()._tree_mask(meta)


def _narrower(layer):
    window = layer.sliding_window_size
    return dataclasses.replace(layer, sliding_window_size=window - 1) if window > 0 else layer


class BandFromVllmWindow(AscendBackend):
    def _mla(self, meta, query, cache, rope, layer, mode, sinks=None, out=None):
        return super()._mla(meta, query, cache, rope, _narrower(layer), mode, sinks, out)

    def _sinks(self, meta, query, k_cache, v_cache, layer, step, sinks):
        return super()._sinks(meta, query, k_cache, v_cache, _narrower(layer), step, sinks)


class MlaSplitWithoutBlockTable(AscendBackend):
    @staticmethod
    def _batch_pages(meta, cache):
        return cache[: meta.batch_size * meta.max_blocks]


class SinksDroppedInDecode(AscendBackend):
    def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        kwargs.pop("sinks", None)
        return super().run_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


MUTANTS = (MlaVerifyAsCausal, MlaTreeMaskInverted, BandFromVllmWindow, MlaSplitWithoutBlockTable, SinksDroppedInDecode)


class Control(AscendBackend):
    pass


for _cls in (Control, *MUTANTS):
    _cls.name = "ascend_" + _cls.__name__.lower()


class AscendMutants(Device):
    """The emulated A2 serving the unchanged backend and every mutant."""

    name = "ascend_mutants"
    plugin_api = 2
    priority = 1

    def probe(self, index=None):
        return npu_capability(index)

    def backends(self):
        return [Control, *MUTANTS]

    def make_graph(self, capability):
        return get_registry().get("npu").make_graph(capability)


@pytest.fixture(scope="module")
def results():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HAL_NPU_EMULATION", "1")
        patch.delenv("HAL_PLUGINS", raising=False)
        register_device(AscendMutants())
        try:
            report = run_check(["ascend_mutants"], [], families=["mla", "sinks"])
        finally:
            unregister_device("ascend_mutants")
            get_registry(reload=True)
    assert not report["errors"], report["errors"]
    return {r["backend"]: r for r in report["results"]}


def test_the_unchanged_backend_passes_the_mla_and_sinks_cases(results):
    control = results["ascend_control"]
    assert control["failed"] == 0, "\n".join(control["failures"])
    assert control["passed"] >= 8


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda cls: cls.__name__)
def test_hal_check_fails_the_mutant(results, mutant):
    result = results[mutant.name]
    assert result["failed"] > 0, f"{mutant.__name__} passed hal check: the suite has a gap"
