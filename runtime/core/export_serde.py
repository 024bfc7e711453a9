"""Three costs of torch.export's (de)serialization that buy atoll nothing, taken out once per process.

Every job moves its programs as torch.export archives: the client serializes the model, the
controller loads it and serializes each stage, the controller and each worker load the stages.
On the tiny models most jobs of the test suite run, about half of that time is two things
(torch 2.13, measured with cProfile on tests/models.py's GPT):

- ``serialize`` deep-copies the whole serialized program to check that its canonical form is well
  defined (``canonicalize``), and throws the copy away: 58% of a ``torch.export.save``;
- loading rebuilds each schema dataclass through ``typing.get_type_hints`` of its class, again
  for every instance (13,545 calls for one small program): 48% of a ``torch.export.load``;
- with the hints memoized, converting the JSON to those dataclasses (``_dict_to_dataclass``) was
  still about half of a load: the same questions asked of each value's type, and each tagged
  union's fields checked again per instance (runtime/core/schema_loader.py).

``apply`` skips the first check, memoizes the type hints per class (the schema's classes do not
change while a process runs) and converts with a plan per type (a load of examples/gpt.py's
6-layer GPT: 0.22 s -> 0.10 s). The archives are byte for byte what torch writes without it, and
load to equal dataclasses (tests/test_export_serde.py). If torch's serde module no longer has
these names, nothing is changed.
"""

from __future__ import annotations

import threading
import typing

from atoll.core.schema_loader import Converter

_applied = False
_lock = threading.Lock()
torch_dict_to_dataclass = None
"""torch's own ``_dict_to_dataclass``, once ``apply`` replaced it (tests compare the two)."""


class _TypingWithCachedHints:
    """The ``typing`` module as torch's serde module sees it, with ``get_type_hints`` memoized."""

    def __init__(self):
        self._hints: dict[tuple, dict] = {}

    def __getattr__(self, name: str):
        return getattr(typing, name)

    def get_type_hints(self, obj, globalns=None, localns=None, include_extras=False):
        key = (obj, id(globalns), id(localns), include_extras)
        hints = self._hints.get(key)
        if hints is None:
            hints = self._hints[key] = typing.get_type_hints(obj, globalns, localns, include_extras)
        return hints


def _canonical_form_not_checked(ep, constants=None):
    return ep


def apply() -> None:
    global _applied
    with _lock:
        if _applied:
            return
        _applied = True
        try:
            from torch._export.serde import serialize as serde
        except ImportError:
            return
        if getattr(serde, "typing", None) is typing:
            serde.typing = _TypingWithCachedHints()
        if callable(getattr(serde, "canonicalize", None)):
            serde.canonicalize = _canonical_form_not_checked
        global torch_dict_to_dataclass
        converter = _schema_converter(serde)
        if converter is not None and callable(getattr(serde, "_dict_to_dataclass", None)):
            torch_dict_to_dataclass, serde._dict_to_dataclass = serde._dict_to_dataclass, converter


def _schema_converter(serde):
    """A ``Converter`` for torch's schema, or None where this torch lacks the names it needs."""
    try:
        from torch._export.serde.union import _Union, _UnionTag
    except ImportError:
        return None
    schema, resolve = getattr(serde, "schema", None), getattr(serde, "_resolve_schema_cls", None)
    if schema is None or resolve is None or not hasattr(_Union, "create") or not hasattr(_UnionTag, "create"):
        return None
    return Converter(schema, resolve, _Union, _UnionTag)
