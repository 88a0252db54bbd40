"""Fine-tune a Hugging Face MoE model with offloaded experts, then save a checkpoint that
transformers' `from_pretrained` loads.

    .venv/bin/python examples/finetune_hf_moe.py --out runs/hf-moe            # tiny random Qwen2-MoE
    .venv/bin/python examples/finetune_hf_moe.py --init runs/hf-moe --out runs/hf-moe-2
    .venv/bin/python examples/finetune_hf_moe.py --family mixtral --tier disk --out runs/mx

Steps: build a tiny random model of the chosen family from its config (byte-level vocabulary of
256, no download) or load a local checkpoint (`--init DIR`, e.g. a previous run's output);
`moescale.models.hf.from_hf` swaps its sparse MoE blocks for moescale layers;
`moescale.offload.offload_moe` moves every expert into a host (or disk) ExpertStore, streamed
through a device budget of `--device-budget-experts` experts and stepped by the host AdamW;
training runs on the built-in corpus (the Python standard library's source as bytes) or on
`--data PATH`; afterwards `moescale.models.resident_model` copies the experts back out of the
store (plain resident modules again), `to_hf` restores the
model's own block classes, `save_pretrained` writes the checkpoint, and the script reloads it
with `AutoModelForCausalLM.from_pretrained` and checks that the logits match.

The corpus is byte-level: with `--init` pointing at a model with its own tokenizer the run is a
smoke test, not a meaningful fine-tune. Prints one line per step and writes
`<out>/finetune.json` (losses, reload difference).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch
import torch.nn.functional as F

from moescale.layers.moe import collect_aux_loss
from moescale.models import resident_model
from moescale.models.hf import from_hf, to_hf
from moescale.offload import OffloadConfig, offload_moe
from moescale.train.config import DataSection
from moescale.train.data import TokenBatches, load_data

FAMILIES = ("qwen2_moe", "mixtral", "qwen3_moe", "olmoe")


def tiny_config(family: str):
    """A small random config of `family` over a byte-level vocabulary."""
    import transformers

    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                  num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=128, num_local_experts=8)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, intermediate_size=128,
                                           moe_intermediate_size=64,
                                           shared_expert_intermediate_size=128, num_experts=8,
                                           decoder_sparse_step=1)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=128, head_dim=16,
                                           moe_intermediate_size=64, num_experts=8)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=64, num_experts=8)
    raise ValueError(f"--family={family!r} is unknown; use one of {', '.join(FAMILIES)}")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the saved HF checkpoint")
    p.add_argument("--family", default="qwen2_moe", choices=FAMILIES)
    p.add_argument("--init", default="", help="local HF checkpoint directory to start from")
    p.add_argument("--data", default="", help="'' = built-in corpus, or a text file/dir")
    p.add_argument("--cache-dir", default="", help="built-in corpus cache (default ~/.cache)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tier", default="host", choices=("host", "disk"))
    p.add_argument("--device-budget-experts", type=float, default=2.0)
    p.add_argument("--host-cache-mb", type=float, default=64.0,
                   help="disk tier: host memory for cached experts")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq < 2:
        raise ValueError(f"--steps={args.steps}, --batch={args.batch} and --seq={args.seq} must "
                         "be >= 1, >= 1 and >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    import transformers

    args = parse(argv)
    torch.manual_seed(args.seed)
    if args.init:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.init)
    else:
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(args.family))
    model = model.float().train()
    vocab = model.config.vocab_size
    from_hf(model)
    store_dir = host_cache = None
    if args.tier == "disk":
        store_dir = os.path.join(args.out, "expert-store")
        os.makedirs(store_dir, exist_ok=True)
        host_cache = int(args.host_cache_mb * 2**20)
    engine = offload_moe(model, OffloadConfig(
        tier=args.tier, directory=store_dir, host_cache_bytes=host_cache,
        device_budget_experts=args.device_budget_experts))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    engine.follow(opt)
    cache = args.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "moescale")
    data = load_data(DataSection(path=args.data), cache)
    if data.vocab_size > vocab:
        raise ValueError(f"the data has {data.vocab_size} token ids but the model's vocabulary "
                         f"is {vocab}")
    batches = TokenBatches(data.train, args.batch, args.seq, args.seed, "train")
    losses = []
    try:
        for step in range(args.steps):
            start = time.perf_counter()
            idx, tgt = batches.next()
            engine.begin_micro_batch(last=True)
            logits = model(input_ids=idx).logits
            ce = F.cross_entropy(logits.float().reshape(-1, vocab), tgt.reshape(-1))
            (ce + collect_aux_loss(model)).backward()
            engine.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(ce.item())
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {time.perf_counter() - start:.2f}s",
                  flush=True)
        resident_model(model)      # the experts back from the store, as plain modules
    finally:
        engine.close()
    if store_dir is not None:   # the experts are back in the model; the store is spent
        shutil.rmtree(store_dir, ignore_errors=True)
    model.eval()
    check_idx = torch.from_numpy(data.val[:args.seq].astype("int64"))[None]
    with torch.no_grad():
        trained = model(input_ids=check_idx).logits
    to_hf(model)
    model.save_pretrained(args.out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(args.out).float().eval()
    with torch.no_grad():
        diff = (loaded(input_ids=check_idx).logits - trained).abs().max().item()
    summary = {"family": model.config.model_type, "steps": args.steps, "losses": losses,
               "reload_max_abs_diff": diff, "data": data.description}
    with open(os.path.join(args.out, "finetune.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"saved {args.out}; from_pretrained reload max |logit diff| = {diff:.2e}")
    if diff > 1e-4:
        print("reloaded model differs from the trained one", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
