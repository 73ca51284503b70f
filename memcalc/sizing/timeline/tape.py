"""The tape a step is walked on: what is live, the moments it makes, and the sizes one rank works with.

Categories are MemTracker's (`memcalc.probe.step`), as docs/timeline.md, "The walk", files each tensor.
"""

from __future__ import annotations

import bisect
import functools
import gc
import itertools
import operator
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod as prod  # the walks' element counts, imported from here
from typing import NamedTuple, TypeVar, overload

from memcalc.config.schema import ModelConfig
from memcalc.model.knobs import DTYPE_BYTES
from memcalc.model.strategy import Strategy
from memcalc.sizing.params import EndModules, end_modules, layer_elements, part, vocab_shard

PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, TEMPORARIES = (
    "parameters", "gradients", "optimizer states", "activations", "temporaries",
)
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, TEMPORARIES)
GRAD_SEED = "loss/grad seed"  # loss.backward()'s 0-d ones tensor, autograd's first gradient, to backward's end


class Live(NamedTuple):
    """One tensor (or one block's saved tensors together) live at a moment (a named tuple, not a frozen dataclass,
    whose __init__ took a quarter of a walk: a walk makes one per tensor, a MoE step hundreds of thousands)."""

    name: str
    category: str  # one of CATEGORIES
    bytes: int
    why: str


@dataclass(slots=True)
class Moment:
    """What is live right after one op allocates its outputs, before anything it frees is freed: its bytes per
    category, and the tensors themselves, read back from the tape's log when asked for (a moment keeps no copy).
    Slotted, not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__, at over three
    times the cost, and a walk marks one per op (a replayed walk's are made only where one is read, `Moments`)."""

    phase: str  # "steady", "forward", "backward" or "optimizer"
    where: str  # the probe's module path ("layers.1.mlp.fc2"), or "" outside any module
    what: str  # the op, in words
    totals: tuple[int, ...]  # bytes per category, in CATEGORIES' order
    log: list[Live | str] = field(compare=False, repr=False)  # the tape's changes, shared: a tensor set, a name gone
    at: int = field(compare=False, repr=False)  # how many of them had happened

    @property
    def bytes(self) -> int:
        return sum(self.totals)

    @property
    def live(self) -> tuple[Live, ...]:
        """Every live tensor, in the order the tape holds them (replayed from its log: for a few moments, not all)."""
        live: dict[str, Live] = {}
        for x in itertools.islice(self.log, self.at):
            if isinstance(x, str):
                del live[x]
            else:
                live[x.name] = x
        return tuple(live.values())

    def by_category(self) -> dict[str, int]:
        """Bytes per category, every category present (0 where none)."""
        return dict(zip(CATEGORIES, self.totals))

    def label(self) -> str:
        """`backward layers.1.mlp.fc2 (GEMM: dW and dX)`: the moment in words."""
        where = f" {self.where}" if self.where else ""
        return f"{self.phase}{where} ({self.what})"


class Moments(Sequence[Moment]):
    """A step's moments in order, read as a sequence of `Moment`s but stored in runs of two kinds: `_Marked`, the
    moments `Tape.mark` made one by one, and `_Replayed`, a traced walk done again (`Tape.replay`): its `Trace`, the
    totals and the log position it started from, a `Moment` made from them only where one is read (an index, an
    iteration, the peak). Why not a list of moments: torchtitan's pipeline replays half a million on gpt3-1t's 64
    stages, and made as objects they and the garbage collector's passes over them took over a third of its walk
    (deferring the passes, `bulk`, saves none for objects that outlive the walk: each is passed over once in each
    generation it reaches)."""

    def __init__(self, log: list[Live | str]) -> None:
        self.log = log  # the tape's, shared
        self.runs: list[_Marked | _Replayed] = []
        self.starts: list[int] = []  # the index of each run's first moment
        self.marking: _Marked | None = None  # the run `mark` appends to: the last run, if it is a _Marked one

    def mark(self, phase: str, where: str, what: str, totals: tuple[int, ...]) -> None:
        """A moment of these totals, now (at the log's end)."""
        if self.marking is None:
            self.marking = _Marked()
            self._add(self.marking)
        self.marking.append(Moment(phase, where, what, totals, self.log, len(self.log)))

    def replay(self, trace: Trace, before: tuple[int, ...], at: int, wheres: tuple[str, ...]) -> None:
        """The moments of a traced walk, done again on top of the totals `before`, `at` changes into the log, at
        `wheres` (the trace's, or moved)."""
        if trace.at:
            self._add(_Replayed(trace, before, at, self.log, (trace.moments[0], wheres, trace.moments[2])))

    def _add(self, run: _Marked | _Replayed) -> None:
        self.starts.append(len(self))
        self.runs.append(run)
        self.marking = run if isinstance(run, _Marked) else None

    def __len__(self) -> int:
        return self.starts[-1] + len(self.runs[-1]) if self.runs else 0

    @overload
    def __getitem__(self, i: int) -> Moment: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Moment, ...]: ...

    def __getitem__(self, i: int | slice) -> Moment | tuple[Moment, ...]:
        found = range(len(self))[i]  # an index from the start (IndexError beyond the end), or those of a slice
        if isinstance(found, range):
            return tuple(self[x] for x in found)
        run = bisect.bisect_right(self.starts, found) - 1
        return self.runs[run][found - self.starts[run]]

    def __iter__(self) -> Iterator[Moment]:
        return itertools.chain.from_iterable(self.runs)

    def __eq__(self, other: object) -> bool:
        """The same moments, in order (by `Moment`'s equality: their phases, wheres, whats and totals)."""
        return tuple(self) == tuple(other) if isinstance(other, Moments) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a list's: moments are added

    def peak(self) -> Moment:
        """The moment with the most bytes live (the first, on a tie): each run finds its own peak's bytes and index (a
        replayed run's from its trace's, no moment made), and the first run whose peak is highest gives the one moment
        made (a pipeline's stage has a run for each walk replayed, thousands)."""
        _, at, run = max(((*x.peak_at(), x) for x in self.runs), key=operator.itemgetter(0))
        return run[at]


class _Marked(list[Moment]):
    """Moments marked one by one."""

    def peak_at(self) -> tuple[int, int]:
        """The bytes of the first of these moments with the most, and its index (index finds the first of equals)."""
        sums = [x.bytes for x in self]
        return max(sums), sums.index(max(sums))


@dataclass(slots=True)
class _Replayed:
    """A traced walk's moments done again: on top of the totals `before`, `at` changes into the tape's `log`, their
    phases, wheres and whats `moments` (slotted, not frozen, as `Moment`: a run for each walk replayed)."""

    trace: Trace
    before: tuple[int, ...]
    at: int
    log: list[Live | str]
    moments: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]

    def __len__(self) -> int:
        return len(self.trace.at)

    def __getitem__(self, i: int) -> Moment:
        trace = self.trace
        totals = tuple(x if change is None else x + change[i] for x, change in zip(self.before, trace.changes))
        return Moment(*(x[i] for x in self.moments), totals, self.log, self.at + trace.at[i])

    def __iter__(self) -> Iterator[Moment]:
        # each moment's totals a tuple zip makes of the categories' columns (one the walk left alone repeats its total)
        trace, repeat = self.trace, itertools.repeat
        columns = (repeat(x) if change is None else map(operator.add, repeat(x), change)
                   for x, change in zip(self.before, trace.changes))
        at = map(operator.add, repeat(self.at), trace.at)
        return map(Moment, *self.moments, zip(*columns), repeat(self.log), at)

    def peak_at(self) -> tuple[int, int]:
        """The traced walk's peak, done again: its bytes, the trace's rise above `before`'s (each moment's totals are
        the trace's plus the same `before`), and its index."""
        return sum(self.before) + self.trace.rise, self.trace.peak


@dataclass(frozen=True)
class Timeline:
    """One step on one rank: every moment in order."""

    strategy: Strategy
    moments: Moments  # the tape's own, not a copy: a timeline is made once its tape's step has ended
    stage: str = "only"  # the pipeline stage (memcalc.sizing.pipeline.stages)

    @property
    def steady(self) -> Moment:
        """Between steps: model states alone."""
        return self.moments[0]

    @functools.cached_property
    def peak(self) -> Moment:
        """The moment with the most bytes live (the first, on a tie)."""
        return self.moments.peak()


@dataclass(frozen=True)
class Sizes:
    """Element counts one rank works with, and the widths of its tensors."""

    b: int
    s: int  # the whole sequence: inside the column/row-parallel pair
    s_seq: int  # the sequence outside the pair: s/t under SP
    h: int
    h_t: int  # the attention's columns inside the pair: a/t heads of d (h/t unless kv_channels says otherwise)
    f_t: int
    a_t: int
    g_t: int  # K/V groups on this rank
    d: int
    qkv_t: int  # QKV output columns on this rank
    v_t: int  # vocabulary rows on this rank (padded)
    positions: int  # rows of the learned position table (0 with RoPE)
    t: int  # ranks that split the weights (1 without TP)
    sp: bool
    act: int  # activation and bf16 weight width
    dtensor: bool = False  # the TP plan's collectives are DTensor's redistributions (torchtitan's partial_dtensor)
    cuda: bool = False  # CUDA's kernels (torchtitan's: the fused rms_norm, flex attention given the batch's positions)
    # torchtitan's pipeline under SP: a stage's received input and its sent output's gradient are its (b, s/t, h)
    # receive buffers, whose layout the residual stream (`stage_receives`) and its gradient (`stage_sends`) keep on
    # that stage
    stage_receives: bool = False
    stage_sends: bool = False
    config: ModelConfig | None = None  # whose inventory (memcalc.sizing.params) `weight` reads

    @classmethod
    def of(cls, config: ModelConfig, strategy: Strategy) -> Sizes:
        t = strategy.weight_shards(config.t)
        sp = strategy.sequence_parallel and t > 1
        d = config.head_dim  # h/a unless kv_channels says otherwise (transformers' head_dim)
        return cls(
            b=config.b, s=config.s, s_seq=config.s // t if sp else config.s, h=config.h, h_t=config.a * d // t,
            f_t=config.ffn // t, a_t=config.a // t, g_t=config.groups // t, d=d,
            qkv_t=(config.a + 2 * config.groups) * d // t,
            v_t=vocab_shard(config, t), t=t, sp=sp, act=DTYPE_BYTES[config.dtype],
            positions=config.positions if config.position_embedding_type == "learned_absolute" else 0, config=config,
        )

    def weight(self, module: str, width: int = 0, bias: bool = False) -> int:
        """Bytes of the parameter `module` (its path below the layer's, or at the model's ends, `ends`; a bias
        `module.bias`) on this rank in the activation dtype (or `width` bytes a value: DeepSeek's fp32 router GEMM, a
        norm's fp32 gradient), shaped as the implementation's inventory: its gradient's, as the op makes it. `bias`:
        the bias of `module`, 0 where it has none (the inventory says which modules have one)."""
        elements = _elements(self.config, self.t)
        return (width or self.act) * (elements.get(f"{module}.bias", 0) if bias else elements[module])

    @property
    def ends(self) -> EndModules:
        """The modules at the model's two ends, by their paths in the inventory (`weight` reads them)."""
        return end_modules(self.config)

    def seq(self, width: int) -> int:
        """Bytes of an activation-dtype (s, b, width) tensor outside the pair: (s/t, b, width) under SP."""
        return self.act * self.s_seq * self.b * width

    def full(self, width: int) -> int:
        """Bytes of an activation-dtype (s, b, width) tensor with the whole sequence."""
        return self.act * self.s * self.b * width

    def tokens(self, width: int) -> int:
        """Bytes of one `width`-byte value per token of the micro-batch, (b, s)."""
        return width * self.b * self.s


@functools.lru_cache(maxsize=64)
def _elements(config: ModelConfig, t: int) -> dict[str, int]:
    """Each parameter of a layer (by its path below the layer's) and of the model's two ends: its elements on a rank
    of t (`Sizes.weight`). An output layer tied to the embedding on its stage has no weight of its own: the word
    table is its weight."""
    modules = end_modules(config)
    ends = {p.module: prod(p.shape) for which in ("first", "last") for p in part(config, t, which)}
    return {modules.head: ends[modules.word]} | layer_elements(config, t) | ends


class _Live(dict):
    """The live tensors by name, which keeps the bytes of each category and a log of every change as it goes (a
    moment is then its totals and its place in the log, however many tensors are live). They change only by set and
    pop."""

    def __init__(self) -> None:
        super().__init__()
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self.log: list[Live | str] = []

    # dict's own methods called by name, not through super(): a walk makes millions of these calls
    def __setitem__(self, name: str, x: Live) -> None:
        old = dict.get(self, name)
        if old is not None:
            self.totals[old.category] -= old.bytes
        dict.__setitem__(self, name, x)
        self.totals[x.category] += x.bytes
        self.log.append(x)

    def pop(self, name: str, *default: Live | None) -> Live | None:  # type: ignore[override]
        x = dict.pop(self, name, None)
        if x is None:
            return dict.pop(self, name, *default)
        self.totals[x.category] -= x.bytes
        self.log.append(name)
        return x

    def _unlogged(self, *args: object, **kwargs: object) -> None:
        raise TypeError("the live tensors change only by set and pop: the totals and the log follow those")

    update = setdefault = clear = popitem = __ior__ = __delitem__ = _unlogged  # type: ignore[assignment]


class Tape:
    def __init__(self) -> None:
        self.live = _Live()
        self.moments = Moments(self.live.log)

    def add(self, name: str, category: str, nbytes: int, why: str) -> None:
        if name in self.live:
            raise AssertionError(f"{name} is live twice")
        if nbytes:
            self.live[name] = Live(name, category, nbytes, why)

    def drop(self, *names: str) -> None:
        for name in names:
            self.live.pop(name, None)

    def rename(self, old: str, new: str) -> None:
        """The same bytes, under the name the next op knows them by (a gradient handed on, a buffer reused)."""
        self.live[new] = self.live.pop(old)._replace(name=new)

    def rename_all(self, names: dict[str, str]) -> None:
        """`rename` of each of `names` (old -> new) in turn, at a fraction of the cost (a pipeline renames every
        micro-batch's tensors apart from the next one's, and back): by _Live's own pop and set, the totals as they
        were, unless a tensor is live under the new name already."""
        live, log = self.live, self.live.log
        for old, new in names.items():
            if new in live:
                self.rename(old, new)
                continue
            x = dict.pop(live, old)
            x = Live(new, x.category, x.bytes, x.why)
            dict.__setitem__(live, new, x)
            log += (old, x)

    def mark(self, phase: str, where: str, what: str) -> None:
        self.moments.mark(phase, where, what, tuple(self.live.totals.values()))

    def traced(self, walk: Callable[[], None]) -> Trace:
        """`walk` run on the tape, and what it did there (`replay` does it again)."""
        live = self.live
        at, moments, before, names = len(live.log), len(self.moments), tuple(live.totals.values()), set(live)
        walk()
        changes, left = live.log[at:], {}
        for x in changes:  # what it left live, in the order the tape then holds it
            if type(x) is str:
                left.pop(x, None)
            else:
                left[x.name] = x
        gone = {x for x in changes if type(x) is str and x in names}  # each tensor live before that went
        marked = self.moments[moments:]
        columns = zip(*(_less(x.totals, before) for x in marked)) if marked else ((),) * len(CATEGORIES)
        peak = _first_peak(marked)
        return Trace(tuple(changes), tuple(gone), tuple(left.values()),
                     tuple(tuple(getattr(x, name) for x in marked) for name in ("phase", "where", "what")),
                     tuple(x if any(x) else None for x in columns), tuple(x.at - at for x in marked),
                     _less(tuple(live.totals.values()), before), peak,
                     sum(_less(marked[peak].totals, before)) if marked else 0)

    def replay(self, trace: Trace, moved: tuple[str, str] | None = None) -> None:
        """What a traced walk did, done again, where it would do the same (the same ops, the same tensors live under
        every name they touch): its changes to the live tensors, and its moments, on top of those live now. `moved`:
        the module the walk was traced in and the one it is done in now, where its moments (each in the first or a
        module below it) are read instead."""
        live, log = self.live, self.live.log
        at, before = len(log), tuple(live.totals.values())
        for name in trace.gone:  # as _Live's own pop and set, without a log entry: the trace's are added after
            dict.pop(live, name)
        for x in trace.left:
            dict.__setitem__(live, x.name, x)
        log += trace.log
        for category, change in zip(CATEGORIES, trace.totals):
            live.totals[category] += change
        wheres = trace.moments[1] if moved is None else tuple(_moved(x, *moved) for x in trace.moments[1])
        self.moments.replay(trace, before, at, wheres)


class Trace(NamedTuple):
    """What a walk did to a tape: its changes to the live tensors (the log's entries; in sum, the tensors live before
    that went, `gone`, and those it left live, in the order the tape holds them, `left`), its moments (their phases,
    wheres and whats; for each category their totals less the one before the walk, None where none changed; how many
    changes came before each), its change to the totals, which of its moments peaks (the first, on a tie) and its
    bytes less those before the walk."""

    log: tuple[Live | str, ...]
    gone: tuple[str, ...]
    left: tuple[Live, ...]
    moments: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]
    changes: tuple[tuple[int, ...] | None, ...]
    at: tuple[int, ...]
    totals: tuple[int, ...]
    peak: int
    rise: int


def _moved(where: str, old: str, new: str) -> str:
    """`where`, module `old` or a module below it, at `new` instead (layers.0.mlp.fc2 -> layers.3.mlp.fc2)."""
    if where != old and not where.startswith(old + "."):
        raise AssertionError(f"{where} is not in {old}: its walk cannot move to {new}")
    return new + where[len(old):]


R = TypeVar("R")


class Replays:
    """Walks done once and replayed (`Tape.replay`) wherever they would do the same: a walk `run` under a `kind` of
    ops that reads and writes the tape only under its `names`, and finds the same tensors live under them (a Live
    names itself) as one done before under that kind, makes the same changes and the same moments on top of the
    totals now, and returns what that one returned. So a model's layers, whose ops name their tensors alike, are walked
    once each kind (Megatron's walk of DeepSeek-V3 made and freed each of 61 layers' 256 experts' tensors one by one,
    a third of a second); each moment is read in the module its replay runs in (`module`), the same below it."""

    def __init__(self, tape: Tape) -> None:
        self.tape = tape
        self.done: dict[tuple[Hashable, tuple[Live, ...]], tuple[Trace, str, object]] = {}

    def run(self, kind: Hashable, names: tuple[str, ...], module: str, walk: Callable[[], R]) -> R:
        """`walk`'s result, walked (and traced) or replayed; its moments in `module` or below it."""
        found = (kind, tuple(filter(None, map(self.tape.live.get, names))))
        if found in self.done:
            trace, traced_in, result = self.done[found]
            self.tape.replay(trace, None if traced_in == module else (traced_in, module))
            return result  # type: ignore[return-value]  # what the same walk returned
        results: list[R] = []
        trace = self.tape.traced(lambda: results.append(walk()))
        self.done[found] = trace, module, results[0]
        return results[0]


def _first_peak(moments: tuple[Moment, ...]) -> int:
    """The index of the first of `moments` with the most bytes (0 where there are none)."""
    return max(range(len(moments)), key=lambda i: moments[i].bytes, default=0)


def _less(totals: tuple[int, ...], before: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(map(operator.sub, totals, before))


@contextmanager
def bulk() -> Iterator[None]:
    """A walk allocates hundreds of thousands of small records and frees them in bulk, none in a cycle: the cyclic
    garbage collector's passes over them would cost a third of the walk, so it waits until the walk is done."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
