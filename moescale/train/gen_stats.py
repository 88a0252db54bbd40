"""Generation statistics per phase (prefill, decode): tokens/s, bytes read, expert cache hits, RSS.

    meter = GenerationMeter(model, engine)
    model.generate(idx_BS, n, on_token=meter.on_token)
    print("\\n".join(meter.lines()))

`GPT.generate` calls `on_token(phase, positions)` after each forward ("prefill": the prompt, or
the window kept by a context shift; "decode": one position per sequence). Per phase the meter
sums, between consecutive calls:
- seconds, forwards, positions fed and tokens generated (tokens/s = generated / seconds for
  decode; prefill reports positions/s);
- `read_bytes` of /proc/self/io: what this process (all its threads) read from the block
  device, i.e. measured at the device, not by the store's own count (page-cache hits and tmpfs
  read nothing there);
- expert uses: per forward and MoE layer, the experts its tokens route to (`MoE.last_stats`);
  expert reads: the disk-tier store's master reads (its bytes read / one master's bytes), so
  the host cache's hit rate is 1 - reads / uses and the routed bytes (uses x master bytes) are
  what a forward would read with no cache;
- peak RSS: VmHWM of /proc/self/status, reset (/proc/self/clear_refs "5") after every forward,
  so each phase has its own peak.

The probes are moescale.bench.disk_probe's (ProcessIO, reset_peak_rss, peak_rss_bytes; Linux).

Legend: B batch.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from moescale.layers.moe import MoE
from moescale.sizes import fmt_bytes
from moescale.offload.records import POS_MASTER
from moescale.proc_stats import ProcessIO, peak_rss_bytes, reset_peak_rss


@dataclass
class Phase:
    forwards: int = 0
    positions: int = 0       # positions fed, summed over the batch
    tokens: int = 0          # tokens generated, summed over the batch
    seconds: float = 0.0
    read_bytes: int = 0      # /proc/self/io read_bytes
    expert_uses: int = 0
    expert_reads: int = 0
    peak_rss: int = 0

    def rates(self, master_bytes: int) -> dict:
        n = max(1, self.tokens)
        out = dict(tokens_per_s=self.tokens / self.seconds if self.seconds else 0.0,
                   positions_per_s=self.positions / self.seconds if self.seconds else 0.0,
                   read_bytes_per_token=self.read_bytes / n,
                   routed_bytes_per_token=self.expert_uses * master_bytes / n)
        out["hit_rate"] = (1 - self.expert_reads / self.expert_uses) \
            if self.expert_uses and master_bytes else None
        return out


class GenerationMeter:
    """Collects `Phase` figures from GPT.generate's on_token calls (see the module docstring)."""

    def __init__(self, model, engine=None) -> None:
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]
        self.store = None if engine is None else engine.store   # an OffloadEngine's store
        disk = None if self.store is None else self.store.disk
        self.master_bytes = max(geo.strides[POS_MASTER] for geo in disk.geometries) \
            if disk is not None and disk.numels else 0      # a master row, in its format
        self.phases = {"prefill": Phase(), "decode": Phase()}
        self.start()

    def start(self) -> None:
        """Begin measuring now (call right before generate)."""
        self._t = time.perf_counter()
        self._io = ProcessIO()
        self._store_read = self.store.bytes_read if self.store is not None else 0
        reset_peak_rss()

    def on_token(self, phase: str, positions: int = 0, tokens: int = 1) -> None:
        now, (read, _) = time.perf_counter(), self._io.take()
        store_read = self.store.bytes_read if self.store is not None else 0
        p = self.phases[phase]
        p.forwards += 1
        p.positions += positions
        p.tokens += tokens
        p.seconds += now - self._t
        p.read_bytes += read
        p.expert_uses += sum(int((m.last_stats.routed_E > 0).sum()) for m in self.moes
                             if m.last_stats is not None)
        if self.master_bytes:
            p.expert_reads += round((store_read - self._store_read) / self.master_bytes)
        p.peak_rss = max(p.peak_rss, peak_rss_bytes())
        reset_peak_rss()
        self._store_read = store_read
        self._t = time.perf_counter()      # the meter's own work is not the model's

    def summary(self) -> dict:
        """{phase: figures and rates} as plain data (for summary.json and the bench)."""
        return {name: dict(asdict(p), **p.rates(self.master_bytes))
                for name, p in self.phases.items()} | {"master_bytes": self.master_bytes}

    def peak(self) -> int:
        """The highest RSS of any phase."""
        return max(p.peak_rss for p in self.phases.values())

    def lines(self) -> list[str]:
        """Human-readable lines, one per phase that ran."""
        s, out = self.summary(), []
        for name in ("prefill", "decode"):
            p = s[name]
            if not p["forwards"]:
                continue
            speed = (f"{p['positions_per_s']:.1f} positions/s" if name == "prefill"
                     else f"{p['tokens_per_s']:.2f} tokens/s")
            line = (f"{name}: {p['positions']} positions, {p['tokens']} tokens in "
                    f"{p['seconds']:.2f} s ({speed}), read {fmt_bytes(p['read_bytes'])}")
            if name == "decode":
                line += f" ({fmt_bytes(p['read_bytes_per_token'])}/token)"
            if p["hit_rate"] is not None:
                line += (f", routed experts {fmt_bytes(p['routed_bytes_per_token'])}/token, "
                         f"host cache hit rate {p['hit_rate']:.1%}")
            out.append(line + f", peak RSS {fmt_bytes(p['peak_rss'])}")
        return out
