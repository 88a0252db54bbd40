"""Every subcommand's --help describes every option it takes (counted from the parsers
themselves: argparse actions with an empty help, `moescale train` fields without a comment);
`moescale --version`; the benchmarks run through `moescale bench` name themselves so; a bad
`--runs` of ep-offload is refused before any rank starts; a benchmark run without --out writes
under runs/bench/, never over the committed results."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

import moescale
from moescale import cli
from moescale.bench.cli import BENCHMARKS
from moescale.bench.measure import COMMITTED, result_path
from moescale.train.config import _options, _section_types
from moescale.train.field_docs import field_docs

COMMANDS = [[c] for c in cli.SUBCOMMANDS if c not in ("train", "bench")] + \
    [["bench", b] for b in BENCHMARKS]


def help_parsers(monkeypatch, capsys, argv) -> list[argparse.ArgumentParser]:
    seen = []
    monkeypatch.setattr(argparse.ArgumentParser, "print_help",
                        lambda self, file=None: seen.append(self))
    try:
        cli.main([*argv, "--help"])
    except SystemExit:
        pass
    capsys.readouterr()
    return seen


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
def test_every_option_of_every_subcommand_is_described(argv, monkeypatch, capsys):
    (parser,) = help_parsers(monkeypatch, capsys, argv)
    assert parser.prog == "moescale " + " ".join(argv)
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    bare = [a.option_strings or [a.dest] for a in options if not (a.help or "").strip()]
    assert options and not bare, f"{len(bare)} of {len(options)} undescribed: {bare}"


def test_every_train_option_is_described(capsys):
    bare = [f"--{section}.{name}" for section, cls in _section_types().items()
            for name in _options(cls, section) if not field_docs(cls).get(name)]
    assert not bare
    assert cli.main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--data.val_path" in text and "upcycled" in text


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"moescale {moescale.__version__}"


def test_ep_offload_refuses_one_run_before_starting_ranks(capsys):
    start = time.perf_counter()
    assert cli.main(["bench", "ep-offload", "--runs", "1"]) == 2
    assert time.perf_counter() - start < 5
    assert "--runs=1 must be >= 2" in capsys.readouterr().err


def test_results_go_under_runs_unless_out_is_given():
    default = result_path(None, "layer_cpu.json")
    assert default.parts[:2] == ("runs", "bench") and default.name == "layer_cpu.json"
    assert not default.is_relative_to(COMMITTED)
    assert result_path("benchmarks/results/x.json", "x.json") == Path("benchmarks/results/x.json")


def test_train_takes_kebab_case_names_too():
    from moescale.train.cli import parse_args

    _, _, overrides, _ = parse_args(["--model.top-k", "1", "--train.run-dir=x",
                                     "--model.num_experts", "4"])
    assert overrides == {"model.top_k": "1", "train.run_dir": "x", "model.num_experts": "4"}
