"""docs/impl-<name>.md: one page per implementation, rendered from its module.

Each page says which library version the rules were measured on, which layouts it runs (and refuses, and why),
its TP plan, what its layer keeps beside the paper's, what it keeps gathered under SP, the hand-written account
(docs/impl-notes/<name>.md), and its formulas for the library's default knobs.
"""

from __future__ import annotations

from itertools import groupby
from dataclasses import replace
from pathlib import Path

from memcalc.docgen.model import formula_section
from memcalc.docgen.template import DOCS_DIR, heading, md_table
from memcalc.model.impls import IMPLEMENTATIONS
from memcalc.model.impls.base import Implementation, SizeCondition
from memcalc.model.knobs import KNOBS, Accounting, Knobs, element_bytes
from memcalc.model.ledger import SavedTensor

EXACT = Accounting(exact=True, device="cuda")  # every byte, as on the GPUs users train on


def render(impl: Implementation) -> str:
    """The whole page for one implementation, at the knobs `impl: <name>` alone gets (the library's defaults)."""
    knobs = Knobs(**{"impl": impl.name, **impl.knob_defaults()})
    notes = _notes_path(impl)
    formulas = formula_section("## Per-layer formulas, its default knobs",
                               "Bytes per GPU for one layer, every byte counted, statistics as on CUDA:", knobs, EXACT,
                               impl.runs(knobs))
    sections = [_intro(impl, knobs), _own_knobs(impl), _differences(impl, knobs),
                notes.read_text().rstrip() if notes.exists() else "", _size_rule(impl, knobs), formulas]
    return "\n\n".join(x for x in sections if x).rstrip() + "\n"


def _intro(impl: Implementation, knobs: Knobs) -> str:
    from memcalc.cli.render import describe_knobs

    tp_plan = impl.tp_plan(knobs)
    whole = ", ".join(f"`{n}`" for n in sorted(tp_plan.kept_whole())) or "none"
    notes = _notes_path(impl)
    sources = [f"memcalc/model/impls/{impl.name}.py"]
    sources += [str(notes.relative_to(DOCS_DIR.parent))] if notes.exists() else []
    return heading(f"`--impl {impl.name}`: {impl.title}", " and ".join(sources)) + "\n".join([
        f"Measured on: {impl.measured_on}.",
        "",
        f"Layouts it runs (its defaults): {', '.join(f'`{n}`' for n in impl.runs(knobs))}.",
        *(f"It does not run `{r.strategy}` {r.cited()}." for r in impl.refuses),
        f"Tensors a sequence-parallel layout keeps gathered (whole sequence): {whole}.",
        "",
        f"Its defaults (what `impl: {impl.name}` sets unless the config says otherwise): {describe_knobs(knobs)}.",
        f"Its TP plan for them, module by module: {', '.join(f'`{r.module}` {r.style.value}' for r in tp_plan.rules)}"
        " (memcalc/model/tp_plan.py; a colwise module's entry issues f or g, a rowwise module's exit f* or g*).",
        *([f"Measured per-tensor tables: [measured-{impl.name}.md](measured-{impl.name}.md)."]
          if (DOCS_DIR / f"measured-{impl.name}.md").exists() else []),
    ])


def _own_knobs(impl: Implementation) -> str:
    """The knobs only this library has (`Knob.impls`): each flag, its default and where that default comes from."""
    own = [k for k in KNOBS if impl.name in k.impls]
    if not own:
        return ""
    return "\n".join([
        "## Its own knobs", "",
        "Settings other libraries do not have (refused there). Each default is what the library's users get unless"
        " they pass a flag; the probe builds the library's config from the same values.", "",
        md_table(("flag", "default", "where the default comes from"),
                 ([f"`{k.flag}`", "unset" if k.default is None else str(k.default), k.source] for k in own)),
    ])


def _differences(impl: Implementation, knobs: Knobs) -> str:
    """What the library keeps beyond the paper's layer with the same knobs, and what it does not keep."""
    paper = IMPLEMENTATIONS["megatron"].layer_tensors(replace(knobs, impl="megatron"), EXACT)
    mine = impl.layer_tensors(knobs, EXACT)
    added = [x for x in mine if x not in paper]
    dropped = [x for x in paper if x not in mine]
    parts = ["## What it keeps that the paper's layer does not", ""]
    parts += [_tensor_table(added, knobs)] if added else ["Nothing: every tensor it keeps is the paper's."]
    if dropped:
        parts += ["", "The paper's tensors it does not keep:", "", _tensor_table(dropped, knobs)]
    return "\n".join(parts)


def _notes_path(impl: Implementation) -> Path:
    """The hand-written account of what the library's layer keeps and why (too long for its module's docstring)."""
    return DOCS_DIR / "impl-notes" / f"{impl.name}.md"


def _size_rule(impl: Implementation, knobs: Knobs) -> str:
    """Where what the layer keeps depends on the sizes, and what it keeps then."""
    rule = impl.size_rule
    if rule is None:  # single tensors only depend on the sizes (`SizeCondition`), or nothing does
        nowhere = "Nowhere: the knobs alone decide what the layer keeps."
        return "\n".join(["## Where the sizes matter", "", _size_conditions(impl) if impl.size_conditions else nowhere])
    seed = replace(knobs, attention="eager", recompute="none", dtype="bf16", **rule.shown_with)
    inside, outside = impl.layer_tensors(seed, EXACT), rule.outside(seed, EXACT)
    changed = [x for x in outside if x not in inside]
    shown = "".join(f", {name} {value}" for name, value in rule.shown_with.items())
    return "\n".join([
        "## Where the sizes matter", "", f"{rule.what[:1].upper()}{rule.what[1:]}.",
        "Numbers (`estimate`, `sweep`, `fit`) follow the rule point by point, and `estimate` names the departure from"
        " the paper it makes; the formulas below hold where the kernel runs (`memcalc formula` prints those outside"
        " too, and with --s and --a the one that holds there).",
        "", f"What the layer keeps outside (eager attention, bf16{shown}):", "", _tensor_table(changed, seed),
        *(["", _size_conditions(impl)] if impl.size_conditions else []),
    ])


def _size_conditions(impl: Implementation) -> str:
    """The single tensors kept as written only at some sizes (`SizeCondition`), a line for each reason: the tensors
    that one rule decides (SelectiveAC's shifted count decides every matmul output of a block) share it."""
    lines = ["Single tensors kept as written only at some sizes (numbers follow them point by point):", ""]
    for what, conditions in groupby(impl.size_conditions, key=lambda c: c.what):
        lines.append(f"- {', '.join(map(_condition_tensor, conditions))}: {what[:1].upper()}{what[1:]}.")
    return "\n".join(lines)


def _condition_tensor(c: SizeCondition) -> str:
    """A tensor a size condition decides, and what is kept in its place where it is not kept as written."""
    names = [x.name for x in c.instead]
    instead = "" if not names else " (in another form)" if names == [c.tensor.name] \
        else f" ({', '.join(f'`{x}`' for x in names)} in its place)"
    return f"`{c.tensor.name}`{instead}"


def _tensor_table(tensors: list[SavedTensor], knobs: Knobs) -> str:
    return md_table(("tensor", "kept by", "shape", "bytes per element (cuda)", "why"), (
        [f"`{x.name}`", x.saved_by, f"({', '.join(d.value for d in x.shape)})",
         str(element_bytes(x.kind, knobs, EXACT)), x.why] for x in tensors
    ))


def pages() -> dict[Path, str]:
    """Every implementation's page, by path."""
    return {DOCS_DIR / f"impl-{impl.name}.md": render(impl) for impl in IMPLEMENTATIONS.values()}
