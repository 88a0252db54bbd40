"""Option values: a CLI word or a TOML value, converted to the annotated type of a config field.

`convert(text, hint, option)` turns `--train.steps 2000` or `steps = 2000` into the field's type
(bool, int, float, str, `Size`: bytes written '512MiB', '2GB' or a number; optionally None), or
raises ValueError naming the option and the value:
TOML arrays, tables and dates for a scalar, integers past 64 bits (exact scientific notation
such as `1e6` is an integer), non-finite floats. `type_name` is how `--help` shows a type.

The fields, their defaults and their checks are config.py's; this file knows no option names.
"""

from __future__ import annotations

import decimal
import math
import types
import typing

from moescale.sizes import Size, parse_size

__all__ = ["Size", "parse_size", "convert", "type_name"]


def unwrap_optional(hint):
    """(base type, optional?) of an annotation like `int | None`; `int | str` (a count or a
    word such as 'auto') stays a union."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        assert len(args) == 1 or set(args) == {int, str}, hint
        return (args[0] if len(args) == 1 else int | str), optional
    return hint, False


def convert(text, hint, option: str):
    """Convert `text` (a CLI string or a TOML value) to the annotated type of `option`."""
    base, optional = unwrap_optional(hint)
    if not isinstance(text, (str, int, float)):     # a TOML array, table or date
        raise ValueError(f"{option}={text} is a TOML {type(text).__name__}; give one "
                         f"{type_name(base)} value")
    if base == int | str:       # a count, or a word the field's own check knows ('auto')
        if isinstance(text, str) and not text.strip().lstrip("+-").isdigit():
            return text.strip()
        return convert(text, int, option)
    if isinstance(text, str) and optional and text.strip().lower() in ("none", "null", ""):
        return None
    if base is Size:
        return Size(parse_size(text, option))
    if base is bool:
        if isinstance(text, bool):
            return text
        low = str(text).strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{option}={text!r} is not a boolean; use true or false")
    if base is int:
        if isinstance(text, bool) or (isinstance(text, float) and not text.is_integer()):
            raise ValueError(f"{option}={text!r} is not an integer")
        try:
            value = int(text) if not isinstance(text, str) else _parse_int(text)
        except (ValueError, OverflowError):
            raise ValueError(f"{option}={text!r} is not an integer (or past 64 bits)") from None
        if not -2**63 <= value < 2**63:
            raise ValueError(f"{option}={text!r} is past 64 bits; give a smaller integer")
        return value
    if base is float:
        if isinstance(text, bool):
            raise ValueError(f"{option}={text!r} is not a number")
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{option}={text!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"{option}={text!r} must be a finite number")
        return value
    if base is str:
        if isinstance(text, int) and not isinstance(text, bool):
            return str(text)    # TOML `chunks = 2`
        if not isinstance(text, str):
            raise ValueError(f"{option}={text!r} must be a string")
        return text
    raise AssertionError(f"unsupported option type {hint} for {option}")


def _parse_int(text: str) -> int:
    """'42', '0x2a', '1_000' and exact scientific notation ('1e6'); ValueError otherwise."""
    try:
        return int(text.strip(), 0)
    except ValueError:
        try:
            value = decimal.Decimal(text.strip())
        except decimal.InvalidOperation:
            raise ValueError(text) from None
        if not value.is_finite() or value.adjusted() > 18 or \
                value != value.to_integral_value():
            raise ValueError(text) from None
        return int(value)


def type_name(hint) -> str:
    """How --help shows an annotation: `int`, `float | none`."""
    base, optional = unwrap_optional(hint)
    name = "size (e.g. 512MiB)" if base is Size else \
        "int | str" if base == int | str else base.__name__
    return name + (" | none" if optional else "")
