"""Caches keyed on objects a cache must not keep alive (process groups, device meshes)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


class IdentityMap(Generic[V]):
    """A mapping keyed by an object's identity that holds the object weakly.

    An entry goes when its object is collected, and an object never finds the entry of
    another object, even an equal one (``DeviceMesh`` compares by value: an equal mesh of a
    re-initialized world must not get the old mesh's groups) or one that reuses the address
    of a collected object.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, V]] = {}

    def get(self, obj: object) -> V | None:
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]

    def setdefault(self, obj: object, make: Callable[[], V]) -> V:
        """The value of ``obj``, made with ``make()`` and kept if there is none."""
        value = self.get(obj)
        if value is not None:
            return value
        key, entries = id(obj), self._entries

        def drop(ref: weakref.ref) -> None:
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        value = make()
        entries[key] = (weakref.ref(obj, drop), value)
        return value

    def __len__(self) -> int:
        return sum(1 for ref, _ in self._entries.values() if ref() is not None)

    def values(self) -> Iterator[V]:
        return (value for ref, value in list(self._entries.values()) if ref() is not None)

    def clear(self) -> None:
        self._entries.clear()
