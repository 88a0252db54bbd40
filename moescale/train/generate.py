"""`moescale generate RUN_DIR --prompt TEXT`: continue a prompt with a trained run's model.

    moescale generate runs/20261201-223000 --prompt "def " --tokens 200
    moescale generate RUN_DIR --prompt "import os" --temperature 0 --step 250   # greedy
    moescale generate RUN_DIR --prompt "def " --experts disk --memory 2GiB   # past RAM
    moescale generate RUN_DIR --prompt "def " --prompt "class "                 # a batch

Loads the run (newest verified checkpoint, or `--step`; any residency or exchange the run
trained with) with `moescale.train.streamed.open_run`: `--experts resident` (moescale.load_run),
`host` or `disk` (the experts stay in an ExpertStore and stream per token: a run larger than
memory generates), `auto` (default: the run's own residency, or disk with `--memory`, which
bounds the host memory the model holds). Decoding is KV-cached (GPT.generate). Encodes the prompt with the run's tokenizer
(`data.tokenizer` when the run recorded one, else UTF-8 bytes; a larger vocabulary, model.hf or
data.vocab_size, on byte text drops the ids past 255), samples `--tokens` tokens
(temperature, top-k, seeded: the same seed prints the same text) and prints the continuation
(the prompt is not repeated; several `--prompt`s run as one batch per prompt length, each
continuation printed after a `[i]` line; sampled, not greedy, continuations of a batch differ
from those of the prompt alone, as the batch shares one generator). The statistics (tokens/s,
bytes read per token at the device, the host cache's hit rate, peak RSS; gen_stats.py) go to
stderr, one line per phase. Torch threads: `--threads`, by default the CPUs the load leaves
free, as `moescale train` picks them (torch's one thread per core made 120 tokens take 41 s
instead of 6 s at load 2.5 on 2 cores). Bad arguments raise ValueError, which `moescale`
prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moescale.train.streamed import EXPERTS


class Parser(argparse.ArgumentParser):
    """argparse whose errors are ValueErrors (one line from `moescale`, exit 2)."""

    def error(self, message: str):
        raise ValueError(f"{message} (see moescale {self.prog.split()[-1]} --help)")


def parser() -> Parser:
    p = Parser(prog="moescale generate", description="Continue a prompt with the model of a "
               "`moescale train` run and print the continuation.")
    p.add_argument("run_dir", help="the run directory (runs/<timestamp>)")
    p.add_argument("--prompt", required=True, action="append",
                   help="text to continue (repeat for a batch of prompts)")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40,
                   help="sample among the k likeliest tokens; 0: all (default 40)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (default 1234)")
    p.add_argument("--step", type=int, default=None,
                   help="the checkpoint's step (default: the newest that verifies)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--experts", default="auto", choices=EXPERTS,
                   help="where the experts live while generating: resident, host or disk "
                        "(streamed per token); auto: the run's own residency, disk with "
                        "--memory (default auto)")
    p.add_argument("--memory", default=None,
                   help="host memory the model may hold (dense weights, KV cache, expert "
                        "caches), e.g. 2GiB; implies --experts disk (default: unbounded)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads; 0: the CPUs the load leaves free, as train.threads "
                        "(default 0)")
    return p


def continuation(model, tokenizer, prompt: str, tokens: int, *, temperature: float,
                 top_k: int, seed: int, byte_ids: bool = False, on_token=None) -> str:
    """The decoded text `model` appends to `prompt` (tokenizer None: UTF-8 bytes; byte_ids:
    the run trained on bytes, ids past 255 of a larger vocabulary decode to nothing)."""
    return continuations(model, tokenizer, [prompt], tokens, temperature=temperature,
                         top_k=top_k, seed=seed, byte_ids=byte_ids, on_token=on_token)[0]


def _encode(model, tokenizer, prompt: str, byte_ids: bool) -> list[int]:
    vocab = model.config.vocab_size
    if tokenizer is None and vocab != 256 and not (byte_ids and vocab > 256):
        raise ValueError(f"this run's model has a vocabulary of {vocab} ids and its config "
                         "records no data.tokenizer, so text cannot be encoded; runs on token "
                         ".bin files need the tokenizer that made them (data.tokenizer)")
    ids = tokenizer.encode(prompt) if tokenizer is not None else list(prompt.encode("utf-8"))
    if not ids:
        raise ValueError("--prompt is empty; give at least one character to continue")
    if max(ids) >= vocab:
        raise ValueError(f"--prompt encodes to id {max(ids)}, but the model's vocabulary has "
                         f"{vocab} ids; the run's tokenizer does not match its model")
    return ids


def continuations(model, tokenizer, prompts: list[str], tokens: int, *, temperature: float,
                  top_k: int, seed: int, byte_ids: bool = False, on_token=None) -> list[str]:
    """continuation of each prompt; prompts of one token length run as one batch (their
    experts are fetched once per token for the whole batch)."""
    encoded = [_encode(model, tokenizer, p, byte_ids) for p in prompts]
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    out: list[list[int]] = [[] for _ in prompts]
    for length in sorted({len(ids) for ids in encoded}):
        rows = [i for i, ids in enumerate(encoded) if len(ids) == length]
        idx_BS = torch.tensor([encoded[i] for i in rows], dtype=torch.int64, device=device)
        new_BS = model.generate(idx_BS, tokens, temperature=temperature, top_k=top_k or None,
                                generator=gen, on_token=on_token)[:, length:]
        for i, row in zip(rows, new_BS.tolist()):
            out[i] = row
    if tokenizer is not None:
        return [tokenizer.decode(ids) for ids in out]
    return [bytes(i for i in ids if i < 256).decode("utf-8", errors="replace") for ids in out]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    for name, value, ok, need in (("--tokens", args.tokens, args.tokens >= 0, ">= 0"),
                                  ("--temperature", args.temperature, args.temperature >= 0,
                                   ">= 0 (0: greedy)"),
                                  ("--top-k", args.top_k, args.top_k >= 0, ">= 0 (0: all)"),
                                  ("--seed", args.seed, 0 <= args.seed < 2**63,
                                   "in [0, 2**63 - 1]"),
                                  ("--threads", args.threads, args.threads >= 0,
                                   ">= 0 (0: chosen from the load)")):
        if not ok:
            raise ValueError(f"{name}={value!r} is invalid: must be {need}")
    from moescale.sizes import parse_size
    from moescale.train.gen_stats import GenerationMeter
    from moescale.train.limits import check_threads
    from moescale.train.load_run import byte_text, run_tokenizer
    from moescale.train.streamed import open_run
    from moescale.train.threads import auto_threads
    from moescale.train.trainer import resolve_device

    check_threads(args.threads, "--threads")
    memory = None if args.memory is None else parse_size(args.memory, "--memory")
    torch.set_num_threads(args.threads or auto_threads()[0])
    with open_run(args.run_dir, experts=args.experts, memory=memory, step=args.step,
                  device=resolve_device(args.device), batch=len(args.prompt)) as run:
        meter = GenerationMeter(run.model, run.engine)
        texts = continuations(run.model, run_tokenizer(run.config, args.run_dir), args.prompt, args.tokens,
                              temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                              byte_ids=byte_text(run.config), on_token=meter.on_token)
        where = run.experts + (f" ({run.plan.describe()})" if run.plan else "")
    if len(texts) == 1:
        print(texts[0])
    else:
        for i, text in enumerate(texts):
            print(f"[{i}]\n{text}")
    print(f"experts: {where}", file=sys.stderr)
    for line in meter.lines():
        print(line, file=sys.stderr)
    return 0
