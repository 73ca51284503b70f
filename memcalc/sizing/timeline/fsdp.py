"""FSDP2 (`fully_shard`) in the step of transformers' Llama and torchtitan's Llama3: the sharded states and each
unit's gather and reduce-scatter, as ops on the walk's tape (memcalc.sizing.timeline.hf and .torchtitan call them
where FSDP2's hooks run).

A layout is data: a list of units, each one `fully_shard` call with its parameters (module, shape, in registration
order) and its reshard_after_forward. accelerate's (`Fsdp.of`): every decoder layer, then the whole model (the root:
embedding, final norm, lm_head, unsharded from its forward to the end of backward). torchtitan's (`Fsdp.torchtitan`,
its apply_fsdp_to_decoder): tok_embeddings, every block (a MoE one with its experts: one unit at ep = 1), then norm
and lm_head as one unit never resharded after forward, the model's own call holding nothing; its trainer zeroes the
sharded gradients in place (zero_grad(set_to_none=False)), so they live between steps and each reduce-scatter's shard
is added into them. At ep > 1
(experts over the FSDP2 ranks) a MoE block's fully_shard makes two parameter groups, each gathered and reduced on its
own (`block_groups`), and torchtitan prefetches each unit's all-gathers explicitly (`prefetch`). Both
with MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=...), over dp_shard ranks. What torch 2.13's FSDP2 does,
and so what the tape holds:

    steady          each parameter an fp32 DTensor sharded on dim 0 (dim 0 padded up to a multiple of
                    dp_shard); AdamW's m and v, the same shards, and a 0-d fp32 step per parameter; no
                    gradients (zero_grad sets them to None), or under torchtitan their fp32 shards
    pre-forward     a unit's all-gather: this rank's shards cast to bf16 (in fp32 not cast), a flat buffer of
                    the whole unit in param_dtype (foreach_all_gather), copied out into each parameter's
                    unsharded storage (foreach_all_gather_copy_out; a Shard(1) parameter's rank by rank into
                    a temporary, then chunk-cat into its own); the buffer is kept until the next unit's copy-out
                    (implicit forward prefetch), the last until the root's forward returns
    post-forward    reshard_after_forward: the unit's unsharded parameters freed
    pre-backward    the unit's own gather copied out (again, if resharded), and the next unit's all-gather
                    issued at once (implicit backward prefetch): its flat buffer waits for that unit's turn
    backward        each weight's bf16 gradient is the unsharded parameter's .grad, kept to the unit's end
    post-backward   under tp each Partial gradient (a sequence-parallel norm's) all-reduced over t into a
                    copy, the Partial one freed; the unit resharded; each Shard(1) gradient copied, laid out on
                    dim 0; the gradients it has cast into a flat reduce_dtype reduce-scatter buffer, freed, and
                    this rank's shard (fp32, the parameter's dtype) made; the buffer is kept until the next
                    reduce-scatter (FSDP2 waits for it there). Under HSDP (dp_replicate)
                    the output is all-reduced across replicas in place, and the unit holds it, in
                    reduce_dtype before any cast to fp32 (AllReduceState), until its next post-backward or
                    the end of backward. A unit of several modules
                    (torchtitan's norm and lm_head) runs it once per module whose input gradient is ready,
                    each time for the gradients there are, and is gathered again in between

On the fake process group the collectives move nothing, but every buffer is allocated as on a GPU.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from memcalc.config.schema import ModelConfig
from memcalc.model.impls.torchtitan import efsdp, expert_dim1
from memcalc.model.knobs import DTYPE_BYTES
from memcalc.sizing.params import EXPERTS, Param, hf_layer_params, part, torchtitan_layer_params
from memcalc.sizing.pipeline import Stage, stage_rank
from memcalc.sizing.timeline.tape import ACTIVATIONS, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES, Tape, prod

ROOT = "root"
OUTPUT = "norm+lm_head"  # torchtitan's last unit
EXPERT_GROUP = " experts"  # a block's routed experts' parameter group at ep > 1, named after the block's


def _padded(shape: tuple[int, ...], shards: int, dim1: bool = False) -> int:
    """Elements of one parameter as FSDP2 stores it: dim 0 padded up to a multiple of `shards` (sharded on dim 1,
    which FSDP2 requires even, none)."""
    return prod(shape) if dim1 else -(-shape[0] // shards) * shards * prod(shape[1:])


@dataclass(frozen=True)
class Unit:
    """One `fully_shard` call: its parameters in registration order (their modules and shapes) and whether forward
    frees them again (reshard_after_forward; the hf root's stay unsharded to the end of backward)."""

    name: str
    params: tuple[Param, ...]
    reshard_after_forward: bool


def hf_layer(c: ModelConfig, t: int, i: int) -> Unit:
    """Decoder layer i's parameters (memcalc.sizing.params.hf_layer_params), the sparse block's where layer i has
    one."""
    return Unit(f"layers.{i}", hf_layer_params(c, t, f"model.layers.{i}", c.is_moe_layer(i)), c.reshard_after_forward)


def hf_root(c: ModelConfig, t: int) -> Unit:
    """The root's own parameters: the embedding's and the output's; it stays unsharded from its forward to the end of
    backward."""
    return Unit(ROOT, (*part(c, t, "first"), *part(c, t, "last")), False)


def stage_params(c: ModelConfig, stage: Stage, t: int) -> tuple[Param, ...]:
    """The parameters one rank of t holds on a pipeline stage, as FSDP2 and ZeRO shard them. transformers': its
    layers' (each chunk of a stage holds the same kinds: memcalc.sizing.states.check_expert_states), the embedding's
    on the first, the output's on the last. torchtitan's: the chunk its pipeline_llm cuts out of the whole model
    (_split_module keeps the rank's blocks, tok_embeddings on the first, norm and lm_head on the last), which its
    apply_fsdp_to_decoder shards as the whole model's units."""
    if c.impl == "hf":
        layers = (x for i in range(stage.layers) for x in hf_layer(c, t, i).params)
        return (*(part(c, t, "first") if stage.has_embedding else ()), *layers,
                *(part(c, t, "last") if stage.has_output else ()))
    return tuple(x for u in stage_units(c, stage, t) for x in u.params)


def stage_units(c: ModelConfig, stage: Stage, t: int) -> tuple[Unit, ...]:
    """torchtitan's units on a pipeline stage, in its chunk's module order: the whole model's (`torchtitan_units`)
    that hold the chunk its pipeline_llm cuts out (the rank's blocks, tok_embeddings on the first, norm and lm_head on
    the last)."""
    ends = {"tok_embeddings": stage.has_embedding, OUTPUT: stage.has_output}
    units = torchtitan_units(c, t, c.rank_chunks(stage_rank(stage.name, c.pp))[0])
    return tuple(u for u in units if ends.get(u.name, True))


def torchtitan_block(i: int, c: ModelConfig) -> str:
    """Block i's module path in torchtitan's Llama3Model: under its activation checkpointing (FullAC, SelectiveAC)
    the block inside torch's checkpoint_wrapper, which keeps it under this name."""
    return f"layers.{i}._checkpoint_wrapped_module" if c.recompute != "none" else f"layers.{i}"


def torchtitan_units(c: ModelConfig, t: int, layers: range | None = None) -> tuple[Unit, ...]:
    """torchtitan's apply_fsdp_to_decoder on its Llama3Model (memcalc.sizing.params.torchtitan_layer_params): the
    embedding, each block (of `layers`, all by default; `block_groups`), and norm with lm_head, never resharded after
    forward ("as an optimization": FSDP2 would prefetch them at once). Under pp its "default" policy reshards none
    after forward."""
    reshard = c.reshard_after_forward and c.pp == 1
    blocks = (g for i in (range(c.L) if layers is None else layers) for g in block_groups(c, t, i, reshard))
    return (Unit("tok_embeddings", part(c, t, "first"), reshard), *blocks,
            Unit(OUTPUT, part(c, t, "last"), False))


def block_groups(c: ModelConfig, t: int, i: int, reshard: bool) -> tuple[Unit, ...]:
    """Block i's fully_shard: one parameter group; a MoE block's at ep > 1 two (its shard_placement_fn gives the
    routed experts the efsdp mesh, and FSDP2 makes a group of each process group's parameters, in the order their
    first parameter comes): the rest over dp_shard, then the routed experts (`EXPERT_GROUP`) over efsdp."""
    params = torchtitan_layer_params(c, t, torchtitan_block(i, c), c.is_moe_layer(i))
    if c.ep == 1 or not c.is_moe_layer(i):
        return (Unit(f"layers.{i}", params, reshard),)
    return (Unit(f"layers.{i}", tuple(p for p in params if p.group is not EXPERTS), reshard),
            Unit(f"layers.{i}{EXPERT_GROUP}", tuple(p for p in params if p.group is EXPERTS), reshard))


@dataclass(frozen=True)
class Fsdp:
    """One rank of dp_shard: its units (each `fully_shard` call, in forward order), and the ops FSDP2 runs around
    them. `accumulate`: the sharded gradients live between steps (zero_grad(set_to_none=False) zeroes them in place),
    and each reduce-scatter's output shard is added into them and freed."""

    shards: int
    act: int  # param_dtype's bytes
    reduce: int  # reduce_dtype's bytes
    units: tuple[Unit, ...]
    tp: bool = False  # transformers' tp_plan on the mesh's other dimension
    accumulate: bool = False
    partial: frozenset[str] = frozenset()  # modules whose weight's gradient DTensor leaves Partial over t
    dim1: frozenset[str] = frozenset()  # parameters sharded on dim 1 (Shard(1): evenly, no padding)
    replicas: int = 1  # HSDP's dp_replicate: each reduce-scatter's output all-reduced across replicas
    sync: bool = True  # False: each backward keeps the gradients unreduced (`accumulate_unsynced`)
    experts: int = 0  # under ep > 1 the ranks of efsdp, the routed experts' own mesh (0: theirs is `shards` too)
    explicit: bool = False  # torchtitan's explicit prefetching at ep > 1 (`prefetch`), not FSDP2's implicit

    @classmethod
    def torchtitan(cls, config: ModelConfig, t: int, sp: bool, stage: Stage | None = None) -> Fsdp:
        """torchtitan's layout (torchtitan_units; on a pipeline `stage` its chunk's, `stage_units`) over dp_shard
        ranks, on this rank's shards of t under its TP plan, its trainer's zero_grad(set_to_none=False). Under
        sequence parallelism the norms run on this rank's tokens alone: their Replicate weights' gradients are
        Partial sums over t. Under pp torch's schedule runs each micro-batch's backward without gradient sync."""
        units = torchtitan_units(config, t) if stage is None else stage_units(config, stage, t)
        norms = frozenset(p.module for u in units for p in u.params if len(p.shape) == 1) if sp else frozenset()
        dim1 = frozenset(p.module for u in units for p in u.params if expert_dim1(config) and p.group is EXPERTS)
        return cls(config.dp_shard or 1, DTYPE_BYTES[config.dtype], DTYPE_BYTES[config.reduce_dtype], units,
                   accumulate=True, partial=norms, replicas=config.dp_replicate or 1, dim1=dim1, sync=config.pp == 1,
                   experts=efsdp(config) if config.ep > 1 else 0, explicit=config.ep > 1)

    def unit_of(self, module: str) -> str | None:
        """The unit that holds the parameter of `module` (named by the module's path); None if no unit does."""
        return next((u.name for u in self.units if any(p.module == module for p in u.params)), None)

    @classmethod
    def of(cls, config: ModelConfig, t: int) -> Fsdp:
        """accelerate's layout of transformers' Llama: FSDP2 over dp_shard ranks on each decoder layer, then the root
        (the weights' shards on one rank of t, tp on the mesh's other dimension)."""
        layers = tuple(hf_layer(config, t, i) for i in range(config.L))
        return cls(config.dp_shard or 1, DTYPE_BYTES[config.dtype], DTYPE_BYTES[config.reduce_dtype],
                   (*layers, hf_root(config, t)), t > 1, replicas=config.dp_replicate or 1)

    def unit(self, block: str) -> Unit:
        return next(u for u in self.units if u.name == block)

    def groups(self, block: str) -> tuple[str, ...]:
        """The parameter groups of a unit, in FSDP2's order: the unit's own, and at ep > 1 its routed experts'."""
        return tuple(u.name for u in self.units if u.name in (block, f"{block}{EXPERT_GROUP}"))

    def unsharded(self, block: str, modules: Collection[str] | None = None) -> int:
        """Elements of a block gathered whole (each parameter padded), or of those of its parameters in `modules`."""
        return sum(_padded(p.shape, self._shards(p), p.module in self.dim1) for p in self.unit(block).params
                   if modules is None or p.module in modules)

    def sharded(self, block: str, modules: Collection[str] | None = None) -> int:
        """Elements of this rank's shard of a block (or of those of its parameters in `modules`)."""
        return sum(self._own(p) for p in self.unit(block).params if modules is None or p.module in modules)

    @property
    def shard(self) -> int:
        """Elements of this rank's shard of every parameter (each dim 0 padded): memcalc.sizing.states counts the
        model states of it too."""
        return sum(self._own(p) for u in self.units for p in u.params)

    def _own(self, p: Param) -> int:
        """Elements of this rank's shard of `p`: of the whole padded parameter one of `shards`, a routed expert's
        under ep > 1 one of efsdp (apply_fsdp_to_decoder's per-parameter mesh, `experts`)."""
        return _padded(p.shape, self._shards(p), p.module in self.dim1) // self._shards(p)

    def _shards(self, p: Param) -> int:
        """The ranks `p` is sharded over: efsdp for a routed expert's under ep > 1, else dp_shard."""
        return self.experts if self.experts and p.group is EXPERTS else self.shards

    def states(self, tape: Tape) -> None:
        """fp32 shards of every parameter, AdamW's m and v of them, and one 0-d step per parameter."""
        shard = self.shard
        count = sum(len(u.params) for u in self.units)
        tape.add("states/weights", PARAMETERS, 4 * shard, f"fp32 DTensor shards (1/{self.shards} of each"
                 " parameter, dim 0 padded): the optimizer's copy itself")
        tape.add("states/adam_m", OPTIMIZER, 4 * shard, "AdamW's first moment of this rank's shards, fp32")
        tape.add("states/adam_v", OPTIMIZER, 4 * shard, "AdamW's second moment of this rank's shards, fp32")
        tape.add("optimizer/step", OPTIMIZER, 4 * count, "AdamW counts steps in a 0-d fp32 tensor per parameter")
        if self.accumulate:
            tape.add("states/grads", GRADIENTS, 4 * shard, "the sharded fp32 gradients, zeroed in place between steps")

    def all_gather(self, tape: Tape, block: str, phase: str, where: str, filed: bool = True) -> None:
        """foreach_all_gather: this rank's shards cast to param_dtype, then the block's flat buffer of every
        rank's shards; the casts are freed once copied in. In fp32 there is no cast (FSDP2 clamps a param_dtype equal
        to the shards' to None): the shards are the all-gather's input. `filed`: FSDPMemTracker files the buffer as
        FSDP2's own (inside a unit's pre-forward or pre-backward hook; not in backward after it, where torchtitan's
        explicit prefetch issues it)."""
        made = ACTIVATIONS if phase == "forward" else TEMPORARIES
        if self.act != 4:
            tape.add(f"fsdp/{block} cast", made, self.act * self.sharded(block),
                     "this rank's shards cast to param_dtype, the all-gather's input")
        name = f"fsdp/{block} all-gather"
        # FSDPMemTracker files the buffer as the op's output first, as FSDP2's own once it is told of it
        tape.add(name, made, self.act * self.unsharded(block), "FSDP2's all-gather output: the whole block in"
                 " param_dtype, one flat buffer")
        tape.mark(phase, where, f"FSDP2's all-gather of {block}: its output, beside this rank's cast shards")
        if filed:
            tape.live[name] = tape.live[name]._replace(category=PARAMETERS)
            tape.mark(phase, where, f"FSDP2's all-gather of {block}: its buffer beside this rank's cast shards")
        tape.drop(f"fsdp/{block} cast")

    def copy_out(self, tape: Tape, unit: str, phase: str, where: str) -> None:
        """Each parameter group of `unit` unsharded in turn (`_copy_out`)."""
        for block in self.groups(unit):
            self._copy_out(tape, block, phase, where)

    def _copy_out(self, tape: Tape, block: str, phase: str, where: str) -> None:
        """The gathered buffer copied into each parameter's unsharded storage (wait_for_unshard). In backward the
        buffer is freed at once; in forward FSDP2 keeps it until the next group's copy-out has made its storages
        (its all_gather_state), the last one until the root's forward returns (`forward_done`)."""
        if f"fsdp/{block} unsharded" in tape.live:
            return
        if self._alone(block):
            self._copy_alone(tape, block, phase, where)
            return
        if f"fsdp/{block} all-gather" not in tape.live:
            self.all_gather(tape, block, phase, where)
        name = f"fsdp/{block} unsharded"
        # FSDP2 frees and regrows the same storages (resize_): gathered first in the step's forward, FSDPMemTracker
        # files them as an op's output (an activation) until FSDP2's pre-forward hook has run, then as the
        # unsharded parameters; gathered again in backward, they are known as such at once
        tape.add(name, ACTIVATIONS if phase == "forward" else PARAMETERS, self.act * self.unsharded(block),
                 "the block's parameters gathered whole, in param_dtype, while it runs")
        dim1 = self.act * self.unsharded(block, self.dim1)
        if dim1:  # Shard(1) parameters are copied out into temporaries first, then chunk-cat into their own
            tape.add(f"fsdp/{block} chunk-cat", ACTIVATIONS if phase == "forward" else TEMPORARIES, dim1,
                     "the Shard(1) parameters' all-gather outputs, rank by rank: chunk-cat into their storage")
            tape.mark(phase, where, f"FSDP2 chunk-cats {block}'s Shard(1) parameters out of temporaries")
            tape.drop(f"fsdp/{block} chunk-cat")
        tape.mark(phase, where, f"FSDP2 copies the gathered {block} out of its all-gather buffer")
        if phase == "forward":
            self.forward_done(tape, keep=block)
        else:
            tape.drop(f"fsdp/{block} all-gather")
        if phase == "backward" or not self.explicit:  # else once the unit's prefetch is issued (`pre_forward`)
            tape.live[name] = tape.live[name]._replace(category=PARAMETERS)

    def unshard(self, tape: Tape, block: str) -> None:
        """FSDPModule.unshard() called outside FSDP2's hooks, in forward (torchtitan's ChunkedLossWrapper on lm_head):
        FSDPMemTracker files the all-gather's input and output as activations, then the unsharded parameters as such;
        the buffer goes once copied out."""
        whole, cast, buffer = self.unsharded(block), f"fsdp/{block} cast", f"fsdp/{block} all-gather"
        if self.act != 4:
            tape.add(cast, ACTIVATIONS, self.act * whole // self.shards, "this rank's shards cast to param_dtype")
        tape.add(buffer, ACTIVATIONS, self.act * whole, "FSDP2's all-gather output, one flat buffer")
        tape.mark("forward", "", f"unshard(): FSDP2's all-gather of {block}")
        tape.drop(cast)
        tape.add(f"fsdp/{block} unsharded", PARAMETERS, self.act * whole, "the block's parameters gathered whole")
        tape.mark("forward", "", f"unshard(): FSDP2 copies the gathered {block} out of its all-gather buffer")
        tape.drop(buffer)

    def _alone(self, block: str) -> bool:
        """Whether `block` is a group over one rank: the routed experts' at ep = dp_shard (efsdp 1), which FSDP2
        neither all-gathers nor reduce-scatters (`_copy_alone`, `_reduce_alone`)."""
        return self.experts == 1 and block.endswith(EXPERT_GROUP)

    def _copy_alone(self, tape: Tape, block: str, phase: str, where: str) -> None:
        """wait_for_unshard over one rank: parameter by parameter this rank's shard cast to param_dtype (its
        all_gather_inputs; none in fp32) and copied into its unsharded storage, each cast held by the loop's variable
        until the next one's is made and the last until the call returns; then in forward the all-gather buffer the
        previous group left (its all_gather_state) goes. FSDPMemTracker files the storages as it files a gathered
        group's."""
        made, stored = (ACTIVATIONS, ACTIVATIONS) if phase == "forward" else (TEMPORARIES, PARAMETERS)
        params = self.unit(block).params
        for i, p in enumerate(params):
            if self.act != 4:
                tape.add(f"fsdp/{block} cast {i}", made, self.act * self._own(p), "this rank's shard cast to"
                         " param_dtype (one rank: it is the whole parameter)")
                tape.mark(phase, where, f"FSDP2 casts {p.module}'s shard (one rank: nothing to all-gather)")
            tape.add(f"fsdp/{block} unsharded {i}", stored, self.act * self._own(p), "the parameter's unsharded"
                     " storage, the cast copied in")
            tape.drop(f"fsdp/{block} cast {i - 1}")
            tape.mark(phase, where, f"FSDP2 copies {p.module}'s shard into its unsharded storage")
        tape.drop(*[f"fsdp/{block} unsharded {i}" for i in range(len(params))], f"fsdp/{block} cast {len(params) - 1}")
        tape.add(f"fsdp/{block} unsharded", stored, self.act * self.unsharded(block), "the block's parameters whole,"
                 " in param_dtype, while it runs")
        if phase == "forward":
            self.forward_done(tape, keep=block)

    def forward_done(self, tape: Tape, keep: str | None = None) -> None:
        """Free the all-gather buffers forward kept: all but `keep`'s, and under explicit prefetching not those of
        the groups after it (prefetched, not yet copied out)."""
        names = [u.name for u in self.units]
        pending = names[names.index(keep) + 1:] if keep is not None and self.explicit else []
        tape.drop(*[f"fsdp/{n} all-gather" for n in names if n != keep and n not in pending])

    def pre_forward(self, tape: Tape, unit: str, where: str, following: str | None) -> None:
        """FSDP2's pre-forward of `unit`: its groups unsharded, then under explicit prefetching the `following`
        unit's all-gathers issued; FSDPMemTracker files the unsharded parameters as such once the hook returns."""
        self.copy_out(tape, unit, "forward", where)
        if not self.explicit:
            return
        if following != unit:
            self.prefetch(tape, following, "forward", where)
        for name in (f"fsdp/{g} unsharded" for g in self.groups(unit)):
            tape.live[name] = tape.live[name]._replace(category=PARAMETERS)

    def prefetch(self, tape: Tape, unit: str | None, phase: str, where: str) -> None:
        """torchtitan's explicit prefetching at ep > 1 (set_modules_to_forward_prefetch and _backward_prefetch): in a
        unit's pre-forward, after its own copy-out, the next unit's groups all-gathered in order; in its pre-backward
        the previous unit's, in reverse. FSDP2 skips a group already unsharded or gathered."""
        if not self.explicit or unit is None:
            return
        groups = self.groups(unit) if phase == "forward" else reversed(self.groups(unit))
        for block in (g for g in groups if not self._alone(g)):
            if f"fsdp/{block} unsharded" not in tape.live and f"fsdp/{block} all-gather" not in tape.live:
                self.all_gather(tape, block, phase, where, filed=phase == "forward")

    @staticmethod
    def block_of(where: str) -> str:
        """The block a module belongs to: `model.layers.3.mlp.up_proj` is layers.3's; the rest are the root's."""
        parts = where.split(".")
        return f"layers.{parts[2]}" if where.startswith("model.layers.") else ROOT

    def post_forward(self, tape: Tape, block: str) -> None:
        """reshard_after_forward frees a unit's unsharded parameters (the hf root's stay for backward)."""
        if self.unit(block).reshard_after_forward:
            tape.drop(*[f"fsdp/{g} unsharded" for g in self.groups(block)])

    def pre_backward(self, tape: Tape, block: str, where: str, prefetch: str | None) -> None:
        """The block unsharded (copied out if resharded), then the next block's all-gather issued (explicitly at
        ep > 1, `prefetch`)."""
        self.copy_out(tape, block, "backward", where)
        if self.explicit:
            self.prefetch(tape, prefetch, "backward", where)
        elif prefetch is not None and f"fsdp/{prefetch} unsharded" not in tape.live:
            self.all_gather(tape, prefetch, "backward", where)

    def keep_grad(self, tape: Tape, where: str, name: str, nbytes: int) -> None:
        """A weight's bf16 gradient, the unsharded parameter's .grad until the reduce-scatter of the block of `where`
        (the module handing it over)."""
        tape.add(f"fsdp/{self.block_of(where)} grad {name}", TEMPORARIES, nbytes, "the unsharded parameter's .grad,"
                 " kept until the block's reduce-scatter (made in backward: a temporary, as MemTracker files it)")

    def embedding_rows(self, tape: Tape, where: str) -> str:
        """Under tp the embedding's gradient is the whole (v, h) table (DTensor gives the Shard(0) weight a
        Replicate gradient): FSDP2 lays it out as the weight (redistribute), this rank's v/t rows, and the table
        goes."""
        whole, rows = f"fsdp/{ROOT} grad model.embed_tokens", f"fsdp/{ROOT} grad model.embed_tokens (rows)"
        tape.add(rows, TEMPORARIES, self.act * prod(self.unit(ROOT).params[0].shape), "this rank's rows of the"
                 " embedding's gradient, laid out as its weight (DTensor's redistribute) for the reduce-scatter")
        tape.mark("backward", where, "this rank's rows of the embedding's Replicate gradient")
        tape.drop(whole)
        return rows

    @staticmethod
    def finalize_backward(tape: Tape) -> None:
        """FSDP2's final callback: the all-reduce inputs HSDP still holds (each unit's last) go."""
        tape.drop(*[n for n in tape.live if n.startswith("fsdp/") and n.endswith(" all-reduce")])

    def all_reduced(self, tape: Tape, where: str, name: str) -> str:
        """FSDP2 lays a Partial gradient out as its Replicate weight (DTensor's redistribute: an all-reduce over t
        into a new tensor) before the reduce-scatter; the Partial one goes as the unsharded .grad is set to None."""
        reduced = f"{name} (all-reduced)"
        tape.add(reduced, TEMPORARIES, tape.live[name].bytes, "a Partial weight gradient all-reduced over t, for"
                 " FSDP2's reduce-scatter")
        tape.mark("backward", where, f"FSDP2 all-reduces {name.split(' grad ', 1)[1]}'s Partial gradient over t")
        tape.drop(name)
        return reduced

    def _dim0_copies(self, tape: Tape, block: str, where: str, grads: list[str], made: str) -> list[str]:
        """foreach_reduce's first loop: each Shard(1) gradient chunked on dim 1 and concatenated on dim 0, a copy in
        the flat list; the originals, still referenced by the loop, go (measured) with the last one's copy, all but
        the last: its loop variable holds it until foreach_reduce returns. The Shard(1) gradients' names."""
        dim1 = [n for n in (f"fsdp/{block} grad {m}" for m, *_ in self.unit(block).params if m in self.dim1)
                if n in grads]  # in registration order, as FSDP2 loops over them
        for i, name in enumerate(dim1):
            tape.add(f"{name} (dim 0)", made, tape.live[name].bytes, "a Shard(1) gradient's chunks"
                     " concatenated on dim 0, for the reduce-scatter's copy-in")
            if i == len(dim1) - 1:
                tape.drop(*dim1[:-1])
            tape.mark("backward", where, f"FSDP2 lays {name.split(' grad ', 1)[1]}'s Shard(1) gradient out on dim 0")
        return dim1

    def post_backward(self, tape: Tape, block: str, where: str, modules: tuple[str, ...] | None = None) -> None:
        """FSDP2's post-backward, as FSDPMemTracker files each step (the module's docstring). The last parameter's
        gradient lives on in foreach_reduce's loop variable until it returns. `modules`: the parameters with a gradient
        (foreach_reduce takes only those), all by default."""
        grads = [n for n in tape.live if n.startswith(f"fsdp/{block} grad ")]
        for name in grads:
            tape.live[name] = tape.live[name]._replace(category=GRADIENTS)
        if self.sync:
            self.reduce_scatter(tape, block, where, grads, modules)
        else:
            self.accumulate_unsynced(tape, block, where)

    def reduce_scatter(self, tape: Tape, block: str, where: str, grads: list[str],
                       modules: tuple[str, ...] | None = None, made: str = TEMPORARIES, reshard: bool = True) -> None:
        """FSDP2's post-backward of `block` from its unsharded gradients `grads` on: resharded (unless `reshard` is
        off: set_reshard_after_backward(False)), the gradients reduce-scattered into this rank's shard. `made`: the
        category FSDPMemTracker files what it makes in."""
        if block == ROOT and self.tp:
            grads.append(self.embedding_rows(tape, where))
        partial = [f"fsdp/{block} grad {m}" for m, *_ in self.unit(block).params if m in self.partial]  # in order
        reduced = {n: self.all_reduced(tape, where, n) for n in partial if n in grads}
        grads = [reduced.get(n, n) for n in grads]
        tape.drop(*((f"fsdp/{block} unsharded",) if reshard else ()))
        if f"{block}{EXPERT_GROUP}" not in self.groups(block):  # a unit's last group waits (not the dense one
            # before its experts'): the previous reduce-scatter buffers, waited on now
            tape.drop(*[n for n in tape.live if n.startswith("fsdp/") and n.endswith(" reduce-scatter")])
        tape.drop(f"fsdp/{block} all-reduce")  # this unit's last, under HSDP (_wait_for_post_backward)
        if self._alone(block):
            self._reduce_alone(tape, block, where, grads, made)
            return
        dim1 = self._dim0_copies(tape, block, where, grads, made)
        whole = self.unsharded(block, modules)
        rs = f"fsdp/{block} reduce-scatter"
        tape.add(rs, made, self.reduce * whole,
                 "FSDP2's reduce-scatter input: the block's gradients in reduce_dtype, one flat buffer")
        tape.mark("backward", where, f"FSDP2's reduce-scatter buffer for {block}'s gradients")
        # the last parameter in registration order with a gradient (tied, the hf root's is the final norm)
        module = [m for m, *_ in self.unit(block).params if modules is None or m in modules][-1]
        last = reduced.get(f"fsdp/{block} grad {module}", f"fsdp/{block} grad {module}")
        held = (last, *dim1[-1:])  # the last Shard(1) one: foreach_reduce's first loop variable
        tape.drop(*(n for n in grads if n not in held), *(f"{n} (dim 0)" for n in dim1))
        out = f"fsdp/{block} sharded grads"
        tape.add(out, made, self.reduce * self.sharded(block, modules),
                 "this rank's shard of the block's gradients, in reduce_dtype")
        tape.mark("backward", where, f"{block}'s gradients copied in and freed, the reduce-scatter's output made")
        tape.live[rs] = tape.live[rs]._replace(category=GRADIENTS)  # filed as the reduce-scatter's input
        tape.mark("backward", where, f"the reduce-scatter of {block}'s gradients")
        # HSDP: FSDP2 holds the all-reduce's input, the reduce_dtype output, to the end of backward (AllReduceState)
        held_input = f"fsdp/{block} all-reduce"
        if self.reduce != 4:  # cast to the fp32 parameters' dtype; the reduce_dtype output goes, or is held
            tape.add(f"{out} (fp32)", made, 4 * self.sharded(block, modules), "the shard cast to the parameters'"
                     " fp32")
            tape.mark("backward", where, f"{block}'s gradient shard cast to fp32")
            if self.replicas > 1:
                tape.rename(out, held_input)
            else:
                tape.drop(out)
            tape.rename(f"{out} (fp32)", out)
        tape.drop(*held)
        if self.accumulate and self.replicas > 1 and self.reduce == 4:  # the held input is the output itself
            tape.rename(out, held_input)
        elif self.accumulate:  # added into the sharded gradients
            tape.drop(out)
        else:
            tape.live[out] = tape.live[out]._replace(category=GRADIENTS)

    def _reduce_alone(self, tape: Tape, block: str, where: str, grads: list[str], made: str) -> None:
        """foreach_reduce over one rank (the routed experts' at efsdp 1, fp32 reduce, no HSDP): the gradients copied
        into the flat reduce_dtype input, all freed (no first loop over Shard(1) chunks holds the last), an output as
        large, filled with the input divided by torchtitan's factor (a temporary quotient), added into the sharded
        gradients and freed; the input is kept as the reduce-scatter's would be. FSDPMemTracker sees no
        reduce-scatter, so it files the input as made."""
        whole, rs = self.reduce * self.unsharded(block), f"fsdp/{block} reduce-scatter"
        tape.add(rs, made, whole, "FSDP2's reduce input: the block's gradients in reduce_dtype, one flat buffer")
        tape.mark("backward", where, f"FSDP2's reduce buffer for the gradients of {block} (one rank)")
        tape.drop(*grads)
        tape.add(f"fsdp/{block} sharded grads", made, whole, "the reduce's output: the whole block, one rank's")
        tape.mark("backward", where, f"the gradients of {block} copied in and freed, the output made")
        tape.add(f"fsdp/{block} quotient", made, whole, "the input divided by the gradient divide factor")
        tape.mark("backward", where, f"the gradients of {block} divided, to be copied into the output")
        tape.drop(f"fsdp/{block} quotient", f"fsdp/{block} sharded grads")

    def accumulate_unsynced(self, tape: Tape, block: str, where: str) -> None:
        """FSDP2's post-backward under set_requires_gradient_sync(False) and set_reshard_after_backward(False): the
        unit stays unsharded, and each parameter's unsharded .grad (in registration order) becomes a reduce_dtype
        copy, its unsharded_accumulated_grad (to_accumulated_grad_if_needed), or, once there is one, is added into it
        (accumulate_unsharded_grad_if_needed); each .grad goes at the next parameter's op. Where reduce_dtype is
        param_dtype FSDP2 keeps none: autograd adds each later gradient into the .grad itself."""
        if self.reduce == self.act:
            return
        grads = [n for n in (f"fsdp/{block} grad {m}" for m, *_ in self.unit(block).params) if n in tape.live]
        for i, name in enumerate(grads):
            tape.drop(*grads[i - 1:i])
            accumulated = name.replace(" grad ", " accumulated ", 1)
            if accumulated not in tape.live:
                tape.add(accumulated, TEMPORARIES, tape.live[name].bytes // self.act * self.reduce,
                         "the unsharded gradient in reduce_dtype, accumulated over the micro-batches")
            tape.mark("backward", where, f"FSDP2 accumulates {name.split(' grad ', 1)[1]}'s gradient unreduced")
        tape.drop(*grads[-1:])
        tape.mark("backward", where, f"{block}'s gradients accumulated, the unsharded .grads freed")

    def reduce_accumulated(self, tape: Tape) -> None:
        """The pipeline schedule's perform_reduce_grad at the step's end: each unit's post-backward, in module order,
        outside autograd's backward (FSDPMemTracker files what it makes as activations), reduce-scatters the
        gradients accumulated over every micro-batch and reshards the unit; the last reduce-scatter's buffer goes in
        the final callback."""
        for unit in self.units:
            accumulated = [n for n in tape.live if n.startswith(f"fsdp/{unit.name} accumulated ")]
            for name in accumulated:  # post_backward takes them as the unit's unsharded gradients
                tape.rename(name, name.replace(" accumulated ", " grad ", 1))
            grads = [n for n in tape.live if n.startswith(f"fsdp/{unit.name} grad ")]
            self.reduce_scatter(tape, unit.name, "", grads, made=ACTIVATIONS)
        tape.drop(*[n for n in tape.live if n.startswith("fsdp/") and n.endswith(" reduce-scatter")])
        self.finalize_backward(tape)
