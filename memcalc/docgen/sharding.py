"""docs/sharding.md: data-parallel sharding as each stack runs it, rendered from `memcalc.sizing.states`, the
config schema and `memcalc.sizing.timeline.fsdp`'s and `zero`'s descriptions into docs/templates/sharding.md.
"""

from __future__ import annotations

import re

from memcalc.config.schema import SHARDING_REFUSALS, build_config, field_help
from memcalc.docgen.template import DOCS_DIR, filled, heading
from memcalc.sizing import states
from memcalc.sizing.timeline import fsdp, zero

DOCS = DOCS_DIR / "sharding.md"

FIELDS = ("dp_shard", "dp_replicate", "reshard_after_forward", "reduce_dtype", "zero_stage", "distributed_optimizer")

# (layout, the fields that choose it, in words): every row of the states table, each evaluated on a config.
LAYOUTS = (
    ("Megatron-LM, distributed optimizer", {"distributed_optimizer": True}),
    ("FSDP2 (torchtitan; transformers' Trainer with accelerate)", {"impl": "hf", "dp_shard": 8}),
    *((f"DeepSpeed ZeRO-{stage} (transformers' Trainer)", {"impl": "hf", "zero_stage": stage}) for stage in range(4)),
)
_SIZES = {"s": 8, "h": 8, "a": 1, "dp": 8}
_AUTO_WORDS = {"reduce_bucket_size": "h*h elements", "stage3_prefetch_bucket_size": "0.9*h*h",
               "stage3_param_persistence_threshold": "10*h"}


def render() -> str:
    sources = "memcalc/sizing/states.py, the config schema and memcalc/sizing/timeline/fsdp.py and zero.py"
    return heading("Data-parallel sharding: FSDP2, HSDP and ZeRO", sources) + filled(
        "sharding.md",
        fields="\n".join(f"| `{name}` | `--{name.replace('_', '-')}` | {field_help(name)} |" for name in FIELDS),
        states=_states(),
        refusals="\n".join(f"- {why.format(c=_Example(), own='...')}" for _, why in SHARDING_REFUSALS),
        fsdp=(fsdp.__doc__ or "").strip(),
        auto=", ".join(f"`{key}` {_AUTO_WORDS[key]}" for key in zero.DEEPSPEED_AUTO),
        zero=(zero.__doc__ or "").strip(),
        examples=_examples(),
    )


def _states() -> str:
    """The states table's rows: each layout's model states, bytes a parameter."""
    rows = []
    for title, fields in LAYOUTS:
        config = build_config(_SIZES | fields)
        for term in states.STATE_LAYOUTS[states.sharding(config)]:
            width = term.width(config)
            if width:
                split = term.split.ranks(config)
                over = term.split.over if split > 1 else "none"
                rows.append(f"| {title} | `{term.name}` | {width} | {over} | {term.why} |")
    return "\n".join(rows)


# What fits, in one command each (their outputs are pasted by scripts/refresh_guide.py; tests/test_doc_examples.py
# runs them).
EXAMPLES = (
    ("The largest micro-batch of Llama 3 70B (transformers' model, s = 2048) that fits on 64 H100s with FSDP2 over"
     " 8 ranks and TP 8 (transformers' tp_plan), by the step's peak (`--solve dp_shard` finds the smallest FSDP2"
     " shard group instead, HSDP replicating the rest):",
     "memcalc fit --config llama3-70b --impl hf --s 2048 --gpus 64 --gpu h100-80gb --t 8 --dp-shard 8 \\\n"
     "    --strategy tp --recompute none --solve b"),
)


def _examples() -> str:
    """Each example with the output pasted on the page now (the generator keeps it; refresh_guide.py renews it)."""
    page = DOCS.read_text() if DOCS.exists() else ""
    blocks = []
    for words, command in EXAMPLES:
        pasted = re.search(r"```text\n\$ " + re.escape(command) + r"\n(.*?)```", page, flags=re.S)
        blocks += [words, "", "```text", f"$ {command}", *([pasted.group(1).rstrip("\n")] if pasted else []), "```", ""]
    return "\n".join(["## What fits", "", *blocks]).rstrip("\n")


class _Example:
    """Placeholder values for a refusal's wording."""

    def __getattr__(self, name: str) -> str:
        return f"<{name}>"
