"""`moescale export RUN_DIR OUT`: a trained run as a directory transformers loads, tokenizer included.

    moescale export runs/20261201-223000 exported/
    python -c "import transformers as t; t.AutoModelForCausalLM.from_pretrained('exported', \
trust_remote_code=True); t.AutoTokenizer.from_pretrained('exported')"

Loads the run with `moescale.load_run` (newest verified checkpoint, or `--step`) and writes OUT
(a new directory) with moescale.train.hf_export: the model (`--format auto`: Mixtral when the
run's GPT has a Mixtral equivalent, else moescale's GPT as remote code; `mixtral` refuses a
model without one, naming the option and the fix, before anything is written; `moescale`
always writes the remote-code format), the run's tokenizer and a generation config.
"""

from __future__ import annotations

import sys

from moescale.models.export_hf import FORMATS
from moescale.train.generate import Parser


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="moescale export", description="Write the model of a `moescale train` run, "
               "its tokenizer and a generation config as a directory that transformers' "
               "from_pretrained and AutoTokenizer.from_pretrained load.")
    p.add_argument("run_dir", help="the run directory (runs/<timestamp>)")
    p.add_argument("out", help="the directory to write (must not exist, or be empty)")
    p.add_argument("--format", default="auto", choices=FORMATS,
                   help="auto: mixtral when the model has a Mixtral equivalent, else moescale "
                        "(default); mixtral: transformers' MixtralForCausalLM (GLU runs); "
                        "moescale: moescale's GPT as remote code (trust_remote_code=True)")
    p.add_argument("--step", type=int, default=None,
                   help="the checkpoint's step (default: the newest that verifies)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from moescale.train.hf_export import export_run

    try:
        out, how = export_run(args.run_dir, args.out, step=args.step, fmt=args.format)
    except ValueError as err:
        if "has no Mixtral equivalent" in str(err):      # check_gpt's refusal of a field
            raise ValueError(f"the run's model.{err}; or --format moescale (any model)"
                             ) from None
        raise
    print(f"wrote {out} ({how})")
    return 0
