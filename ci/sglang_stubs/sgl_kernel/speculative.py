"""STAND-IN for ``sgl_kernel.speculative`` of sgl_kernel's CPU build (see the package's docstring): the op SGLang's
CPU engine calls for NGRAM speculative decoding, in plain torch."""

import torch


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """The NGRAM draft tree's verify metadata from its mask, in place (the contract SGLang documents in
    sglang/kernels/ops/speculative/reconstruct_tree.py, which calls this on the CPU).

    ``tree_mask``: bool ``[bs * n * n]`` (``[b, i, j]``: node ``j`` is ``i`` or one of its ancestors); per node
    ``i`` of request ``b``: ``positions[b * n + i]`` = its strict ancestors + ``verified_seq_len[b]``;
    ``retrive_index[b, i] = b * n + i``; ``retrive_next_token[b, i]``: its first child (smallest ``k > i`` with
    ``i`` an ancestor), ``retrive_next_sibling[b, i]``: the smallest ``k > i`` of the same parent (the parent being
    the largest ancestor), -1 where there is none or ``i`` is the root."""
    n = draft_token_num
    if batch_size == 0:
        return
    nodes = torch.arange(n, device=tree_mask.device)
    lower = nodes[None, :] < nodes[:, None]  # [i, j]: j < i
    ancestors = tree_mask[: batch_size * n * n].view(batch_size, n, n).bool() & lower
    positions[: batch_size * n] = (ancestors.sum(2) + verified_seq_len[:batch_size, None]).flatten()
    retrive_index[:batch_size] = torch.arange(batch_size * n, device=tree_mask.device).view(batch_size, n)
    # first child of j: smallest row i > j with ancestors[i, j]
    child = torch.where(ancestors, nodes[None, :, None].expand_as(ancestors), n).min(1).values
    retrive_next_token[:batch_size] = torch.where(child < n, child, -1)
    parent = torch.where(ancestors, nodes[None, None, :], -1).max(2).values  # [b, i]
    same = (parent[:, :, None] == parent[:, None, :]) & lower[None]  # [b, k, i]: k > i, same parent
    sibling = torch.where(same, nodes[None, :, None], n).min(1).values  # [b, i]
    retrive_next_sibling[:batch_size] = torch.where((parent >= 0) & (sibling < n), sibling, -1)
