"""Generic JSON conversion of frozen dataclass trees: ``to_dict``/``to_json`` and, driven by the type
hints, ``from_dict`` back.

Its own module, apart from the classes in model.py, so node programs that parse only their own
dataclasses (the agent's job spec) do not pay for creating every class of model.py at start-up: a
launch waits on the agent's import. Standard library only: it is shipped to nodes.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import enum
import json
import types
import typing
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def to_dict(value: Any) -> Any:
    """Dataclass/Enum/tuple tree -> JSON-ready dicts and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [to_dict(v) for v in value]
    if isinstance(value, Mapping):   # a dict, or a frozen dataclass's read-only one
        return {_key(k): to_dict(v) for k, v in value.items()}
    return value


def _key(key: Any) -> str:
    """A mapping's key as JSON has it: an Enum's value (``str()`` of a member names its class)."""
    return key.value if isinstance(key, enum.Enum) else str(key)


def to_json(value: Any, *, indent: int | None = 2) -> str:
    return json.dumps(to_dict(value), indent=indent, sort_keys=False)


def from_dict(cls: type[T], data: Any) -> T:
    """Inverse of ``to_dict`` driven by the type hints; raises ValueError on a shape mismatch."""
    return _convert(cls, data, cls.__name__)


def _convert(tp: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        return _convert_union(tp, data, where)
    if origin is tuple:
        return _convert_tuple(tp, data, where)
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(data, list):
            raise ValueError(f"{where}: expected a list, got {type(data).__name__}")
        return [_convert(arg, v, f"{where}[{i}]") for i, v in enumerate(data)]
    if origin in (dict, collections.abc.Mapping):
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        out = {(str(k) if key_tp in (str, Any) else _convert(key_tp, k, f"{where} key {k!r}")):
               _convert(val_tp, v, f"{where}.{k}") for k, v in data.items()}
        # A Mapping field is a frozen dataclass's: read-only, as the dataclass is.
        return out if origin is dict else types.MappingProxyType(out)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, data, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise ValueError(f"{where}: {data!r} is not one of {allowed}") from None
    return _convert_scalar(tp, data, where)


def _convert_union(tp: Any, data: Any, where: str) -> Any:
    """The first of the union's types that takes ``data`` (null only where the union has None)."""
    args = typing.get_args(tp)
    if data is None:
        if type(None) in args:
            return None
        raise ValueError(f"{where}: null is not allowed")
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(arg, data, where)
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    raise ValueError(errors[0] if errors else f"{where}: no type matches")


def _convert_tuple(tp: Any, data: Any, where: str) -> tuple[Any, ...]:
    args = typing.get_args(tp)
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"{where}: expected a list, got {type(data).__name__}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
    if len(args) != len(data):
        raise ValueError(f"{where}: expected {len(args)} items, got {len(data)}")
    return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data)))


def _convert_dataclass(tp: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(tp)
    kwargs = {}
    for f in dataclasses.fields(tp):
        if not f.init:
            continue
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where}: missing field {f.name!r}")
    return tp(**kwargs)


# No count, size or rate hgtrain stores comes near 2^63; a file holding more was not written by it, and
# the number would break what reads it (float() overflows; a batch of 10^400 is no batch).
INT_BOUND = 1 << 63


def _convert_scalar(tp: Any, data: Any, where: str) -> Any:
    """A JSON number, string or boolean as ``tp``: a bool is no number, a float no integer."""
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise ValueError(f"{where}: expected a number, got {data!r}")
        if isinstance(data, int) and not -INT_BOUND < data < INT_BOUND:   # float() would overflow
            raise ValueError(f"{where}: a number of {len(str(abs(data)))} digits")
        return float(data)
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise ValueError(f"{where}: expected an integer, got {data!r}")
        if not -INT_BOUND < data < INT_BOUND:
            raise ValueError(f"{where}: a number of {len(str(abs(data)))} digits")
        return data
    if tp in (str, bool):
        if not isinstance(data, tp):
            raise ValueError(f"{where}: expected {tp.__name__}, got {data!r}")
        return data
    if isinstance(tp, type) and issubclass(tp, str):   # a checked name (stages.Device): parsed here
        if not isinstance(data, str):
            raise ValueError(f"{where}: expected a string, got {data!r}")
        try:
            return tp(data)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    raise TypeError(f"{where}: unsupported type {tp!r}")
