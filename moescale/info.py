"""`moescale info`: what this machine offers moescale — versions, devices, CPU, memory and disk.

Prints one `name: value` line per fact (or JSON with `--json`): moescale, Python, torch and the
other dependencies' versions; CUDA devices with their memory (or "none"); CPU count, torch's
thread count and CPU capability; total and available RAM; free disk in the current directory
and in the default cache directory. Reads only; changes no setting.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
from pathlib import Path

from moescale.sizes import fmt_bytes

_PACKAGES = ("torch", "numpy", "safetensors", "tqdm", "matplotlib", "tomli-w", "psutil",
             "transformers")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gather() -> dict:
    import psutil
    import torch

    import moescale

    info: dict[str, object] = {"moescale": moescale.__version__,
                               "python": f"{platform.python_version()} ({platform.machine()})",
                               "os": platform.platform()}
    for name in _PACKAGES:
        info[name] = _version(name)
    if torch.cuda.is_available():
        info["cuda"] = torch.version.cuda
        info["devices"] = [
            f"cuda:{i} {torch.cuda.get_device_name(i)} "
            f"{fmt_bytes(torch.cuda.get_device_properties(i).total_memory)}"
            for i in range(torch.cuda.device_count())]
    else:
        info["devices"] = ["none (CPU only; offloading runs against a simulated device budget)"]
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older builds lack the query
        capability = "unknown"
    info["cpus"] = os.cpu_count()
    info["cpu_affinity"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count()
    info["torch_threads"] = torch.get_num_threads()
    info["cpu_capability"] = capability
    mem = psutil.virtual_memory()
    info["ram_total"] = fmt_bytes(mem.total)
    info["ram_available"] = fmt_bytes(mem.available)
    info["disk_free_cwd"] = fmt_bytes(shutil.disk_usage(os.getcwd()).free)
    cache = Path("~/.cache").expanduser()
    while not cache.exists() and cache != cache.parent:
        cache = cache.parent
    info["disk_free_cache"] = fmt_bytes(shutil.disk_usage(cache).free)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moescale info",
                                     description="versions, devices, memory and disk found")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv or [])
    info = gather()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    for key, value in info.items():
        if isinstance(value, list):
            value = "; ".join(value)
        print(f"{key + ':':<16} {value}")
    return 0
