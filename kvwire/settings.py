"""How kvwire's settings structs check what they are given, and read the environment.

A setting is a field of a msgspec struct whose annotation carries its range
(``Annotated[int, msgspec.Meta(ge=1)]``). That annotation is the one rule:
``msgspec.convert`` and ``msgspec.json.decode`` apply it when a config is read,
:func:`check_fields` (called from a struct's ``__post_init__``) applies it when
one is built in Python, and :func:`read_env` applies it to ``KVWIRE_*``
variables. A refused value raises ``ValueError`` naming the setting (or the
variable), the value and what is allowed.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

import msgspec
import msgspec.inspect as mi
from msgspec import Meta

__all__ = ["Positive", "Seconds", "check_fields", "convert_strings", "describe", "read_env"]

Positive = Annotated[int, Meta(ge=1)]
"""A count of at least one (items, bytes, sockets): every config's counts."""

Seconds = Annotated[float, Meta(gt=0)]
"""A duration in seconds, more than zero."""

S = TypeVar("S", bound=msgspec.Struct)

_AT = re.compile(r" - at `\$\.([^`]+)`$")


def describe(annotation: Any, none: str = "None") -> str:
    """What a field of type ``annotation`` accepts, in words (``none``: how ``None`` is named)."""
    return _describe(mi.type_info(annotation), none)


def _describe(info: mi.Type, none: str) -> str:
    if isinstance(info, mi.UnionType):
        kinds = [_describe(t, none) for t in info.types if not isinstance(t, mi.NoneType)]
        has_none = any(isinstance(t, mi.NoneType) for t in info.types)
        return ", or ".join(kinds + ([none] if has_none else []))
    if isinstance(info, mi.BoolType):
        return "a boolean (1, 0, true or false)"
    if isinstance(info, mi.IntType | mi.FloatType):
        kind = "an integer" if isinstance(info, mi.IntType) else "a number"
        if info.ge is not None and info.le is not None:
            return f"{kind} from {info.ge} to {info.le}"
        low = f">= {info.ge}" if info.ge is not None else f"> {info.gt}" if info.gt is not None else ""
        high = f"<= {info.le}" if info.le is not None else f"< {info.lt}" if info.lt is not None else ""
        return " ".join([kind, " and ".join(b for b in (low, high) if b)]).strip()
    if isinstance(info, mi.LiteralType):
        return "one of " + ", ".join(repr(v) for v in info.values)
    if isinstance(info, mi.StrType):
        return "a string"
    return type(info).__name__  # pragma: no cover - no setting has another type


def check_fields(struct: msgspec.Struct) -> None:
    """Refuse a field whose value its annotation does not allow (``ValueError``).

    msgspec checks ``Meta`` constraints when it decodes or converts, not when
    a struct is built in Python; a settings struct's ``__post_init__`` calls
    this so that both ways of making one apply the same rule.
    """
    for f in _fields(type(struct)):
        value = getattr(struct, f.name)
        try:
            msgspec.convert(value, f.type)
        except msgspec.ValidationError:
            raise ValueError(
                f"{type(struct).__name__}.{f.name}={value!r} is refused: "
                f"expected {describe(f.type)}"
            ) from None


# A struct type's fields, read once: msgspec.structs.fields resolves the type hints on
# every call (about 0.3 ms), and a router builds one config per source.
_fields = functools.cache(msgspec.structs.fields)


def read_env(cls: type[S], env: Mapping[str, str]) -> S:
    """Build ``cls`` from the environment variables named by its fields' encoded names.

    Only those variables are read; an empty one counts as unset (the field's
    default). Strings are converted as msgspec does outside strict mode
    (``"1"``/``"true"`` for booleans, ``"0.5"`` for numbers), then checked
    against each field's range. A refused value raises ``ValueError`` naming
    the variable, its value and what is allowed.
    """
    names = [f.encode_name for f in _fields(cls)]
    return convert_strings(cls, {n: env[n] for n in names if env.get(n, "") != ""})


def convert_strings(
    cls: type[S],
    given: Mapping[str, object],
    label: Callable[[str], str] = str,
    none: str = "unset",
) -> S:
    """Build ``cls`` from ``given`` (encoded field names to strings or values, as an
    environment or a command line gives them), checked as :func:`read_env` says;
    ``label`` names a field's source in the error (``"--hwm"`` for ``hwm``), ``none``
    how its ``None`` is spelt there."""
    fields = {f.encode_name: f for f in _fields(cls)}
    try:
        return msgspec.convert(dict(given), cls, strict=False)
    except msgspec.ValidationError as exc:
        found = _AT.search(str(exc))
        if found is None or found.group(1) not in given:  # a rule across fields
            raise ValueError(str(exc)) from None
        name = found.group(1)
        raise ValueError(
            f"{label(name)}={given[name]!r} is refused: "
            f"expected {describe(fields[name].type, none)}"
        ) from None
