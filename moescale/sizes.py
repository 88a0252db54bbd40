"""Byte sizes: the `Size` type of a config field, the parser of its text, and `fmt_bytes`, the
one formatter of byte counts for people (messages, summaries, `moescale plan` and `info`).

A field annotated `Size` (or `Size | None`) holds a number of bytes, an `int` at run time, so
Python callers pass integers (`device_budget_bytes=64 << 20`); the command line and TOML files
give text such as '512MiB', '2GB' or '1e9', which `parse_size` turns into bytes once, at the
edge (moescale.train.options.convert reads the annotation).
"""

from __future__ import annotations

import math
import re
import typing

Size = typing.NewType("Size", int)    # bytes; given as '512MiB', '2GB', '1e9' or an integer
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text, option: str) -> int:
    """'512MiB', '2GB', '1e9', '4096' or a positive integer -> bytes; ValueError naming
    `option` and the value otherwise."""
    if isinstance(text, bool):
        raise ValueError(f"{option}={text!r} is not a size; write e.g. '512MiB' or '2GB'")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = re.fullmatch(r"([0-9.eE+]+)\s*([a-zA-Z]*)", str(text).strip())
        if match is None or match.group(2).lower() not in SIZE_UNITS:
            raise ValueError(f"{option}={text!r} is not a size; write e.g. '512MiB', '2GB' or a "
                             "number of bytes")
        try:
            value = float(match.group(1)) * SIZE_UNITS[match.group(2).lower()]
        except ValueError:
            raise ValueError(f"{option}={text!r} is not a size; write e.g. '512MiB' or "
                             "'2GB'") from None
    if not (value >= 1 and math.isfinite(value)):
        raise ValueError(f"{option}={text!r} is invalid: a size must be at least one byte")
    return int(value)


def fmt_bytes(n: float, exact: bool = False) -> str:
    """A byte count in binary units with one decimal: '512 B', '1.5 KiB', '64.0 MiB', '2.0 GiB',
    '3.1 TiB'. `exact` (errors about budgets and free space) gives the count itself, and the
    unit where that rounds it: '400 bytes', '67108864 bytes (64.0 MiB)'."""
    value = n
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if exact:
        return f"{int(n)} bytes" + ("" if unit == "B" else f" ({value:.1f} {unit})")
    return f"{int(n)} B" if unit == "B" else f"{value:.1f} {unit}"
