"""`moescale export RUN_DIR OUT --format mixtral`: a trained run's model in a standard format.

    moescale export runs/20261201-223000 exported/ --format mixtral
    python -c "import transformers; transformers.MixtralForCausalLM.from_pretrained('exported')"

Loads the run with `moescale.load_run` (newest verified checkpoint, or `--step`) and writes
OUT (a new directory) with `moescale.models.export_mixtral`: config.json + model.safetensors in
the published Mixtral layout. A run whose model has no Mixtral equivalent (GELU experts without
GLU, moe_every > 1, a Switch router, a capacity factor, ...) is refused with one line naming
the option and the fix; nothing is written then.
"""

from __future__ import annotations

import sys

from moescale.train.generate import Parser

FORMATS = ("mixtral",)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="moescale export", description="Write the model of a `moescale train` run "
               "as a checkpoint directory of another library.")
    p.add_argument("run_dir", help="the run directory (runs/<timestamp>)")
    p.add_argument("out", help="the directory to write (must not exist, or be empty)")
    p.add_argument("--format", default="mixtral", choices=FORMATS,
                   help="mixtral: transformers' MixtralForCausalLM (default)")
    p.add_argument("--step", type=int, default=None,
                   help="the checkpoint's step (default: the newest that verifies)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from moescale.models.mixtral import check_gpt, export_mixtral
    from moescale.train.load_run import load_run

    model, _ = load_run(args.run_dir, step=args.step)
    try:
        check_gpt(model.config)
    except ValueError as err:
        raise ValueError(f"the run's model.{err}") from None
    out = export_mixtral(model, args.out)
    print(f"wrote {out} ({args.format}: config.json, model.safetensors)")
    return 0
