"""Helper ops around attention, each in a Triton and a torch version, chosen in one place.

``helper_ops_for(backend)`` returns the Triton set when ``backend.support_triton()`` is
True *and* the backend's device has a Triton target, else the torch set. Both are
graph-recordable: no host syncs, and every shape comes from the output buffers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hal.backend import AttentionBackend

__all__ = ["HelperOps", "TorchHelperOps", "TritonHelperOps", "helper_ops_for"]


class HelperOps:
    """The helper-op interface. ``name`` says which implementation runs."""

    name = ""

    def write_kv(self, k_buffer, v_buffer, loc, k, v) -> None:
        """Store ``k``/``v`` ``[n, kv_heads, dim]`` at slots ``loc`` ``[n]`` of the layer buffers."""
        raise NotImplementedError

    def build_kv_indices(self, req_to_token, req_pool_indices, kv_start, kv_end, kv_indptr, kv_indices) -> None:
        """``kv_indices[kv_indptr[b]:][: kv_end[b] - kv_start[b]] = req_to_token[req_pool_indices[b],
        kv_start[b] : kv_end[b]]`` for each request ``b`` (``kv_start`` None means 0)."""
        raise NotImplementedError

    def compute_positions(self, extend_prefix_lens, extend_seq_lens, extend_start_loc, positions) -> None:
        """``positions[extend_start_loc[b] + i] = extend_prefix_lens[b] + i`` for ``i < extend_seq_lens[b]``."""
        raise NotImplementedError


class TorchHelperOps(HelperOps):
    name = "torch"

    def write_kv(self, k_buffer, v_buffer, loc, k, v) -> None:
        k_buffer[loc] = k.to(k_buffer.dtype)
        v_buffer[loc] = v.to(v_buffer.dtype)

    def build_kv_indices(self, req_to_token, req_pool_indices, kv_start, kv_end, kv_indptr, kv_indices) -> None:
        width = req_to_token.shape[1]
        pos = torch.arange(width, device=req_to_token.device)
        start = torch.zeros_like(kv_end) if kv_start is None else kv_start
        rows = req_to_token[req_pool_indices.long()]  # [B, width]
        valid = (pos[None, :] >= start[:, None]) & (pos[None, :] < kv_end[:, None])
        target = kv_indptr[: kv_end.numel(), None].long() + pos[None, :] - start[:, None]
        dump = kv_indices.numel()  # invalid entries land in one extra element, dropped below
        target = torch.where(valid, target, torch.full_like(target, dump))
        out = torch.cat([kv_indices, kv_indices.new_zeros(1)])  # entries past kv_indptr[-1] stay as they were
        out.scatter_(0, target.flatten(), rows.flatten().to(kv_indices.dtype))
        kv_indices.copy_(out[:dump])

    def compute_positions(self, extend_prefix_lens, extend_seq_lens, extend_start_loc, positions) -> None:
        tokens = torch.arange(positions.numel(), device=positions.device)
        req = torch.searchsorted(extend_start_loc.long(), tokens, right=True) - 1
        pos = extend_prefix_lens.long()[req] + tokens - extend_start_loc.long()[req]
        positions.copy_(pos.to(positions.dtype))


class TritonHelperOps(HelperOps):
    name = "triton"

    def write_kv(self, k_buffer, v_buffer, loc, k, v) -> None:
        from hal.kernels import triton as kernels

        kernels.write_kv(k_buffer, v_buffer, loc, k, v)

    def build_kv_indices(self, req_to_token, req_pool_indices, kv_start, kv_end, kv_indptr, kv_indices) -> None:
        from hal.kernels import triton as kernels

        kernels.build_kv_indices(req_to_token, req_pool_indices, kv_start, kv_end, kv_indptr, kv_indices)

    def compute_positions(self, extend_prefix_lens, extend_seq_lens, extend_start_loc, positions) -> None:
        from hal.kernels import triton as kernels

        kernels.compute_positions(extend_prefix_lens, extend_seq_lens, extend_start_loc, positions)


TORCH_OPS = TorchHelperOps()
TRITON_OPS = TritonHelperOps()


def helper_ops_for(backend: AttentionBackend) -> HelperOps:
    """Triton ops when the backend allows Triton and its device has a Triton target, else torch ops."""
    if backend.support_triton() and backend.capability.triton_target:
        return TRITON_OPS
    return TORCH_OPS
