"""A `record` behaves as the `@dataclass(frozen=True)` it stands for: the stdlib's own dataclass is the oracle.

Each test declares the same class twice, once as a record and once as a frozen dataclass, and checks that
building, comparing, hashing, printing, copying and assigning give the same results (or the same errors).
"""

import copy
import pickle
from dataclasses import FrozenInstanceError, asdict, dataclass, field, fields, replace
from typing import Any

import pytest

from memcalc.records import record


@record
class Point:
    """A record with a required field, a default and a per-instance factory."""

    x: int
    y: int = 0
    tags: list = field(default_factory=list)


@dataclass(frozen=True)
class PointDataclass:
    x: int
    y: int = 0
    tags: list = field(default_factory=list)


@record(kw_only=True)
class Named:
    """Keyword-only fields, as Knobs and ModelConfig declare them."""

    name: str
    size: int = 1


@record
class Labelled:
    """A record that writes its own repr keeps it, as a dataclass does."""

    label: str

    def __repr__(self) -> str:
        return f"<{self.label}>"


def both(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    return Point(*args, **kwargs), PointDataclass(*args, **kwargs)


@pytest.mark.parametrize("args, kwargs", [((1,), {}), ((1, 2), {}), ((), {"x": 1, "y": 2}), ((1,), {"tags": [3]})])
def test_builds_the_fields_a_dataclass_builds(args, kwargs):
    mine, theirs = both(*args, **kwargs)
    assert asdict(mine) == asdict(theirs)
    assert [f.name for f in fields(mine)] == [f.name for f in fields(theirs)]


def test_a_factory_default_is_made_per_instance():
    assert Point(1).tags is not Point(1).tags


@pytest.mark.parametrize("args, kwargs", [((), {}), ((1, 2, [], 4), {}), ((1,), {"x": 2}), ((1,), {"z": 2})])
def test_refuses_the_arguments_a_dataclass_refuses(args, kwargs):
    with pytest.raises(TypeError):
        PointDataclass(*args, **kwargs)
    with pytest.raises(TypeError):
        Point(*args, **kwargs)


def test_keyword_only_fields_refuse_positional_arguments():
    assert Named(name="a").size == 1
    with pytest.raises(TypeError):
        Named("a")


def test_equality_and_hash_follow_the_fields_as_a_dataclass_does():
    a, b = Point(1, 2, ()), Point(1, 2, ())
    assert a == b and hash(a) == hash(b)
    assert Point(1, 2, ()) != Point(1, 3, ())
    assert Point(1, 2, ()) != PointDataclass(1, 2, ())  # another class is never equal, as with dataclasses
    assert len({Point(1, 0, ()), Point(1, 0, ()), Point(2, 0, ())}) == 2


def test_repr_is_the_dataclass_repr_under_the_record_name():
    mine, theirs = both(1, 2, [3])
    assert repr(mine) == repr(theirs).replace("PointDataclass", "Point")
    assert repr(Labelled("x")) == "<x>"


@pytest.mark.parametrize("action", [lambda p: setattr(p, "x", 5), lambda p: delattr(p, "x"),
                                    lambda p: setattr(p, "new", 5)])
def test_refuses_assignment_as_a_frozen_dataclass_does(action):
    for point in both(1):
        with pytest.raises(FrozenInstanceError):
            action(point)


def test_replace_copy_and_pickle_keep_the_values():
    point = Point(1, 2, [3])
    assert replace(point, y=5) == Point(1, 5, [3])
    assert copy.deepcopy(point) == point
    assert pickle.loads(pickle.dumps(point)) == point


def test_pattern_matching_reads_positional_fields():
    match Point(1, 2):
        case Point(x, y):
            assert (x, y) == (1, 2)
