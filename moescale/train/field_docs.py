"""A config dataclass's field documentation, read from the comments that follow each field.

The config classes (the run's sections and the library's `OffloadConfig` / `ParallelConfig`)
document a field with the comment on its line and the comment-only lines under it:

    chunks: int | str = 1           # pipelined all-to-all: 1 (plain exchange), a chunk count, or
                                    # auto (tuned online)

`field_docs(cls)` returns {field name: its comment text, joined into one line} over the class
and its bases, so `moescale train --help` prints the same words the code shows; a field
without a comment maps to ''.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

FIELD = re.compile(r"^\s+(\w+)\s*:[^#]*?(?:#\s?(.*))?$")
COMMENT = re.compile(r"^\s+#\s?(.*)$")


def field_docs(cls) -> dict[str, str]:
    """{field: documentation} of dataclass `cls`, from the source of it and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        docs.update(_class_docs(klass))
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def _class_docs(klass) -> dict[str, str]:
    try:
        lines = inspect.getsource(klass).splitlines()
    except (OSError, TypeError):     # no source (e.g. a class built at run time)
        return {}
    names = {f.name for f in dataclasses.fields(klass)}
    docs: dict[str, list[str]] = {}
    current = None
    for line in lines:
        match = FIELD.match(line)
        if match and match.group(1) in names and match.group(1) not in docs:
            current = match.group(1)
            docs[current] = [match.group(2).strip()] if match.group(2) else []
            continue
        comment = COMMENT.match(line)
        if comment and current is not None and docs[current]:
            docs[current].append(comment.group(1).strip())
        else:
            current = None
    return {name: " ".join(parts) for name, parts in docs.items()}
