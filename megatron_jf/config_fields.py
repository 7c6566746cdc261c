"""Command-line details of a config dataclass's fields, recorded on the field (``metadata["cli"]``) for
:func:`megatron_jf.cli.add_dataclass_arguments`, and the checks every config dataclass shares. Standard library only:
the config modules import this, and the command-line generator imports them, so neither imports the other."""

from __future__ import annotations

import dataclasses

__all__ = ["cli_field", "part", "is_part", "leaves", "check_choices"]


def cli_field(default=dataclasses.MISSING, *aliases: str, default_factory=dataclasses.MISSING, **argparse_kw):
    """A dataclass ``field`` with command-line details for :func:`megatron_jf.cli.add_dataclass_arguments`.

    Args:
        default / default_factory: as :func:`dataclasses.field`.
        aliases: more option strings for the field's flag (Megatron-LM's or vLLM's spelling).
        argparse_kw: passed to ``add_argument`` (``choices``, ``required``, ``metavar``, ``nargs``, ``type``),
            ``const_aliases={"--bf16": "bf16"}``: switches that set the field to a value, and ``tristate=True``: a
            ``bool | None`` field whose flag takes ``auto`` (None), ``on`` or ``off`` (:func:`tristate`), and
            ``option="TP"``: the field is the shared :class:`megatron_jf.cli.Option` of that name (its spellings,
            type and metavar; the field keeps its default and help), so every parser offering the concept has one
            definition of it. ``choices`` is also what :func:`check_choices` accepts: one tuple for both.
    """
    kw = {} if default_factory is dataclasses.MISSING else {"default_factory": default_factory}
    if default is not dataclasses.MISSING:
        kw["default"] = default
    return dataclasses.field(metadata={"cli": {"aliases": aliases, **argparse_kw}}, **kw)


def part(cls, title: str):
    """A field holding a nested config dataclass ``cls`` (a part of a larger config, default ``cls()``): its fields
    become one argument group titled ``title`` of the command line, their flags and ``dest`` names unprefixed."""
    return dataclasses.field(default_factory=cls, metadata={"cli": {"title": title}})


def is_part(f: dataclasses.Field) -> bool:
    """Whether field ``f`` holds a nested config dataclass (:func:`part`)."""
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)


def leaves(cls) -> list[tuple[tuple[str, ...], dataclasses.Field]]:
    """``[(path, field)]`` of a config dataclass's value fields, parts (:func:`part`) expanded in declaration order;
    ``path`` is the attribute path (``("optim", "lr")``)."""
    out = []
    for f in dataclasses.fields(cls):
        if is_part(f):
            out += [((f.name, *p), g) for p, g in leaves(f.default_factory)]
        else:
            out.append(((f.name,), f))
    return out


def check_choices(obj) -> None:
    """Check every field of ``obj`` declared with ``cli_field(choices=...)`` against that tuple (a list field: each
    element; None passes: "not set"), with the command line's words (:func:`megatron_jf.cli.one_of`).

    Raises:
        ValueError: ``unknown <field> 'x'; choose one of a, b, c``.
    """
    for f in dataclasses.fields(obj):
        allowed = f.metadata.get("cli", {}).get("choices")
        if allowed is None:
            continue
        v = getattr(obj, f.name)
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if x is not None and x not in allowed:
                raise ValueError(f"unknown {f.name.replace('_', ' ')} {x!r}; choose one of "
                                 f"{', '.join(map(str, allowed))}")
