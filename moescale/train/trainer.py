"""The training loop of `moescale train`: build, (resume), step, evaluate, checkpoint, summarise.

`Trainer(config, run_dir, resume=..., residency=...)` builds the data streams, the GPT MoE model and AdamW from
a `RunConfig`; `run()` trains to `train.steps`, then prints a summary (train / validation loss,
tokens/s, peak memory, the offload plan) and a short generated sample, and writes report.png.
Each optimizer step runs `train.grad_accum` micro-batches (bf16 autocast when
`train.precision = "bf16"`), clips the global gradient norm, sets the scheduled learning rate
and steps AdamW. Every step writes one metrics.jsonl record with the routed tokens per expert of
every MoE layer (from `layer.last_stats`); every `eval_interval` steps a validation loss on
fixed windows. Checkpoints are written every `checkpoint_interval` steps and at the end.
The exchange may add numbers to each record (`step_metrics`): with several devices, the modelled
max/mean device load (`device_load_max_over_mean`; dynamic placement also the static
placement's `static_load_max_over_mean`), shown in the progress bar and averaged over the run
in the summary.

Resuming restores model, optimizer, step, the data generator and torch's RNG from the newest
checkpoint that verifies, and drops metrics past it, so the continued run logs exactly the
losses of an uninterrupted one. SIGINT (Ctrl-C) or SIGTERM (what torchrun and schedulers send)
finishes the current step, saves a checkpoint and returns 130 (143 for SIGTERM); a second one
aborts at once. A step whose loss or gradient norm is not finite is skipped, not stepped
(guard.py); `train.max_skips` of them in a row stop the run (TrainingDiverged). No checkpoint
with NaN or Inf is written; a fresh run first saves its initial state (step 0), and when the
guard stops a run the checkpoints written within trust.TRUST_STEPS of the divergence are set
aside (trust.py, saving.py). The run directory is this process's while it lives (a lock,
limits.claim_run_dir); a start-up sweep then removes the temp files a killed run left in it
(checkpoint.sweep_temp_files).

Offloading, expert parallelism and dynamic placement plug in as parts (assembly.py): the
ranks (one process or a torch.distributed world: each rank's slice of a batch, reductions of
logged numbers), the exchange (shards the MoE layers, averages gradients over the ranks, adds
per-step load numbers), the residency (resident or offloaded experts) with its expert-step
handle (clips and steps the experts), and the checkpoint state (run_state.py: sharded,
single-process format). `residency=` hands the trainer a residency of the caller's own instead
of the one `[offload]` picks (a parts.Residency, a factory taking the config, or
"module:name"; residency.py: custom_residency). Only rank 0 writes files and prints.

Deliberately not here: the parts themselves, process launch (torchrun, or
launch.train_distributed), the CLI parsing (cli.py), the end-of-run summary (summary.py), the
step guard (guard.py), the checks of what the machine can run (limits.py).

Legend: B batch, S sequence, L MoE layers, E experts.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import tomli_w
import torch

from moescale.atomic import atomic_write_text
from moescale.layers.moe import MoE
from moescale.models import GPT
from moescale.sizes import fmt_bytes
from moescale.train.assembly import assemble, check_parts
from moescale.train.checkpoint import list_checkpoints, sweep_temp_files
from moescale.train.config import ModelSection, RunConfig, to_dict
from moescale.train.data import TokenBatches, load_data
from moescale.train.guard import StepGuard, TrainingDiverged, dense_grad_norm
from moescale.train.hf_export import end_of_run_export
from moescale.train.streamed import generation_mode
from moescale.train import model as run_model
from moescale.train import saving
from moescale.train.limits import (check_budget, check_memory, check_run_dir, check_threads,
                                   claim_run_dir, resolve_device, unclaim)
from moescale.train.metrics import MetricsLog, read_metrics
from moescale.train.optim import build_optimizer, lr_at, set_lr
from moescale.train.gen_stats import GenerationMeter
from moescale.train.summary import imbalance, peak_rss_bytes, postfix_text, summarise
from moescale.train.threads import auto_threads, torch_threads
from moescale.train.tokenizer import keep_copy
from moescale.train.trust import CheckpointTrust

DEFAULT_CACHE_DIR = "~/.cache/moescale"


def _expert_counts(model: GPT) -> list[torch.Tensor]:
    return [m.last_stats.routed_E for m in model.modules()
            if isinstance(m, MoE) and m.last_stats is not None]


class Trainer:
    """One training run in `run_dir` (see the module docstring)."""

    def __init__(self, config: RunConfig, run_dir: str | Path, *, resume: bool = False,
                 out=None, err=None, residency=None) -> None:
        check_parts(config)
        check_threads(config.train.threads)     # before a thread or a byte is spent
        check_run_dir(run_dir)
        self.config, self.sample_meter = config, None
        self.run_dir = Path(run_dir)
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        tc = config.train
        self.parts = assemble(config, run_dir, residency)
        self.ranks = self.parts.ranks
        self.run_dir = self.parts.run_dir     # rank 0's choice
        self.writer = self.ranks.writer
        if not self.writer:
            self.out = self.err = open(os.devnull, "w")
        self.threads_note = "set by train.threads"
        self.threads_auto = tc.threads == 0     # config.toml keeps 0; checkpoints the choice
        if tc.threads == 0:
            tc.threads, self.threads_note = auto_threads(self.ranks.world_size)
        self.run_lock = None
        try:
            self.run_lock = claim_run_dir(self.run_dir, resume, self.ranks)
            with torch_threads(tc.threads):           # building is torch work too (threads.py)
                self._build_model(resume)
                try:
                    self._build(resume)
                except BaseException:     # stop the offload engine's threads
                    self.parts.close()
                    raise
        except BaseException:
            unclaim(self.run_lock)
            raise

    def close(self) -> None:
        """Give the run directory back (run() does at its end; idempotent)."""
        if self.run_lock is not None:
            self.run_lock.release()

    def _build_model(self, resume: bool) -> None:
        config, tc = self.config, self.config.train
        self.device = resolve_device(tc.device)
        # resumed: the run's recorded tokenizer, the checkpoint's weights
        notes = [] if resume else run_model.adopt_tokenizer(config)
        self.data = load_data(config.data, DEFAULT_CACHE_DIR)
        check_memory(config, self.data.vocab_size, self.device)
        torch.manual_seed(tc.seed)
        self.model = run_model.build_model(config, self.data.vocab_size,
                                           self.parts.expert_device(), self.run_dir)
        if config.model.hf is not None and not resume:
            notes.append(run_model.load_hf_weights(self.model, config))
        for note in notes:
            print(note, file=self.err)
        if self.parts.expert_device() is None:   # else: moved once the experts are out
            self.model.to(self.device)
        self.params = self.model.num_parameters()
        check_budget(config, self.params.total)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.writer:
            removed, freed = sweep_temp_files(self.run_dir)
            if removed:
                print(f"removed {removed} temp file(s) ({fmt_bytes(freed)}) that an "
                      f"interrupted run left in {self.run_dir}", file=self.err)

    def _build(self, resume: bool) -> None:
        config, tc = self.config, self.config.train
        self.parts.prepare(self.model)       # exchange, then residency
        self.model.to(self.device)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.parts.attach(self.model, self.optimizer)
        self.experts = self.parts.step       # the expert-step handle
        self.batches = TokenBatches(self.data.train, tc.batch_size, tc.seq_len, tc.seed, "train")
        self.val_windows = TokenBatches(self.data.val, tc.batch_size, tc.seq_len, tc.seed + 1,
                                        "validation").fixed(tc.eval_batches)
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, MoE)]
        self.step = 0
        self.stop_requested = False
        self.stop_signal = None
        self.guard = StepGuard(tc.max_skips, self.err, str(self.run_dir))
        self.trust = CheckpointTrust()
        self._expert_skips = 0
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", enabled=self.writer,
                                  tensorboard=tc.tensorboard)    # events in run_dir/tensorboard
        self.resumed_from = None
        if resume:
            self._resume()
            for r in read_metrics(self.metrics.path):     # the loss history of trust.py
                if r.get("kind") == "train":
                    self.trust.note(r["step"], r["loss"], r.get("skipped"))
        elif list_checkpoints(self.ckpt_dir):
            raise ValueError(f"run directory {str(self.run_dir)!r} already holds checkpoints; "
                             "continue it with --resume, or choose another train.run_dir")
        else:
            self.metrics.truncate_after(0)
        if self.writer:
            self._write_config()

    # -- setup ---------------------------------------------------------------------------
    def _write_config(self) -> None:
        """config.toml: the run's options with the model's resolved shape (each model option
        the size left unset, as the built model has it), train.run_dir left '' (resume names
        the directory; --config this file starts a new one), train.threads 0 when chosen
        automatically (the checkpoints record the choice for --resume); the config object is
        left as given. A file-based tokenizer is copied into RUN_DIR/tokenizer/."""
        tree = to_dict(self.config)
        flat = self.model.config.to_flat()
        if self.config.model.hf is None:     # else: the shape is model.hf's (a copy here)
            tree["model"].update({name: flat[name] for name in
                                  ModelSection.shape_fields() if flat[name] is not None})
        else:
            run_model.write_config_copy(self.run_dir, self.config)
        tree["train"]["run_dir"] = ""     # --config this file: a new run in a new directory
        tree["train"]["threads"] = 0 if self.threads_auto else tree["train"]["threads"]
        keep_copy(self.data.tokenizer, self.run_dir)      # RUN_DIR/tokenizer/: movable runs
        text = "# resolved configuration of this run (moescale train --config this file)\n"
        text += tomli_w.dumps(tree)
        atomic_write_text(self.run_dir / "config.toml", text)

    def _resume(self) -> None:
        saving.resume(self)

    def save(self) -> Path:
        """Collective: a checkpoint of the current step (saving.py)."""
        return saving.save(self)

    # -- loop ----------------------------------------------------------------------------
    def _autocast(self):
        if self.config.train.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, lr: float | None = None) -> dict:
        """One optimizer step at the scheduled learning rate (or `lr`, for callers that
        schedule by time); returns its metrics record."""
        tc, oc = self.config.train, self.config.optim
        lr = lr_at(self.step, oc, tc.steps) if lr is None else lr
        set_lr(self.optimizer, lr)     # offloaded experts follow it (engine.follow)
        self.optimizer.zero_grad(set_to_none=True)
        self.experts.take_wait_s()     # not this step's: evaluation, the last step's tail
        ce_sum = aux_sum = 0.0
        counts_LE = None
        for i in range(tc.grad_accum):
            self.parts.begin_micro_batch(last=i == tc.grad_accum - 1)
            idx_BS, targets_BS = self.ranks.shard(*self.batches.next())  # this rank's rows
            idx_BS, targets_BS = idx_BS.to(self.device), targets_BS.to(self.device)
            with self._autocast():      # through DDP when the exchange wraps the model
                _, loss = self.parts.train_model(idx_BS, targets_BS)
            self.experts.before_backward(loss.detach())
            (loss / tc.grad_accum).backward()
            parts = self.model.last_loss_parts
            ce_sum += float(parts["ce"])
            aux_sum += float(parts["aux"])
            layer_counts = [c.to("cpu", torch.int64) for c in _expert_counts(self.model)]
            counts_LE = layer_counts if counts_LE is None else \
                [a + b for a, b in zip(counts_LE, layer_counts)]
        clip = oc.grad_clip if oc.grad_clip > 0 else math.inf
        grad_norm = self.parts.clip(self.model, clip)   # EP: gradients averaged first
        skips, self._expert_skips = self._expert_skips, self.experts.skipped_steps()
        ce_sum, aux_sum, skips, wait_s = self.ranks.mean(    # wait_s: the ranks' mean
            [ce_sum, aux_sum, self._expert_skips - skips, self.experts.take_wait_s()])
        skipped = self.guard.verdict(      # every rank sees the same numbers: all agree
            ce_sum / tc.grad_accum, aux_sum / tc.grad_accum,
            dense_grad_norm(self.model.parameters()) if grad_norm is None else grad_norm,
            round(skips * self.ranks.world_size))
        if skipped is None:
            self.experts.step()
            self.optimizer.step()
        else:                 # no update: the gradients are discarded
            self.experts.skip_step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        counts = [c.tolist() for c in self.ranks.sum_counts(counts_LE or [])]
        return {"kind": "train", "step": self.step, "loss": ce_sum / tc.grad_accum,
                "aux_loss": aux_sum / tc.grad_accum, "lr": lr, "grad_norm": grad_norm,
                "wait_s": wait_s,
                "tokens": tc.batch_size * tc.seq_len * tc.grad_accum,
                "imbalance": imbalance(counts), "tokens_per_expert": counts,
                **({} if skipped is None else {"skipped": skipped}),
                **self.parts.exchange.step_metrics(self.model, counts)}

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        try:
            losses = []
            for idx_BS, targets_BS in self.val_windows:
                idx_BS, targets_BS = self.ranks.shard(idx_BS, targets_BS)
                with self._autocast():
                    self.model(idx_BS.to(self.device), targets_BS.to(self.device))
                losses.append(float(self.model.last_loss_parts["ce"]))
        finally:
            self.model.train()
        return self.ranks.mean([sum(losses) / len(losses)])[0]

    def _on_signal(self, signum, frame) -> None:
        if self.stop_requested:
            raise KeyboardInterrupt
        self.stop_requested = True
        self.stop_signal = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              "(a second Ctrl-C or SIGTERM aborts without saving)", file=self.err)

    def run(self, until_step: int | None = None) -> int:
        """Train to train.steps, or to `until_step` (a checkpoint is saved there; the learning
        rate schedule still spans train.steps), or until SIGINT / SIGTERM. 0 when done, 130
        (SIGINT) or 143 (SIGTERM) when interrupted. Sets torch's thread count to
        train.threads for the call only."""
        tc = self.config.train
        try:
            with torch_threads(tc.threads):
                return self._run(min(tc.steps, until_step or tc.steps))
        finally:
            self.parts.close()
            self.close()

    def _run(self, last_step: int) -> int:
        from tqdm import tqdm

        tc = self.config.train
        stops = (signal.SIGINT, signal.SIGTERM)
        previous = [signal.getsignal(s) for s in stops]
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            for s in stops:
                signal.signal(s, self._on_signal)
        self.model.train()
        bar = tqdm(total=tc.steps, initial=self.step, file=self.err,
                   disable=not (tc.progress and self.writer),
                   dynamic_ncols=True, unit="step", mininterval=0.5)
        train_time = 0.0
        train_tokens = 0
        rate = None
        start = time.perf_counter()
        last_ckpt = None
        first_step = self.step
        try:
            if self.step == 0 and self.resumed_from is None and tc.initial_checkpoint:
                self.save()          # the initial state: trusted until a later one is (trust.py)
            while self.step < last_step and not self.stop_requested:
                t0 = time.perf_counter()
                record = self.train_step()
                dt = time.perf_counter() - t0
                train_time += dt
                train_tokens += record["tokens"]
                rate = record["tokens"] / dt if rate is None else \
                    0.9 * rate + 0.1 * record["tokens"] / dt
                record["tokens_per_s"] = record["tokens"] / dt
                record["elapsed_s"] = time.perf_counter() - start
                self.metrics.write(record)
                self.stop_requested = self.ranks.any(self.stop_requested)  # ranks agree
                bar.update(1)
                bar.set_postfix_str(postfix_text(record, rate, self.parts.residency.streams_experts),
                                    refresh=False)
                self.trust.note(self.step, record["loss"], record.get("skipped"))
                self.guard.record(self.step, record.get("skipped"))   # may stop the run
                done = self.step == tc.steps
                if done or (tc.eval_interval and self.step % tc.eval_interval == 0):
                    val = self.evaluate()
                    self.metrics.write({"kind": "val", "step": self.step, "val_loss": val})
                    bar.write(f"step {self.step}: validation loss {val:.4f}", file=self.err)
                periodic = tc.checkpoint_interval and self.step % tc.checkpoint_interval == 0
                if done or periodic or self.step == last_step or self.stop_requested:
                    last_ckpt = self.save()
            self.guard.check_trained(self.step - first_step)
        except TrainingDiverged as err:
            raise TrainingDiverged(f"{err}; {saving.set_aside_diverged(self)}") from None
        finally:
            bar.close()
            self.metrics.close()
            if in_main:
                for s, handler in zip(stops, previous):
                    signal.signal(s, handler)
        if self.stop_requested and last_ckpt is None and self.step > 0:
            last_ckpt = self.save()
        peak_rss = peak_rss_bytes()       # the sample's meter restarts the peak (gen_stats.py)
        sample = self.sample() if not self.stop_requested else ""   # collective under EP
        memory = self.parts.memory()
        memory.setdefault("host_peak_rss_bytes", max(
            peak_rss, self.sample_meter.peak() if self.sample_meter else 0))
        if self.writer:
            self.summary = summarise(self, train_time, train_tokens,
                                     time.perf_counter() - start, last_ckpt, sample, memory)
            if self.step == tc.steps:     # after the summary: its peak memory is training's
                end_of_run_export(self.run_dir, self.summary, self.out, self.params.total)
        if self.stop_requested:
            print(f"interrupted at step {self.step}/{tc.steps}; checkpoint {last_ckpt}\n"
                  f"continue with: moescale train --resume {self.run_dir}", file=self.out)
            return 143 if self.stop_signal == signal.SIGTERM else 130
        return 0

    # -- end of run ----------------------------------------------------------------------
    def sample(self, prompt: str = "def ", temperature: float = 0.8) -> str:
        """The end-of-run sample (KV-cached; offloaded experts stream per token); its
        figures (gen_stats.py) are kept in self.sample_meter for the summary."""
        n = self.config.train.sample_tokens
        if n == 0:
            return ""
        gen = torch.Generator(device=self.device).manual_seed(self.config.train.seed)
        tok = self.data.tokenizer       # None: a .bin of ids with no tokenizer to decode them
        ids = (tok.encode(prompt) if tok else []) or [int(self.data.val[0])]
        idx_1S = torch.tensor([ids], dtype=torch.int64, device=self.device)
        engine = self.parts.residency.engine
        self.sample_meter = GenerationMeter(self.model, engine)
        with self._autocast(), generation_mode(engine):   # the host cache holds masters
            out = self.model.generate(idx_1S, n, temperature=temperature, top_k=40,
                                      generator=gen, on_token=self.sample_meter.on_token
                                      )[0].tolist()
        if tok:     # a padded vocabulary's extra ids decode to nothing
            return tok.decode([i for i in out if i < tok.vocab_size])
        return " ".join(map(str, out))
