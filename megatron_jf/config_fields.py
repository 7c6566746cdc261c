"""Command-line details of a config dataclass's fields, recorded on the field (``metadata["cli"]``) for
:func:`megatron_jf.cli.add_dataclass_arguments`. Standard library only: the config modules import this, and the
command-line generator imports them, so neither imports the other."""

from __future__ import annotations

import dataclasses

__all__ = ["cli_field"]


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
            definition of it.
    """
    kw = {} if default_factory is dataclasses.MISSING else {"default_factory": default_factory}
    if default is not dataclasses.MISSING:
        kw["default"] = default
    return dataclasses.field(metadata={"cli": {"aliases": aliases, **argparse_kw}}, **kw)
