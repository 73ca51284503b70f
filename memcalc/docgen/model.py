"""docs/model.md, rendered from the ledger, the layer's knobs and the formulas.

Every saved tensor (shape, width, split, why backward needs it) and the strategies' formulas for the default layer
and each knob's variant; every name, shape and formula comes from `memcalc.model`, the prose from
docs/templates/model.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from memcalc.docgen.template import DOCS_DIR, filled, heading, md_table
from memcalc.model import formula as F
from memcalc.model import ledger
from memcalc.model.impls import implementation, layer_tensors
from memcalc.model.knobs import BY_NAME as KNOB_BY_NAME
from memcalc.model.knobs import DTYPE_BYTES, KNOBS, Accounting, Knobs
from memcalc.model.ledger import Region, SavedTensor
from memcalc.model.strategy import STRATEGIES, TP, TP_SP, Strategy

DOCS = DOCS_DIR / "model.md"

BLOCK_TITLES = {
    "layer": "The whole layer (full recomputation)",
    "ln1": "The norm before attention",
    "attention": "Attention",
    "ln2": "The norm before the MLP",
    "mla": "Multi-head latent attention (DeepSeek-V2/V3; with --kv-lora-rank, in place of Q, K, V and the projection input)",
    "mlp": "The MLP",
    "moe": "The mixture-of-experts MLP (router, experts, shared experts; with --num-experts)",
}
REGION_PROSE = {
    Region.TENSOR: "inside the column/row-parallel pair (QKV to output projection, fc1 to fc2)",
    Region.SEQUENCE: "outside the pair: norms, the inputs of the column-parallel linears, residual-side dropouts",
    Region.REPLICATED: "the token ids the embedding reads, whole on every rank",
    Region.EXPERT: "the r token-expert slots a rank's experts receive, counted per rank (r = kbs balanced, or the"
    " bound --moe-tokens names); TP (expert TP = t) splits only the expert width",
}


@dataclass(frozen=True)
class Variant:
    """One knob (or accounting choice) changed from the default layer, and what it means."""

    knobs: Knobs
    accounting: Accounting
    meaning: str


def _flags(knobs: Knobs, accounting: Accounting = Accounting()) -> str:
    """The CLI flags that select `knobs` and `accounting`: the fields that differ from the defaults."""
    changed = [
        (f.name, getattr(obj, f.name))
        for obj, default in ((knobs, Knobs()), (accounting, Accounting()))
        for f in fields(obj) if getattr(obj, f.name) != getattr(default, f.name)
    ]
    return " ".join(_flag(name, value) for name, value in changed)


def _flag(name: str, value: object) -> str:
    """A field's command-line spelling; a size-setting knob takes its symbol."""
    knob = KNOB_BY_NAME.get(name)
    flag = knob.flag if knob else f"--{name}"
    if knob and knob.symbol:
        return f"{flag} {knob.symbol}"
    if value is False and knob is not None and knob.kind == "flag":  # a flag on by default: its --no- form
        return f"--no-{flag[2:]}"
    return flag if value is True else f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


# Each knob's variants come from the knob table; accounting is not a knob, so its variants are listed here.
VARIANTS = (
    *(Variant(Knobs(**values), Accounting(), meaning) for k in KNOBS for values, meaning in k.variants()),
    Variant(Knobs(), Accounting(exact=True),
            "Exact accounting adds the small terms the paper leaves out: each norm's per-token statistics."),
    Variant(Knobs(), Accounting(exact=True, device="cpu"),
            "On CPU the norm statistics are kept in the activation dtype instead of fp32."),
    Variant(Knobs(norm="rmsnorm"), Accounting(exact=True),
            "RMSNorm's only statistic is the reciprocal RMS."),
    Variant(Knobs(attention="flash"), Accounting(exact=True),
            "The flash kernel keeps one fp32 log-sum-exp per row and head to rebuild the softmax."),
)


def render() -> str:
    """The whole of docs/model.md."""
    page = filled(
        "model.md",
        # The block picture drawn in the ledger's docstring (its indented lines).
        diagram="\n".join(line[4:] for line in (ledger.__doc__ or "").splitlines() if line.startswith("    ")),
        widths=", ".join(f"{name} {n}" for name, n in DTYPE_BYTES.items()),
        symbols="\n".join(f"| ${F.latex_name(n)}$ | {meaning} |" for n, meaning in F.MEANINGS.items()),
        regions="\n".join(f"- **{r.value}** region: {REGION_PROSE[r]}." for r in Region),
        strategies="\n".join(f"| `{s.name}` | {s.title} | {_splits(s)} |" for s in STRATEGIES.values()),
        tensors=_tensors(),
        formulas="\n\n".join([formula_section(
            "## Formulas of the default layer",
            "Bytes per GPU for one layer: the seed's model (GELU MLP of width 4h, multi-head eager attention,"
            " LayerNorm, dropout, no recomputation, 16-bit activations), the paper's accounting.",
            Knobs(), Accounting()), *map(_variant, VARIANTS)]),
    )
    sources = "memcalc/model/ledger.py, knobs.py, impls/, strategy.py\nand formula.py"
    tail = "Do not edit by hand: change the code and regenerate."
    return heading("The memcalc model", sources, tail) + page.rstrip() + "\n"


def _splits(strategy: Strategy) -> str:
    """Each region `strategy` splits, along the dimensions it splits there (in the order the ledger meets them)."""
    parts = []
    for region in (r for r in Region if r in strategy.splits):
        dims = dict.fromkeys(strategy.split_dim(x) for x in ledger.ALL_TENSORS if x.region is region)
        parts.append(f"{region.value} region along {' or '.join(d.value for d in dims)}")
    return "; ".join(parts) or "nothing"


def _tensors() -> str:
    """Each block's saved tensors, a table each."""
    header = ("tensor", "saved by", "shape", "bytes per element", "tp", "tp-sp", "when", "why backward needs it")
    return "\n\n".join(
        f"### {BLOCK_TITLES.get(block, block)}\n\n"
        + md_table(header, [_tensor_cells(x) for x in ledger.ALL_TENSORS if x.block == block])
        for block in dict.fromkeys(x.block for x in ledger.ALL_TENSORS)
    )


def _tensor_cells(x: SavedTensor) -> list[str]:
    shape = "(" + ", ".join(d.value for d in x.shape) + ")"
    splits = [f"{d.value}/t" if (d := s.split_dim(x)) else "-" for s in (TP, TP_SP)]
    return [f"`{x.name}`", x.saved_by, shape, x.kind.value, *splits, _when(x), x.why]


def _when(x: SavedTensor) -> str:
    """Whether the default layer keeps `x`, and which knobs drop or add it (counting every byte; by name, since
    the implementation may keep its own form of it)."""
    exact = Accounting(exact=True)

    def keeps(knobs: Knobs) -> bool:
        return x.name in {y.name for y in layer_tensors(knobs, exact)}

    default = keeps(Knobs())
    knob_sets = dict.fromkeys(v.knobs for v in VARIANTS if v.knobs != Knobs())
    flips = [f"`{_flags(k)}`" for k in knob_sets if keeps(k) != default]
    status = "default" if default else f"added by {', '.join(flips)}"
    if not x.paper:
        status += " (with `--exact`)"
    if default and flips:
        status += f"; dropped by {', '.join(flips)}"
    return status


def formula_section(
    title: str, intro: str, knobs: Knobs, accounting: Accounting, names: tuple[str, ...] = tuple(STRATEGIES),
) -> str:
    """Each named strategy's per-layer formula, then each tensor's term as a table and in LaTeX."""
    formulas = _formulas(knobs, accounting, names)
    rows = list(terms_by_tensor(formulas).items())
    return "\n".join([title, "", intro, "", totals(formulas), "", "Each tensor's term:", "", terms_table(rows, names),
                      "", terms_latex(rows, names)])


def _variant(v: Variant) -> str:
    """A knob's formulas and the terms it adds, removes or changes against the default layer, under the layouts
    the implementation runs for the variant's knobs (a layout it leaves out is named, with why)."""
    impl = implementation(v.knobs)
    names = impl.runs(v.knobs)
    refused = [r for n in STRATEGIES if (r := impl.refusal(v.knobs, n)) is not None]
    left_out = [f"`{r.strategy}` is left out: `--impl {impl.name}` does not run it {r.condition}: {r.reason}"
                f" ([impl-{impl.name}.md](impl-{impl.name}.md))." for r in refused]
    formulas = _formulas(v.knobs, v.accounting, names)
    old, new = terms_by_tensor(_formulas(Knobs(), Accounting(), names)), terms_by_tensor(formulas)
    added_or_changed = [(x, exprs) for x, exprs in new.items() if old.get(x) != exprs]
    removed = [(x, exprs) for x, exprs in old.items() if x not in new]
    parts = [f"## Variant `{_flags(v.knobs, v.accounting)}`", "", v.meaning, "",
             *(x for line in left_out for x in (line, "")), totals(formulas)]
    if added_or_changed:
        table, latex = terms_table(added_or_changed, names), terms_latex(added_or_changed, names)
        parts += ["", "Terms it adds or changes:", "", table, "", latex]
    if removed:
        parts += ["", "Terms it removes:", "", terms_table(removed, names)]
    return "\n".join(parts)


def _formulas(knobs: Knobs, accounting: Accounting, names: tuple[str, ...]) -> list[F.LayerFormula]:
    """Each named strategy's per-layer formula."""
    return [F.layer_formula(STRATEGIES[n], knobs, accounting) for n in names]


def terms_by_tensor(formulas: list[F.LayerFormula]) -> dict[SavedTensor, list]:
    """Each tensor's term under each of `formulas`' strategies, in the ledger's order."""
    return {terms[0][0]: [e for _, e in terms] for terms in zip(*(lf.terms for lf in formulas))}


def terms_table(rows: list[tuple[SavedTensor, list]], names: tuple[str, ...]) -> str:
    """A markdown table: a row per tensor, a column per strategy, each cell that tensor's term."""
    return md_table(["tensor", *names], ([f"`{x.name}`", *(f"`{F.to_text(e)}`" for e in exprs)] for x, exprs in rows))


def totals(formulas: list[F.LayerFormula]) -> str:
    """The per-layer formula of each strategy, as text and as one LaTeX block."""
    table = md_table(("strategy", "bytes per GPU per layer"),
                     ([f"`{lf.strategy.name}`", f"`{F.to_text(lf.total)}`"] for lf in formulas))
    latex = " \\\\\n".join(f"\\text{{{lf.strategy.name}}} &= {F.to_latex(lf.total)}" for lf in formulas)
    return f"{table}\n\n$$\n\\begin{{aligned}}\n{latex}\n\\end{{aligned}}\n$$"


def terms_latex(rows: list[tuple[SavedTensor, list]], names: tuple[str, ...]) -> str:
    """One LaTeX array: a row per tensor, a column per strategy, each cell that tensor's term."""
    head = " & ".join(["", *(f"\\text{{{name}}}" for name in names)])
    body = " \\\\\n".join(
        " & ".join([f"\\text{{{x.name}}}".replace("_", "\\_"), *(F.to_latex(e) for e in exprs)]) for x, exprs in rows
    )
    return f"$$\n\\begin{{array}}{{l{'l' * len(names)}}}\n{head} \\\\\n{body}\n\\end{{array}}\n$$"
