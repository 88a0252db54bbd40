"""A node's shared expert store in one memory-mapped file: made by local rank 0, mapped by all.

Under torchrun no parent process exists to build a shared `ExpertStore` and hand its tensors to
the ranks (what `shared_expert_store` + `run_local` do in tests), so `node_expert_store(moes,
group)` does it collectively, with a file in /dev/shm (tmpfs, i.e. RAM; $MOESCALE_SHM_DIR
names another directory):

  1. rank 0 of the group removes the stores of dead owners (`sweep_stale_stores`: the files a
     SIGKILLed run left), picks the name `moescale-store-node<node>-<pid>-<random>-<host>.bin`
     and broadcasts it BEFORE the file exists, so from then on every rank knows what to clean;
  2. rank 0 checks the free space, creates the file exclusively (O_EXCL), sized for every
     layer's [E, 4, P] records and [E] step counts, maps it (`torch.from_file(shared=True)`:
     MAP_SHARED) and writes the fp32 masters of its model's GroupedExperts (gradients,
     moments and steps start at zero); it broadcasts "ok" (or its error, so no rank waits for
     a file that never came);
  3. the other ranks map the same file; a barrier;
  4. every rank removes the name. The mappings outlive it, so the memory goes back to the
     system when the last rank exits, however it exits, and nothing is left in /dev/shm.
     On any failure between 1 and 4 (an error, SIGTERM, a peer's death seen by a collective)
     every surviving rank removes it too: SIGKILL of rank 0 during set-up is cleaned by rank 1,
     and only SIGKILL of every rank at once leaves a file, which the next start removes (its
     owner pid is dead).

File layout, all float32: layer 0's data_E4P, layer 0's steps_E, layer 1's data_E4P, ...
Every rank must start from identical experts (same seed); only rank 0's are read. The group's
ranks must share one machine (the mapping is local): `moescale train` checks LOCAL_WORLD_SIZE.
Across nodes every node (group) makes its own store; `node` (the node's index) goes into the
name, so the stores of virtual nodes on one machine are told apart.

Not here: the store's semantics (offload/store.py), the experts computed on it
(experts.py, streamed.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

from moescale.layers.moe import MoE
from moescale.offload.store import MASTER, ExpertLayout, ExpertStore, StoreConfig
from moescale.parallel.all_to_all import broadcast_outcome, collective_errors
from moescale.shared_store.experts import (
    expert_master,
    grouped_experts_of,
    grouped_layout,
)
from moescale.sizes import fmt_bytes

DEFAULT_DIRECTORY = "/dev/shm"
DIRECTORY_VARIABLE = "MOESCALE_SHM_DIR"   # overrides the default (a tmpfs directory)
_NAME = re.compile(r"moescale-store-node\d+-(?P<pid>\d+)-[0-9a-f]{12}(?:-(?P<host>.+))?\.bin")


def _views(flat: torch.Tensor, layouts: Sequence[ExpertLayout],
           num_experts: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(data_E4P, steps_E) per layer: views of the flat mapping."""
    out, off = [], 0
    for layout, E in zip(layouts, num_experts):
        n = E * 4 * layout.numel
        out.append((flat[off:off + n].view(E, 4, layout.numel), flat[off + n:off + n + E]))
        off += n + E
    assert off == flat.numel(), (off, flat.numel())
    return out


def _create(path: str, numel: int, directory: str) -> torch.Tensor:
    need = 4 * numel
    if not os.path.isdir(directory):
        raise ValueError(f"the shared expert store goes to {directory!r}, which is not a "
                         "directory; dynamic placement needs a tmpfs such as /dev/shm")
    free = shutil.disk_usage(directory).free
    if free < need:
        raise OSError(errno.ENOSPC, f"the shared expert store needs "
                      f"{fmt_bytes(need, exact=True)} in {directory!r} but "
                      f"{fmt_bytes(free, exact=True)} are free; "
                      "give the machine (container) more shared memory, e.g. docker "
                      "--shm-size, or train a smaller model")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, need)
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=numel, dtype=torch.float32)


def shm_directory() -> str:
    """Where node stores go: $MOESCALE_SHM_DIR when set (e.g. one tmpfs directory per test
    worker, so that concurrent runs' files are told apart), else /dev/shm."""
    return os.environ.get(DIRECTORY_VARIABLE) or DEFAULT_DIRECTORY


def node_expert_store(moes: Sequence[MoE], group=None,
                      directory: str | None = None, node: int = 0) -> ExpertStore:
    """Collective over `group` (the ranks of node `node`): one host copy of the experts of
    `moes` (layer i = moes[i]) mapped by every rank, as an ExpertStore (see the module
    docstring). directory None: `shm_directory()`."""
    directory = shm_directory() if directory is None else directory
    if not os.path.isdir(directory):      # every rank of the node sees the same: all refuse
        raise ValueError(f"the node store's directory {directory!r} (${DIRECTORY_VARIABLE} or "
                         f"{DEFAULT_DIRECTORY}) is not a directory; point ${DIRECTORY_VARIABLE} "
                         "at a tmpfs directory")
    experts = [grouped_experts_of(m, "a shared expert store") for m in moes]
    layouts = [grouped_layout(x) for x in experts]
    num_experts = [x.num_experts for x in experts]
    numel = sum(E * (4 * lay.numel + 1) for lay, E in zip(layouts, num_experts))
    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    path, flat = None, None
    try:
        box = [None]
        if rank == 0:
            sweep_stale_stores(directory)      # what killed runs left behind
            box = [store_name(directory, node)]
        with collective_errors("shared-store name broadcast", group):
            dist.broadcast_object_list(box, src=src, group=group)
        path = box[0]        # from here on every rank removes the file if set-up fails
        message = ("ok", "")
        if rank == 0:
            try:
                flat = _create(path, numel, directory)
                for x, (data_E4P, _) in zip(experts, _views(flat, layouts, num_experts)):
                    for e in range(x.num_experts):
                        data_E4P[e, MASTER].copy_(expert_master(x, e))
            except (OSError, ValueError) as err:
                message = ("error", f"rank {src} could not create the shared expert store: {err}")
        broadcast_outcome(message, src, group, "shared-store status broadcast")
        if rank != 0:
            flat = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)
        with collective_errors("shared-store mapping barrier", group):
            dist.barrier(group=group)
    finally:       # success: every rank has mapped it; failure: nobody will
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return ExpertStore.attach(StoreConfig(tier="host", shared_memory=True), layouts,
                              _views(flat, layouts, num_experts))


def store_name(directory: str, node: int) -> str:
    """A fresh store path that names its owner: node, pid and host (for `sweep_stale_stores`)."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
    return os.path.join(directory, f"moescale-store-node{node}-{os.getpid()}-"
                        f"{secrets.token_hex(6)}-{host}.bin")


def owner_alive(pid: int) -> bool:
    """Whether process `pid` runs (another user's counts; a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True          # another user's process
    try:                     # a zombie (killed, not yet reaped) holds no mapping
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def sweep_stale_stores(directory: str) -> list[str]:
    """Remove the store files in `directory` whose owner (the pid in the name, on this host)
    is dead: what SIGKILLed runs left behind (a live run's file is never touched; it exists
    only while its ranks map it). Returns the names removed."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None or m.group("host") not in (None, host) or owner_alive(int(m.group("pid"))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, name))
            removed.append(name)
    return removed
