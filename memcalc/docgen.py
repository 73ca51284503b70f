"""docs/model.md, rendered from the ledger, the layer's knobs and the formulas.

The reference explains every saved tensor (shape, width, how each strategy splits
it, why backward needs it) and prints the three strategies' formulas, term by
term, for the default layer and for each knob's variant. Every name, shape and
formula comes from `memcalc.model.ledger`, `memcalc.model.knobs`, `memcalc.model.strategy` and
`memcalc.model.formula`; only the connecting prose is written here. A test fails when
the checked-in file differs from what this module renders.

    python -m memcalc.docgen          # print
    python -m memcalc.docgen --write  # update docs/model.md
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path

from memcalc.model import formula as F
from memcalc.model import ledger
from memcalc.model.knobs import DTYPE_BYTES, Accounting, Knobs, layer_tensors
from memcalc.model.ledger import Region, SavedTensor
from memcalc.model.strategy import STRATEGIES, TP, TP_SP, Strategy

DOCS = Path(__file__).resolve().parents[1] / "docs" / "model.md"

BLOCK_TITLES = {
    "layer": "The whole layer (full recomputation)",
    "ln1": "The norm before attention",
    "attention": "Attention",
    "ln2": "The norm before the MLP",
    "mlp": "The MLP",
}
REGION_PROSE = {
    Region.TENSOR: "inside the column/row-parallel pair (QKV to output projection, fc1 to fc2)",
    Region.SEQUENCE: "outside the pair: norms, the inputs of the column-parallel linears, residual-side dropouts",
}


@dataclass(frozen=True)
class Variant:
    """One knob (or accounting choice) changed from the default layer, and what it means."""

    knobs: Knobs
    accounting: Accounting
    meaning: str

    @property
    def flags(self) -> str:
        return _flags(self.knobs, self.accounting)


def _flags(knobs: Knobs, accounting: Accounting = Accounting()) -> str:
    """The CLI flags that select `knobs` and `accounting`: the fields that differ from the defaults."""
    changed = [
        (f.name, getattr(obj, f.name))
        for obj, default in ((knobs, Knobs()), (accounting, Accounting()))
        for f in fields(obj) if getattr(obj, f.name) != getattr(default, f.name)
    ]
    return " ".join(_flag(name, value) for name, value in changed)


def _flag(name: str, value: object) -> str:
    """A field's command-line spelling; the size-setting knobs take their symbol."""
    symbolic = {"ffn_set": "--ffn-hidden-size f", "gqa": "--num-query-groups g", "dropout": "--dropout 0"}
    if name in symbolic:
        return symbolic[name]
    return f"--{name}" if value is True else f"--{name} {value}"


VARIANTS = (
    Variant(Knobs(mlp="swiglu", ffn_set=True), Accounting(),
            "SwiGLU computes SiLU(gate) * up: backward needs the gate (for SiLU's derivative) and both factors "
            "of the product, three (b, s, f) tensors where GELU kept one."),
    Variant(Knobs(ffn_set=True), Accounting(),
            "An MLP width f other than 4h changes only the two tensors of that width."),
    Variant(Knobs(gqa=True), Accounting(),
            "Grouped-query attention keeps K and V for g groups of heads instead of a."),
    Variant(Knobs(attention="flash"), Accounting(),
            "A fused kernel never materialises the s x s scores: backward rebuilds them from Q, K and V, and "
            "regenerates the dropout mask from the RNG seed."),
    Variant(Knobs(norm="rmsnorm"), Accounting(),
            "RMSNorm subtracts no mean; under the paper's accounting nothing changes (see the exact variant)."),
    Variant(Knobs(dropout=False), Accounting(),
            "Without dropout there are no masks, and the weights x V matmul reads the softmax output itself."),
    Variant(Knobs(recompute="selective"), Accounting(),
            "Selective recomputation (Korthikanti et al. 2022) reruns the attention core in backward, so none "
            "of its s x s tensors is kept."),
    Variant(Knobs(recompute="full"), Accounting(),
            "Full recomputation keeps only the layer's input and reruns the whole forward in backward."),
    Variant(Knobs(dtype="fp32"), Accounting(),
            "Activations take the wider dtype; dropout masks stay one byte."),
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
    sections = [_intro(), _strategies(), _tensors(), _default_formulas(), *map(_variant, VARIANTS)]
    return "\n\n".join(sections).rstrip() + "\n"


def _intro() -> str:
    symbols = "\n".join(f"| ${n}$ | {meaning} |" for n, meaning in F.MEANINGS.items())
    widths = ", ".join(f"{name} {n}" for name, n in DTYPE_BYTES.items())
    return f"""# The memcalc model

<!-- Generated by `python -m memcalc.docgen --write` from memcalc/ledger.py, layer.py, strategy.py
and formula.py. Do not edit by hand: change the code and regenerate. -->

memcalc counts the bytes of activations one GPU keeps for backward in one transformer layer. A
tensor is an activation exactly when some operator's backward reads it: a dropout keeps its mask,
GELU its input, softmax its output. Each such tensor is described once in `memcalc/ledger.py`;
the knobs decide which of them a layer keeps, and a strategy decides which dimension it splits
across the t tensor-parallel ranks. All L layers keep L times one layer's bytes.

The layer is Megatron-LM's pre-norm block:

```
{_diagram()}
```

Activation dtype widths in bytes: {widths}.

| symbol | meaning |
|---|---|
{symbols}
| $d$ | head dimension, h/a |"""


def _diagram() -> str:
    """The block picture drawn in the ledger's docstring (its indented lines)."""
    lines = (ledger.__doc__ or "").splitlines()
    return "\n".join(line[4:] for line in lines if line.startswith("    "))


def _strategies() -> str:
    rows = []
    for s in STRATEGIES.values():
        split = "; ".join(
            f"{region.value} region along {_split_dims(s, region)}"
            for region in Region if region in s.splits
        )
        rows.append(f"| `{s.name}` | {s.title} | {split or 'nothing'} |")
    regions = "\n".join(f"- **{r.value}** region: {REGION_PROSE[r]}." for r in Region)
    return "\n".join([
        "## How the strategies split a layer",
        "",
        "Each tensor lives in one of two regions of the layer:",
        "",
        regions,
        "",
        "A strategy divides by t the tensors of the regions it splits, along one dimension;"
        " the rest are replicated on every rank.",
        "",
        "| strategy | name | splits |",
        "|---|---|---|",
        *rows,
    ])


def _split_dims(strategy: Strategy, region: Region) -> str:
    """The dimensions `strategy` splits in `region`, in the order the ledger meets them."""
    dims = dict.fromkeys(strategy.split_dim(x) for x in ledger.ALL_TENSORS if x.region is region)
    return " or ".join(d.value for d in dims)


def _tensors() -> str:
    parts = [
        "## The saved tensors, block by block",
        "",
        "*When* says whether the default layer keeps the tensor, and which knobs drop or add it;"
        " the small terms the paper leaves out are counted only with `--exact`. Under `tp` and `tp-sp`"
        " the split dimension is divided by t; `-` means every rank keeps the whole tensor.",
    ]
    for block in dict.fromkeys(x.block for x in ledger.ALL_TENSORS):
        parts += ["", f"### {BLOCK_TITLES.get(block, block)}", "",
                  "| tensor | saved by | shape | bytes per element | tp | tp-sp | when | why backward needs it |",
                  "|---|---|---|---|---|---|---|---|"]
        parts += [_tensor_row(x) for x in ledger.ALL_TENSORS if x.block == block]
    return "\n".join(parts)


def _tensor_row(x: SavedTensor) -> str:
    shape = "(" + ", ".join(d.value for d in x.shape) + ")"
    splits = [f"{d.value}/t" if (d := s.split_dim(x)) else "-" for s in (TP, TP_SP)]
    cells = [f"`{x.name}`", x.saved_by, shape, x.kind.value, *splits, _when(x), x.why]
    return "| " + " | ".join(cells) + " |"


def _when(x: SavedTensor) -> str:
    """Whether the default layer keeps `x`, and which knobs drop or add it (counting every byte)."""
    exact = Accounting(exact=True)
    default = x in layer_tensors(Knobs(), exact)
    knob_sets = dict.fromkeys(v.knobs for v in VARIANTS if v.knobs != Knobs())
    flips = [f"`{_flags(k)}`" for k in knob_sets if (x in layer_tensors(k, exact)) != default]
    status = "default" if default else f"added by {', '.join(flips)}"
    if not x.paper:
        status += " (with `--exact`)"
    if default and flips:
        status += f"; dropped by {', '.join(flips)}"
    return status


def _default_formulas() -> str:
    formulas = [F.layer_formula(s, Knobs(), Accounting()) for s in STRATEGIES.values()]
    rows = list(_terms_by_tensor(Knobs(), Accounting()).items())
    return "\n".join([
        "## Formulas of the default layer",
        "",
        "Bytes per GPU for one layer: the seed's model (GELU MLP of width 4h, multi-head eager attention,"
        " LayerNorm, dropout, no recomputation, 16-bit activations), the paper's accounting.",
        "",
        _totals(formulas),
        "",
        "Each tensor's term:",
        "",
        _terms_table(rows),
        "",
        _terms_latex(rows),
    ])


def _variant(v: Variant) -> str:
    """A knob's formulas and the terms it adds, removes or changes against the default layer."""
    formulas = [F.layer_formula(s, v.knobs, v.accounting) for s in STRATEGIES.values()]
    old, new = _terms_by_tensor(Knobs(), Accounting()), _terms_by_tensor(v.knobs, v.accounting)
    added_or_changed = [(x, exprs) for x, exprs in new.items() if old.get(x) != exprs]
    removed = [(x, exprs) for x, exprs in old.items() if x not in new]
    parts = [f"## Variant `{v.flags}`", "", v.meaning, "", _totals(formulas)]
    if added_or_changed:
        table, latex = _terms_table(added_or_changed), _terms_latex(added_or_changed)
        parts += ["", "Terms it adds or changes:", "", table, "", latex]
    if removed:
        parts += ["", "Terms it removes:", "", _terms_table(removed)]
    return "\n".join(parts)


def _terms_by_tensor(knobs: Knobs, accounting: Accounting) -> dict[SavedTensor, list]:
    """Each tensor's term under every strategy, in the ledger's order."""
    formulas = [F.layer_formula(s, knobs, accounting) for s in STRATEGIES.values()]
    return {terms[0][0]: [e for _, e in terms] for terms in zip(*(lf.terms for lf in formulas))}


def _terms_table(rows: list[tuple[SavedTensor, list]]) -> str:
    """A markdown table: a row per tensor, a column per strategy, each cell that tensor's term."""
    lines = [f"| tensor | {' | '.join(STRATEGIES)} |", "|---" * (len(STRATEGIES) + 1) + "|"]
    lines += [f"| `{x.name}` | " + " | ".join(f"`{F.to_text(e)}`" for e in exprs) + " |" for x, exprs in rows]
    return "\n".join(lines)


def _totals(formulas: list[F.LayerFormula]) -> str:
    """The per-layer formula of each strategy, as text and as one LaTeX block."""
    text = "\n".join(f"| `{lf.strategy.name}` | `{F.to_text(lf.total)}` |" for lf in formulas)
    latex = " \\\\\n".join(f"\\text{{{lf.strategy.name}}} &= {F.to_latex(lf.total)}" for lf in formulas)
    table = f"| strategy | bytes per GPU per layer |\n|---|---|\n{text}"
    return f"{table}\n\n$$\n\\begin{{aligned}}\n{latex}\n\\end{{aligned}}\n$$"


def _terms_latex(rows: list[tuple[SavedTensor, list]]) -> str:
    """One LaTeX array: a row per tensor, a column per strategy, each cell that tensor's term."""
    head = " & ".join(["", *(f"\\text{{{name}}}" for name in STRATEGIES)])
    body = " \\\\\n".join(
        " & ".join([f"\\text{{{x.name}}}".replace("_", "\\_"), *(F.to_latex(e) for e in exprs)]) for x, exprs in rows
    )
    return f"$$\n\\begin{{array}}{{l{'l' * len(STRATEGIES)}}}\n{head} \\\\\n{body}\n\\end{{array}}\n$$"


def main(argv: list[str] | None = None) -> None:
    """Print the reference, or with --write update docs/model.md."""
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args == ["--write"]:
        DOCS.parent.mkdir(exist_ok=True)
        DOCS.write_text(text)
        print(f"wrote {DOCS}")
    elif not args:
        sys.stdout.write(text)
    else:
        sys.exit("usage: python -m memcalc.docgen [--write]")


if __name__ == "__main__":
    main()
