"""Bad `moescale train` input: one line on stderr naming the value, exit code 2, no traceback
(issue 13, item 4). A table of 120+ cases, run in-process through the CLI's own `main` (fast),
a few through the real command. Before the fix 8 of 93 such inputs gave tracebacks or a
segfault (`--train.threads 100000`), and several messages named no value or file.

Each row: an id, the arguments after `moescale train` (placeholders filled by the fixture:
{corpus} a small text corpus, {tmp} the test's folder, {run} a fresh run directory) and the
text the one line must contain (the value, or the file, it is about).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from fault_helpers import tiny_args
from warm_runner import run_warm

from moescale.cli import main
from moescale.train.checkpoint import save_checkpoint

BAD = [
    # command line shape
    ("bare-word", ["xyz"], "'xyz'"),
    ("unknown-flag", ["--foo", "1"], "--foo"),
    ("no-dot", ["--model", "x"], "--model"),
    ("missing-value", ["--train.steps"], "--train.steps"),
    ("unknown-section", ["--nosuch.x", "1"], "nosuch.x"),
    ("unknown-field", ["--model.width", "3"], "model.width"),
    ("eq-unknown", ["--train.stepz=3"], "train.stepz"),
    # model
    ("size", ["--model.size", "huge"], "'huge'"),
    ("n_layers-0", ["--model.n_layers", "0"], "model.n_layers=0"),
    ("n_layers-neg", ["--model.n_layers", "-1"], "model.n_layers=-1"),
    ("n_layers-text", ["--model.n_layers", "two"], "'two'"),
    ("n_layers-float", ["--model.n_layers", "1.5"], "'1.5'"),
    ("d_model-0", ["--model.d_model", "0"], "model.d_model=0"),
    ("d_model-text", ["--model.d_model", "wide"], "'wide'"),
    ("d_model-1e8", ["--model.d_model", "1e8"], "d_model 100000000"),
    ("d_model-100M", ["--model.d_model", "100000000"], "d_model 100000000"),
    ("n_heads-0", ["--model.n_heads", "0"], "model.n_heads=0"),
    ("n_heads-3", ["--model.n_heads", "3"], "3"),
    ("d_ff-0", ["--model.d_ff", "0"], "model.d_ff=0"),
    ("d_ff-huge", ["--model.d_ff", "1e12"], "d_ff 1000000000000"),
    ("experts-0", ["--model.num_experts", "0"], "model.num_experts=0"),
    ("experts-1e9", ["--model.num_experts", "1e9"], "num_experts 1000000000"),
    ("top_k-0", ["--model.top_k", "0"], "model.top_k=0"),
    ("top_k-gt-E", ["--model.top_k", "5"], "top_k"),
    ("router", ["--model.router", "random"], "'random'"),
    ("capacity-0", ["--model.capacity_factor", "0"], "model.capacity_factor=0"),
    ("capacity-neg", ["--model.capacity_factor", "-1"], "-1"),
    ("capacity-nan", ["--model.capacity_factor", "nan"], "'nan'"),
    ("capacity-inf", ["--model.capacity_factor", "inf"], "'inf'"),
    ("capacity-text", ["--model.capacity_factor", "big"], "'big'"),
    ("moe_every-neg", ["--model.moe_every", "-1"], "model.moe_every=-1"),
    ("glu-text", ["--model.glu", "maybe"], "'maybe'"),
    ("activation", ["--model.activation", "sparkle"], "sparkle"),
    ("aux-neg", ["--model.aux_loss_coef", "-1"], "model.aux_loss_coef=-1"),
    ("z-neg", ["--model.z_loss_coef", "-0.5"], "-0.5"),
    ("z-nan", ["--model.z_loss_coef", "nan"], "'nan'"),
    ("dropout-1", ["--model.dropout", "1"], "model.dropout=1"),
    ("dropout-neg", ["--model.dropout", "-0.1"], "-0.1"),
    # data
    ("data-missing", ["--data.path", "{tmp}/nope.txt"], "nope.txt"),
    ("data-one-missing", ["--data.path", "{corpus},{tmp}/gone"], "gone"),
    ("data-mixed", ["--data.path", "{tmp}/neg.bin,{tmp}/notes.txt"], "neg.bin"),
    ("data-odd-bytes", ["--data.path", "{tmp}/odd.bin", "--data.token_dtype", "uint16"],
     "odd.bin"),
    ("data-negative-ids", ["--data.path", "{tmp}/neg.bin", "--data.token_dtype", "int32"],
     "-7"),
    ("data-ids-past-vocab", ["--data.path", "{tmp}/big.bin", "--data.token_dtype", "uint16"],
     "300"),
    ("data-empty-bin", ["--data.path", "{tmp}/empty.bin"], "empty.bin"),
    ("data-empty-text", ["--data.path", "{tmp}/empty.txt"], "empty.txt"),
    ("data-too-short", ["--data.path", "{tmp}/short.txt"], "33"),
    ("val_fraction-0", ["--data.val_fraction", "0"], "data.val_fraction=0"),
    ("val_fraction-1", ["--data.val_fraction", "1"], "data.val_fraction=1"),
    ("val_fraction-text", ["--data.val_fraction", "tenth"], "'tenth'"),
    ("token_dtype", ["--data.token_dtype", "float32"], "'float32'"),
    ("vocab-1", ["--data.vocab_size", "1"], "data.vocab_size=1"),
    ("vocab-huge", ["--data.path", "{tmp}/big.bin", "--data.token_dtype", "uint16",
                    "--data.vocab_size", "1e12"], "1000000000000"),
    ("data-bin-no-dtype", ["--data.path", "{tmp}/big.bin"], "big.bin.json"),
    ("data-dtype-vs-sidecar", ["--data.path", "{tmp}/side.bin", "--data.token_dtype", "uint8"],
     "'uint16'"),
    ("data-bad-sidecar", ["--data.path", "{tmp}/badside.bin"], "badside.bin.json"),
    ("data-tokenizer-missing", ["--data.tokenizer", "{tmp}/nope.json"], "nope.json"),
    ("data-tokenizer-unloadable", ["--data.tokenizer", "{tmp}/notes.txt"], "notes.txt"),
    ("text_column-blank", ["--data.text_column", " "], "data.text_column"),
    # optim
    ("lr-0", ["--optim.lr", "0"], "optim.lr=0"),
    ("lr-neg", ["--optim.lr", "-1"], "optim.lr=-1"),
    ("lr-nan", ["--optim.lr", "nan"], "'nan'"),
    ("lr-inf", ["--optim.lr", "inf"], "'inf'"),
    ("lr-text", ["--optim.lr", "fast"], "'fast'"),
    ("lr-overflow", ["--optim.lr", "1e400"], "'1e400'"),
    ("min_lr-gt-lr", ["--optim.min_lr", "1"], "optim.min_lr=1"),
    ("min_lr-neg", ["--optim.min_lr", "-1e-5"], "-1e-05"),
    ("warmup-neg", ["--optim.warmup_steps", "-1"], "optim.warmup_steps=-1"),
    ("warmup-float", ["--optim.warmup_steps", "2.5"], "'2.5'"),
    ("schedule", ["--optim.schedule", "step"], "'step'"),
    ("wd-neg", ["--optim.weight_decay", "-0.1"], "-0.1"),
    ("beta1-1", ["--optim.beta1", "1"], "optim.beta1=1"),
    ("beta1-neg", ["--optim.beta1", "-0.1"], "-0.1"),
    ("beta2-big", ["--optim.beta2", "1.5"], "1.5"),
    ("eps-0", ["--optim.eps", "0"], "optim.eps=0"),
    ("grad_clip-neg", ["--optim.grad_clip", "-1"], "optim.grad_clip=-1"),
    # train
    ("steps-0", ["--train.steps", "0"], "train.steps=0"),
    ("steps-neg", ["--train.steps", "-5"], "train.steps=-5"),
    ("steps-float", ["--train.steps", "1.5"], "'1.5'"),
    ("steps-text", ["--train.steps", "many"], "'many'"),
    ("steps-64bit", ["--train.steps", "1e999999999"], "'1e999999999'"),
    ("steps-hex-junk", ["--train.steps", "0xZZ"], "'0xZZ'"),
    ("batch-0", ["--train.batch_size", "0"], "train.batch_size=0"),
    ("batch-1e11", ["--train.batch_size", "1e11"], "train.batch_size=100000000000"),
    ("batch-int-huge", ["--train.batch_size", "100000000000"],
     "train.batch_size=100000000000"),
    ("seq_len-0", ["--train.seq_len", "0"], "train.seq_len=0"),
    ("seq_len-huge", ["--train.seq_len", "1e9"], "1000000000"),
    ("grad_accum-0", ["--train.grad_accum", "0"], "train.grad_accum=0"),
    ("eval_interval-neg", ["--train.eval_interval", "-1"], "train.eval_interval=-1"),
    ("eval_batches-0", ["--train.eval_batches", "0"], "train.eval_batches=0"),
    ("ckpt_interval-neg", ["--train.checkpoint_interval", "-1"],
     "train.checkpoint_interval=-1"),
    ("keep_last-0", ["--train.keep_last", "0"], "train.keep_last=0"),
    ("seed-neg", ["--train.seed", "-1"], "train.seed=-1"),
    ("seed-65bit", ["--train.seed", str(2**64)], str(2**64)),
    ("seed-2^63", ["--train.seed", str(2**63)], str(2**63)),
    ("seed-1e30", ["--train.seed", "1e30"], "'1e30'"),
    ("seed-text", ["--train.seed", "lucky"], "'lucky'"),
    ("precision", ["--train.precision", "fp16"], "'fp16'"),
    ("device-tpu", ["--train.device", "tpu"], "'tpu'"),
    ("device-cuda-x", ["--train.device", "cuda:x"], "'cuda:x'"),
    ("threads-neg", ["--train.threads", "-1"], "train.threads=-1"),
    ("threads-100000", ["--train.threads", "100000"], "train.threads=100000"),
    ("threads-1e6", ["--train.threads", "1e6"], "train.threads=1000000"),
    ("run_dir-file", ["--train.run_dir", "{tmp}/notes.txt"], "notes.txt"),
    ("run_dir-under-file", ["--train.run_dir", "{tmp}/notes.txt/run"], "notes.txt"),
    ("run_dir-unwritable", ["--train.run_dir", "/proc/1/moescale-run"], "/proc/1/moescale-run"),
    ("run_dir-has-ckpts", ["--train.run_dir", "{tmp}/hasckpt"], "hasckpt"),
    ("sample_tokens-neg", ["--train.sample_tokens", "-1"], "train.sample_tokens=-1"),
    ("progress-text", ["--train.progress", "sometimes"], "'sometimes'"),
    ("max_skips-0", ["--train.max_skips", "0"], "train.max_skips=0"),
    # offload
    ("offload-mode", ["--offload.mode", "cloud"], "'cloud'"),
    ("budget-text", ["--offload.device_budget", "lots"], "'lots'"),
    ("budget-neg", ["--offload.device_budget", "-5"], "'-5'"),
    ("budget-zero", ["--offload.device_budget", "0"], "'0'"),
    ("budget-unit", ["--offload.device_budget", "5 parsecs"], "'5 parsecs'"),
    ("budget-experts-0", ["--offload.mode", "host", "--offload.device_budget_experts", "0"],
     "offload.device_budget_experts=0"),
    ("budget-both", ["--offload.mode", "host", "--offload.device_budget", "1MiB",
                     "--offload.device_budget_experts", "2"], "offload.device_budget_experts"),
    ("budget-too-small", ["--offload.mode", "host", "--offload.device_budget", "1KiB"],
     "1024 bytes"),
    ("budget-device-only", ["--offload.device_budget", "1KiB"], "1,024 bytes"),
    ("host_budget-text", ["--offload.host_budget", "all"], "'all'"),
    ("host_cache-text", ["--offload.host_cache", "some"], "'some'"),
    ("step_mode", ["--offload.step_mode", "lazy"], "'lazy'"),
    ("eager-clip", ["--offload.mode", "host", "--offload.step_mode", "eager"],
     "optim.grad_clip=1.0"),
    ("activation_policy", ["--offload.activation_policy", "drop"], "'drop'"),
    ("lookahead-neg", ["--offload.lookahead", "-1"], "offload.lookahead=-1"),
    ("rates", ["--offload.rates", "h100"], "'h100'"),
    ("auto-no-budget", ["--offload.mode", "auto"], "offload.device_budget"),
    # parallel
    ("ep_size-0", ["--parallel.ep_size", "0"], "parallel.ep_size=0"),
    ("ep_size-unlaunched", ["--parallel.ep_size", "2"], "parallel.ep_size=2"),
    ("ep_size-not-divisor", ["--parallel.ep_size", "3"], "parallel.ep_size=3"),
    ("chunks-0", ["--parallel.chunks", "0"], "parallel.chunks=0"),
    ("chunks-text", ["--parallel.chunks", "many"], "'many'"),
    ("chunks-single", ["--parallel.chunks", "2"], "parallel.chunks=2"),
    ("reuse", ["--parallel.reuse", "S9"], "'S9'"),
    ("reuse-single", ["--parallel.reuse", "S1"], "parallel.reuse='S1'"),
    ("placement", ["--parallel.placement", "random"], "'random'"),
    ("split-static", ["--parallel.split", "false"], "parallel.split=false"),
    ("node_size-neg", ["--parallel.node_size", "-1"], "parallel.node_size=-1"),
    ("node_size-static", ["--parallel.node_size", "2"], "parallel.node_size=2"),
    ("timeout-0", ["--parallel.timeout_s", "0"], "parallel.timeout_s=0"),
    ("dynamic-unlaunched", ["--parallel.placement", "dynamic"], "parallel.placement='dynamic'"),
    ("dynamic-offload", ["--parallel.placement", "dynamic", "--offload.mode", "pin"],
     "offload.tier='pin'"),
    ("dynamic-bf16", ["--parallel.placement", "dynamic", "--train.precision", "bf16"],
     "train.precision='bf16'"),
    # config files
    ("config-missing", ["--config", "{tmp}/none.toml"], "none.toml"),
    ("config-invalid", ["--config", "{tmp}/invalid.toml"], "invalid.toml"),
    ("config-undecodable", ["--config", "{tmp}/binary.toml"], "binary.toml"),
    ("config-array", ["--config", "{tmp}/array.toml"], "[32, 64]"),
    ("config-inline-table", ["--config", "{tmp}/table.toml"], "{'a': 1}"),
    ("config-date", ["--config", "{tmp}/date.toml"], "1979-05-27"),
    ("config-not-a-table", ["--config", "{tmp}/section.toml"], "'model'"),
    ("config-unknown-key", ["--config", "{tmp}/unknown.toml"], "model.width"),
    ("config-string-int", ["--config", "{tmp}/string.toml"], "'many'"),
    ("config-float-int", ["--config", "{tmp}/float.toml"], "2.5"),
    ("config-bool-int", ["--config", "{tmp}/bool.toml"], "True"),
    ("config-bad-value", ["--config", "{tmp}/negative.toml"], "optim.lr=-1.0"),
    ("config-huge-int", ["--config", "{tmp}/huge.toml"], str(10**30)),
    ("config-a-directory", ["--config", "{tmp}"], "{tmp}"),
    # resume
    ("resume-missing", ["--resume", "{tmp}/gone"], "gone"),
    ("resume-no-config", ["--resume", "{tmp}/noconfig"], "noconfig"),
    ("resume-undecodable", ["--resume", "{tmp}/undecodable"], "undecodable/config.toml"),
    ("resume-invalid-toml", ["--resume", "{tmp}/badtoml"], "badtoml/config.toml"),
    ("resume-no-checkpoint", ["--resume", "{tmp}/nockpt"], "nockpt"),
    ("resume-a-file", ["--resume", "{tmp}/notes.txt"], "notes.txt"),
]

# run in a process of their own too: the first as the real command (fork + exec of
# `python -m moescale`), the others as `moescale` forked from the test session's warm fork
# server (tests/warm_runner.py: the same main, without a fresh interpreter importing torch)
REAL = ["threads-100000", "batch-1e11", "config-array", "resume-undecodable", "seed-65bit"]

CONFIGS = {
    "invalid.toml": b"[model\n", "binary.toml": b"\xff\xfe\x00[model]",
    "array.toml": b"[model]\nd_model = [32, 64]\n", "table.toml": b"[train]\nsteps = {a = 1}\n",
    "date.toml": b"[train]\nsteps = 1979-05-27\n", "section.toml": b"model = 3\n",
    "unknown.toml": b"[model]\nwidth = 3\n", "string.toml": b'[train]\nsteps = "many"\n',
    "float.toml": b"[train]\nsteps = 2.5\n", "bool.toml": b"[train]\nsteps = true\n",
    "negative.toml": b"[optim]\nlr = -1.0\n", "huge.toml": b"[train]\nseed = " +
    str(10**30).encode() + b"\n",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus):
    """The files and directories the table refers to."""
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "notes.txt").write_text("a regular file\n")
    for name, data in CONFIGS.items():
        (tmp / name).write_bytes(data)
    np.array([5, -7, 9] * 400, dtype=np.int32).tofile(tmp / "neg.bin")
    np.array([5, 300, 9] * 400, dtype=np.uint16).tofile(tmp / "big.bin")
    (tmp / "odd.bin").write_bytes(b"\x01\x02\x03")
    (tmp / "empty.bin").write_bytes(b"")
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "short.txt").write_bytes(b"print(1)\n")
    np.array([5, 9] * 400, dtype=np.uint16).tofile(tmp / "side.bin")
    (tmp / "side.bin.json").write_text('{"dtype": "uint16", "vocab_size": 50257}')
    (tmp / "badside.bin").write_bytes(b"\x01\x02" * 100)
    (tmp / "badside.bin.json").write_text("{oops")
    for name, config in (("undecodable", b"\xff\xfe[train]"), ("badtoml", b"[[[\n")):
        (tmp / name).mkdir()
        (tmp / name / "config.toml").write_bytes(config)
    (tmp / "noconfig").mkdir()
    (tmp / "nockpt").mkdir()
    (tmp / "nockpt" / "config.toml").write_text(f'[data]\npath = "{corpus}"\n')
    save_checkpoint(tmp / "hasckpt" / "checkpoints", 1, {"w": torch.ones(1)}, {}, 1)
    return tmp


def _argv(row_args: list[str], files, corpus, run) -> list[str]:
    fill = {"{tmp}": str(files), "{corpus}": str(corpus), "{run}": str(run)}

    def sub(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text
    base = [] if row_args[0] == "--resume" else tiny_args(corpus, run)
    return ["train", *base, *map(sub, row_args)]


def _check(code: int, err: str, expect: str, files) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("moescale train: error: ")
    assert expect.replace("{tmp}", str(files)) in lines[0], lines[0]


def test_the_table_has_over_100_cases():
    assert len(BAD) >= 100 and len({row[0] for row in BAD}) == len(BAD)


@pytest.mark.parametrize("case,args,expect", BAD, ids=[row[0] for row in BAD])
def test_bad_input_is_one_line_exit_2(case, args, expect, files, corpus, tmp_path, capsys):
    code = main(_argv(args, files, corpus, tmp_path / "run"))
    _check(code, capsys.readouterr().err, expect, files)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bad_input_through_the_real_command(files, corpus, tmp_path):
    rows = {row[0]: row for row in BAD}
    first, *others = REAL
    proc = subprocess.Popen([sys.executable, "-m", "moescale",
                             *_argv(rows[first][1], files, corpus, tmp_path / first)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    for case in others:
        code, output = run_warm(["moescale", *_argv(rows[case][1], files, corpus,
                                                     tmp_path / case)], tmp_path,
                                dict(os.environ), 100)
        _check(code, output, rows[case][2], files)
    _, err = proc.communicate(timeout=100)
    _check(proc.returncode, err, rows[first][2], files)
