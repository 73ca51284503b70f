"""Frozen value records: what `@dataclass(frozen=True)` declares, cheaper to create at start-up.

Python 3.11's dataclasses compile six methods of every frozen class from source text (about 1 ms a class, some
twenty at estimate's start-up); `record` declares the same dataclass with those six written once, here. Two
differences: no __post_init__ (refused), and `dataclasses` sees it as not frozen, so a subclass is declared with
`record` too. tests/test_records.py checks a record against the frozen dataclass it stands for.
"""

from __future__ import annotations

from dataclasses import MISSING, FrozenInstanceError, dataclass, fields
from operator import attrgetter
from typing import Any, Callable, TypeVar

T = TypeVar("T", bound=type)

_FACTORY = object()  # a field's default is made per instance by its default_factory


def record(cls: T | None = None, /, *, kw_only: bool = False) -> Any:
    """`@dataclass(frozen=True)` (or `kw_only=True` as well), with the shared methods: use it as either decorator."""

    def wrap(cls: T) -> T:
        assert "__post_init__" not in cls.__dict__, f"{cls.__qualname__}: the shared __init__ calls no __post_init__"
        own = {name for name in _METHODS if name in cls.__dict__}  # a method the class writes itself stays
        if cls.__dict__.get("__hash__", 0) is None and "__eq__" in own:  # None only for its own __eq__: no hash
            own.discard("__hash__")  # given, so dataclass would hash the fields
        made = dataclass(cls, init=False, repr=False, eq=False, kw_only=kw_only)
        for name, method in _METHODS.items():
            if name not in own:
                setattr(made, name, method)
        made._record_spec = _Spec(made)  # each record class its own (a subclass may add fields)
        return made

    return wrap if cls is None else wrap(cls)


class _Spec:
    """What the shared methods need of one record class."""

    def __init__(self, cls: type) -> None:
        every = fields(cls)
        assert every, f"{cls.__qualname__} has no fields"
        self.names = frozenset(f.name for f in every)
        self.positional = tuple(f.name for f in every if not f.kw_only)
        self.all_positional = len(self.positional) == len(every)  # every field can be given in order
        self.start = {f.name: _FACTORY if f.default_factory is not MISSING else f.default for f in every}
        self.required = tuple(f.name for f in every if f.default is MISSING and f.default_factory is MISSING)
        self.factories = tuple((f.name, f.default_factory) for f in every if f.default_factory is not MISSING)
        getter = attrgetter(*(f.name for f in every))
        self.values: Callable[[Any], tuple] = getter if len(every) > 1 else lambda obj: (getter(obj),)


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    """Fields from `args` in order, then from `kwargs`, then from their defaults, as dataclass's __init__ sets them."""
    spec = self._record_spec
    if not kwargs and spec.all_positional and len(args) == len(spec.positional):  # each field, in order
        vars(self).update(zip(spec.positional, args))
        return
    cls = type(self)
    if len(args) > len(spec.positional):
        raise TypeError(f"{cls.__qualname__}.__init__() takes {len(spec.positional)} positional arguments"
                        f" but {len(args)} were given")
    if not kwargs.keys() <= spec.names:
        unknown = next(name for name in kwargs if name not in spec.names)
        raise TypeError(f"{cls.__qualname__}.__init__() got an unexpected keyword argument {unknown!r}")
    given = spec.positional[:len(args)]
    if kwargs and not kwargs.keys().isdisjoint(given):
        twice = next(name for name in given if name in kwargs)
        raise TypeError(f"{cls.__qualname__}.__init__() got multiple values for argument {twice!r}")
    state = dict(spec.start)
    state.update(zip(given, args))
    state.update(kwargs)
    missing = [name for name in spec.required if state[name] is MISSING]
    if missing:
        raise TypeError(f"{cls.__qualname__}.__init__() missing required arguments: {', '.join(missing)}")
    for name, factory in spec.factories:
        if state[name] is _FACTORY:
            state[name] = factory()
    vars(self).update(state)  # past __setattr__, as a frozen dataclass's __init__ writes its fields


def _setattr(self: Any, name: str, value: Any) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _delattr(self: Any, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


def _eq(self: Any, other: Any) -> Any:
    if other.__class__ is not self.__class__:
        return NotImplemented
    values = self._record_spec.values
    return values(self) == values(other)


def _hash(self: Any) -> int:
    return hash(self._record_spec.values(self))


def _repr(self: Any) -> str:
    shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
    return f"{self.__class__.__qualname__}({shown})"


_METHODS: dict[str, Callable[..., Any]] = {
    "__init__": _init, "__setattr__": _setattr, "__delattr__": _delattr, "__eq__": _eq, "__hash__": _hash,
    "__repr__": _repr,
}
