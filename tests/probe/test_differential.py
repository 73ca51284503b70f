"""Differential: at drawn shapes and knobs, each library's own layer keeps exactly what the ledger predicts.

For every implementation (and every transformers family memcalc reads that the probe builds), hypothesis draws a
layout the library runs, a tensor-parallel size t in {1, 2, 4}, shapes that include b = 1, s not a multiple of
4 and s <= 16, odd head counts per rank and every GQA ratio t allows, and the knob values and recomputations the
library takes. The library's layer runs as rank 0 of t (torch's fake group, `memcalc.probe.launch`) and its saved
tensors are held up against `estimate --exact --device cpu`, name by name, to the byte.

The default run draws a few examples per subject (seeded: the same ones every time, about a minute in all);
`pytest -m slow tests/probe/test_differential.py` draws many more, from a fresh seed each run. hypothesis keeps no
database (`database=None`).

A subject is one line of `SUBJECTS`: adding an implementation is adding a line.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model.impls import IMPLEMENTATIONS
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES
from .libs import assert_exact

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = Accounting(exact=True, device="cpu")
DROPOUT = st.sampled_from((0.0, 0.1))
DTYPES = st.sampled_from(("bf16", "bf16", "fp32"))  # bf16 twice: the dtype models are trained in
LLAMA = {"norm": "rmsnorm", "mlp": "swiglu"}
# Small latent attention (DeepSeek's shape): latents r_q, r_kv; heads d_nope + d_rope, values d_v.
MLA = {"kv_lora_rank": 12, "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 6, "v_head_dim": 5}


@dataclass(frozen=True)
class Subject:
    """One implementation, or one transformers family, as the differential test draws it."""

    name: str
    module: str  # the library it runs: skipped where not installed
    fields: dict[str, Any]  # fixed config fields (impl, the family's architecture)
    knobs: st.SearchStrategy[dict[str, Any]]  # drawn knob values
    family: str | None = None  # transformers' family, whose decoder layer `hf.run_layer` builds
    gqa: bool = True  # whether num_query_groups may be fewer than a
    moe: bool = False  # routed experts: forced to the balanced route, so each expert's tokens are known
    extra: dict[str, Any] = field(default_factory=dict)  # other fixed fields (latent widths)
    align: int = 1  # widths (head, expert) a multiple of this: torch._grouped_mm wants 16-byte strides


def _knobs(**choices: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(choices)


_MEGATRON = _knobs(
    norm=st.sampled_from(("layernorm", "rmsnorm")), mlp=st.sampled_from(("gelu", "gelu_tanh", "swiglu")),
    dropout=DROPOUT, dtype=DTYPES, recompute=st.sampled_from(("none", "selective", "full")),
    bias_activation_fusion=st.booleans(), qk_layernorm=st.booleans(), add_bias_linear=st.booleans(),
)
_MEGATRON_MLA = _knobs(norm=st.sampled_from(("layernorm", "rmsnorm")), mlp=st.sampled_from(("gelu", "swiglu")),
                      dropout=DROPOUT, dtype=DTYPES, q_lora_rank=st.sampled_from((None, 8)),
                      recompute=st.sampled_from(("none", "selective")))
# megatron-core refuses top-1 softmax routing without moe_router_pre_softmax (TransformerConfig; memcalc does not
# refuse it yet: docs/limitations.md)
MEGATRON_ROUTER = st.sampled_from(({"moe_router_topk": 1, "moe_router_pre_softmax": True}, {"moe_router_topk": 2},
                                   {"moe_router_topk": 3, "moe_router_pre_softmax": True}))


def routed(knobs: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """`knobs` with one of the routers megatron-core builds (`MEGATRON_ROUTER`)."""
    return st.tuples(knobs, MEGATRON_ROUTER).map(lambda pair: pair[0] | pair[1])


_MEGATRON_MOE = routed(_knobs(dtype=DTYPES, moe_token_dispatcher_type=st.sampled_from(("alltoall", "allgather")),
                              bias_activation_fusion=st.booleans()))
_TORCHTITAN = _knobs(dtype=DTYPES, recompute=st.sampled_from(("none", "op", "full")))
_TORCHTITAN_MOE = _knobs(dtype=DTYPES, moe_router_topk=st.sampled_from((1, 2)),
                         recompute=st.sampled_from(("none", "op", "full")),
                         moe_shared_expert_intermediate_size=st.sampled_from((None, 16)))
# torchtitan's Qwen3 (qk_layernorm): heads of h/a or of an even kv_channels of their own (its RoPE rotates pairs)
_TORCHTITAN_QWEN3 = _knobs(dtype=DTYPES, recompute=st.sampled_from(("none", "op", "full")),
                           kv_channels=st.sampled_from((None, 4, 10)))
_TORCHTITAN_QWEN3_MOE = _knobs(dtype=DTYPES, moe_router_topk=st.sampled_from((1, 2)),
                               recompute=st.sampled_from(("none", "op", "full")),
                               kv_channels=st.sampled_from((None, 4, 10)))
# torchtitan's DeepSeek-V3 block: bf16 (fp32 is refused), with or without a query latent; values as wide as the
# heads (d_v = d_n + d_r: the CPU stand-in's flash kernel)
_TORCHTITAN_MLA = _knobs(q_lora_rank=st.sampled_from((None, 8)), recompute=st.sampled_from(("none", "op", "full")))
TORCHTITAN_MLA = MLA | {"v_head_dim": 10}
_HF_LLAMA = _knobs(attention=st.sampled_from(("eager", "flash")), dropout=DROPOUT, dtype=DTYPES,
                   recompute=st.sampled_from(("none", "full")))
_HF_GPT2 = _knobs(attention=st.sampled_from(("eager", "flash")), dropout=DROPOUT, dtype=DTYPES,
                  recompute=st.sampled_from(("none", "full")), mlp=st.sampled_from(("gelu", "gelu_tanh")))
_HF_EAGER = _knobs(dropout=DROPOUT, dtype=DTYPES, recompute=st.sampled_from(("none", "full")))
_HF_FALCON = _knobs(dtype=DTYPES, recompute=st.sampled_from(("none", "full")), mlp=st.sampled_from(("gelu", "gelu_tanh")))
_HF_FALCON_NEW = _knobs(attention=st.sampled_from(("eager", "flash")), dtype=DTYPES,
                        recompute=st.sampled_from(("none", "full")), mlp=st.sampled_from(("gelu", "gelu_tanh")),
                        single_norm=st.booleans())
_HF_MOE = _knobs(attention=st.sampled_from(("eager", "flash")), dtype=DTYPES, recompute=st.sampled_from(("none", "full")),
                 moe_router_topk=st.sampled_from((1, 2)))
_HF_GEMMA2 = _knobs(dropout=DROPOUT, dtype=DTYPES, recompute=st.sampled_from(("none", "full")),
                    attn_logit_softcapping=st.sampled_from((None, 50.0)), sliding_window=st.sampled_from((None, 3, 8)))
_HF_GEMMA3 = _knobs(attention=st.sampled_from(("eager", "flash")), dropout=DROPOUT, dtype=DTYPES,
                    recompute=st.sampled_from(("none", "full")), attn_logit_softcapping=st.sampled_from((None, 50.0)),
                    sliding_window=st.sampled_from((None, 3, 8)))
# GPTNeoXLayer: its share of each head rotated on an even number of channels (align 2: d in 4, 8, 12)
_HF_GPT_NEOX = _knobs(attention=st.sampled_from(("eager", "flash")), dropout=DROPOUT, dtype=DTYPES,
                      recompute=st.sampled_from(("none", "full")), mlp=st.sampled_from(("gelu", "gelu_tanh")),
                      rotary_percent=st.sampled_from((0.5, 1.0)), parallel_residual=st.booleans())
_HF_MISTRAL_WINDOW = _knobs(dropout=DROPOUT, dtype=DTYPES, recompute=st.sampled_from(("none", "full")),
                            sliding_window=st.sampled_from((3, 8, 40)))
_HF_DEEPSEEK_MOE = _knobs(dtype=DTYPES, recompute=st.sampled_from(("none", "full")),
                          moe_router_topk=st.sampled_from((1, 2)),
                          moe_shared_expert_intermediate_size=st.sampled_from((None, 16)))
_HF_GPT_OSS = _knobs(dropout=DROPOUT, dtype=DTYPES, recompute=st.sampled_from(("none", "full")),
                     moe_router_topk=st.sampled_from((1, 2)),
                     experts_implementation=st.sampled_from(("grouped_mm", "eager")),
                     sliding_window=st.sampled_from((None, 4, 9)))

SUBJECTS = (
    Subject("megatron", "megatron.core", {"impl": "megatron"}, _MEGATRON),
    Subject("megatron latent attention", "megatron.core", {"impl": "megatron"}, _MEGATRON_MLA, gqa=False, extra=MLA),
    Subject("megatron moe", "megatron.core", {"impl": "megatron", "norm": "rmsnorm", "mlp": "swiglu", "dropout": 0.0,
                                              "num_experts": 4, "add_bias_linear": False}, _MEGATRON_MOE, moe=True),
    Subject("torchtitan", "torchtitan", {"impl": "torchtitan"}, _TORCHTITAN),
    Subject("torchtitan moe", "torchtitan", {"impl": "torchtitan", "num_experts": 4},
            _TORCHTITAN_MOE, moe=True, align=8),
    Subject("torchtitan latent attention", "torchtitan", {"impl": "torchtitan"}, _TORCHTITAN_MLA, gqa=False,
            extra=TORCHTITAN_MLA),
    Subject("torchtitan qwen3", "torchtitan", {"impl": "torchtitan", "qk_layernorm": True}, _TORCHTITAN_QWEN3),
    Subject("torchtitan qwen3 moe", "torchtitan", {"impl": "torchtitan", "qk_layernorm": True, "num_experts": 4},
            _TORCHTITAN_QWEN3_MOE, moe=True, align=8),
    Subject("hf llama", "transformers", {"impl": "hf"} | LLAMA, _HF_LLAMA, family="llama"),
    Subject("hf mistral", "transformers", {"impl": "hf"} | LLAMA, _HF_LLAMA, family="mistral"),
    Subject("hf qwen2", "transformers", {"impl": "hf", "add_qkv_bias": True} | LLAMA, _HF_LLAMA, family="qwen2"),
    Subject("hf qwen3", "transformers", {"impl": "hf", "qk_layernorm": True} | LLAMA, _HF_LLAMA, family="qwen3"),
    Subject("hf gemma", "transformers", {"impl": "hf", "norm": "rmsnorm_1p", "mlp": "geglu_tanh"}, _HF_LLAMA,
            family="gemma"),
    Subject("hf olmo", "transformers", {"impl": "hf", "norm": "layernorm_np", "mlp": "swiglu"}, _HF_LLAMA,
            family="olmo"),
    Subject("hf gpt2", "transformers", {"impl": "hf", "norm": "layernorm"}, _HF_GPT2, family="gpt2", gqa=False),
    Subject("hf mistral (sliding_window)", "transformers", {"impl": "hf", "attention": "eager"} | LLAMA,
            _HF_MISTRAL_WINDOW, family="mistral"),
    Subject("hf gemma2", "transformers", {"impl": "hf", "norm": "rmsnorm_1p", "mlp": "geglu_tanh", "attention": "eager",
                                          "sandwich_norm": True}, _HF_GEMMA2, family="gemma2"),
    Subject("hf gemma3_text", "transformers", {"impl": "hf", "norm": "rmsnorm_1p", "mlp": "geglu_tanh",
                                               "sandwich_norm": True, "qk_layernorm": True}, _HF_GEMMA3,
            family="gemma3_text"),
    Subject("hf phi3", "transformers", {"impl": "hf", "fused_qkv": True, "attention": "eager"} | LLAMA, _HF_EAGER,
            family="phi3"),
    Subject("hf olmo2", "transformers", {"impl": "hf", "norm": "rmsnorm_fp32w", "mlp": "swiglu", "post_norm": True,
                                         "qk_layernorm": True}, _HF_LLAMA, family="olmo2"),
    Subject("hf glm", "transformers", {"impl": "hf", "rotary_percent": 0.5} | LLAMA, _HF_LLAMA, family="glm"),
    Subject("hf glm4", "transformers", {"impl": "hf", "rotary_percent": 0.5, "sandwich_norm": True} | LLAMA, _HF_LLAMA,
            family="glm4"),
    Subject("hf falcon (multi-head)", "transformers", {"impl": "hf", "norm": "layernorm", "parallel_residual": True,
                                                       "single_norm": True, "attention": "eager", "dropout": 0.0},
            _HF_FALCON, family="falcon", gqa=False),
    Subject("hf falcon (new_decoder_architecture)", "transformers",
            {"impl": "hf", "norm": "layernorm", "parallel_residual": True, "fused_qkv": True, "dropout": 0.0},
            _HF_FALCON_NEW, family="falcon"),
    Subject("hf starcoder2", "transformers", {"impl": "hf", "norm": "layernorm", "rotary_percent": 1.0}, _HF_GPT2,
            family="starcoder2"),
    Subject("hf gpt_neox", "transformers", {"impl": "hf", "norm": "layernorm", "fused_qkv": True,
                                            "add_bias_linear": True}, _HF_GPT_NEOX, family="gpt_neox", gqa=False,
            align=2),
    # BloomMLP is 4h wide (ffn_hidden_size None); BloomAttention has no sdpa path
    Subject("hf bloom", "transformers", {"impl": "hf", "norm": "layernorm", "alibi": True, "mlp": "gelu_tanh",
                                         "attention": "eager", "position_embedding_type": "alibi",
                                         "add_bias_linear": True, "ffn_hidden_size": None}, _HF_EAGER, family="bloom",
            gqa=False),
    Subject("hf gptj", "transformers", {"impl": "hf", "norm": "layernorm", "rotary_percent": 0.5,
                                        "parallel_residual": True, "single_norm": True}, _HF_GPT2, family="gptj",
            gqa=False),
    Subject("hf cohere", "transformers", {"impl": "hf", "norm": "layernorm_nb", "mlp": "swiglu",
                                          "parallel_residual": True, "single_norm": True}, _HF_LLAMA, family="cohere"),
    Subject("hf cohere (use_qk_norm)", "transformers", {"impl": "hf", "norm": "layernorm_nb", "mlp": "swiglu",
                                                        "parallel_residual": True, "single_norm": True,
                                                        "qk_layernorm": True}, _HF_LLAMA, family="cohere"),
    Subject("hf deepseek_v3 (latent attention, dense)", "transformers", {"impl": "hf", "attention": "eager"} | LLAMA,
            _HF_EAGER, family="deepseek_v3", extra=MLA),
    Subject("hf deepseek_v3 (DeepseekV3MoE)", "transformers", {"impl": "hf", "attention": "eager", "dropout": 0.0,
                                                              "num_experts": 4, "moe_router_score_function": "sigmoid"}
            | LLAMA, _HF_DEEPSEEK_MOE, family="deepseek_v3", extra=MLA, gqa=False, moe=True, align=8),
    Subject("hf mixtral", "transformers", {"impl": "hf", "dropout": 0.0, "num_experts": 4} | LLAMA, _HF_MOE,
            family="mixtral", moe=True, align=8),
    Subject("hf mixtral (eager loop)", "transformers", {"impl": "hf", "dropout": 0.0, "num_experts": 4,
                                                        "experts_implementation": "eager"} | LLAMA, _HF_MOE,
            family="mixtral", moe=True, align=8),
    Subject("hf qwen2_moe", "transformers", {"impl": "hf", "dropout": 0.0, "num_experts": 4,
                                             "moe_shared_expert_intermediate_size": 8} | LLAMA, _HF_MOE,
            family="qwen2_moe", moe=True, align=8),
    Subject("hf qwen3_moe", "transformers", {"impl": "hf", "dropout": 0.0, "num_experts": 4, "qk_layernorm": True}
            | LLAMA, _HF_MOE, family="qwen3_moe", moe=True, align=8),
    Subject("hf gpt_oss", "transformers", {"impl": "hf", "norm": "rmsnorm_fp32w", "mlp": "swiglu_clamped",
                                           "attention_sinks": True, "attention": "eager", "num_experts": 4}, _HF_GPT_OSS, family="gpt_oss", moe=True, align=8),
)


@st.composite
def cases(draw: st.DrawFn, subject: Subject) -> tuple[Any, str]:
    """A config the subject's library runs, and one of the layouts it runs it under."""
    knobs = subject.fields | subject.extra | ({"family": subject.family} if subject.family else {}) | draw(subject.knobs)
    t = draw(st.sampled_from((1, 2, 4)))
    per_rank = draw(st.sampled_from((1, 2, 3, 5)))  # heads per rank, odd ones included
    a = t * per_rank
    groups = t * draw(st.sampled_from([g for g in range(1, per_rank + 1) if per_rank % g == 0])) if subject.gqa else None
    d = subject.align * draw(st.sampled_from((2, 4, 6)))  # RoPE wants an even head width
    b = draw(st.sampled_from((1, 1, 2, 3)))
    layouts = _layouts(knobs, t)
    assume(layouts)
    strategy = draw(st.sampled_from(layouts))
    sp = STRATEGIES[strategy].sequence_parallel
    s = t * draw(st.integers(1, 6)) if sp else draw(st.integers(1, 24))
    if subject.moe:  # the balanced route gives every expert k*b*s/E tokens: E must divide them
        assume(knobs["moe_router_topk"] * b * s % knobs["num_experts"] == 0)
        knobs |= {"moe_ffn_hidden_size": t * subject.align * draw(st.integers(1, 3))}
    # a width the subject fixes (BLOOM's 4h) is kept
    fields = {"ffn_hidden_size": t * draw(st.integers(1, 6))} | knobs | {"b": b, "s": s, "a": a, "h": a * d,
                                                                        "num_query_groups": groups, "t": t}
    try:
        config = build_config(fields)
        IMPLEMENTATIONS[config.impl].check(config)
    except ConfigError:
        assume(False)  # refused input is a one-line error, not a number: nothing to compare
    return config, strategy


def _layouts(knobs: dict[str, Any], t: int) -> list[str]:
    """The layouts the implementation runs for these knobs at this t (t = 1: no parallelism only)."""
    if t == 1:
        return ["none"]
    try:
        runs = IMPLEMENTATIONS[knobs["impl"]].runs(build_config(knobs | {"t": t, "a": t, "h": 4 * t, "s": 2 * t}))
    except ConfigError:
        return []
    return [name for name in runs if name != "none"]


def _saved(tp: Any, config: Any, strategy: str, subject: Subject) -> Any:
    """Rank 0's saved storages from the library's own layer (MoE: the balanced route)."""
    from memcalc.probe.measure import runner

    if subject.family is not None:
        from memcalc.probe.libs import hf

        return hf.run_layer(tp, config, STRATEGIES[strategy], route="balanced" if subject.moe else None)
    route = {"route": "balanced"} if subject.moe else {}
    return runner(config.impl).run_layer(tp, config, STRATEGIES[strategy], **route)


def check_against_the_ledger(subject: Subject, config: Any, strategy: str) -> None:
    """The library's layer, run as rank 0 of t, keeps to the byte what `estimate --exact --device cpu` says."""
    from memcalc.model.evaluate import estimate
    from memcalc.probe.launch import run
    from memcalc.probe.measure import compare

    t = config.t if STRATEGIES[strategy].tensor_parallel else 1
    (saved,) = run(_saved, (config, strategy, subject), mode="single" if t == 1 else "fake", t=t)
    assert_exact(compare(estimate(config, STRATEGIES[strategy], CPU), saved))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _drawn(subject: Subject, examples: int, derandomize: bool) -> Any:
    """A hypothesis test of `subject` over `examples` drawn cases; the default (derandomized) run reports the first
    failing case as drawn, without shrinking it, to stay within its time."""
    phases = [Phase.generate] if derandomize else [Phase.generate, Phase.shrink]
    @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize, print_blob=True,
              phases=phases, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
    @given(cases(subject))
    def drawn(case: tuple[Any, str]) -> None:
        check_against_the_ledger(subject, *case)

    return drawn


PER_SUBJECT = 4  # the default run: seeded, a few per subject, about a minute in all
SLOW_PER_SUBJECT = 60


@pytest.fixture
def library(request: pytest.FixtureRequest) -> Subject:
    subject = request.param
    pytest.importorskip("torch")
    if not _installed(subject.module):
        pytest.skip(f"{subject.module} is not installed")
    return subject


@pytest.mark.parametrize("library", SUBJECTS, ids=[s.name for s in SUBJECTS], indirect=True)
def test_the_library_keeps_what_the_ledger_predicts_at_drawn_shapes(library):
    _drawn(library, PER_SUBJECT, derandomize=True)()


@pytest.mark.slow
@pytest.mark.parametrize("library", SUBJECTS, ids=[s.name for s in SUBJECTS], indirect=True)
def test_the_library_keeps_what_the_ledger_predicts_at_many_drawn_shapes(library, request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("many examples: select with -m slow")
    _drawn(library, SLOW_PER_SUBJECT, derandomize=False)()
