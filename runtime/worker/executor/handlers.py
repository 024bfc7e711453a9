"""The executor's handlers, one per action kind (atoll.core.actions declares the kinds).

A handler is ``handler(executor, action, state)``: it runs one action of the list on this worker
for the step whose ``StepState`` it is given. Modules register theirs with ``@handles(kind)``;
the executor refuses, when a plan is loaded, an action whose kind no handler runs.
"""

from __future__ import annotations

from collections.abc import Callable

from atoll.core.actions import ActionSpec

Handler = Callable[..., None]
_HANDLERS: dict[ActionSpec, Handler] = {}


def handles(kind: ActionSpec) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        if kind in _HANDLERS:
            raise ValueError(f"{kind.name} has a handler already ({_HANDLERS[kind].__qualname__})")
        _HANDLERS[kind] = fn
        return fn

    return register


def handler_of(kind: ActionSpec) -> Handler | None:
    return _HANDLERS.get(kind)
