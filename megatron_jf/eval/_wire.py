"""Value codec between the trusted verifier and the sandboxed candidate (see :mod:`megatron_jf.eval.verdict`).

Its source is also prepended to the sandbox child's source (``_sandbox_child.py``), so it must stay
self-contained (standard library only, no relative imports).

A value is encoded as a JSON tree of tagged lists: ``["n"]`` None, ``["b", bool]``, ``["i", "7b"]`` int (as a
hexadecimal string, any size), ``["f", "0.1"]`` float (``repr``, so ``nan``/``inf`` survive), ``["c", re, im]``,
``["s", str]``, ``["y", hex]`` bytes, ``["ba", hex]`` bytearray, ``["l", [...]]`` list, ``["t", [...]]`` tuple,
``["set", [...]]``, ``["fs", [...]]`` frozenset, ``["d", [[k, v], ...]]`` dict, ``["r", start, stop, step]``
range, ``["q", num, den]`` Fraction, ``["dec", str]`` Decimal, ``["it", [...]]`` any other iterator (a generator,
``map``, ...; materialised, decoded as ``iter(list)``), ``["o", type name, repr]`` anything else.

:func:`decode` is the trusted half: whatever bytes the candidate sent, it only ever builds exact built-in types
(subclasses are encoded as their base type, an object with a forged ``__eq__`` arrives as an :class:`Opaque`
that equals nothing), and it refuses trees deeper than :data:`MAX_DEPTH` or larger than :data:`MAX_NODES` nodes.
"""

import decimal as _decimal
import fractions as _fractions

MAX_DEPTH = 64
MAX_NODES = 1_000_000
MAX_ITER_ITEMS = 100_000


class WireError(ValueError):
    """A value cannot be encoded, or an encoded tree is malformed / too large."""


class Opaque:
    """A value the candidate returned that has no built-in equivalent; it equals nothing, not even itself."""

    __slots__ = ("type_name", "text")

    def __init__(self, type_name, text):
        self.type_name = str(type_name)[:100]
        self.text = str(text)[:200]

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    __hash__ = None

    def __repr__(self):
        return f"<unverifiable {self.type_name}: {self.text}>"


def encode(obj, _depth=0, _count=None):
    """Encode ``obj`` (see the module docstring). Raises :class:`WireError` on cycles/too deep/too many nodes."""
    if _count is None:
        _count = [0]
    _count[0] += 1
    if _count[0] > MAX_NODES or _depth > MAX_DEPTH:
        raise WireError("value too large or too deeply nested to transfer")
    d = _depth + 1
    if obj is None:
        return ["n"]
    if obj is True or obj is False:
        return ["b", obj]
    if isinstance(obj, bool):
        return ["b", bool.__bool__(obj)]
    if isinstance(obj, int):
        return ["i", int.__format__(obj, "x")]  # hex: no int/str digit limit (CPython 3.11+)
    if isinstance(obj, float):
        return ["f", float.__repr__(obj)]
    if isinstance(obj, complex):
        return ["c", float.__repr__(complex.real.__get__(obj)), float.__repr__(complex.imag.__get__(obj))]
    if isinstance(obj, str):
        return ["s", str.__str__(obj)]
    if isinstance(obj, bytearray):
        return ["ba", bytes(obj).hex()]
    if isinstance(obj, bytes):
        return ["y", bytes.hex(obj)]
    if isinstance(obj, list):
        return ["l", [encode(x, d, _count) for x in list.__iter__(obj)]]
    if isinstance(obj, tuple):
        return ["t", [encode(x, d, _count) for x in tuple.__iter__(obj)]]
    if isinstance(obj, frozenset):
        return ["fs", [encode(x, d, _count) for x in frozenset.__iter__(obj)]]
    if isinstance(obj, set):
        return ["set", [encode(x, d, _count) for x in set.__iter__(obj)]]
    if isinstance(obj, dict):
        return ["d", [[encode(k, d, _count), encode(dict.__getitem__(obj, k), d, _count)]
                      for k in dict.__iter__(obj)]]
    if isinstance(obj, range):
        return ["r", obj.start, obj.stop, obj.step]
    if isinstance(obj, _fractions.Fraction):
        return ["q", str(int(obj.numerator)), str(int(obj.denominator))]
    if isinstance(obj, _decimal.Decimal):
        return ["dec", _decimal.Decimal.__str__(obj)]
    if hasattr(type(obj), "__next__") and hasattr(type(obj), "__iter__"):
        items = []
        for x in obj:
            if len(items) >= MAX_ITER_ITEMS:
                raise WireError(f"iterator yields more than {MAX_ITER_ITEMS} items")
            items.append(encode(x, d, _count))
        return ["it", items]
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001
        text = "?"
    return ["o", type(obj).__name__, str(text)[:200]]


def _hashable(v):
    try:
        hash(v)
    except TypeError as e:
        raise WireError(f"unhashable element {type(v).__name__} in a set or dict key") from e
    return v


def decode(tree, _depth=0, _count=None):
    """Build the value that ``tree`` encodes, from exact built-in types only (see the module docstring).

    Raises:
        WireError: malformed, too deep or too large tree.
    """
    if _count is None:
        _count = [0]
    _count[0] += 1
    if _count[0] > MAX_NODES or _depth > MAX_DEPTH:
        raise WireError("encoded value too large or too deeply nested")
    if type(tree) is not list or not tree or type(tree[0]) is not str:
        raise WireError(f"malformed value {str(tree)[:80]!r}")
    tag, args, d = tree[0], tree[1:], _depth + 1
    try:
        if tag == "n":
            return None
        if tag == "b":
            return bool(args[0]) if type(args[0]) is bool else _bad(tree)
        if tag == "i":
            if type(args[0]) is not str or len(args[0]) > 100_000:
                _bad(tree)
            return int(args[0], 16)
        if tag == "f":
            return float(str(args[0]))
        if tag == "c":
            return complex(float(str(args[0])), float(str(args[1])))
        if tag == "s":
            return args[0] if type(args[0]) is str else _bad(tree)
        if tag == "y":
            return bytes.fromhex(str(args[0]))
        if tag == "ba":
            return bytearray.fromhex(str(args[0]))
        if tag in ("l", "t", "set", "fs", "it"):
            if type(args[0]) is not list:
                _bad(tree)
            items = [decode(x, d, _count) for x in args[0]]
            if tag == "l":
                return items
            if tag == "t":
                return tuple(items)
            if tag == "it":
                return iter(items)
            items = [_hashable(x) for x in items]
            return set(items) if tag == "set" else frozenset(items)
        if tag == "d":
            if type(args[0]) is not list:
                _bad(tree)
            out = {}
            for kv in args[0]:
                if type(kv) is not list or len(kv) != 2:
                    _bad(tree)
                out[_hashable(decode(kv[0], d, _count))] = decode(kv[1], d, _count)
            return out
        if tag == "r":
            if not all(type(a) is int for a in args[:3]) or len(args) != 3:
                _bad(tree)
            return range(args[0], args[1], args[2])
        if tag == "q":
            return _fractions.Fraction(int(str(args[0])), int(str(args[1])))
        if tag == "dec":
            return _decimal.Decimal(str(args[0]))
        if tag == "o":
            return Opaque(args[0], args[1])
    except WireError:
        raise
    except (IndexError, ValueError, TypeError, ZeroDivisionError, _decimal.InvalidOperation) as e:
        raise WireError(f"malformed value {str(tree)[:80]!r}: {e}") from e
    raise WireError(f"unknown value tag {tag[:20]!r}")


def _bad(tree):
    raise WireError(f"malformed value {str(tree)[:80]!r}")
