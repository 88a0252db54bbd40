"""Node-shared expert stores for dynamic placement (ES-MoE): one copy of a node's experts that
the node's ranks share, and the residencies built on it.

The dispatcher that places experts on ranks every iteration is `moescale.parallel.dynamic`
(it reaches experts only through the ExpertContainer Protocol); the stores are
`moescale.offload`'s ExpertStore. This package is where the two meet, so that neither imports
the other:

- experts.py: `SharedStoreExperts` (a layer's experts computed on the shared host copy),
  `shared_expert_store`, `dynamic_placement_moe`, `step_shared_experts`, `owned_experts`;
- node_store.py: `node_expert_store` (the node's store in /dev/shm, made by local rank 0,
  mapped by the others), `sweep_stale_stores`;
- node_disk.py: the same store on the disk tier (`node_disk_store`, the ranks' file views);
- streamed.py: `StreamedSharedExperts` (the store streamed through each rank's device budget);
- residency.py: `DynamicOffload` (dynamic placement with offload.tier host or disk);
- step.py: the expert-step handles `SharedStoreStep`, `StreamedStoreStep`.
See docs/dynamic_placement.md.
"""

from moescale.shared_store.experts import (SharedStoreExperts, dynamic_placement_moe,
                                           shared_expert_store, step_shared_experts)

__all__ = ["SharedStoreExperts", "dynamic_placement_moe", "shared_expert_store",
           "step_shared_experts"]
