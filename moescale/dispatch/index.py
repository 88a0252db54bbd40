"""The index math every exchange shares: gathering consecutive row segments in a new order,
(source, expert)-major rows reordered to (expert, source)-major, and a permutation's inverse.

The static EP exchange (moescale.parallel.expert_parallel), the pipelined one's chunk layouts
(moescale.dispatch.chunk_layout) and dynamic placement's row layout
(moescale.dispatch.placed_layout) all build their row orders from these. Host lists in, index
tensors out; nothing here communicates.

Legend: S rows (of the tensor an index gathers from), W source ranks, L experts per rank.
"""

from __future__ import annotations

import torch


def segments_index(segments: list[tuple[int, int]], total: int, device) -> torch.Tensor | None:
    """Index gathering consecutive (start, length) segments of a `total`-row tensor, in the
    order given (out = x[index]); None when it is the identity."""
    shift_B, n_B, dst, identity = [], [], 0, True
    for start, n in segments:
        if n == 0:
            continue
        identity &= start == dst
        shift_B.append(start - dst)
        n_B.append(n)
        dst += n
    assert dst == total, (dst, total)
    if identity:
        return None
    shift_S = torch.repeat_interleave(torch.tensor(shift_B, device=device),
                                      torch.tensor(n_B, device=device), output_size=total)
    return torch.arange(total, device=device) + shift_S


def expert_major_order(recv_counts_WL: list[list[int]], device) -> tuple[torch.Tensor | None,
                                                                         list[int]]:
    """Index that reorders rows from (source, expert)-major to (expert, source)-major.

    Returns (perm_S or None when the order is already expert-major, local_counts_L) with
    expert_major = source_major[perm_S].
    """
    num_src = len(recv_counts_WL)
    num_local = len(recv_counts_WL[0]) if num_src else 0
    local_counts = [sum(recv_counts_WL[s][l] for s in range(num_src)) for l in range(num_local)]
    if num_src == 1 or num_local == 1:
        return None, local_counts
    src_start, offset = {}, 0
    for s in range(num_src):
        for l in range(num_local):
            src_start[s, l] = offset
            offset += recv_counts_WL[s][l]
    segments = [(src_start[s, l], recv_counts_WL[s][l])
                for l in range(num_local) for s in range(num_src)]
    return segments_index(segments, offset, device), local_counts


def inverse_permutation(perm_S: torch.Tensor) -> torch.Tensor:
    """inv_S with x == x[perm_S][inv_S]: rows gathered by perm_S go back where they were."""
    inv_S = torch.empty_like(perm_S)
    inv_S[perm_S] = torch.arange(perm_S.numel(), device=perm_S.device)
    return inv_S
