"""The end of a `moescale train` run: summary.json, report.png and the summary printed, plus the
per-step load numbers the progress bar shows.

`summarise(trainer, ...)` reads the run's metrics.jsonl back, adds the memory peaks (host RSS,
the device's and, on the disk tier, the store's bytes) and the run's plan (train/assembly.py), writes
summary.json and report.png and prints the summary: run dir, data, model, steps, train loss
(mean of the last 20 steps), validation loss, tokens/s, threads, peak memory per tier, offload
plan, the modelled device load when several devices ran, the seconds compute waited for
offloaded experts (total over the logged steps, `wait_s`, and its share of their step time,
`wait_share`). `imbalance`, `postfix_text` and `load_text` are the per-step numbers of the
metrics record and the progress bar.

Not here: the loop (trainer.py), the numbers' meaning (metrics.py), the plot (report.py).
"""

from __future__ import annotations

import resource

import torch

from moescale.atomic import atomic_write_json
from moescale.sizes import fmt_bytes
from moescale.train.metrics import read_metrics
from moescale.train.report import write_report

LOAD_KEYS = ("device_load_max_over_mean", "static_load_max_over_mean")


def imbalance(counts_LE: list[list[int]]) -> float:
    """max over layers of (max / mean) tokens per expert: 1.0 is perfectly balanced."""
    worst = 1.0
    for counts_E in counts_LE:
        mean = sum(counts_E) / max(1, len(counts_E))
        if mean > 0:
            worst = max(worst, max(counts_E) / mean)
    return worst


def postfix_text(record: dict, rate: float, streamed: bool) -> str:
    """The progress bar's postfix for a step: loss, tokens/s (`rate`, smoothed), lr, expert
    imbalance, the modelled device load (if logged) and, with streamed experts, wait_s."""
    wait = f" wait {record['wait_s']:.3f}s" if streamed else ""
    return (f"loss {record['loss']:.3f} tok/s {rate:,.0f} lr {record['lr']:.2e} "
            f"imb {record['imbalance']:.2f}" + wait + load_text(record))


def load_text(record: dict) -> str:
    """The tqdm postfix part for a step's modelled device load (max/mean), if logged."""
    if "device_load_max_over_mean" not in record:
        return ""
    static = record.get("static_load_max_over_mean")
    return f" load {record['device_load_max_over_mean']:.2f}" + \
        (f" (static {static:.2f})" if static is not None else "")


def _mean_loads(train: list[dict]) -> dict:
    """The run's mean of each logged max/mean device load (summary.json)."""
    out = {}
    for key in LOAD_KEYS:
        values = [r[key] for r in train if key in r]
        if values:
            out[f"mean_{key}"] = sum(values) / len(values)
    return out


def _load_lines(s: dict) -> list[str]:
    if "mean_device_load_max_over_mean" not in s:
        return []
    static = s.get("mean_static_load_max_over_mean")
    return [f"device load:  max/mean {s['mean_device_load_max_over_mean']:.3f} "
            f"(modelled rows, mean over the run's steps; {s['placement']} placement)"
            + (f", static placement {static:.3f}" if static is not None else "")]


def _wait_lines(s: dict) -> list[str]:
    """The seconds compute waited for offloaded experts, when it did."""
    if not s.get("wait_s"):
        return []
    return [f"expert wait:  {s['wait_s']:.1f} s ({s['wait_share']:.1%} of the step time: "
            "uploads, their fences and disk reads)"]


def _pipeline_lines(s: dict) -> list[str]:
    """The chunk count and strategy each pipelined layer chose on its last call."""
    if not s.get("pipeline"):
        return []
    picks = {}
    for name, (chunks, strategy) in s["pipeline"].items():
        picks.setdefault((chunks, strategy), []).append(name)
    return ["pipeline:     " + "; ".join(
        f"{chunks} chunks, {strategy} ({len(names)} layer{'s' * (len(names) > 1)})"
        for (chunks, strategy), names in picks.items()) + " (last step)"]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def summarise(trainer, train_time: float, train_tokens: int, wall: float, last_ckpt,
              sample: str, memory: dict) -> dict:
    """summary.json and report.png of the trainer's run, and the summary printed to its out;
    returns the summary (also sets trainer.plan_text, the plan's one line)."""
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    vals = [r for r in records if r["kind"] == "val"]
    tail = train[-20:]
    memory = {"host_peak_rss_bytes": peak_rss_bytes(), **memory}
    if trainer.device.type == "cuda" and "device_peak_bytes" not in memory:
        memory["device_peak_bytes"] = torch.cuda.max_memory_allocated(trainer.device)
    plan, trainer.plan_text = trainer.parts.plan(trainer.device)
    summary = {
        "kind": "summary", "step": trainer.step, "steps": trainer.config.train.steps,
        "train_loss": sum(r["loss"] for r in tail) / len(tail) if tail else None,
        "train_loss_steps": len(tail),
        "val_loss": vals[-1]["val_loss"] if vals else None,
        "tokens_per_s": train_tokens / train_time if train_time else None,
        "wall_s": wall, "memory": memory, "offload_plan": plan,
        "world_size": trainer.ranks.world_size,
        "device": str(trainer.device), "params_total": trainer.params.total,
        "params_active": trainer.params.active, "checkpoint": str(last_ckpt),
        "resumed_from": trainer.resumed_from,
        "placement": trainer.config.parallel.placement, **_mean_loads(train),
        "wait_s": sum(r.get("wait_s", 0.0) for r in train),
        "wait_share": sum(r.get("wait_s", 0.0) for r in train) / max(1e-9, sum(
            r["tokens"] / r["tokens_per_s"] for r in train if r.get("tokens_per_s"))),
        "pipeline": next((r["pipeline"] for r in reversed(train) if "pipeline" in r), None),
    }
    report = write_report(trainer.run_dir) if trainer.config.train.report else None
    summary["report"] = str(report) if report else None
    summary["sample"] = sample
    meter = getattr(trainer, "sample_meter", None)
    summary["sample_stats"] = meter.summary() if meter is not None and sample else None
    atomic_write_json(trainer.run_dir / "summary.json", summary)
    print_summary(trainer, summary)
    return summary


def print_summary(trainer, s: dict) -> None:
    fmt = (lambda v, f: format(v, f) if v is not None else "n/a")
    mem = s["memory"]
    tiers = f"host RSS {fmt_bytes(mem['host_peak_rss_bytes'])}"
    if "device_peak_bytes" in mem:
        budget = mem.get("device_budget_bytes")
        tiers += f", device {fmt_bytes(mem['device_peak_bytes'])}" + \
            (f" (budget {fmt_bytes(budget)})" if budget else "")
    if "disk_bytes" in mem:
        tiers += (f", disk {fmt_bytes(mem['disk_bytes'])} (read "
                  f"{fmt_bytes(mem['disk_read_bytes'])}, written "
                  f"{fmt_bytes(mem['disk_written_bytes'])})")
    cfg, model = trainer.config, trainer.model.config
    lines = [
        f"run dir:      {trainer.run_dir}",
        f"data:         {trainer.data.description}",
        f"model:        {cfg.model.hf or cfg.model.size}, {trainer.params.total:,} parameters "
        f"({trainer.params.active:,} active per token), {len(trainer.moe_layers)} MoE layers x "
        f"{model.moe.num_experts} experts top-{model.moe.top_k}",
        f"steps:        {s['step']}/{s['steps']}",
        f"train loss:   {fmt(s['train_loss'], '.4f')} "
        f"(mean of the last {s.get('train_loss_steps', 20)} steps)",
        f"val loss:     {fmt(s['val_loss'], '.4f')}",
        f"tokens/s:     {fmt(s['tokens_per_s'], ',.0f')}   wall time {s['wall_s']:.1f} s   "
        f"threads {cfg.train.threads} ({trainer.threads_note})",
        f"peak memory:  {tiers}",
        f"offload plan: {trainer.plan_text}",
        *_load_lines(s),
        *_wait_lines(s),
        *_pipeline_lines(s),
        f"report:       {s['report'] or 'not drawn (train.report false)'}",
    ]
    if s["sample"]:
        meter = getattr(trainer, "sample_meter", None)
        lines += [f"sample {line}" for line in (meter.lines() if meter is not None else [])]
        lines.append("sample:\n" + s["sample"])
    print("\n".join(lines), file=trainer.out)
