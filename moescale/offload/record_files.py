"""Writing a layer of the disk tier's record files at set-up: each expert's master row (in the
store's format), its moment rows and gradient row left as a sparse tail (zero, no blocks).

Files a previous run left in the layer's directory are unlinked first, never written over (a
checkpoint may hold hard links to them). A master given as None is zero and left unwritten
too: the caller adopts or writes the real one next (a generation store filled from a
checkpoint). Returns every expert's chunk sums by row position, as the disk tier keeps them.

Deliberately not here: reading and writing records during training (disk_tier.py).
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

import torch

from moescale.offload.direct_io import DirectIO, SlotPool, chunk_sums
from moescale.offload.records import POS_EXP_AVG, POS_EXP_AVG_SQ, POS_MASTER
from moescale.offload.state_format import RecordGeometry


def write_layer_files(io: DirectIO, directory: str, path_of: Callable[[int], str],
                      geo: RecordGeometry, num_experts: int, init) -> Iterator[dict]:
    """Write expert e's file at path_of(e) for e in range(num_experts), yielding its sums."""
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        if name.startswith("expert") and name.endswith(".bin"):
            os.unlink(os.path.join(directory, name))
    zeros = {pos: chunk_sums(torch.zeros(geo.strides[pos], dtype=torch.uint8), io.chunk_bytes)
             for pos in (POS_MASTER, POS_EXP_AVG, POS_EXP_AVG_SQ)}
    staging = SlotPool(1, geo.strides[POS_MASTER])
    row_u8 = staging.slots[0]
    row_P = geo.typed(row_u8, POS_MASTER)     # fp32, or bf16 (rounded to nearest)
    try:
        for e in range(num_experts):
            master_P = init(e)
            path = path_of(e)
            if master_P is None:
                sums = zeros[POS_MASTER]
                open(path, "xb").close()
            else:
                row_P.copy_(master_P)
                sums = io.write(path, 0, row_u8, create=True).result()
            os.truncate(path, geo.total)
            yield {**zeros, POS_MASTER: sums}
    finally:
        staging.close()
