"""Run a `moescale ...` command (a doc block's, a trainer test's) or a doc block's python script in
a process forked from the test session's warm fork server, instead of a fresh interpreter.

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
their threads; moescale registers none).

`torchrun --nproc-per-node N -m moescale ...` (optionally `--standalone`) runs as N ranks
forked the same way, each with the variables torchrun gives its workers (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR / MASTER_PORT on 127.0.0.1,
TORCHELASTIC_RUN_ID / RESTART_COUNT / MAX_RESTARTS, OMP_NUM_THREADS=1), rank 0 hosting the
rendezvous store; like torchrun's agent, the first rank to fail ends the others and its exit
code is the command's. That saves a fresh torchrun launcher and N fresh interpreters per
command (~7 s of a 2-step 2-rank run, ~12 s at 4 ranks). What it does not run is torchrun's
own launcher: the real `torchrun` runs in tests/parallel/test_torchrun.py, which also checks
that its workers' variables are the ones given here, and any other torchrun command line in a
doc block (several nodes, a script) runs the real launcher. The trainer's torchrun tests
(tests/train: test_train_nodes, test_train_dynamic, test_train_ep_offload) fork their ranks
the same way (`run_warm_torchrun`, `nodes` > 1 for machines of `torchrun --nnodes`).
A python script's own forkserver processes (run_local's ranks) come from the session's
server as well (`_reuse_session_fork_server`), instead of a fresh server per script.
MOESCALE_DOC_FRESH=1 runs everything fresh, torchrun included.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import tempfile
import time
import uuid
from pathlib import Path

from moescale.parallel.launch import free_port


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
        _reuse_session_fork_server()
        script = str(Path(cwd, argv[1]))
        sys.argv = [script] + list(argv[2:])
        sys.path.insert(0, str(Path(script).parent))
        runpy.run_path(script, run_name="__main__")
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


def _reuse_session_fork_server() -> None:
    """Processes the script starts with the forkserver method (run_local's ranks) come from the
    session's warm server too, not from a fresh server this process would start (a new
    interpreter importing torch and moescale: ~3.5 s per script that launches ranks).

    A child of the fork server already holds the server's address and the "alive" pipe
    (multiprocessing.forkserver sets both in the server and in each child it forks); only
    `ensure_running`, which starts a server whenever this process has not started one itself,
    is told that one is running. Where that internal state is missing (another Python), the
    script starts its own server as it would anyway. Those ranks write where the session's
    server writes (nowhere: tests/conftest.py); a rank's error still reaches the script (and so
    the block's output) through run_local."""
    from multiprocessing import forkserver, resource_tracker
    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_address", None) is None or \
            getattr(server, "_forkserver_alive_fd", None) is None:
        return
    server.ensure_running = resource_tracker.ensure_running


def _run_forked(jobs: list[tuple[list[str], dict[str, str]]], cwd: Path,
                timeout_s: float) -> tuple[int | None, list[str]]:
    """Each (argv, env) of `jobs` in its own process forked from the warm server, all at once:
    (0, the first failing process's exit code, or None past timeout_s; each one's output). A
    failure ends the others, as torchrun's agent does."""
    ctx = multiprocessing.get_context("forkserver")
    outs = []
    for _ in jobs:
        fd, path = tempfile.mkstemp(prefix="moescale-doc-", suffix=".out")
        os.close(fd)
        outs.append(Path(path))
    procs = [ctx.Process(target=_child, args=(argv, str(cwd), env, str(out)))
             for (argv, env), out in zip(jobs, outs)]
    for proc in procs:
        proc.start()
    deadline, code = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        codes = [proc.exitcode for proc in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            code = failed[0] if failed else 0
            break
        time.sleep(0.05)
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
        proc.join(10)
    output = []
    for out in outs:
        try:
            output.append(out.read_text(encoding="utf-8", errors="replace"))
        finally:
            out.unlink(missing_ok=True)
    return code, output


def run_warm(argv: list[str], cwd: Path, env: dict[str, str],
             timeout_s: float) -> tuple[int | None, str]:
    """(exit code, or None if it ran past timeout_s and was killed; its output)."""
    code, (output,) = _run_forked([(argv, env)], cwd, timeout_s)
    return code, output


def torchrun_ranks(argv: list[str]) -> tuple[int, list[str]] | None:
    """(ranks, moescale's arguments) for `torchrun [--standalone] --nproc-per-node N -m moescale
    ARGS`; None for any other torchrun command line (the real launcher runs it)."""
    if argv[:1] != ["torchrun"]:
        return None
    ranks, i = None, 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--standalone":
            i += 1
        elif arg in ("--nproc-per-node", "--nproc_per_node") and i + 1 < len(argv):
            ranks, i = argv[i + 1], i + 2
        elif arg.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            ranks, i = arg.split("=", 1)[1], i + 1
        elif argv[i:i + 2] == ["-m", "moescale"] and ranks is not None and ranks.isdigit():
            return int(ranks), argv[i + 2:]
        else:
            return None
    return None


def torchrun_environment(env: dict[str, str], rank: int, ranks: int, port: int,
                         run_id: str, nodes: int = 1) -> dict[str, str]:
    """What torchrun's agents set for worker `rank` (global, node-major) of `ranks` per node on
    `nodes` machines (`torchrun --nnodes nodes --nproc-per-node ranks`). Checked against a real
    torchrun's workers in tests/parallel/test_torchrun.py."""
    world, (node, local) = ranks * nodes, divmod(rank, ranks)
    worker = dict(env)
    worker.update(RANK=str(rank), LOCAL_RANK=str(local), GROUP_RANK=str(node),
                  ROLE_RANK=str(rank), ROLE_NAME="default", WORLD_SIZE=str(world),
                  LOCAL_WORLD_SIZE=str(ranks), GROUP_WORLD_SIZE=str(nodes),
                  ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                  TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0",
                  TORCHELASTIC_MAX_RESTARTS="0")
    if ranks > 1:
        worker.setdefault("OMP_NUM_THREADS", "1")
    return worker


def run_warm_torchrun(ranks: int, args: list[str], cwd: Path, env: dict[str, str],
                      timeout_s: float, nodes: int = 1) -> tuple[int | None, str]:
    """`torchrun [--nnodes nodes] --nproc-per-node ranks -m moescale *args` (every node on this
    machine) with the ranks forked from the warm fork server: (exit code: 0, the first failing
    rank's, or None past timeout_s; the ranks' outputs one after another, each under a
    `[rank r]` line)."""
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    jobs = [(["moescale"] + list(args), torchrun_environment(env, r, ranks, port, run_id, nodes))
            for r in range(ranks * nodes)]
    code, outputs = _run_forked(jobs, cwd, timeout_s)
    return code, "".join(f"[rank {r}]\n{out}" for r, out in enumerate(outputs))
