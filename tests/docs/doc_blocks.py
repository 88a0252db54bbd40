"""The fenced code blocks of README.md and docs/*.md, and how each one is run as written.

`collect_blocks()` reads every fenced block with its language tag, its opening fence's line
(1-based) and an optional marker on the nearest non-blank line before the fence:
`<!-- doc-test: skip: REASON -->`. What runs:

- ```python: the block as a script, in a fresh temporary directory, with this interpreter and
  PYTHONPATH at the repository; the shrink overrides (below) are its command-line arguments
  (`section.option=value`), which the training snippets read.
- ```bash / ```sh / ```shell: every command (continuation lines joined, `#` comments dropped),
  in order, in one fresh temporary directory, as an argument list (no shell: no `$VAR`, no
  `~`); ```console: the lines that start with `$ `. A command must start with `moescale`,
  `python` or `torchrun` (this interpreter's; `python -m moescale` / `python -m
  torch.distributed.run` when the console scripts are not installed); any other command
  fails the block, so a block that cannot run says why in a skip marker.
- ```text / ```toml / ```json / ```output: not run. A block without a tag is an error.

Shrink: unless MOESCALE_DOC_SHRINK=0, a `moescale train` command gets SHRINK appended (the
last value of an option wins), a `--resume` one trains to step 4 instead of 2, so the whole
set runs in minutes; SHRINK also leaves out report.png (drawing it takes ~1.3 s of a 2-step
run's ~2 s; tests/train/test_cli.py checks a CLI run's report). Fixtures in the temporary
directory, the stand-ins for the user's own files the examples name: `texts/` (a few text
files: the repository's docs) and `my.toml` (a small run config).

Speed: `moescale` commands, python scripts and single-node `torchrun -m moescale` commands (one
forked process per rank, torchrun's environment) run in processes forked from the test
session's warm fork server (warm_runner.py: torch and the CLI imported once); other torchrun
command lines start the real launcher; MOESCALE_DOC_FRESH=1 starts every command fresh.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from warm_runner import run_warm, run_warm_torchrun, torchrun_ranks, warm_enabled

REPO = Path(__file__).resolve().parents[2]
RUN_TAGS = ("python", "bash", "sh", "shell", "console")
TEXT_TAGS = ("text", "toml", "json", "output")
COMMANDS = ("moescale", "python", "torchrun")
SKIP = re.compile(r"<!--\s*doc-test:\s*skip:\s*(.*?)\s*-->")
SHRINK = {"train.steps": "2", "train.batch_size": "4", "train.seq_len": "32",
          "train.eval_interval": "0", "train.eval_batches": "1", "train.sample_tokens": "0",
          "train.checkpoint_interval": "0", "train.progress": "false", "train.report": "false"}
RESUME_STEPS = "4"


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its tag, its text, and a skip reason if marked."""

    path: str        # relative to the repository
    line: int        # the opening fence's line (1-based)
    tag: str
    text: str
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[Path]:
    return [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def collect_blocks() -> list[Block]:
    blocks = []
    for path in doc_files():
        lines = path.read_text(encoding="utf-8").split("\n")
        i = 0
        while i < len(lines):
            opening = re.match(r"^\s*```(\S*)\s*$", lines[i])
            if not opening:
                i += 1
                continue
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith("```"):
                end += 1
            before = next((s for s in reversed(lines[:i]) if s.strip()), "")
            marker = SKIP.search(before)
            blocks.append(Block(str(path.relative_to(REPO)), i + 1, opening.group(1),
                                "\n".join(lines[i + 1:end]) + "\n",
                                marker.group(1) if marker else None))
            i = end + 1
    return blocks


def shell_commands(block: Block) -> list[list[str]]:
    """The block's commands as argument lists (comments dropped, continuations joined)."""
    lines = block.text.split("\n")
    if block.tag == "console":
        lines = [s[2:] for s in lines if s.startswith("$ ")]
    joined, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        joined.append(current + line)
        current = ""
    return [argv for argv in (shlex.split(s, comments=True) for s in joined) if argv]


def shrink_enabled() -> bool:
    return os.environ.get("MOESCALE_DOC_SHRINK", "1") != "0"


def shrunk(argv: list[str]) -> list[str]:
    """argv with the shrink overrides appended when it is a `moescale train` run."""
    if not shrink_enabled() or "--help" in argv or "-h" in argv:
        return argv
    words = [a for a in argv if not a.startswith("-")]
    is_train = any(a == "moescale" and words[i + 1:i + 2] == ["train"]
                   for i, a in enumerate(words))
    if not is_train:
        return argv
    extra = dict(SHRINK, **({"train.steps": RESUME_STEPS} if "--resume" in argv else {}))
    return argv + [x for option, value in extra.items() for x in (f"--{option}", value)]


def resolved(argv: list[str]) -> list[str]:
    """The command with this interpreter's python / moescale / torchrun."""
    bindir = Path(sys.executable).parent
    head, rest = argv[0], argv[1:]
    if head not in COMMANDS:
        raise AssertionError(f"{shlex.join(argv)!r} starts with {head!r}, not one of "
                             f"{', '.join(COMMANDS)}; mark the block "
                             "<!-- doc-test: skip: REASON --> if it cannot run here")
    if head == "python":
        return [sys.executable] + rest
    found = shutil.which(head, path=str(bindir)) or shutil.which(head)
    if found:
        return [found] + rest
    module = "moescale" if head == "moescale" else "torch.distributed.run"
    return [sys.executable, "-m", module] + rest


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


MY_TOML = """[model]
num_experts = 4

[optim]
lr = 0.002
"""


def prepare(workdir: Path) -> None:
    """The user's files the examples name: texts/ (a few text files) and my.toml."""
    (workdir / "my.toml").write_text(MY_TOML, encoding="utf-8")
    texts = workdir / "texts"
    texts.mkdir()
    for doc in sorted((REPO / "docs").glob("*.md")):
        shutil.copy(doc, texts / doc.name)


def run_block(block: Block, workdir: Path, timeout_s: float) -> list[str]:
    """Run the block in workdir; returns what ran (one line per command). A failure raises
    AssertionError with the command, its exit code and the end of its output."""
    prepare(workdir)
    if block.tag == "python":
        script = workdir / "snippet.py"
        script.write_text(block.text, encoding="utf-8")
        overrides = [f"{k}={v}" for k, v in SHRINK.items()] if shrink_enabled() else []
        commands = [([sys.executable, script.name] + overrides,
                     ["python", script.name] + overrides)]
    else:
        commands = [(resolved(shrunk(argv)), shrunk(argv)) for argv in shell_commands(block)]
        if not commands:
            raise AssertionError(f"{block.id}: no command to run; mark the block "
                                 "<!-- doc-test: skip: REASON --> or tag it text")
    for argv, as_written in commands:
        code, output = run_command(argv, as_written, workdir, timeout_s)
        if code is None:
            raise AssertionError(f"{block.id}: {shlex.join(argv)} ran past {timeout_s} s")
        if code != 0:
            raise AssertionError(f"{block.id}: {shlex.join(argv)} exited {code}:\n"
                                 f"{output[-4000:]}")
    return [shlex.join(argv) for argv, _ in commands]


def run_command(argv: list[str], as_written: list[str], workdir: Path,
                timeout_s: float) -> tuple[int | None, str]:
    """(exit code or None on timeout, output): `moescale` commands, python scripts and
    single-node `torchrun -m moescale` commands in processes forked from the warm fork server
    (warm_runner.py), the rest as fresh processes."""
    if warm_enabled() and as_written[0] in ("moescale", "python"):
        return run_warm(as_written, workdir, environment(), timeout_s)
    ranks = torchrun_ranks(as_written) if warm_enabled() else None
    if ranks is not None:
        return run_warm_torchrun(*ranks, workdir, environment(), timeout_s)
    try:
        done = subprocess.run(argv, cwd=workdir, env=environment(), timeout=timeout_s,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except subprocess.TimeoutExpired:
        return None, ""
    return done.returncode, done.stdout
