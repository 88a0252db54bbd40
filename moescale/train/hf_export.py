"""A run's model, tokenizer and sampling settings as one directory transformers loads.

    export_run("runs/20261201-223000", "exported")    # -> (Path, a one-line description)
    model = AutoModelForCausalLM.from_pretrained("exported", trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained("exported", trust_remote_code=True)

(`trust_remote_code` is needed for the remote-code format only, by both calls: AutoTokenizer
reads config.json's model type; a Mixtral export loads without it.)

`export_run` loads the run (`moescale.load_run`: newest verified checkpoint, or `step`) and
writes, in one published directory (models/export_hf.py decides the model format):

- the model: Mixtral (transformers' own class) when the run's GPT has a Mixtral equivalent,
  else moescale's GPT as remote code (`trust_remote_code=True`; any expert shape and router);
- the tokenizer (tokenizer.json + tokenizer_config.json, transformers' fast tokenizer): the
  run's `data.tokenizer` (its copy in the run directory when the original is gone), a
  nanoGPT meta.pkl's characters, or for byte-level runs a byte-level BPE with no merges whose
  id of every byte is the byte's value, so it encodes and decodes exactly as the run did;
  a run on token .bin files without a tokenizer gets none (noted on the returned description);
- generation_config.json: sampling as `moescale generate` samples (temperature 0.8, top-k 40),
  the tokenizer's end-of-text id as eos (and pad) when it has one.

`refresh_run_export(run_dir)` writes RUN_DIR/hf this way at the end of a run, replacing an
earlier export only once the new one is complete. transformers is imported only here (and only
when a run is exported).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from moescale.models.export_hf import export_hf
from moescale.sizes import fmt_bytes

EXPORT_DIR = "hf"
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 40}


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character of each byte (byte-level BPE's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def byte_tokenizer_object():
    """A `tokenizers.Tokenizer` whose id of every byte is its value (moescale's ByteTokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = _byte_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def hf_tokenizer(tokenizer, byte_ids: bool):
    """transformers' fast tokenizer of a run's tokenizer (None: the run's ids have no text)."""
    from transformers import PreTrainedTokenizerFast

    if tokenizer is None and not byte_ids:
        return None
    obj = byte_tokenizer_object() if tokenizer is None else tokenizer.tokenizers_object()
    eos = None if tokenizer is None or tokenizer.eos_id is None \
        else obj.id_to_token(tokenizer.eos_id)
    return PreTrainedTokenizerFast(tokenizer_object=obj, eos_token=eos)


def generation_config(eos_id: int | None):
    from transformers import GenerationConfig

    return GenerationConfig(**SAMPLING, eos_token_id=eos_id, pad_token_id=eos_id)


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None,
               fmt: str = "auto") -> tuple[Path, str]:
    """Write RUN_DIR's model + tokenizer + generation config to the new directory `out`;
    returns (out, description)."""
    from moescale.train.load_run import byte_text, load_run, run_tokenizer

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("the export writes transformers' tokenizer and generation config: "
                         "pip install transformers (or pip install moescale[hf])") from None
    model, config = load_run(run_dir, step=step)
    tok = hf_tokenizer(run_tokenizer(config, run_dir), byte_text(config))
    eos_id = tok.eos_token_id if tok is not None else None

    def extras(folder: Path) -> None:
        if tok is not None:
            tok.save_pretrained(folder)
        generation_config(eos_id).save_pretrained(folder)

    path, written = export_hf(model, out, fmt, extra_config={"eos_token_id": eos_id},
                              write_extra=extras)
    how = "transformers' MixtralForCausalLM" if written == "mixtral" else \
        "moescale's GPT as remote code: from_pretrained(..., trust_remote_code=True)"
    tok_note = "tokenizer" if tok is not None else \
        "no tokenizer (the run's token ids came without one: train with --data.tokenizer)"
    return path, f"{written}: {how}; {tok_note}, generation config"


def refresh_run_export(run_dir: str | Path) -> tuple[Path, str]:
    """The run's newest checkpoint exported as RUN_DIR/hf (an earlier one replaced: the new
    export is complete before the old one is removed)."""
    run_dir = Path(run_dir)
    final = run_dir / EXPORT_DIR
    staging = Path(tempfile.mkdtemp(prefix=".hf-export.", dir=run_dir))
    try:
        _, how = export_run(run_dir, staging / EXPORT_DIR)
        if final.exists():
            os.replace(final, staging / "old")
        os.replace(staging / EXPORT_DIR, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final, how


def end_of_run_export(run_dir: Path, summary: dict, out, num_params: int) -> None:
    """A finished run's RUN_DIR/hf (refresh_run_export), noted in summary.json and on `out`;
    skipped with a note when transformers is not installed, or when the whole model (the
    export holds it in RAM, fp32, with its copies: 12 bytes per parameter) would not fit the
    memory available now (an offloaded model larger than RAM)."""
    from moescale.atomic import atomic_write_json
    from moescale.train.limits import _available_ram

    later = f"later: moescale export {run_dir} OUT"
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"hf export:    skipped (pip install transformers; {later})", file=out)
        return
    need, free = 12 * num_params, _available_ram()
    if need > free:
        print(f"hf export:    skipped (the export holds the whole model in RAM, about "
              f"{fmt_bytes(need)}, and {fmt_bytes(free)} are free; {later} on a "
              "machine with more memory)", file=out)
        return
    path, how = refresh_run_export(run_dir)
    summary["hf_export"] = str(path)
    atomic_write_json(Path(run_dir) / "summary.json", summary)
    print(f"hf export:    {path} ({how})", file=out)

