"""torch.export's JSON -> schema dataclasses, planned once per type instead of worked out per value.

Loading an archive turns its JSON into torch's schema dataclasses with ``_dict_to_dataclass``,
which asks each value's type the same questions every time (``typing.get_origin``, the class's
type hints, ``dataclasses.fields``) and builds each tagged union with ``_Union.create``, whose
check of reserved field names walks the class's fields through the union's own slow
``__getattribute__``, again for every instance. On tests/models.py's GPT that was about half of a
``torch.export.load`` even with the type hints memoized (runtime/core/export_serde.py).

``Converter`` answers the questions once per type (a plan: a function of the value) and checks
each union class once. It keeps ``_dict_to_dataclass``'s rules, in its order: strings and forward
references name schema classes, ``Annotated`` and ``Optional`` unwrap, a union takes its one
``{tag: value}``, a dataclass takes the keys it has fields for (others are ignored, for forward
compatibility), lists and dicts convert their items by the type's arguments, floats become
floats, anything else stays as it is. A union built here is what ``create`` builds: its fields
None but the tag's, and ``_type`` the tag (one tag object per class and name).
tests/test_export_serde.py compares the results with torch's own function on whole programs.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any


class Converter:
    """``convert(cls, data)``: ``data`` (parsed JSON) as an instance of schema type ``cls``."""

    def __init__(self, schema, resolve: Callable[[Any], Any], union_base: type, union_tag: type):
        self._globalns = vars(schema)
        self._resolve = resolve  # torch's own: a schema class's name or forward reference -> the class
        self._union_base = union_base
        self._union_tag = union_tag
        self._plans: dict[Any, Callable[[Any], Any]] = {}

    def __call__(self, cls, data):
        try:
            plan = self._plans[cls]
        except KeyError:
            plan = self._plans[cls] = self._plan(cls)
        return plan(data)

    def _plan(self, cls) -> Callable[[Any], Any]:
        convert = self
        cls = self._resolve(cls)
        if isinstance(cls, str):
            raise AssertionError(f"Unresolved class type: '{cls}'.")
        origin = typing.get_origin(cls)
        if origin is Annotated:
            inner = cls.__origin__
            return lambda data: convert(inner, data)
        if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(cls):
            args = typing.get_args(cls)
            if len(args) != 2:
                raise AssertionError(f"expected 2 type args, got {len(args)}")
            inner = args[0]
            return lambda data: None if data is None else convert(inner, data)
        if isinstance(cls, type) and issubclass(cls, self._union_base):
            return self._union_plan(cls)
        if dataclasses.is_dataclass(cls):
            hints = typing.get_type_hints(cls, globalns=self._globalns)
            fields = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
            return lambda data: cls(**{name: convert(t, data[name]) for name, t in fields if name in data})
        args = typing.get_args(cls)
        is_float = cls is float

        def value(data):
            if isinstance(data, list):
                if not data:
                    return data
                item = args[0]
                return [convert(item, d) for d in data]
            if isinstance(data, dict):
                item = args[1]
                return {k: convert(item, v) for k, v in data.items()}
            if is_float:
                return float(data)
            return data

        return value

    def _union_plan(self, cls: type) -> Callable[[Any], Any]:
        convert = self
        hints = typing.get_type_hints(cls, globalns=self._globalns)
        names = [f.name for f in dataclasses.fields(cls)]
        cls.create(**{names[0]: None})  # the class's own checks (reserved field names), once
        tags = {name: self._union_tag.create(name, cls) for name in names}
        empty = dict.fromkeys(names)
        # what create builds, without its per-instance checks; a class with an __init__ written by
        # hand (not dataclasses', compiled from "<string>") or a __post_init__ of its own keeps create
        generated = getattr(getattr(cls.__init__, "__code__", None), "co_filename", "") == "<string>"
        own = cls.__post_init__ is not self._union_base.__post_init__ or not generated

        def union(data):
            if not isinstance(data, dict):
                raise AssertionError(f"expected dict, got {type(data).__name__}")
            if len(data) != 1:
                raise AssertionError(f"expected dict with 1 key, got {len(data)}")
            ((tag, value),) = data.items()
            if not isinstance(tag, str):
                raise AssertionError(f"expected str key, got {type(tag).__name__}")
            value = convert(hints[tag], value)
            if own:
                return cls.create(**{tag: value})
            obj = object.__new__(cls)
            obj.__dict__.update(empty)
            obj.__dict__[tag] = value
            obj.__dict__["_type"] = tags[tag]
            return obj

        return union
