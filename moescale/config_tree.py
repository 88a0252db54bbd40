"""Nested config dataclasses from, and back to, flat keys.

A model's configuration is a tree with each field declared once, in the class it belongs to:
`GPTConfig` (moescale.models.gpt) holds an `MoEConfig` (moescale.layers.moe) in `moe`, which
holds a `RouterConfig` (moescale.routing.config) in `router`. The command line, `MoE(...)`'s
keywords, size overrides and the on-disk formats (config.toml, the remote-code config.json,
save_moefied's records) speak in flat keys: `num_experts`, `top_k`, `router`, `d_ff`.

- `build(cls, flat)` is the one way from flat keys to the tree: each key goes to every level
  that declares a field of that flat name; a level's fields are resolved (given, or the
  field's default) before the levels inside it are built, so a name declared at two levels
  (`d_model`, `bias`: GPTConfig and MoEConfig) takes the outer level's value at both. A nested
  level may also be given whole (`moe=MoEConfig(...)`, `router=RouterConfig(...)`); a flat key
  that disagrees with it is refused.
- `flatten(config)` is the way back: the flat dict of the whole tree (the outer value of a
  name declared twice).

A field's flat name is its own name unless its class renames it in a `FLAT_NAMES` class
attribute (RouterConfig's `kind` is the flat `router`). `FlatKeys` gives a config class
`from_flat(**flat)` and `to_flat()`. Plain data only: no tensors, no modules.
"""

from __future__ import annotations

import dataclasses
import types
import typing


def _flat_name(cls: type, name: str) -> str:
    return getattr(cls, "FLAT_NAMES", {}).get(name, name)


def _nested(hint) -> type | None:
    """The config dataclass a field holds (`X` or `X | None`), or None for a plain field."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = inner[0] if len(inner) == 1 else None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _fields(cls: type) -> list[tuple[dataclasses.Field, type | None]]:
    hints = typing.get_type_hints(cls)
    return [(f, _nested(hints[f.name])) for f in dataclasses.fields(cls) if f.init]


def flat_names(cls: type) -> tuple[str, ...]:
    """Every flat key of `cls`'s tree, outer levels first (a name declared twice once)."""
    names: dict[str, None] = {}
    for f, inner in _fields(cls):
        if inner is None:
            names[_flat_name(cls, f.name)] = None
        else:
            names.update(dict.fromkeys(flat_names(inner)))
    return tuple(names)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _build(cls: type, flat: dict):
    kwargs, resolved = {}, dict(flat)
    for f, inner in _fields(cls):
        key = _flat_name(cls, f.name)
        if inner is None:
            value = flat[key] if key in flat else _default(f)
            if key in flat:
                kwargs[f.name] = value
            if value is not dataclasses.MISSING:
                resolved[key] = value
    for f, inner in _fields(cls):
        if inner is not None:
            given = flat.get(f.name)
            kwargs[f.name] = given if isinstance(given, inner) else _build(inner, resolved)
    try:
        return cls(**kwargs)
    except TypeError as err:     # a required field nobody gave
        raise ValueError(f"{cls.__name__}: {err}; give it") from None


def build(cls: type, flat: dict):
    """`cls`'s tree from flat keys (see the module docstring); ValueError naming an unknown
    key with the valid ones, or a key that disagrees with a level given whole."""
    names = flat_names(cls)
    whole = {f.name for _, f in _walk(cls)}
    unknown = sorted(set(flat) - set(names) - whole)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; valid fields: "
                         f"{', '.join(names)}")
    config = _build(cls, flat)
    got = flatten(config)
    for key, value in flat.items():
        if key in got and value is not None and not dataclasses.is_dataclass(value) \
                and got[key] != value:
            raise ValueError(f"{key}={value!r} disagrees with the {key}={got[key]!r} of the "
                             f"config given whole; give {key} once")
    return config


def _walk(cls: type):
    """(class, field) of every nested-config field in `cls`'s tree."""
    for f, inner in _fields(cls):
        if inner is not None:
            yield cls, f
            yield from _walk(inner)


def flatten(config) -> dict:
    """The flat dict of `config`'s whole tree (see the module docstring)."""
    out: dict = {}
    for f, inner in _fields(type(config)):
        value = getattr(config, f.name)
        if inner is None:
            out[_flat_name(type(config), f.name)] = value
        elif value is not None:
            for key, item in flatten(value).items():
                out.setdefault(key, item)
    return out


class FlatKeys:
    """`from_flat` / `to_flat` for a config dataclass tree (see the module docstring)."""

    @classmethod
    def from_flat(cls, **flat):
        """This config from flat keys, e.g. GPTConfig.from_flat(d_model=64, num_experts=4)."""
        return build(cls, flat)

    def to_flat(self) -> dict:
        """The flat keys of this config's tree (what config.json and config.toml store)."""
        return flatten(self)
