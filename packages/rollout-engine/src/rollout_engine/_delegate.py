"""`Delegate`: a public method that is another component's method, docstring included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Delegate(Generic[_P, _R]):
    """`name = Delegate("_part", Part.name)` in a class body makes `obj.name(...)` call
    `obj._part.name(...)`: the API stays on the facade, the behaviour and its documentation
    in the one component that owns them."""

    def __init__(self, attribute: str, method: Callable[Concatenate[Any, _P], _R]) -> None:
        self._attribute = attribute
        self._name = method.__name__
        self.__doc__ = method.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        if name != self._name:
            raise TypeError(f"{owner.__name__}.{name} would delegate to {self._name}")

    def __get__(self, obj: object, objtype: type | None = None) -> Callable[_P, _R]:
        if obj is None:
            return self  # type: ignore[return-value]  # the class attribute, for help()
        bound: Callable[_P, _R] = getattr(getattr(obj, self._attribute), self._name)
        return bound
