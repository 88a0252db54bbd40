"""`OffloadConfig(tier="auto")`: let the planner choose the offloading mode for a model.

`resolve_auto(model, config)` describes the model's MoE layers to the planner (width, expert
hidden width, expert count, top-k, GLU, dense parameter count, compute dtype, the config's
`tokens_per_micro_batch`), takes the budgets from the config (device: required; host: the
config's `host_budget_bytes` or the memory available now; disk: the free space of
`directory`, 0 without one), the rates measured on this machine at the model's sizes
(`rates="measure"`: medians of warm timings, a quicker probe than `moescale plan`'s; the disk
probed under `directory` only) or
ES-MoE's A100 node (`rates="a100"`), and maps the planner's pick onto a concrete config:

    device -> host tier with every expert pinned on the device (pin_fraction=1.0)
    pin    -> host tier, the hottest 25% pinned
    host   -> host tier
    disk   -> disk tier under `directory` (host cache: the config's or half the host budget)

Deliberately not here: re-planning during training (the pick is made once).
"""

from __future__ import annotations

import dataclasses
import shutil

import psutil
from torch import nn

from moescale.dispatch.protocol import FFN_SHAPE, capabilities_of
from moescale.layers.moe import MoE
from moescale.offload.planner import A100_NODE, Budgets, ModelSpec, plan
from moescale.offload.rates import measure_rates


# The start of a run measures less than `moescale plan` (1 GiB disk passes, 2 + 5 rounds: about
# 14 GiB written and 18 s here): 256 MiB passes, 1 + 3 rounds (3 GiB, 2-3 s). Enough to
# pick a mode; a virtual disk's host cache may flatter the disk reads of so small a probe.
QUICK_PROBE = dict(runs=3, warmup=1, disk_file_bytes=256 << 20)


def model_spec(model: nn.Module, tokens: int, dtype: str, master: str = "fp32",
               moments: str = "fp32") -> ModelSpec:
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        raise ValueError("tier='auto' found no MoE layer in the model")
    first = moes[0]
    expert_ids = {id(p) for m in moes for p in m.experts.parameters()}
    dense = sum(p.numel() for p in model.parameters() if id(p) not in expert_ids)
    glu = FFN_SHAPE in capabilities_of(first.experts) and first.experts.glu
    return ModelSpec(moe_layers=len(moes), d_model=first.config.d_model,
                     d_ff=first.config.d_ff, num_experts=max(m.num_experts for m in moes),
                     top_k=first.config.top_k, tokens=tokens, glu=glu, dtype=dtype,
                     dense_params=dense, master=master, moments=moments)


def resolve_auto(model: nn.Module, config):
    """(concrete OffloadConfig, the planner's estimates, its pick) for tier='auto'."""
    spec = model_spec(model, config.tokens_per_micro_batch, config.compute_dtype,
                      config.master, config.moments)
    host = config.host_budget_bytes
    if host is None:
        host = psutil.virtual_memory().available
    disk = shutil.disk_usage(config.directory).free if config.directory else 0
    budgets = Budgets(device_bytes=config.device_budget_bytes, host_bytes=host,
                      disk_bytes=disk, host_cache_bytes=config.host_cache_bytes)
    rates = measure_rates(config.directory, disk=config.directory is not None,
                          **QUICK_PROBE, **spec.probe_sizes()) \
        if config.rates == "measure" else A100_NODE
    estimates, pick = plan(spec, budgets, rates, step_mode=config.step_mode,
                           pin_fraction=0.25, lookahead=config.lookahead)
    if pick is None:
        table = "; ".join(f"{e.mode}: device {e.device_bytes} host {e.host_bytes} disk "
                          f"{e.disk_bytes}" for e in estimates)
        raise ValueError(f"tier='auto': no offloading mode fits the budgets (device "
                         f"{budgets.device_bytes}, host {budgets.host_bytes}, disk "
                         f"{budgets.disk_bytes} bytes; needs {table}); raise a budget or give "
                         "a disk directory")
    changes = dict(tier="host", pin_fraction={"device": 1.0, "pin": 0.25}.get(pick, 0.0))
    if pick == "disk":
        changes = dict(tier="disk", pin_fraction=0.0, host_cache_bytes=(
            config.host_cache_bytes if config.host_cache_bytes is not None else host // 2))
    return dataclasses.replace(config, **changes), estimates, pick
