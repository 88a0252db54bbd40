"""Expert offloading (ES-MoE): experts live in a host / disk ExpertStore, stream through a
device cache, and step on the host. Entry point: `offload_moe(model, OffloadConfig(...))`.

See docs/offloading.md for the data flow, fences and memory accounting.
"""

from moescale.offload.config import OffloadConfig
from moescale.offload.engine import OffloadEngine
from moescale.offload.entry import offload_moe
from moescale.offload.optimizer import AdamWConfig, HostOptimizer
from moescale.offload.store import ExpertLayout, ExpertStore, StoreConfig

__all__ = ["AdamWConfig", "ExpertLayout", "ExpertStore", "HostOptimizer", "OffloadConfig",
           "OffloadEngine", "StoreConfig", "offload_moe"]
