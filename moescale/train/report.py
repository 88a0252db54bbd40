"""report.png of a run: loss curves, throughput, the training signals and the expert-load
heatmap, from metrics.jsonl.

Seven panels: train loss per step with validation loss points (log scale) and the learning
rate (right axis); tokens/s per step (and its
running median); the aux (balance) loss; the global gradient norm (log scale past a 10x
range); the load imbalance, max/mean of each MoE layer's tokens per expert (the worst layer)
and, with several devices, the modelled device load (and static placement's, under dynamic
placement); the share of each step's time that compute waited for offloaded experts (wait_s
over the step time; a note without axes when the experts were resident); a heatmap of each
expert's share of its layer's routed tokens over the steps, one row per (MoE layer, expert),
each row labelled with its expert up to 64 rows, layers separated by lines (an evenly loaded layer is a flat colour at 1/E). Matplotlib with
the Agg backend, so it works without a display.

This file reads metrics; it never touches the model or the training state.
"""

from __future__ import annotations

import math
from pathlib import Path

from moescale.atomic import atomic_path
from moescale.train.metrics import read_metrics


def _running_median(values: list[float], window: int = 25) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = sorted(values[max(0, i - window + 1):i + 1])
        out.append(chunk[len(chunk) // 2])
    return out


def _series(train: list[dict], key: str, steps: list[int]) -> tuple[list, list]:
    """(steps, values) of the records that hold a finite number under key."""
    pairs = [(s, float(r[key])) for s, r in zip(steps, train)
             if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _signal_panels(axes, train: list[dict], steps: list[int]) -> None:
    """aux loss, grad norm, load imbalance, expert wait (see the module docstring)."""
    ax = axes[0]
    ax.plot(*_series(train, "aux_loss", steps), lw=0.8)
    ax.set_title("aux (balance) loss")
    ax.set_ylabel("aux loss")

    ax = axes[1]
    xs, norms = _series(train, "grad_norm", steps)
    if norms:
        ax.plot(xs, norms, lw=0.8)
        if min(norms) > 0 and max(norms) > 10 * min(norms):
            ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "not measured (eager expert steps)", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_title("gradient norm (before clipping)")
    ax.set_ylabel("global L2 norm")

    ax = axes[2]
    for key, label in (("imbalance", "tokens per expert (worst layer)"),
                       ("device_load_max_over_mean", "device load (modelled)"),
                       ("static_load_max_over_mean", "device load, static placement")):
        xs, values = _series(train, key, steps)
        if values:
            ax.plot(xs, values, lw=0.8, label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_title("load imbalance (max / mean; 1 = even)")
    ax.set_ylabel("max / mean")
    ax.legend(fontsize="small")

    ax = axes[3]
    share = [(s, 100 * r["wait_s"] * r["tokens_per_s"] / r["tokens"])
             for s, r in zip(steps, train)
             if r.get("wait_s") is not None and r.get("tokens_per_s") and r.get("tokens")]
    if any(v > 0 for _, v in share):
        ax.plot([s for s, _ in share], [v for _, v in share], lw=0.6, alpha=0.5,
                label="per step")
        ax.plot([s for s, _ in share], _running_median([v for _, v in share]), lw=1.5,
                label="running median")
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no waits: every expert resident on the device", ha="center",
                va="center", transform=ax.transAxes)
        ax.set_axis_off()        # a note, not an empty plot
    ax.set_title("expert wait (uploads, fences, disk reads)")
    ax.set_ylabel("% of step time")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)


def write_report(run_dir: str | Path, path: str | Path | None = None) -> Path | None:
    """Draw report.png (or `path`) from run_dir/metrics.jsonl; None when nothing was logged."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r.get("kind") == "train"]
    vals = [r for r in records if r.get("kind") == "val"]
    if not train:
        return None
    out = Path(path) if path is not None else run_dir / "report.png"
    steps = [r["step"] for r in train]
    fig = plt.figure(figsize=(13, 15))
    grid = fig.add_gridspec(4, 2, height_ratios=[1, 1, 1, 1.4])
    axes = [fig.add_subplot(grid[r, c]) for r in range(3) for c in range(2)]
    axes.append(fig.add_subplot(grid[3, :]))

    ax = axes[0]
    ax.plot(steps, [r["loss"] for r in train], lw=0.8, alpha=0.8, label="train")
    if vals:
        ax.plot([r["step"] for r in vals], [r["val_loss"] for r in vals], "o-", ms=4,
                label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token, log scale)")
    ax.set_yscale("log")       # the late, flat part of a run stays readable
    ax.set_title(f"loss — {run_dir.name}")
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, [r.get("lr", float("nan")) for r in train], color="grey", lw=0.8,
               ls="--", label="learning rate")
    lr_ax.set_ylabel("learning rate")
    lines = ax.get_legend_handles_labels()
    more = lr_ax.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1])

    ax = axes[1]
    rates = [r.get("tokens_per_s", 0.0) for r in train]
    ax.plot(steps, rates, lw=0.6, alpha=0.5, label="per step")
    ax.plot(steps, _running_median(rates), lw=1.5, label="running median")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s")
    ax.set_title("throughput")
    ax.grid(alpha=0.3)
    ax.legend()

    _signal_panels(axes[2:6], train, steps)

    ax = axes[6]
    counts = [r.get("tokens_per_expert") or [] for r in train]
    if counts and counts[0]:
        num_layers, num_experts = len(counts[0]), len(counts[0][0])
        share_ST = np.zeros((num_layers * num_experts, len(train)))
        for t, per_layer in enumerate(counts):
            for layer, counts_E in enumerate(per_layer):
                total = max(1, sum(counts_E))
                share_ST[layer * num_experts:(layer + 1) * num_experts, t] = \
                    np.asarray(counts_E, dtype=float) / total
        im = ax.imshow(share_ST, aspect="auto", interpolation="nearest", cmap="viridis",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5,
                               num_layers * num_experts - 0.5, -0.5))
        for layer in range(1, num_layers):
            ax.axhline(layer * num_experts - 0.5, color="white", lw=1)
        ax.set_yticks([layer * num_experts + (num_experts - 1) / 2
                       for layer in range(num_layers)])
        ax.set_yticklabels([f"MoE layer {layer}" for layer in range(num_layers)])
        if num_layers * num_experts <= 64:      # each row's expert, where it stays legible
            ax.set_yticks(range(num_layers * num_experts), minor=True)
            ax.set_yticklabels([f"e{e}" for _ in range(num_layers) for e in range(num_experts)],
                               minor=True, fontsize="x-small")
            ax.tick_params(axis="y", which="major", pad=22)
        fig.colorbar(im, ax=ax, label=f"share of the layer's routed tokens (even = "
                                      f"{1 / num_experts:.3f})")
        ax.set_title(f"tokens per expert ({num_experts} experts per layer) over time")
        ax.set_xlabel("step")
    else:
        ax.text(0.5, 0.5, "no MoE layers", ha="center", va="center")
        ax.set_axis_off()
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)
    return out
