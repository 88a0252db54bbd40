"""Per-rank sharded checkpoints of expert state: save and resume at any rank count, no gather.

    entry = save_expert_shards(model, ckpt_dir, rank=rank, tag=f"{step:08d}",
                               optimizer=opt, engine=engine)      # every rank, its own experts
    entries = all_gather_object(entry)                             # the caller's commit point
    ...
    load_expert_shards(model, ckpt_dir, entries, optimizer=opt, engine=engine)   # any layout

Each rank writes the experts it holds (resident expert-parallel shards with their AdamW
moments from the torch optimizer, offloaded experts' store records, a node-shared store's
block), keyed by layer and GLOBAL expert id, into its own directory, atomically, with a
checksum per tensor; disk-tier records are hard-linked, not copied. Each rank then loads only
the experts it holds at resume, whatever the writer ranks held, verifying before it changes
anything. No process ever holds more than its own experts (plus one tensor or one record).

Modules: save.py, load.py (the two calls), index.py (format, manifest entry,
`ShardCheckpointError`), holdings.py (what a model holds; `expert_state_keys`,
`expert_parameters` for the dense half), tensorfile.py (safetensors one tensor at a time).
The dense half of a checkpoint and the commit point are the caller's (moescale/train/).
"""

from moescale.expert_state.holdings import expert_parameters, expert_state_keys
from moescale.expert_state.index import FORMAT, SHARDS_PREFIX, ShardCheckpointError, shards_dir
from moescale.expert_state.load import load_expert_shards
from moescale.expert_state.save import save_expert_shards

__all__ = ["FORMAT", "SHARDS_PREFIX", "ShardCheckpointError", "expert_parameters",
           "expert_state_keys", "load_expert_shards", "save_expert_shards", "shards_dir"]
