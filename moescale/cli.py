"""`moescale` command line: dispatches to the subcommands, turns user errors into one line.

Subcommands live in their own modules and expose `main(argv) -> int`; this file only routes
to them and guarantees that a `ValueError` (a user error) prints one clear line and exits 2,
with no traceback.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "train": ("moescale.train.cli", "train the default MoE GPT (or a configured one)"),
    "bench": ("moescale.bench.cli", "run a benchmark: moescale bench {layer,...}"),
    "generate": ("moescale.train.generate", "continue a prompt with a trained run's model"),
    "export": ("moescale.train.export", "write a trained run as a directory transformers loads "
                                        "(model, tokenizer, generation config)"),
    "plan": ("moescale.offload.plan_cli", "choose an offloading mode from memory budgets"),
    "info": ("moescale.info", "versions, devices, memory and disk found"),
}


def usage_text(command: str, table: dict[str, tuple[str, str]], what: str) -> str:
    """The help of a name -> (module, description) router: `moescale` and `moescale bench`."""
    width = max(map(len, table)) + 2
    lines = [f"usage: {command} <{what}> [options]", "", f"{what}s:"]
    lines += [f"  {name:<{width}}{help_}" for name, (_, help_) in table.items()]
    lines.append(f"\n`{command} <{what}> --help` lists its options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage_text("moescale", SUBCOMMANDS, "command"))
        print("`moescale --version` prints the installed version.")
        return 0
    if argv[0] in ("-V", "--version"):
        from moescale import __version__

        print(f"moescale {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"moescale: unknown command {name!r}; choose one of {', '.join(SUBCOMMANDS)}",
              file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("moescale"):
            print(f"moescale: the {name!r} command is not available in this version",
                  file=sys.stderr)
            return 2
        raise
    try:
        return int(module.main(rest) or 0)
    except ValueError as err:
        print(f"moescale {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
