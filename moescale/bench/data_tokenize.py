"""Tokenizing a corpus larger than the batches: throughput and peak memory of `load_data`.

Builds a text folder of `--mb` MB from copies of the standard library's sources (each copy in
its own sub-folder), trains a byte-level BPE of `--vocab` tokens on a 2 MB sample of it (the
tokenizers library; nothing is downloaded), then measures, in one process, for the tokenizer
and for plain bytes: the first `load_data` (content key + tokenization into the cache), the
second (key only: the cache is found), tokens and bytes per second, and the peak resident set
above the resident set before the call (VmHWM, reset through /proc/self/clear_refs). The corpus
is never held in memory, so that peak should stay near a few batches (moescale/train/corpus.py:
BATCH_BYTES of text and its ids), flat in `--mb`.

Writes runs/bench/<time>/data_tokenize_<hardware>.json (CPU flags, sizes, every number).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import torch

from moescale.bench.disk_probe import cpu_flags
from moescale.bench.measure import hardware_tag, result_path, write_json
from moescale.train import corpus as corpus_mod
from moescale.train.config import DataSection
from moescale.train.data import load_data, stdlib_files
from moescale.train.tokenizer import load_tokenizer
from moescale.proc_stats import peak_rss_bytes, reset_peak_rss


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moescale bench data",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=256, help="corpus size in MB (default 256)")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    p.add_argument("--block-kib", type=int, default=0, help="text per block (default: corpus.py's)")
    p.add_argument("--batch-kib", type=int, default=0, help="text per batch (default: corpus.py's)")
    p.add_argument("--dir", default="", help="work folder (default: a temp folder, removed)")
    p.add_argument("--out", default="", help="result JSON path")
    return p


def build_corpus(folder: Path, target_bytes: int) -> tuple[int, int]:
    """Copies of the stdlib's *.py files until `target_bytes`; (files, bytes)."""
    root, rels = stdlib_files()
    files = size = 0
    copy = 0
    while size < target_bytes:
        for rel in rels:
            data = (root / rel).read_bytes()
            if not data:
                continue
            out = folder / f"copy{copy:03d}" / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
            files, size = files + 1, size + len(data)
            if size >= target_bytes:
                break
        copy += 1
    return files, size


def train_tokenizer(folder: Path, vocab: int, out: Path) -> float:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample, got = [], 0
    for path in sorted(folder.rglob("*.py")):
        sample.append(path.read_text(errors="replace"))
        got += len(sample[-1])
        if got > 2_000_000:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    start = time.perf_counter()
    tok.train_from_iterator(sample, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out))
    return time.perf_counter() - start


def _measure_child(cfg: DataSection, cache: Path, corpus_bytes: int, block: int, batch: int,
                   queue) -> None:
    from moescale.train import corpus as corpus_mod
    corpus_mod.BLOCK_BYTES, corpus_mod.BATCH_BYTES = block, batch
    load_tokenizer(cfg.tokenizer)      # imports the library: not counted
    out = {}
    for label in ("first", "cached"):
        before = psutil.Process().memory_info().rss
        reset_peak_rss()
        start = time.perf_counter()
        data = load_data(cfg, cache)
        seconds = time.perf_counter() - start
        tokens = len(data.train) + len(data.val)
        out[label] = dict(seconds=round(seconds, 3),
                          peak_rss_above_start_mib=round((peak_rss_bytes() - before) / 2**20, 1))
        del data
    out.update(tokens=tokens, mb_per_s=round(corpus_bytes / 1e6 / out["first"]["seconds"], 2),
               tokens_per_s=round(tokens / out["first"]["seconds"]),
               bytes_per_token=round(corpus_bytes / tokens, 3), block_bytes=block,
               batch_bytes=batch)
    queue.put(out)


def measure(cfg: DataSection, cache: Path, corpus_bytes: int, block: int, batch: int) -> dict:
    """`load_data` twice (tokenize, then find the cache) in a fresh process, so the peak
    resident set is this call's alone."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure_child, args=(cfg, cache, corpus_bytes, block, batch,
                                                    queue))
    proc.start()
    out = queue.get()
    proc.join()
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="moescale-data-"))
    try:
        corpus, cache = work / "corpus", work / "cache"
        corpus.mkdir(parents=True, exist_ok=True)
        files, size = build_corpus(corpus, int(args.mb * 1e6))
        train_s = train_tokenizer(corpus, args.vocab, work / "tokenizer.json")
        print(f"corpus: {files:,} files, {size / 1e6:.1f} MB; BPE of {args.vocab} trained on "
              f"2 MB in {train_s:.1f} s; CPU flags {' '.join(cpu_flags())}, "
              f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
        results = {}
        block = args.block_kib * 1024 or corpus_mod.BLOCK_BYTES
        batch = args.batch_kib * 1024 or corpus_mod.BATCH_BYTES
        for name, tok in (("bpe", str(work / "tokenizer.json")), ("bytes", "")):
            results[name] = r = measure(DataSection(path=str(corpus), tokenizer=tok), cache, size,
                                        block, batch)
            first, cached = r["first"], r["cached"]
            print(f"{name:>5}: {r['tokens']:,} tokens ({r['bytes_per_token']} bytes/token) in "
                  f"{first['seconds']:.1f} s = {r['mb_per_s']} MB/s, {r['tokens_per_s']:,} "
                  f"tokens/s; peak RSS +{first['peak_rss_above_start_mib']} MiB; cached: "
                  f"{cached['seconds']:.2f} s, +{cached['peak_rss_above_start_mib']} MiB")
        tag = hardware_tag(torch.device("cpu"))
        out = result_path(args.out, f"data_tokenize_{tag}.json")
        write_json(out, dict(benchmark="data-tokenize", hardware=tag,
                             cpu_flags=cpu_flags(), cpus=os.cpu_count(),
                             load_avg=os.getloadavg()[0], corpus_files=files,
                             corpus_bytes=size, vocab=args.vocab,
                             tokenizer_train_s=round(train_s, 2), results=results))
        print(f"wrote {out}")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0
