"""`StoreAccess`: one layer of an ExpertStore as moescale.layers.state_access.ExpertState.

Per expert the master, the two moments and a step count (records of the store's format; a
compact format is decoded on read and encoded on write). The gradient accumulator is not state
between steps: writing an expert zeroes it. Offloaded containers (offload/experts.py) and the
node's shared stores (moescale.shared_store) return it from `state_access`.

Legend: P parameters of one expert.
"""

from __future__ import annotations

import torch

from moescale.layers.state_access import Moments, Tensors
from moescale.offload.records import STATE
from moescale.offload.store import ExpertStore


class StoreAccess:
    """One layer of an ExpertStore: records of master, gradient accumulator and moments."""

    def __init__(self, key: str, store: ExpertStore, layer: int, engine=None,
                 stacked: bool = True) -> None:
        self.key, self.store, self.layer, self.engine = key, store, layer, engine
        self.stacked = stacked
        layout = store.layouts[layer]
        self.spec = list(zip(layout.names, layout.shapes))
        self.layout = layout

    @property
    def tier(self) -> str:
        return self.store.config.tier

    def masters(self, l: int) -> Tensors:
        """Copies of expert l's fp32 master (any tier; a bf16 master converts exactly)."""
        key = (self.layer, l)
        rec = self.store.acquire(key)
        try:
            return dict(self.layout.split(rec.master_P.to(torch.float32, copy=True)))
        finally:
            self.store.release(key)

    def read(self, l: int) -> tuple[Tensors, Moments]:
        """A host-tier record's fp32 state: views, or decoded copies of compact state (the
        disk tier is saved by linking its files)."""
        assert self.tier == "host", "disk-tier records are linked, not read"
        key, split = (self.layer, l), self.layout.split
        if not self.store.format.exact:
            master_P, exp_avg_P, exp_avg_sq_P = self.store.get_state(key)
            return split(master_P), (split(exp_avg_P), split(exp_avg_sq_P),
                                     self.store.step_of(key))
        rec = self.store.acquire(key)
        self.store.release(key)
        return split(rec.master_P), (split(rec.exp_avg_P), split(rec.exp_avg_sq_P),
                                     float(rec.step_t))

    @torch.no_grad()
    def write(self, l: int, master: Tensors, moments: Moments | None) -> None:
        key = (self.layer, l)
        if not self.store.format.exact:    # encoded in the store's format
            flat = [None if values is None else
                    torch.cat([values[n].reshape(-1).float() for n in self.layout.names])
                    for values in (master, *(moments[:2] if moments else (None, None)))]
            self.store.put_state(key, *flat)
            self.store.set_step(key, 0.0 if moments is None else moments[2])
            self.store.bump_version(key)
            return
        rec = self.store.acquire(key, STATE)
        try:
            split = self.layout.split
            for rows, values in ((rec.master_P, master),
                                 (rec.exp_avg_P, None if moments is None else moments[0]),
                                 (rec.exp_avg_sq_P, None if moments is None else moments[1])):
                for name, view in split(rows).items():
                    if values is None:
                        view.zero_()
                    else:
                        view.copy_(values[name])
            if rec.data_4P is not None:       # host tier; the disk tier drops the row below
                rec.grad_P.zero_()
            self.store.set_step(key, 0.0 if moments is None else moments[2])
            self.store.bump_version(key)      # device copies of the old state are stale
        finally:
            self.store.release(key, dirty=True, rows=STATE, grad_zero=True)

    def finish(self) -> None:
        pass
