"""Rank functions of test_dense_dcp.py: a small model trained one-process, replicated over 2
gloo ranks (gradients all-reduced) or sharded over them with FSDP2's `fully_shard`, saving and
resuming its dense checkpoint through moescale.train.dense_dcp at any of those layouts.

Every layout sees the same global batch of each step (a rank its equal slice of the rows), so
the losses agree up to the reduction order. Legend: B batch rows, D width.
"""

from __future__ import annotations

import io
import os
import signal

import torch
import torch.distributed as dist
from torch import nn

from moescale.train import dense_dcp
from moescale.train.dense_dcp import dense_metadata, load_dense, save_dense, verify_dense
from moescale.train.named_state import dense_state, load_dense_state, load_targets
from moescale.train.ranks import OneProcess, WorldRanks

ROWS, WIDTH, CLASSES = 8, 16, 4


class Net(nn.Module):
    """Embedding-like input layer, two blocks (the units fully_shard shards), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                                  nn.Linear(2 * WIDTH, WIDTH),
                                                  nn.LayerNorm(WIDTH)) for _ in range(2))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x_BD):
        h_BD = self.inp(x_BD)
        for block in self.blocks:
            h_BD = h_BD + block(h_BD)
        return self.head(h_BD)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, 8, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g)


def build(layout: str, world: int):
    torch.manual_seed(0)
    model = Net()
    if layout == "sharded":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    return model, opt


def full_state(model, opt) -> dict[str, torch.Tensor]:
    """Every dense tensor whole (a DTensor gathered: collective), for exact comparisons."""
    tensors, _ = dense_state(model, opt, set())
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in tensors.items()}


def train_on_ranks(rank: int, world: int, *args):
    """`train` on a rank of run_local; the state comes back as torch.save bytes (a tensor
    through the result queue would be shared memory the ending process takes away)."""
    losses, entry, rest, state = train(rank, world, *args)
    buf = io.BytesIO()
    torch.save(state, buf)
    return losses, entry, rest, buf.getvalue()


def train(rank: int, world: int, layout: str, directory: str, steps: int,
          save_at: int | None = None, resume: dict | None = None, die_at: int | None = None):
    """Train to `steps` (from `resume`'s step when given: {"entry", "rest", "step"}); save
    the dense half at `save_at`; at `die_at` save again and SIGKILL this process once every
    rank's DCP files are written (before the manifest and the rename). Returns (losses, entry,
    rest, state at save or at load)."""
    ranks = OneProcess() if world == 1 else WorldRanks(30)
    model, opt = build(layout, world)
    first, entry, rest, state = 0, None, None, None
    if resume is not None:
        verify_dense(directory, resume["entry"], ranks)
        targets = load_targets(model, opt, dense_metadata(directory, resume["entry"]), set())
        load_dense(directory, resume["entry"], targets)
        load_dense_state(model, opt, targets, resume["rest"], set())
        first, state = resume["step"], full_state(model, opt)
    losses = []
    for step in range(first, steps):
        x_BD, y_B = batch(step)
        rows = ROWS // world
        x_BD, y_B = x_BD[rank * rows:(rank + 1) * rows], y_B[rank * rows:(rank + 1) * rows]
        loss = nn.functional.cross_entropy(model(x_BD), y_B)
        loss.backward()
        if layout == "replicated":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
        losses.append(value.item() / world)
        if step + 1 == die_at:
            dense_dcp._publish = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
            save_dense(dense_state(model, opt, set())[0], directory, die_at, ranks)
        if step + 1 == save_at:
            tensors, rest = dense_state(model, opt, set())
            entry = save_dense(tensors, directory, save_at, ranks)
            state = full_state(model, opt)
    return losses, entry, rest, state
