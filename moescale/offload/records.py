"""The disk tier's record format: an expert's four fp32 rows in one file (and one host slot).

Rows at a stride of `align_up(4 P)` bytes (a multiple of 4 KiB, as direct I/O needs), in the
order MASTER, EXP_AVG, EXP_AVG_SQ, GRAD: what a step needs (master and moments) is one
contiguous range, and the gradient row, zero between steps, comes last. Subsets of rows are bit
masks over these positions (M, A, S, G; STATE = what persists between steps, ALL).

Deliberately not here: the cache of records (disk_tier.py), checkpoint manifests
(checkpoint.py).

Legend: P parameters of one expert.
"""

from __future__ import annotations

# row positions in a record file / slot
POS_MASTER, POS_EXP_AVG, POS_EXP_AVG_SQ, POS_GRAD = 0, 1, 2, 3
M, A, S, G = 1, 2, 4, 8          # bit masks of those rows
STATE = M | A | S                # what persists between steps
ALL = STATE | G


def rows_of(mask: int) -> list[int]:
    return [p for p in range(4) if mask >> p & 1]

