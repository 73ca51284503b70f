"""FSDP2 (`fully_shard`) in the step of transformers' Llama: the sharded states and each block's gather and
reduce-scatter, as ops on the walk's tape (memcalc.sizing.timeline.hf calls them where FSDP2's hooks run).

The layout is accelerate's and torchtitan's: `fully_shard` on every decoder layer, then on the whole model (the
root: embedding, final norm, lm_head), with MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=...), over
dp_shard ranks. What torch 2.13's FSDP2 does, and so what the tape holds:

    steady          each parameter an fp32 DTensor sharded on dim 0 (dim 0 padded up to a multiple of
                    dp_shard); AdamW's m and v, the same shards, and a 0-d fp32 step per parameter; no
                    gradients (zero_grad sets them to None)
    pre-forward     a block's all-gather: this rank's shards cast to bf16, a flat bf16 buffer of the whole
                    block (foreach_all_gather), copied out into each parameter's unsharded bf16 storage
                    (foreach_all_gather_copy_out); the buffer is kept until the next block's copy-out
                    (implicit forward prefetch), the last until the root's forward (with the loss) returns;
                    the root, gathered before the embedding, stays unsharded to the end of backward
    post-forward    reshard_after_forward: the block's unsharded parameters freed
    pre-backward    the block's own gather copied out (again, if resharded), and the next block's all-gather
                    issued at once (implicit backward prefetch): its flat buffer waits for that block's turn
    backward        each weight's bf16 gradient is the unsharded parameter's .grad, kept to the block's end
    post-backward   the block resharded; its gradients cast into a flat reduce_dtype reduce-scatter buffer
                    of the whole block, freed, and this rank's shard (fp32, the parameter's dtype) made; the
                    buffer is kept until the next block's reduce-scatter (FSDP2 waits for it there)

On the fake process group the collectives move nothing, but every buffer is allocated as on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memcalc.config.schema import ModelConfig
from memcalc.model.knobs import DTYPE_BYTES
from memcalc.sizing.timeline.tape import ACTIVATIONS, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES, Tape

ROOT = "root"


def _padded(shape: tuple[int, ...], shards: int) -> int:
    """Elements of one parameter as FSDP2 stores it: dim 0 padded up to a multiple of `shards`."""
    rest = 1
    for n in shape[1:]:
        rest *= n
    return -(-shape[0] // shards) * shards * rest


def layer_shapes(c: ModelConfig, t: int) -> tuple[tuple[int, ...], ...]:
    """LlamaDecoderLayer's parameters as this rank of t holds them before FSDP2 shards them (transformers' tp_plan:
    q, k, v, gate, up colwise, o and down rowwise, the norms whole): q, k, v, o; gate, up, down; the two norms."""
    q, kv, f = c.a * c.head_dim // t, c.groups * c.head_dim // t, c.ffn // t
    return ((q, c.h), (kv, c.h), (kv, c.h), (c.h, q), (f, c.h), (f, c.h), (c.h, f), (c.h,), (c.h,))


def root_shapes(c: ModelConfig, t: int) -> tuple[tuple[int, ...], ...]:
    """The root's own parameters: embed_tokens and lm_head (unless tied) v/t rows each under tp, the final norm."""
    rows = c.vocab_size // t
    return ((rows, c.h), (c.h,), *(((rows, c.h),) if not c.tie_embeddings else ()))


@dataclass(frozen=True)
class Fsdp:
    """One rank of dp_shard: the padded sizes of each block, and the ops FSDP2 runs around it."""

    shards: int
    layers: int
    act: int  # param_dtype's bytes
    reduce: int  # reduce_dtype's bytes
    reshard_after_forward: bool
    layer: tuple[tuple[int, ...], ...]
    root: tuple[tuple[int, ...], ...]
    tp: bool = False  # transformers' tp_plan on the mesh's other dimension

    @classmethod
    def of(cls, config: ModelConfig, t: int = 1) -> Fsdp:
        """FSDP2 over dp_shard ranks of the weights' shards on one rank of t (tp on the mesh's other dimension)."""
        return cls(config.dp_shard or 1, config.L, DTYPE_BYTES[config.dtype], DTYPE_BYTES[config.reduce_dtype],
                   config.reshard_after_forward, layer_shapes(config, t), root_shapes(config, t), t > 1)

    def shapes(self, block: str) -> tuple[tuple[int, ...], ...]:
        return self.root if block == ROOT else self.layer

    def unsharded(self, block: str) -> int:
        """Elements of a block gathered whole (each parameter padded)."""
        return sum(_padded(x, self.shards) for x in self.shapes(block))

    def blocks(self) -> tuple[str, ...]:
        return (*(f"layers.{i}" for i in range(self.layers)), ROOT)

    # -- steady state -------------------------------------------------------------------------------

    def states(self, tape: Tape) -> None:
        """fp32 shards of every parameter, AdamW's m and v of them, and one 0-d step per parameter."""
        shard = sum(self.unsharded(b) for b in self.blocks()) // self.shards
        count = sum(len(self.shapes(b)) for b in self.blocks())
        tape.add("states/weights", PARAMETERS, 4 * shard, f"fp32 DTensor shards (1/{self.shards} of each"
                 " parameter, dim 0 padded): the optimizer's copy itself")
        tape.add("states/adam_m", OPTIMIZER, 4 * shard, "AdamW's first moment of this rank's shards, fp32")
        tape.add("states/adam_v", OPTIMIZER, 4 * shard, "AdamW's second moment of this rank's shards, fp32")
        tape.add("optimizer/step", OPTIMIZER, 4 * count, "AdamW counts steps in a 0-d fp32 tensor per parameter")

    # -- the ops around a block -----------------------------------------------------------------------

    def all_gather(self, tape: Tape, block: str, phase: str, where: str) -> None:
        """foreach_all_gather: this rank's shards cast to param_dtype, then the block's flat buffer of every
        rank's shards; the casts are freed once copied in."""
        whole = self.unsharded(block)
        tape.add(f"fsdp/{block} cast", ACTIVATIONS if phase == "forward" else TEMPORARIES,
                 self.act * whole // self.shards, "this rank's shards cast to param_dtype, the all-gather's input")
        tape.add(f"fsdp/{block} all-gather", PARAMETERS, self.act * whole,
                 "FSDP2's all-gather output: the whole block in param_dtype, one flat buffer")
        tape.mark(phase, where, f"FSDP2's all-gather of {block}: its buffer beside this rank's cast shards")
        tape.drop(f"fsdp/{block} cast")

    def copy_out(self, tape: Tape, block: str, phase: str, where: str) -> None:
        """The gathered buffer copied into each parameter's unsharded storage (wait_for_unshard). In backward the
        buffer is freed at once; in forward FSDP2 keeps it until the next block's copy-out (implicit prefetch),
        the last one until the root's forward returns (`forward_done`)."""
        if f"fsdp/{block} unsharded" in tape.live:
            return
        if f"fsdp/{block} all-gather" not in tape.live:
            self.all_gather(tape, block, phase, where)
        if phase == "forward":
            self.forward_done(tape, keep=block)
        name = f"fsdp/{block} unsharded"
        # FSDP2 frees and regrows the same storages (resize_): gathered first in the step's forward, FSDPMemTracker
        # files them as an op's output (an activation) until FSDP2's pre-forward hook has run, then as the
        # unsharded parameters; gathered again in backward, they are known as such at once
        tape.add(name, ACTIVATIONS if phase == "forward" else PARAMETERS, self.act * self.unsharded(block),
                 "the block's parameters gathered whole, in param_dtype, while it runs")
        tape.mark(phase, where, f"FSDP2 copies the gathered {block} out of its all-gather buffer")
        if phase != "forward":
            tape.drop(f"fsdp/{block} all-gather")
        tape.live[name] = replace(tape.live[name], category=PARAMETERS)

    @staticmethod
    def forward_done(tape: Tape, keep: str | None = None) -> None:
        """Free the all-gather buffers forward kept (all but `keep`'s)."""
        tape.drop(*[n for n in tape.live if n.endswith(" all-gather") and n != f"fsdp/{keep} all-gather"])

    @staticmethod
    def block_of(where: str) -> str:
        """The block a module belongs to: `model.layers.3.mlp.up_proj` is layers.3's; the rest are the root's."""
        parts = where.split(".")
        return f"layers.{parts[2]}" if where.startswith("model.layers.") else ROOT

    def reshard(self, tape: Tape, block: str) -> None:
        tape.drop(f"fsdp/{block} unsharded")

    def post_forward(self, tape: Tape, block: str) -> None:
        """reshard_after_forward frees a layer's unsharded parameters (the root's stay for backward)."""
        if self.reshard_after_forward and block != ROOT:
            self.reshard(tape, block)

    def pre_backward(self, tape: Tape, block: str, where: str, prefetch: str | None) -> None:
        """The block unsharded (copied out if resharded), then the next block's all-gather issued."""
        self.copy_out(tape, block, "backward", where)
        if prefetch is not None and f"fsdp/{prefetch} unsharded" not in tape.live:
            self.all_gather(tape, prefetch, "backward", where)

    def keep_grad(self, tape: Tape, block: str, name: str, nbytes: int) -> None:
        """A weight's bf16 gradient, the unsharded parameter's .grad until the block's reduce-scatter."""
        tape.add(f"fsdp/{block} grad {name}", TEMPORARIES, nbytes, "the unsharded parameter's .grad, kept until"
                 " the block's reduce-scatter (made in backward: a temporary, as MemTracker files it)")

    def embedding_rows(self, tape: Tape, where: str) -> str:
        """Under tp the embedding's gradient is the whole (v, h) table (DTensor gives the Shard(0) weight a
        Replicate gradient): FSDP2 lays it out as the weight (redistribute), this rank's v/t rows, and the table
        goes."""
        whole, rows = f"fsdp/{ROOT} grad model.embed_tokens", f"fsdp/{ROOT} grad model.embed_tokens (rows)"
        embedding = self.root[0]
        tape.add(rows, TEMPORARIES, self.act * embedding[0] * embedding[1], "this rank's rows of the embedding's"
                 " gradient, laid out as its weight (DTensor's redistribute) for the reduce-scatter")
        tape.mark("backward", where, "this rank's rows of the embedding's Replicate gradient")
        tape.drop(whole)
        return rows

    def last_parameter(self, block: str) -> str:
        """The module of a block's last parameter in registration order: a decoder layer's post_attention_layernorm,
        the root's lm_head (tied, the final norm: lm_head's weight is the embedding's, registered once)."""
        if block != ROOT:
            return f"model.{block}.post_attention_layernorm"
        return "lm_head" if len(self.root) == 3 else "model.norm"

    def post_backward(self, tape: Tape, block: str, where: str) -> None:
        """FSDP2's post-backward, as FSDPMemTracker files each step: the block's gradients (the unsharded parameters'
        .grad) become its gradients; the block resharded; foreach_reduce's flat reduce_dtype input made (a
        temporary until the reduce-scatter runs on it) and the gradients copied in and freed, but for the last
        parameter's, which foreach_reduce's loop variable keeps until it returns; this rank's output shard made
        (fp32, the sharded gradients); the previous block's input, waited on, freed."""
        grads = [n for n in tape.live if n.startswith(f"fsdp/{block} grad ")]
        for name in grads:
            tape.live[name] = replace(tape.live[name], category=GRADIENTS)
        if block == ROOT and self.tp:
            grads.append(self.embedding_rows(tape, where))
        self.reshard(tape, block)
        for name in [n for n in tape.live if n.startswith("fsdp/") and n.endswith(" reduce-scatter")]:
            tape.drop(name)  # the previous block's, waited on now
        whole = self.unsharded(block)
        rs = f"fsdp/{block} reduce-scatter"
        tape.add(rs, TEMPORARIES, self.reduce * whole,
                 "FSDP2's reduce-scatter input: the block's gradients in reduce_dtype, one flat buffer")
        tape.mark("backward", where, f"FSDP2's reduce-scatter buffer for {block}'s gradients")
        last = f"fsdp/{block} grad {self.last_parameter(block)}"
        tape.drop(*(n for n in grads if n != last))
        out = f"fsdp/{block} sharded grads"
        tape.add(out, TEMPORARIES, self.reduce * whole // self.shards,
                 "this rank's shard of the block's gradients, in reduce_dtype")
        tape.mark("backward", where, f"{block}'s gradients copied in and freed, the reduce-scatter's output made")
        tape.live[rs] = replace(tape.live[rs], category=GRADIENTS)  # filed as the reduce-scatter's input
        tape.mark("backward", where, f"the reduce-scatter of {block}'s gradients")
        if self.reduce != 4:  # cast to the fp32 parameters' dtype; the reduce_dtype output goes
            tape.add(f"{out} (fp32)", TEMPORARIES, 4 * whole // self.shards, "the shard cast to the parameters' fp32")
            tape.mark("backward", where, f"{block}'s gradient shard cast to fp32")
            tape.drop(out)
            tape.rename(f"{out} (fp32)", out)
        tape.drop(last)
        tape.live[out] = replace(tape.live[out], category=GRADIENTS)
