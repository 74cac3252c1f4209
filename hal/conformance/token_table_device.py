"""``tokentable``: a device plugin whose one backend reads token tables only, for ``hal report --matrix``.

A vendor's port written from ``docs/porting.md`` alone reads ``req_to_token`` (the seed's request table) and
nothing else; every engine path that hands a backend another table form (vLLM's block table) must derive the token
table for it (``hal.batch.tables_for``) on every entry path, eager or graph. This plugin is that port at its
smallest: the reference kernel (:func:`hal.kernels.reference.batch_attention`) over token-major pools, its tensors
on the host, no graphs (it reads lengths on the host inside the forward). The matrix registers it
(``hal.registry.register_device``) for its run only.
"""

from __future__ import annotations

import torch

from hal.backend import AttentionBackend
from hal.capability import DeviceCapability
from hal.graph import EagerGraph, Graph
from hal.kernels import reference
from hal.registry import PLUGIN_API, Device

__all__ = ["NAME", "TokenTableBackend", "TokenTableDevice"]

NAME = "tokentable"


class TokenTableBackend(AttentionBackend):
    """Reads ``req_to_token`` only (``reads_tables = {"token"}``), token-major pools, fp32 / bf16, any page size."""

    name = "reference"
    dtypes = frozenset({"fp32", "bf16"})
    reads_tables = frozenset({"token"})
    supports_graph = False
    supports_mla = True
    requires_page_aligned_slots = False
    supports_padding_slots = True
    reads_new_kv = False

    def support_triton(self) -> bool:
        return False

    def plan_out_graph(self, fb, in_capture: bool = False) -> None:
        self.plan.set_metadata(fb.forward_mode, fb)

    def _attend(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs) -> torch.Tensor:
        """q ``[T, Hq, D]`` -> ``[T, Hq * Dv]`` over the cache (the prologue wrote the new K/V)."""
        pool = fb.token_to_kv_pool
        keys, values = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        return reference.batch_attention(q, keys, values, layer, fb, sinks=kwargs.get("sinks")).to(q.dtype)

    run_decode = run_extend = run_mixed = _attend


class TokenTableDevice(Device):
    """The host's tensors under another device name (the plugin a vendor would ship, minus the hardware)."""

    name = NAME
    priority = -20  # never chosen unless named
    plugin_api = PLUGIN_API

    def probe(self, index: int | None = None) -> DeviceCapability:
        return DeviceCapability(
            type=NAME,
            available=True,
            torch_type=torch.empty(0).device.type,  # the host's default tensors
            index=0,
            count=1,
            name="token-table-only port (reference kernel)",
            vendor="hal matrix",
            dtypes=("fp32", "bf16"),
            graph=None,
            emulated=True,
            reasons={"graph": "reads lengths on the host in its forward: no graphs", "triton": "no Triton target"},
        )

    def backends(self):
        return [TokenTableBackend]

    def make_graph(self, capability: DeviceCapability) -> Graph:
        return EagerGraph()
