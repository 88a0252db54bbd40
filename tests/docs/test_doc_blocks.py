"""Every fenced code block of README.md and docs/*.md runs as written (tests/docs/doc_blocks.py
says how: python blocks as scripts, shell blocks' moescale / python / torchrun commands, with
training shrunk to a few steps unless MOESCALE_DOC_SHRINK=0). One test per block, named
file:line; text, TOML and output blocks are not run, and a block that cannot run carries
`<!-- doc-test: skip: REASON -->`.
"""

from __future__ import annotations

import os

import pytest

from doc_blocks import (RUN_TAGS, TEXT_TAGS, Block, collect_blocks, run_block,
                        shell_commands, shrunk)
from warm_runner import run_warm_torchrun, torchrun_ranks

BLOCKS = collect_blocks()
RUNNABLE = [b for b in BLOCKS if b.tag in RUN_TAGS]


def test_every_block_has_a_known_tag_and_skips_give_a_reason():
    bad = [f"{b.id} (tag {b.tag!r})" for b in BLOCKS if b.tag not in RUN_TAGS + TEXT_TAGS]
    assert not bad, ("fenced blocks need a language tag: python / bash to run, text / toml / "
                     "json / output not to: " + ", ".join(bad))
    assert all(b.skip.strip() for b in BLOCKS if b.skip is not None)
    assert not [b.id for b in BLOCKS if b.skip and b.tag not in RUN_TAGS], \
        "a skip marker on a block that is not run anyway"


def test_the_harness_parses_and_shrinks_commands():
    block = Block("x.md", 1, "bash", "moescale train --train.steps 2000   # long\n"
                                     "torchrun --nproc-per-node 2 -m moescale train \\\n"
                                     "    --parallel.ep_size 2\n"
                                     "moescale train --help   # text\n")
    commands = shell_commands(block)
    assert commands == [["moescale", "train", "--train.steps", "2000"],
                        ["torchrun", "--nproc-per-node", "2", "-m", "moescale", "train",
                         "--parallel.ep_size", "2"],
                        ["moescale", "train", "--help"]]
    long_run = shrunk(commands[0])
    assert long_run[-1] != "2000" and long_run[long_run.index("--train.steps", 4) + 1] == "2"
    assert shrunk(commands[1])[:8] == commands[1] and "--train.steps" in shrunk(commands[1])
    assert shrunk(commands[2]) == commands[2]


def test_single_node_torchrun_of_moescale_is_forked_and_anything_else_is_not():
    assert torchrun_ranks(["torchrun", "--nproc-per-node", "2", "-m", "moescale", "train",
                           "--parallel.ep_size", "2"]) == (2, ["train", "--parallel.ep_size", "2"])
    assert torchrun_ranks(["torchrun", "--standalone", "--nproc_per_node=4", "-m", "moescale",
                           "train"]) == (4, ["train"])
    for real in (["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "-m", "moescale"],
                 ["torchrun", "--nproc-per-node", "2", "script.py"],
                 ["torchrun", "--nproc-per-node", "auto", "-m", "moescale", "train"],
                 ["torchrun", "-m", "moescale", "train"],
                 ["moescale", "train"]):
        assert torchrun_ranks(real) is None, real


def test_forked_torchrun_runs_every_rank_and_fails_like_torchrun(tmp_path):
    # A bad option fails every rank with the CLI's exit code 2; the command's code is the
    # first failure's, and each rank's output is kept.
    code, output = run_warm_torchrun(2, ["train", "--model.no_such_option", "1"], tmp_path,
                                     dict(os.environ), timeout_s=60)
    assert code == 2, output
    assert "[rank 0]" in output and "[rank 1]" in output
    # (the first failure ends the other rank, which may not have printed its own yet)
    assert "no_such_option" in output, output


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_block_runs_as_written(block, tmp_path):
    if block.skip:
        pytest.skip(block.skip)
    run_block(block, tmp_path, timeout_s=240)
