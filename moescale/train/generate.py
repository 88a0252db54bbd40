"""`moescale generate RUN_DIR --prompt TEXT`: continue a prompt with a trained run's model.

    moescale generate runs/20261201-223000 --prompt "def " --tokens 200
    moescale generate RUN_DIR --prompt "import os" --temperature 0 --step 250   # greedy

Loads the run with `moescale.load_run` (newest verified checkpoint, or `--step`; any
residency or exchange the run trained with), encodes the prompt with the run's tokenizer
(`data.tokenizer` when the run recorded one, else UTF-8 bytes), samples `--tokens` tokens
(temperature, top-k, seeded: the same seed prints the same text) and prints the continuation
(the prompt is not repeated). Bad arguments raise ValueError, which `moescale` prints as one
line with exit code 2.
"""

from __future__ import annotations

import argparse
import sys

import torch


class Parser(argparse.ArgumentParser):
    """argparse whose errors are ValueErrors (one line from `moescale`, exit 2)."""

    def error(self, message: str):
        raise ValueError(f"{message} (see moescale {self.prog.split()[-1]} --help)")


def parser() -> Parser:
    p = Parser(prog="moescale generate", description="Continue a prompt with the model of a "
               "`moescale train` run and print the continuation.")
    p.add_argument("run_dir", help="the run directory (runs/<timestamp>)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40,
                   help="sample among the k likeliest tokens; 0: all (default 40)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (default 1234)")
    p.add_argument("--step", type=int, default=None,
                   help="the checkpoint's step (default: the newest that verifies)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    return p


def continuation(model, tokenizer, prompt: str, tokens: int, *, temperature: float,
                 top_k: int, seed: int) -> str:
    """The decoded text `model` appends to `prompt` (tokenizer None: UTF-8 bytes)."""
    vocab = model.config.vocab_size
    if tokenizer is None and vocab != 256:
        raise ValueError(f"this run's model has a vocabulary of {vocab} ids and its config "
                         "records no data.tokenizer, so text cannot be encoded; runs on token "
                         ".bin files need the tokenizer that made them (data.tokenizer)")
    ids = tokenizer.encode(prompt) if tokenizer is not None else list(prompt.encode("utf-8"))
    if not ids:
        raise ValueError("--prompt is empty; give at least one character to continue")
    if max(ids) >= vocab:
        raise ValueError(f"--prompt encodes to id {max(ids)}, but the model's vocabulary has "
                         f"{vocab} ids; the run's tokenizer does not match its model")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    idx_1S = torch.tensor([ids], dtype=torch.int64, device=device)
    out = model.generate(idx_1S, tokens, temperature=temperature, top_k=top_k or None,
                         generator=gen)[0, len(ids):].tolist()
    if tokenizer is not None:
        return tokenizer.decode(out)
    return bytes(out).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    for name, value, ok, need in (("--tokens", args.tokens, args.tokens >= 0, ">= 0"),
                                  ("--temperature", args.temperature, args.temperature >= 0,
                                   ">= 0 (0: greedy)"),
                                  ("--top-k", args.top_k, args.top_k >= 0, ">= 0 (0: all)"),
                                  ("--seed", args.seed, 0 <= args.seed < 2**63,
                                   "in [0, 2**63 - 1]")):
        if not ok:
            raise ValueError(f"{name}={value!r} is invalid: must be {need}")
    from moescale.train.load_run import load_run, run_tokenizer
    from moescale.train.trainer import resolve_device

    model, config = load_run(args.run_dir, step=args.step, device=resolve_device(args.device))
    text = continuation(model, run_tokenizer(config), args.prompt, args.tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    print(text)
    return 0
