"""Config checking derived from the TypedDict declarations themselves.

A schema is a ``TypedDict`` (``GenerationConfig``, a backend's extension of it, the nested
``vllm_cfg``); its annotations are the only list of keys and types. Missing keys and ranges
(``top_p`` in (0, 1]) are left to the code that fills defaults.
"""

from __future__ import annotations

import difflib
import functools
import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

from typing_extensions import get_type_hints, is_typeddict

from gen_interface.errors import GenerationConfigError

__all__ = ["ForeignKey", "ForeignKeys", "check_config", "declared_keys"]


@dataclass(frozen=True)
class ForeignKey:
    """A key that the schema does not declare but that configs written for another framework
    (NeMo RL) carry: values for which ``inert`` holds change nothing here and are accepted;
    any other value is refused with ``reason`` (why, and what to use instead)."""

    reason: str
    inert: Callable[[Any], bool] | None = None  # None: every value is inert (accepted, unread)

    @property
    def unread(self) -> bool:
        """Every value is accepted and nothing reads it."""
        return self.inert is None

    def accepts(self, value: Any) -> bool:
        return self.inert is None or self.inert(value)

    @staticmethod
    def only(reason: str, *values: Any) -> ForeignKey:
        """Accepted when equal to one of ``values`` (same type: ``1`` is not ``True``)."""
        return ForeignKey(reason, lambda v: any(type(v) is type(a) and v == a for a in values))


#: Foreign keys per level: the dotted path of a level ("" for the top) -> key -> rule.
ForeignKeys = Mapping[str, Mapping[str, ForeignKey]]

_NONE = type(None)
_WORDS: dict[Any, str] = {
    bool: "a bool (true or false)",
    int: "an integer",
    float: "a number",
    str: "a string",
    _NONE: "null",
}
_PLURALS: dict[Any, str] = {bool: "bools", int: "integers", float: "numbers", str: "strings"}


def check_config(
    config: Mapping[str, Any],
    schema: type,
    *,
    accepted_unread: Collection[str] = (),
    foreign: ForeignKeys | None = None,
    path: str = "",
) -> None:
    """Refuse keys ``schema`` does not declare, at any depth, and values of the wrong type.

    Missing keys are accepted: defaults are filled elsewhere. Supported annotations: ``bool``,
    ``int``, ``float`` (ints accepted), ``str``, ``None``, ``Literal[...]``, unions, ``list[T]``,
    ``dict[K, V]``, ``Mapping[K, V]``, ``Any`` and nested TypedDicts (directly or in a union).
    A ``bool`` is never accepted where an ``int`` or ``float`` is declared.

    Args:
        config: the config as given (a dict literal, parsed YAML).
        schema: a TypedDict class; inherited keys and ``NotRequired``/``Required`` are handled.
        accepted_unread: top-level keys the schema does not declare that are accepted as they
            are (keys a training loop reads, not the generator). Declared keys are always checked.
        foreign: undeclared keys per level (dotted path from ``config``, "" for its top) that
            are accepted while their value is inert and refused with their reason otherwise.
        path: where ``config`` sits in a larger config; prefixed to every path in a message.

    Raises:
        GenerationConfigError: naming the dotted path of the first unknown key (with where it
            belongs or what was probably meant) or of the first value of the wrong type (with
            what was expected and what was given).
        TypeError: ``schema`` is not a TypedDict, or its annotations cannot be resolved.
    """
    levels = {level: dict(keys) for level, keys in (foreign or {}).items()}
    top = levels.setdefault("", {})
    for key in accepted_unread:
        top.setdefault(key, ForeignKey("read by the training loop, not by the generator"))
    _check_mapping(config, schema, _Walk(schema, path, levels), "")


def declared_keys(schema: type) -> dict[str, Any]:
    """Every key ``schema`` declares (inherited ones included) -> its resolved annotation,
    ``Required``/``NotRequired`` removed; for callers that build defaults tables.

    Raises:
        TypeError: ``schema`` is not a TypedDict, or its annotations cannot be resolved.
    """
    return dict(_fields(schema))


class _Walk(NamedTuple):
    root: type  # the schema checked first, whose tree "belongs in" searches
    prefix: str  # the caller's ``path``
    foreign: Mapping[str, Mapping[str, ForeignKey]]  # level path -> undeclared key -> rule

    def shown(self, rel: str) -> str:
        return _join(self.prefix, rel)


@functools.cache
def _fields(schema: type) -> dict[str, Any]:
    if not is_typeddict(schema):
        raise TypeError(f"{schema!r} is not a TypedDict")
    try:
        # Each annotation resolves in the module that declared it, so inherited keys from
        # another module and `from __future__ import annotations` both work.
        return get_type_hints(schema)
    except NameError as exc:
        raise TypeError(f"cannot resolve the annotations of {schema.__qualname__}: {exc}") from exc


@functools.cache
def _placements(root: type) -> dict[str, tuple[str, ...]]:
    """Every key declared anywhere in ``root``'s tree -> its dotted paths from ``root``."""
    found: dict[str, list[str]] = {}

    def walk(schema: type, rel: str, seen: frozenset[type]) -> None:
        for key, tp in _fields(schema).items():
            found.setdefault(key, []).append(_join(rel, key))
            for sub in get_args(tp) if _is_union(tp) else (tp,):
                if is_typeddict(sub) and sub not in seen:
                    walk(sub, _join(rel, key), seen | {sub})

    walk(root, "", frozenset({root}))
    return {key: tuple(paths) for key, paths in found.items()}


def _check_mapping(value: Any, schema: type, walk: _Walk, rel: str) -> None:
    if not isinstance(value, Mapping):
        raise _wrong_type(walk.shown(rel), schema, value)
    fields = _fields(schema)
    foreign = walk.foreign.get(rel, {})
    for key, item in value.items():
        if key in fields:
            _check_value(item, fields[key], walk, _join(rel, key))
        elif key in foreign:
            if not foreign[key].accepts(item):
                raise GenerationConfigError(
                    f"`{walk.shown(_join(rel, key))}` = {_given(item)} is refused: "
                    f"{foreign[key].reason}"
                )
        else:
            raise GenerationConfigError(_unknown_key(str(key), fields, walk, rel))


def _check_value(value: Any, tp: Any, walk: _Walk, rel: str) -> None:
    if tp is Any or tp is object:
        return
    if is_typeddict(tp):
        _check_mapping(value, tp, walk, rel)
        return
    origin, args = get_origin(tp), get_args(tp)
    if _is_union(tp):
        errors: list[GenerationConfigError] = []
        for member in args:
            try:
                _check_value(value, member, walk, rel)
                return
            except GenerationConfigError as exc:
                errors.append(exc)
        # A container matching one member's shape gets that member's error: it names the item.
        shaped = [e for m, e in zip(args, errors, strict=True) if _same_shape(value, m)]
        if len(shaped) == 1:
            raise shaped[0]
        raise _wrong_type(walk.shown(rel), tp, value)
    if origin is Literal:
        if not any(type(value) is type(a) and value == a for a in args):
            raise _wrong_type(walk.shown(rel), tp, value)
    elif origin is list:
        if not isinstance(value, list):
            raise _wrong_type(walk.shown(rel), tp, value)
        for i, item in enumerate(value):
            _check_value(item, args[0] if args else Any, walk, f"{rel}[{i}]")
    elif origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _wrong_type(walk.shown(rel), tp, value)
        key_tp, item_tp = args or (Any, Any)
        for key, item in value.items():
            if not _leaf_ok(key, key_tp):
                keys = _PLURALS.get(key_tp) or _describe(key_tp)
                raise GenerationConfigError(
                    f"`{walk.shown(rel)}` keys must be {keys}, got {_given(key)}"
                )
            _check_value(item, item_tp, walk, _join(rel, str(key)))
    elif not _leaf_ok(value, tp):
        raise _wrong_type(walk.shown(rel), tp, value)


def _leaf_ok(value: Any, tp: Any) -> bool:
    if tp is Any or tp is object:
        return True
    if tp is _NONE:
        return value is None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    raise TypeError(f"check_config cannot check the annotation {tp!r}")


def _same_shape(value: Any, tp: Any) -> bool:
    origin = get_origin(tp)
    if isinstance(value, Mapping):
        return is_typeddict(tp) or origin in (dict, Mapping)
    return isinstance(value, list) and origin is list


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _describe(tp: Any) -> str:
    """The annotation in plain words: "an integer or null", "one of 'raw', 'processed'"."""
    if tp is Any or tp is object:
        return "anything"
    if is_typeddict(tp):
        return f"a dict ({tp.__name__})"
    origin, args = get_origin(tp), get_args(tp)
    if _is_union(tp):
        words = [_describe(a) for a in args if a is not _NONE] + ["null"] * (_NONE in args)
        return ", ".join(words[:-1]) + " or " + words[-1]
    if origin is Literal:
        values = ", ".join(repr(a) for a in args)
        return f"one of {values}" if len(args) > 1 else values
    if origin is list:
        item = args[0] if args else Any
        if item is Any:
            return "a list"
        return (
            f"a list of {_PLURALS[item]}" if item in _PLURALS else f"a list of ({_describe(item)})"
        )
    if origin in (dict, Mapping):
        item = args[1] if args else Any
        return "a dict" if item is Any else f"a dict whose values are each {_describe(item)}"
    return _WORDS.get(tp) or f"a {getattr(tp, '__name__', repr(tp))}"


def _wrong_type(shown: str, tp: Any, value: Any) -> GenerationConfigError:
    what = f"`{shown}`" if shown else "the config"
    return GenerationConfigError(f"{what} must be {_describe(tp)}, got {_given(value)}")


def _given(value: Any) -> str:
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({type(value).__name__})"


def _unknown_key(key: str, fields: Mapping[str, Any], walk: _Walk, rel: str) -> str:
    message = f"unknown key `{walk.shown(_join(rel, key))}`"
    placements = _placements(walk.root)
    homes = placements.get(key, ()) + tuple(
        _join(level, key) for level, keys in walk.foreign.items() if key in keys and level != rel
    )
    if homes:
        return f"{message}: `{key}` belongs " + " or ".join(_home(walk, p) for p in homes)
    near = _close(key, list(fields))
    if not near:  # perhaps both misspelt and misplaced
        near_keys = _close(key, [k for k in placements if k not in fields])
        near = [walk.shown(p) for k in near_keys for p in placements[k]]
    if near:
        return f"{message}: did you mean " + " or ".join(f"`{n}`" for n in near) + "?"
    level = f"`{walk.shown(rel)}`" if walk.shown(rel) else "the config"
    return f"{message}; {level} takes " + ", ".join(f"`{k}`" for k in sorted(fields))


def _home(walk: _Walk, rel: str) -> str:
    parent = walk.shown(rel.rpartition(".")[0])
    where = f"in `{parent}`" if parent else "at the top level"
    return f"{where} (`{walk.shown(rel)}`)"


def _close(key: str, candidates: list[str]) -> list[str]:
    one_edit = [c for c in candidates if _one_edit(key, c)]
    return list(dict.fromkeys(one_edit + difflib.get_close_matches(key, candidates, 3, 0.75)))[:3]


def _one_edit(a: str, b: str) -> bool:
    """One letter dropped, inserted or changed, or two adjacent letters swapped."""
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        swapped = len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
        return len(diff) == 1 or (swapped and a[diff[1]] == b[diff[0]])
    short, long = sorted((a, b), key=len)
    return len(long) == len(short) + 1 and any(
        long[:i] + long[i + 1 :] == short for i in range(len(long))
    )


def _join(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent and key else parent or key
