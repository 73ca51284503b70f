"""A moment of the step in words: where it is, and which of FSDP2's or ZeRO's buffers sit on top of the states then
("backward of layer 0: its gathered parameters and the reduce-scatter of layer 1's gradients").

The buffers are the tape's own names (memcalc.sizing.timeline.fsdp and zero); each kind reads as one phrase
(`PHRASES`), said of the block it belongs to, "its" where that is the block the moment is in.
"""

from __future__ import annotations

import re

from memcalc.sizing.timeline.fsdp import ROOT
from memcalc.sizing.timeline.tape import Moment
from memcalc.sizing.timeline.zero import BUCKET, GATHERED, PARTITION

# (a pattern over a live tensor's name, with the block it belongs to as `block`; its phrase, `{of}` the block's owner
# in words). In the order they are said.
PHRASES: tuple[tuple[str, str], ...] = (
    (r"fsdp/(?P<block>\S+) unsharded", "{of} gathered parameters"),
    (r"fsdp/(?P<block>\S+) grad .*", "{of} unsharded gradients"),
    (r"fsdp/(?P<block>\S+) accumulated .*", "{of} gradients accumulated unreduced"),
    (r"fsdp/(?P<block>\S+) all-gather", "{of} all-gather buffer"),
    (r"fsdp/(?P<block>\S+) reduce-scatter", "the reduce-scatter of {of} gradients"),
    (re.escape(GATHERED) + r" (?P<block>\S+)", "{of} modules gathered by ZeRO-3"),
    (r"zero/grad .*", "the gradients stage 1 keeps whole"),
    (re.escape(BUCKET), "ZeRO's reduce bucket"),
    (re.escape(PARTITION), "the gradient partition"),
    (r"zero/fp32 grad partition", "the fp32 gradient partition"),
)


def _alternative(i: int, pattern: str) -> str:
    """PHRASES[i]'s pattern as the i-th alternative of `_ANY_PHRASE`: a group `phrase{i}`, its block `block{i}`."""
    return f"(?P<phrase{i}>{pattern.replace('(?P<block>', f'(?P<block{i}>')})"


# PHRASES as one pattern, compiled once: in_words reads each tensor live at a peak (on each stage of a pipeline,
# hundreds) once, not once a phrase. Its alternatives are tried in PHRASES' order, and a fullmatch backtracks into the
# next when one fails, so the first phrase whose pattern matches a name whole is the one whose group matched
_ANY_PHRASE = re.compile("|".join(_alternative(i, pattern) for i, (pattern, _) in enumerate(PHRASES)))


def block_words(block: str) -> str:
    """"layer 3" for layers.3; the root's modules (embedding, final norm, lm_head) as "the root"."""
    return "the root" if block == ROOT else block.replace("layers.", "layer ")


def _block(where: str) -> str | None:
    """The decoder layer a module path is in (transformers' model.layers.3.mlp, torchtitan's layers.3.moe ->
    layers.3), the root for the model's other modules, none outside any module."""
    found = re.match(r"(?:model\.)?layers\.(\d+)", where)
    if found:
        return f"layers.{found.group(1)}"
    return ROOT if where else None


def in_words(moment: Moment) -> str:
    """The moment as a sentence: its phase and block, what the op does, and the sharding's buffers live then."""
    block = _block(moment.where)
    head = moment.phase + (f" of {block_words(block)}" if block else "")
    owners: dict[int, list[str | None]] = {}  # by its place in PHRASES, the blocks a phrase is said of, as met
    for x in moment.live:
        found = _ANY_PHRASE.fullmatch(x.name)
        if found:
            i = next(i for i in range(len(PHRASES)) if found[f"phrase{i}"] is not None)
            said_of = owners.setdefault(i, [])
            owner = found.groupdict().get(f"block{i}")
            if owner not in said_of:
                said_of.append(owner)
    said = [PHRASES[i][1].format(of=of) for i in sorted(owners) for of in _whose(owners[i], block)]
    buffers = f": {_listed(said)}" if said else ""
    return f"{head} ({moment.what}){buffers}"


def _whose(owners: list[str | None], block: str | None) -> list[str]:
    """Whose a phrase is said of, in order: "" (no block), "its" (the moment's), "the root's", "layer 3's", and three
    or more layers in a row as one "layers 24 to 47's" (a pipeline stage under FSDP2 holds all its layers' weights)."""
    words: list[str] = []
    run: list[int] = []
    for owner in owners:
        layer = re.fullmatch(r"layers\.(\d+)", owner) if owner and owner != block else None
        n = int(layer.group(1)) if layer else None
        if n is not None and _continues(run, n):
            run.append(n)
            continue
        words += _of_layers(run)
        run = [n] if n is not None else []
        if n is None:
            words.append("" if owner is None else "its" if owner == block else f"{block_words(owner)}'s")
    return words + _of_layers(run)


def _continues(run: list[int], n: int) -> bool:
    """Whether layer `n` goes on `run`, layers in a row one way (24, 25, 26 or 47, 46, 45)."""
    if not run:
        return False
    step = n - run[-1]
    return step in (1, -1) if len(run) == 1 else step == run[-1] - run[-2]


def _of_layers(run: list[int]) -> list[str]:
    """A run of layers as owners: three or more as one range, lowest first, fewer one by one."""
    return [f"layers {min(run)} to {max(run)}'s"] if len(run) >= 3 else [f"layer {x}'s" for x in run]


def _listed(items: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
