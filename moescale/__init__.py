"""moescale: Mixture-of-Experts training past the limits of accelerator memory and uneven routing.

Public API: the MoE block and its configuration, expert containers, routers, the reference
oracle, and `collect_aux_loss`. Subpackages hold the rest (see README and docs/).
"""

from moescale.layers.experts import GroupedExperts, ModuleExperts
from moescale.layers.moe import MoE, MoEConfig, MoEStats, collect_aux_loss
from moescale.layers.reference import ReferenceMoE
from moescale.models import GPT, GPTConfig, gpt_config, moefy
from moescale.offload import OffloadConfig, offload_moe
from moescale.routing.config import RouterConfig
from moescale.routing.routers import Router, RouterOutput

__version__ = "0.1.0"


def __getattr__(name: str):
    """`moescale.load_run(RUN_DIR)` (a trained run's model), imported on first use: it pulls
    in the trainer's modules, which `import moescale` should not."""
    if name == "load_run":
        from moescale.train.load_run import load_run

        return load_run
    raise AttributeError(f"module 'moescale' has no attribute {name!r}")

__all__ = [
    "GPT", "GPTConfig", "gpt_config", "moefy", "OffloadConfig", "offload_moe", "GroupedExperts", "ModuleExperts", "MoE", "MoEConfig", "MoEStats", "ReferenceMoE",
    "Router", "RouterConfig", "RouterOutput", "collect_aux_loss", "load_run", "__version__",
]
