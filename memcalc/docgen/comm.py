"""docs/comm.md: what tensor parallelism sends and what overlapping it costs, rendered from `memcalc.model.comm`
and `memcalc.model.overlap` into docs/templates/comm.md.
"""

from __future__ import annotations

from typing import Iterable

from memcalc.config.gpus import GPUS
from memcalc.docgen.template import DOCS_DIR, filled, heading, md_table
from memcalc.units import human_bytes
from memcalc.model import overlap
from memcalc.model.comm import Collective, block_docs, formula, layer_collectives
from memcalc.model.knobs import Knobs
from memcalc.model.strategy import STRATEGIES

DOCS = DOCS_DIR / "comm.md"

# The MoE layer the docs show: shared experts and the aux loss on, so that every collective appears once.
_MOE = Knobs(num_experts=8, moe_router_topk=2, moe_shared_expert_intermediate_size=64, moe_aux_loss=True)
# The latent attention the docs show: DeepSeek-V3's, with a query latent.
_MLA = Knobs(mlp="swiglu", attention="eager", kv_lora_rank=512, q_lora_rank=1536,
             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def render() -> str:
    gpus = (f"| `{g.name}` | {g.tflops:g} | {g.link_gb_s:g} | {g.memory_bytes:,} ({human_bytes(g.memory_bytes)}) |"
            f" {g.memory_source} |" for g in GPUS.values())
    return heading("Tensor-parallel communication and overlap", "memcalc/model/comm.py and overlap.py") + filled(
        "comm.md",
        # Each strategy's collectives of one layer (Megatron, default knobs); a MoE layer's (megatron-core's
        # all-to-all dispatcher) at ep > 1, under tp-sp and under ep alone.
        collectives=_sections(Knobs(), STRATEGIES, 1, ": {} bytes sent per rank per layer (bf16)"),
        experts=_sections(_MOE, ("tp-sp", "none"), 2, ", ep > 1: {} bytes sent per rank per MoE layer (bf16)"),
        latent=_latent(),
        **{f"{block}_doc": doc for block, doc in block_docs().items()},  # experts_doc, latent_doc, ...
        overlap_doc=(overlap.__doc__ or "").split("\n\n", 1)[1].strip(),
        methods="\n".join(f"| `{m.name}` | `{m.flag}` | {m.kind} | {m.what} |" for m in overlap.METHODS.values()),
        default=", ".join(f"`{m}`" for m in overlap.DEFAULT),
        splits=str(overlap.DEFAULT_SPLITS),
        pairs="\n".join(f"| `{name}` {phase} | `{gemm}` | {', '.join(f'`{x}`' for x in options)} |"
                        for name, phase, _, gemm, options in overlap.PAIRS),
        gpus="\n".join(gpus),
    )


def _sections(knobs: Knobs, names: Iterable[str], ep: int, words: str) -> str:
    """Per strategy: the bytes one rank sends per layer as a formula (`words` say it after the name) and a table of
    the layer's collectives; at ep > 1, with the group each runs over."""
    parts = []
    for name in names:
        rows = layer_collectives(knobs, STRATEGIES[name], ep=ep)
        text, latex = formula(knobs, STRATEGIES[name], 2, ep=ep)
        table = _table(rows, over=ep > 1) if rows else "No tensor-parallel collectives."
        parts.append(f"### `{name}`{words.format(text)}\n\n$$\n{latex}\n$$\n\n{table}")
    return "\n\n".join(parts)


def _table(rows: Iterable[Collective], over: bool = False) -> str:
    """Collectives as a markdown table; `over`: with the group each runs over."""
    group = ("over",) if over else ()
    return md_table(("operator", "collective", *group, "pass", "moves", "why"), (
        [f"`{c.name}`", c.op.value, *((c.group.value,) if over else ()), c.phase, c.moves, c.why] for c in rows
    ))


def _latent() -> str:
    """Latent attention's collectives under tp and tp-sp (its MLP's are a dense layer's)."""
    return "\n\n".join(
        f"### `{name}`\n\n"
        + _table(c for c in layer_collectives(_MLA, STRATEGIES[name]) if c.name.startswith("attention"))
        for name in ("tp", "tp-sp")
    )
