"""Run a doc block's `moescale ...` command or python script in a process forked from the
test session's warm fork server, instead of a fresh interpreter.

A fresh `moescale train` spends about 3.5 s of its few seconds importing torch and
torch._dynamo (the first optimizer imports it) before it reads an option; the session's
multiprocessing fork server (tests/conftest.py: FORKSERVER_PRELOAD) has imported them once.
The child forked from it is a new process with its own pid, working directory, environment,
stdin (/dev/null) and stdout + stderr (a file): it runs `moescale.cli.main(argv)` (the
console script's function) or the script as `__main__` (runpy, its directory first on
sys.path, as `python script.py` does), and exits with its exit code. Uncaught exceptions print
their traceback and exit 1, as the interpreter does.

What differs from a fresh interpreter: modules the server preloaded are already imported
(import-time reads of the environment saw the test session's), and atexit handlers registered
by the command do not run (multiprocessing ends its children with os._exit after joining
their threads; moescale registers none). torchrun commands still start fresh processes, and
MOESCALE_DOC_FRESH=1 runs everything fresh.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import tempfile
from pathlib import Path


def warm_enabled() -> bool:
    return os.environ.get("MOESCALE_DOC_FRESH", "0") != "1"


def _child(argv: list[str], cwd: str, env: dict[str, str], out_path: str) -> None:
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if argv[0] == "moescale":
        from moescale.cli import main
        sys.argv = list(argv)
        code = main(argv[1:])
    else:                                   # ["python", script, args...]
        script = str(Path(cwd, argv[1]))
        sys.argv = [script] + list(argv[2:])
        sys.path.insert(0, str(Path(script).parent))
        runpy.run_path(script, run_name="__main__")
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


def run_warm(argv: list[str], cwd: Path, env: dict[str, str],
             timeout_s: float) -> tuple[int | None, str]:
    """(exit code, or None if it ran past timeout_s and was killed; its output)."""
    fd, out_path = tempfile.mkstemp(prefix="moescale-doc-", suffix=".out")
    os.close(fd)
    out_path = Path(out_path)
    ctx = multiprocessing.get_context("forkserver")
    proc = ctx.Process(target=_child, args=(argv, str(cwd), env, str(out_path)))
    proc.start()
    proc.join(timeout_s)
    code = proc.exitcode
    if code is None:
        proc.kill()
        proc.join(10)
    try:
        output = out_path.read_text(encoding="utf-8", errors="replace")
    finally:
        out_path.unlink(missing_ok=True)
    return code, output
