"""One whole training step of a small GPT on one rank, measured with torch's own MemTracker.

The model is built from the probe's pieces as Megatron-LM's GPTModel lays them out, and trained as Megatron-LM
trains it in mixed precision (an fp32 gradient buffer, fp32 master weights, fused AdamW; in fp32 no master copy), so
that each moment of the step timeline (memcalc.sizing.timeline) has a measured twin. The model, the trainer, how
MemTracker's categories are read, and the libraries' own models under `--step`: docs/probe.md, "One whole step".
"""

from __future__ import annotations

import importlib
import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from memcalc.model.families import layer_family
from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError, ProbeError
from memcalc.model import ledger
from memcalc.model.evaluate import check_strategy
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES, Strategy
from memcalc.probe import check_worst_route, require_torch, routing_fixed
from memcalc.probe.footprint import available
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.launch import Mode, run, run_fake
from memcalc.probe.measure import runner
from memcalc.probe.layer import DTYPES, TransformerLayer
from memcalc.probe.linear import ColumnParallelLinear
from memcalc.probe.mappings import f_star_leave_tp, split_seq
from memcalc.probe.norm import Norm
from memcalc.probe.recorder import batch_first, label, local
from memcalc.sizing.pipeline import pipeline_stages, stage_rank
from memcalc.sizing.params import vocab_shard
from memcalc.sizing.states import DISTRIBUTED_OPTIMIZER
from memcalc.sizing.timeline import (
    ACTIVATIONS, CATEGORIES, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES, Timeline, timeline,
)
from memcalc.units import human_bytes

torch = require_torch()
import torch.distributed as dist  # noqa: E402  (after the install check above)
from torch import nn  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn import functional as F  # noqa: E402

BATCH_SEED = 4321
WEIGHT_SEED = 7  # the embedding table's; the layers' linears seed themselves

# MemTracker's categories (its _MemRefType values) as the timeline's.
MEASURED_CATEGORIES = {
    "Parameter": PARAMETERS,
    "Buffer": PARAMETERS,
    "Gradient": GRADIENTS,
    "Other": GRADIENTS,  # the fp32 main_grad buffer, the one tensor registered with track_external
    "Optstate": OPTIMIZER,
    "Activation": ACTIVATIONS,
    "Temp": TEMPORARIES,
}


# -- the model's two ends ---------------------------------------------------------


class Embedding(nn.Module):
    """Megatron's LanguageModelEmbedding: vocabulary-parallel word embedding, learned positions, dropout.
    (b, s) token ids -> (s, b, h), or this rank's sequence shard (s/t, b, h) under SP."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup, sequence_parallel: bool) -> None:
        super().__init__()
        dtype = DTYPES[config.dtype]
        self.tp, self.sequence_parallel, self.dropout = tp, sequence_parallel, config.dropout
        self.rows = vocab_shard(config, tp.size)  # as Megatron-LM pads the vocabulary (sizing.params)
        generator = torch.Generator().manual_seed(WEIGHT_SEED)
        full = torch.randn(self.rows * tp.size, config.h, generator=generator) * 0.02
        # copied: a view would keep the whole table's storage behind this rank's rows (fp32 `to` is a no-op)
        self.word = nn.Parameter(tp.block(full, 0, "padded vocabulary").to(dtype=dtype, device=tp.device, copy=True))
        self.position = None
        if config.position_embedding_type == "learned_absolute":
            table = torch.randn(config.positions, config.h, generator=generator) * 0.02
            self.position = nn.Parameter(table.to(dtype=dtype, device=tp.device))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        words = self._words(tokens)  # (b, s, h), summed over the ranks
        if self.position is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)  # (s,)
            words = words + F.embedding(positions, self.position)  # keeps the position ids
        x = words.transpose(0, 1).contiguous()  # (s, b, h)
        if self.sequence_parallel:
            x = split_seq(x, self.tp)  # (s/t, b, h)
        if self.dropout > 0:
            x, keep = torch.native_dropout(x, self.dropout, True)
            label(batch_first(keep), ledger.EMBEDDING_DROPOUT_MASK)
        return x

    def _words(self, tokens: torch.Tensor) -> torch.Tensor:
        """Megatron's VocabParallelEmbedding: this rank's rows, then f* (all-reduce) when t > 1."""
        if self.tp.size == 1:
            label(tokens, ledger.EMBEDDING_INPUT_IDS)
            return F.embedding(tokens, self.word)  # keeps the token ids
        start = self.tp.rank * self.rows
        outside = (tokens < start) | (tokens >= start + self.rows)  # (b, s) bool
        ids = tokens - start
        ids[outside] = 0
        label(ids, ledger.EMBEDDING_INPUT_IDS)
        words = F.embedding(ids, self.word).masked_fill(outside.unsqueeze(-1), 0.0)  # keeps ids and the mask
        return f_star_leave_tp(words, self.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocabulary-parallel cross-entropy (core/tensor_parallel/cross_entropy.py), op for op.

    forward: logits (s, b, v/t) -> per-token loss (s, b), in fp32; keeps the fp32 softmax
             (the logits' fp32 copy, turned into exp and normalised in place), which targets
             fall outside this rank's rows (bool) and the targets as row indices (int64)
    backward: the softmax less one at each target, in place, times the loss's gradient
    """

    @staticmethod
    def forward(ctx, logits, target, tp):
        logits = logits.float()  # (s, b, v/t) fp32: the one big tensor the loss keeps
        logits_max = torch.max(logits, dim=-1)[0]
        _all_reduce(logits_max, tp, dist.ReduceOp.MAX)
        rows = logits.shape[-1]
        start = tp.rank * rows
        logits -= logits_max.unsqueeze(-1)
        target_mask = (target < start) | (target >= start + rows)
        masked_target = target.clone() - start
        masked_target[target_mask] = 0
        logits_2d = logits.view(-1, rows)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(logits_2d.shape[0], device=logits.device)
        predicted = logits_2d[arange_1d, masked_target_1d].clone().view_as(target)
        predicted[target_mask] = 0.0
        _all_reduce(predicted, tp, dist.ReduceOp.SUM)
        exp_logits = torch.exp(logits, out=logits)
        sum_exp = exp_logits.sum(dim=-1)
        _all_reduce(sum_exp, tp, dist.ReduceOp.SUM)
        loss = torch.log(sum_exp) - predicted
        exp_logits.div_(sum_exp.unsqueeze(-1))
        label(batch_first(exp_logits), ledger.LOSS_LOGITS)
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d = softmax.view(-1, softmax.shape[-1])
        arange_1d = torch.arange(grad_2d.shape[0], device=grad_2d.device)
        grad_2d[arange_1d, masked_target_1d] -= 1.0 - target_mask.view(-1).float()
        softmax.mul_(grad_loss.unsqueeze(-1))
        return softmax, None, None  # autograd casts it to the logits' dtype


def _all_reduce(x: torch.Tensor, tp: TensorParallelGroup, op: dist.ReduceOp) -> None:
    if tp.size > 1:
        dist.all_reduce(x, op=op, group=tp.group)


class CrossEntropy(nn.Module):
    """The mean over tokens of the vocabulary-parallel cross-entropy (no loss mask)."""

    def __init__(self, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        target = labels.transpose(0, 1).contiguous()  # (b, s) -> (s, b), as the logits
        losses = _VocabParallelCrossEntropy.apply(logits, target, self.tp)  # (s, b) fp32
        return losses.transpose(0, 1).contiguous().mean()


class GPT(nn.Module):
    """Embedding, L layers, final norm, output layer and loss on one tensor-parallel rank.

    `mlps` gives layer i another MLP than the probe's own (None: the probe's): megatron-core's MoELayer in a
    mixture of experts' step (memcalc.probe.libs.megatron_step)."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup, strategy: Strategy,
                 mlps: Callable[[int], nn.Module | None] = lambda i: None) -> None:
        super().__init__()
        sp = strategy.sequence_parallel and tp.size > 1
        dtype = DTYPES[config.dtype]
        self.embedding = Embedding(config, tp, sp)
        self.layers = nn.ModuleList(TransformerLayer(config, tp, sp, mlp=mlps(i)) for i in range(config.L))
        self.final_norm = Norm(config.norm, config.h, ledger.FINAL_NORM, dtype, tp.device, sequence_parallel=sp)
        padded = self.embedding.rows * tp.size
        self.output_layer = ColumnParallelLinear(config.h, padded, tp, sp, bias=False, dtype=dtype,
                                                 seed=WEIGHT_SEED + 1)
        if config.tie_embeddings:
            self.output_layer.weight = self.embedding.word  # one parameter, two uses (pp = 1)
        self.loss = CrossEntropy(tp)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        x = self.final_norm(x)
        label(batch_first(x), ledger.OUTPUT_INPUT)
        return self.loss(self.output_layer(x), labels)


# -- mixed precision: the fp32 gradient buffer and the optimizer ------------------


class MainGrads:
    """Megatron's contiguous fp32 gradient buffer, one view (`param.main_grad`) per parameter (docs/probe.md, "One
    whole step"). A DTensor weight (transformers' TP) has its local shard's view; a gradient laid out otherwise (the
    vocabulary-parallel embedding's Replicate one) is first laid out as its weight."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        shards = [local(p) for p in params]
        self.buffer = torch.zeros(sum(x.numel() for x in shards), dtype=torch.float32, device=shards[0].device)
        for p, x, piece in zip(params, shards, self.buffer.split([x.numel() for x in shards])):
            p.main_grad = piece.view_as(x)
        # The accumulators must outlive this call: autograd holds them only weakly (as Megatron keeps grad_accs).
        self._accumulators = []
        for p in params:
            accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
            accumulator.register_hook(_add_into_main_grad(p))
            self._accumulators.append(accumulator)

    def zero(self) -> None:
        self.buffer.zero_()


def _add_into_main_grad(param: nn.Parameter):
    """Megatron's backward post-hook: main_grad += grad, then the bf16 gradient is dropped. A DTensor gradient is
    first laid out as its parameter (DTensor's embedding backward gives a vocabulary-parallel table a Replicate one)."""

    def hook(*_unused):
        grad = param.grad
        if grad is None:
            return
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
        param.main_grad.add_(local(grad))
        param.grad = None

    return hook


class FlatAdamW(torch.optim.Optimizer):
    """One fused AdamW over one flat fp32 buffer of the weights, its `.grad` the gradient buffer, as Megatron's
    optimizers step them. With `master` (bf16 or fp16 parameters, Float16Optimizer) the buffer holds fp32 master
    weights, each parameter's state its view (`main_param`, an optimizer state), copied back into the parameter after
    each step. Without (fp32, FP32Optimizer: no master copy, its prepare_grads makes each parameter's main_grad its
    `.grad`) each parameter (a DTensor's local shard) is moved onto its view, its own storage freed, and the step
    updates it in place."""

    def __init__(self, params: list[nn.Parameter], main_grads: MainGrads, master: bool, lr: float = 1e-4) -> None:
        super().__init__(params, {})
        self.master = master
        shards = [local(p) for p in params]
        with torch.no_grad():
            self.weights = torch.cat([x.detach().float().reshape(-1) for x in shards])
            for p, x, piece in zip(params, shards, self.weights.split([x.numel() for x in shards])):
                if master:
                    self.state[p]["main_param"] = piece.view_as(x)
                else:
                    x.data = piece.view_as(x)
        self.weights.grad = main_grads.buffer
        self.adamw = torch.optim.AdamW([self.weights], lr=lr, fused=True)

    @torch.no_grad()
    def step(self, closure=None):
        self.adamw.step()
        if not self.master:
            return
        for group in self.param_groups:
            for p in group["params"]:
                local(p).copy_(self.state[p]["main_param"])


# -- one measured step ------------------------------------------------------------


@dataclass(frozen=True)
class StepMeasurement:
    """MemTracker's readings of one step on one rank, in bytes per timeline category."""

    strategy: str
    t: int
    group: str
    steady: dict[str, int]  # at the step's start: model states only
    peak: dict[str, int]  # at the peak
    peak_bytes: int
    moment: str  # "forward <module>", "backward <module>" or "optimizer": where the peak was reached


def batch(config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels (b, s), drawn from the whole vocabulary, the same on every rank."""
    generator = torch.Generator().manual_seed(BATCH_SEED)
    tokens = torch.randint(config.vocab_size, (config.b, config.s), generator=generator)
    labels = torch.randint(config.vocab_size, (config.b, config.s), generator=generator)
    return tokens.to(device), labels.to(device)


def check_route(config: ModelConfig, route: str | None) -> None:
    """ProbeError for a library's experts without a forced route: each expert's tokens would be the data's."""
    if config.moe and route is None:
        raise ProbeError(f"impl {config.impl}: --step on experts forces the router (--route balanced or all-to-one)")


@dataclass(frozen=True)
class Trainer:
    """A model on one rank with its gradient buffer and optimizer, after a warm-up step.

    `loss` runs the forward pass, (tokens, labels) -> the mean loss: memcalc's GPT is called
    with both; transformers' models take labels and return their loss in an output object.
    """

    config: ModelConfig
    model: nn.Module
    main_grads: MainGrads
    optimizer: FlatAdamW
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    @classmethod
    def warmed_up(cls, tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy) -> Trainer:
        """memcalc's own GPT on this rank, built and stepped once."""
        torch.manual_seed(BATCH_SEED + tp.rank)  # dropout masks
        model = GPT(config, tp, strategy)
        return cls.around(config, model, model)

    @classmethod
    def around(cls, config: ModelConfig, model: nn.Module,
               loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], **fields: Any) -> Trainer:
        """`model` with Megatron's gradient buffer and optimizer (and a subclass's own `fields`), stepped once: Adam's
        moments exist from the first step on, so the next step is a steady one."""
        params = list(model.parameters())
        main_grads = MainGrads(params)
        optimizer = FlatAdamW(params, main_grads, master=config.dtype != "fp32")
        trainer = cls(config, model, main_grads, optimizer, loss, **fields)
        trainer.step()
        return trainer

    def register(self, tracker) -> None:
        """Show the tracker what exists before the step: weights, optimizer states, the gradient buffer."""
        tracker.track_external(self.model, self.optimizer, self.optimizer.adamw)
        tracker.track_external(self.main_grads.buffer)  # filed as "Other": see MEASURED_CATEGORIES

    def step(self) -> None:
        """Zero the gradient buffer, load a batch, forward, backward, step; the loss lives to the step's end."""
        self.main_grads.zero()
        tokens, labels = batch(self.config, self.main_grads.buffer.device)
        loss = self.loss(tokens, labels)
        loss.backward()
        self.optimizer.step()


def measure_step_on_rank(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy) -> StepMeasurement:
    """Build memcalc's GPT on this rank, run a warm-up step, then measure one step under MemTracker."""
    return measure_trainer(Trainer.warmed_up(tp, config, strategy), tp, strategy)


def measure_trainer(trainer: Trainer, tp: TensorParallelGroup, strategy: Strategy,
                    tracker: MomentTracker | None = None, kinds: dict[str, str] = MEASURED_CATEGORIES
                    ) -> StepMeasurement:
    """One step of a warmed-up trainer under MemTracker (or `tracker`, a library's, whose categories are `kinds` as
    `categories` reads them): the state before it, the peak, and where the peak was."""
    tracker = tracker or MomentTracker()
    trainer.register(tracker)
    with tracker:  # the state read once inside: FSDPMemTracker registers the shards and states as it is entered
        steady = categories(tracker.get_tracker_snapshot("current"), kinds)
        trainer.step()
    peak = categories(tracker.get_tracker_snapshot("peak"), kinds)
    return StepMeasurement(strategy.name, tp.size, tp.mode, steady, peak, sum(peak.values()), tracker.moment)


def holds_memory(device: Any) -> bool:
    """Whether a MemTracker device's bytes are memory: not the meta device's (`categories`)."""
    return torch.device(device).type != "meta"


def categories(snapshot: dict, kinds: dict[str, str] = MEASURED_CATEGORIES) -> dict[str, int]:
    """A MemTracker snapshot of this rank's one device as bytes per timeline category (`kinds`: the tracker's
    categories as the timeline's; FSDPMemTracker has its own).

    Meta tensors hold no memory, but MemTracker files their nominal bytes under a device of their own, with a peak
    of its own: transformers' rowwise style makes a (b, s, in_features) meta tensor only to read its strides
    (`TensorParallelLayer._from_local_last_dim_shard`). That device is left out.
    """
    out: dict[str, int] = {}
    for device, device_snapshot in snapshot.items():
        if not holds_memory(device):
            continue
        for key, nbytes in device_snapshot.items():
            if (category := kinds.get(getattr(key, "value", key))) is not None:
                out[category] = out.get(category, 0) + nbytes
    return out


class MomentTracker(MemTracker):
    """A MemTracker that also notes where it first reached its peak: the phase and the innermost active module, the
    last entered of those with no active submodule (MemTracker's own set of active modules does not say which:
    docs/probe.md, "One whole step")."""

    def __init__(self, *tracked: Any) -> None:
        """`tracked`: what the tracker it is mixed into takes (FSDPMemTracker's model and optimizer)."""
        super().__init__(*tracked)
        self.entered: list[str] = []  # active modules, in the order they became active
        self.moment = ""
        # module -> per forward not yet backward (a pipeline stage's micro-batches, first in first out), weak
        # references to its leaf inputs (`release`)
        self._leaf_inputs: dict[Any, list[list[Any]]] = {}

    def track_held(self, *tensors: torch.Tensor) -> None:
        """Tensors a library makes once and keeps between steps, out of any module's parameters (a pipeline stage's
        receive buffers), as activations."""
        for x in tensors:
            self._update_and_maybe_create_winfos(x, _MemRefType.ACT)

    def _enter(self, module) -> None:
        if module is not None:
            self.entered.append(self._mod_tracker.get_known_fqn(module))

    def _leave(self, module) -> None:
        name = self._mod_tracker.get_known_fqn(module) if module is not None else None
        if name in self.entered:
            del self.entered[len(self.entered) - 1 - self.entered[::-1].index(name)]

    @contextmanager
    def called_again(self, module) -> Iterator[None]:
        """Around a module's pre-forward: called again outside any other (a pipeline stage, once a micro-batch;
        torchtitan's lm_head, once a loss chunk), MemTracker takes it for its next iteration unless another module is
        active, but this tracker measures one step."""
        again = module in self.memory_tracking and not self._mod_tracker.is_bw
        parents = self._mod_tracker.parents
        if again:
            parents.add("one step")
        try:
            yield
        finally:
            parents.discard("one step")

    def _pre_fw_hook(self, module, inputs) -> None:
        outermost = not self.entered
        with self.called_again(module):
            super()._pre_fw_hook(module, inputs)
        self._enter(module)
        if outermost:
            self.note_leaves(module, inputs)

    def note_leaves(self, module, inputs) -> None:
        """In forward, the leaves among the inputs of a module called outside any other (`_pre_fw_hook`: the loss
        chunks' lm_head, a pipeline stage) that need a gradient, for `release`. Noting them inside a layer changed
        what MemTracker read in Megatron's latent attention (its moment-by-moment tests), for a reason not yet found."""
        if not self._mod_tracker.is_bw:
            leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.is_leaf and x.requires_grad
                      and not isinstance(x, torch.nn.Parameter)]
            self._leaf_inputs.setdefault(module, []).append([weakref.ref(x) for x in leaves])

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        super()._post_fw_hook(module, inputs, outputs)
        self._leave(module)

    def _pre_bw_hook(self, module, args) -> None:
        super()._pre_bw_hook(module, args)
        self._enter(module)

    def _post_bw_hook(self, module, args) -> None:
        super()._post_bw_hook(module, args)
        self._leave(module)
        self.release(module)

    def release(self, module) -> None:
        """ModTracker hooks the inputs of a module's forward that need a gradient (register_multi_grad_hook); on a
        leaf (torchtitan's loss chunks, detached from the model) the hook holds the leaf's AccumulateGrad, which holds
        the leaf: a cycle through C++ that no collection frees, so the tracker alone would keep the leaf to the step's
        end. Its hooks ran with the module's backward: removed then, the leaf goes when the code lets it go. A leaf
        that another module's pending backward also reads (a layer's input, read by two projections and the layer)
        keeps its hooks until the last of them: they are that module's too."""
        pending = self._leaf_inputs.get(module)
        done = pending.pop(0) if pending else []
        others = {id(ref()) for forwards in self._leaf_inputs.values() for refs in forwards for ref in refs}
        for ref in done:
            leaf = ref()
            if leaf is not None and leaf._backward_hooks and id(leaf) not in others:
                leaf._backward_hooks.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self._peak_bytes()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self._peak_bytes() > before:
            self.moment = self.where()
        return out

    def _peak_bytes(self) -> int:
        """The peaks' sum over the devices that hold memory: a meta tensor's peak (transformers' rowwise style makes
        one, `categories`) rising is no moment of the step's."""
        return sum(n for device, n in self._peak_mem.items() if holds_memory(device))

    def where(self) -> str:
        """`backward layers.1.mlp.fc2`: the phase and the innermost active module, less the root's name."""
        if self._in_opt:
            return "optimizer"
        phase = "backward" if self._mod_tracker.is_bw else "forward"
        leaves = [m for m in self.entered if not any(o.startswith(m + ".") for o in self.entered)]
        inner = leaves[-1].partition(".")[2] if leaves else ""
        return f"{phase} {inner}".strip()


# -- prediction next to measurement -------------------------------------------------

STEP_MODELS = {  # what --step runs, by --impl
    "megatron": "memcalc's own GPT", "hf": "transformers' LlamaForCausalLM", "torchtitan": "torchtitan's Llama3Model",
}
TOLERANCE = 0.01  # issue 8's bound: the peak and each of its categories within 1% of what MemTracker measured


@dataclass(frozen=True)
class CategoryRow:
    """One category (or the total, as "total") at the peak: the timeline's bytes next to MemTracker's."""

    category: str
    predicted: int
    measured: int

    @property
    def difference(self) -> int:
        return self.predicted - self.measured

    @property
    def within(self) -> bool:
        """Within TOLERANCE of the measured bytes (a category measured at 0 must be predicted at 0)."""
        return abs(self.difference) <= TOLERANCE * self.measured


@dataclass(frozen=True)
class StepComparison:
    """One strategy's step: how it ran, the timeline, and MemTracker's readings."""

    strategy: Strategy
    launch: Mode
    predicted: Timeline
    measured: StepMeasurement
    model: str = "memcalc's own GPT"  # what ran: STEP_MODELS
    device: str = "cpu"  # whose kernels: cuda runs the CPU as CUDA runs (torchtitan's shim)
    world: str = ""  # the fake group's world in its factors (t=2, dp_shard*t=2*2=4); "" for one process alone
    rank: int = 0  # the fake group's rank this process ran as (a pipeline stage's)

    @property
    def predicted_moment(self) -> str:
        peak = self.predicted.peak
        return f"{peak.phase} {peak.where}".strip()

    @property
    def moment_matches(self) -> bool:
        return self.predicted_moment == self.measured.moment

    def rows(self, at: str = "peak") -> tuple[CategoryRow, ...]:
        """Each category and the total, at the peak ("peak") or before the step ("steady")."""
        predicted, measured = getattr(self.predicted, at).by_category(), getattr(self.measured, at)
        rows = [CategoryRow(c, predicted[c], measured.get(c, 0)) for c in CATEGORIES]
        return (*rows, CategoryRow("total", sum(predicted.values()), sum(measured.values())))

    @property
    def matches(self) -> bool:
        return all(row.within for row in (*self.rows("peak"), *self.rows("steady")))

    def differences(self) -> list[str]:
        """Each category beyond TOLERANCE, in words."""
        return [
            f"{at} {row.category} predicted {row.predicted:,} B, measured {row.measured:,} B"
            f" ({row.difference:+,} B)"
            for at in ("peak", "steady") for row in self.rows(at) if not row.within
        ]

    def how(self) -> str:
        on = "on cpu" if self.device == "cpu" else "on cpu, run as CUDA runs it"
        if self.predicted.stage != "only":
            first = f", its {'dp_shard' if 'dp_shard' in self.world else 'tp'} rank 0" if self.world else ""
            stage = f"the {self.predicted.stage} pipeline stage{first}"
            return (f"one process as rank {self.rank} of {self.world or f'pp={self.measured.t}'} ({stage})"
                    f" through torch's fake process group {on}")
        if self.launch is Mode.FAKE:
            return f"one process as rank 0 of {self.world} through torch's fake process group {on}"
        return f"one process (t=1) {on}"


def measure_step(config: ModelConfig, strategies: list[str], route: str | None = None,
                 device: str = "cpu") -> list[StepComparison]:
    """Predict and measure one training step per strategy, on the CPU: one process, or rank 0 of the fake group's
    world (t, FSDP2's mesh or DeepSpeed's dp); with `device` cuda (torchtitan's model) predicted for CUDA's kernels
    and run as CUDA runs them (its shim).

    Every strategy's timeline is made before any step runs, so an unmodelled knob is named at once. `route`
    forces a mixture of experts' router (transformers' Mixtral and Qwen2-MoE, megatron-core's MoELayer): the timeline
    walks the balanced bound, which only the balanced route pins, or megatron's worst, which all-to-one pins
    (transformers' grouped_mm experts: any forced route, `_route_pins_bound`).
    """
    if config.impl not in STEP_MODELS:
        raise ConfigError(f"--step runs memcalc's own Megatron-style model, transformers' LlamaForCausalLM with"
                          f" --impl hf or torchtitan's Llama3Model with --impl torchtitan; with --impl {config.impl}"
                          " it cannot")
    if route is not None and not config.moe:
        raise ConfigError(f"--route {route} forces a MoE router: the config has no experts (set num_experts)")
    if device != "cpu" and config.impl != "torchtitan":
        raise ConfigError(f"--step runs as CUDA does (--device {device}) only with --impl torchtitan")
    if config.pp > 1 and config.impl != "torchtitan":
        raise ConfigError(f"--step runs one pipeline stage (pp={config.pp}) only with --impl torchtitan (torch's"
                          f" pipelining on the fake group); with --impl {config.impl} it runs the whole model:"
                          " set pp 1")
    if DISTRIBUTED_OPTIMIZER.ranks(config) > 1:
        raise ConfigError(f"--step runs one rank's AdamW on the whole model, not Megatron-LM's distributed optimizer"
                          f" (its states sharded over dp*cp={DISTRIBUTED_OPTIMIZER.ranks(config)}): see them with"
                          " estimate --totals")
    accounting = Accounting(exact=True, device=device)
    planned = [(STRATEGIES[name], timeline(config, check_strategy(config, STRATEGIES[name]), accounting, stage))
               for name in strategies for stage in _stages(config)]
    check_worst_route(config, route, [strategy for strategy, _ in planned])
    if config.moe and not _route_pins_bound(config, route):
        raise ConfigError(f"--step on a mixture of experts needs --route balanced with moe_tokens balanced (or, with"
                          f" --impl megatron, --route all-to-one with moe_tokens worst; not"
                          f" {route or 'the real router'}, {config.moe_tokens}; transformers' grouped_mm experts: any"
                          " forced route): the step timeline walks the bound, which only the forced route pins")
    model = _model(config, route)
    _check_fits(planned)
    trainer = _trainer(config)
    out = []
    for strategy, predicted in planned:
        if config.pp > 1:  # this process is the stage's first rank of pp x t or pp x dp_shard through the fake group
            world, rank = stage_world(config, strategy, predicted.stage)
            measured = run_fake(trainer, (config, strategy, route, device), math.prod(world.values()), rank=rank)
            words = _in_words(world) if math.prod(world.values()) > config.pp else ""
            out.append(StepComparison(strategy, Mode.FAKE, predicted, measured, model, device, words, rank))
            continue
        world = _fake_world(config, strategy)
        mode = Mode.FAKE if world else Mode.SINGLE
        routed = (route,) if config.moe else ()  # only the MoE runners take one
        routed = (route, device) if device != "cpu" else routed  # torchtitan's runner takes the device after it
        (measured,) = run(trainer, (config, strategy, *routed), mode=mode, t=math.prod(world.values()))
        out.append(StepComparison(strategy, mode, predicted, measured, model, device, _in_words(world)))
    return out


def stage_world(config: ModelConfig, strategy: Strategy, stage: str) -> tuple[dict[str, int], int]:
    """The factors of the fake group's world a pipeline stage's step runs on, pp x t (t under a TP strategy, else 1)
    or under FSDP2 pp x dp_shard, and the rank this process runs as: the stage's first, as torchtitan's ParallelDims
    lays the ranks out (pp outermost)."""
    t = strategy.weight_shards(config.t)
    inner = {"dp_shard": config.dp_shard} if config.dp_shard is not None else {"t": t}
    return {"pp": config.pp} | inner, stage_rank(stage, config.pp) * math.prod(inner.values())


def _fake_world(config: ModelConfig, strategy: Strategy) -> dict[str, int]:
    """The factors of the fake group's world a whole-model step runs rank 0 of (empty: one process alone): FSDP2's
    mesh dp_replicate*dp_shard*t, DeepSpeed's dp, or tp's t."""
    tp = strategy.weight_shards(config.t)
    if config.zero_stage is not None:
        return {"dp": config.dp}
    if config.dp_shard:
        return {name: n for name, n in (("dp_replicate", config.dp_replicate), ("dp_shard", config.dp_shard),
                                        ("t", tp)) if n and n > 1} or {"dp_shard": config.dp_shard}
    return {"t": tp} if tp > 1 else {}


def _in_words(world: dict[str, int]) -> str:
    """The fake group's world as its factors say it: t=2, dp=3, dp_shard*t=2*2=4; "" for none (one process)."""
    if not world:
        return ""
    if len(world) == 1:
        return "{}={}".format(*next(iter(world.items())))
    return f"{'*'.join(world)}={'*'.join(map(str, world.values()))}={math.prod(world.values())}"


def _stages(config: ModelConfig) -> tuple[str | None, ...]:
    """The pipeline stages a step is measured on, each on its rank (those that bound memory), or the only."""
    return tuple(x.name for x in pipeline_stages(config)) if config.pp > 1 else (None,)


def _route_pins_bound(config: ModelConfig, route: str | None) -> bool:
    """Whether the forced route pins the bound the MoE walk takes: balanced the balanced bound (`routing_fixed`);
    all-to-one the worst, where every rank's tokens' k slots land on the same k experts (megatron's walk,
    memcalc.sizing.timeline.megatron_moe.expert_slots; torchtitan's at ep > 1); any forced route the balanced bound
    where all k*b*s slots sit in one storage a tensor, whatever each expert's count (transformers' grouped_mm experts,
    torchtitan's GroupedExperts at ep = 1: memcalc.sizing.timeline.hf_moe, torchtitan_moe)."""
    experts_apart = config.impl == "megatron" or config.impl == "torchtitan" and config.ep > 1
    grouped = config.impl == "hf" and config.experts_implementation == "grouped_mm" or \
        config.impl == "torchtitan" and config.ep == 1
    return (routing_fixed(config, route) or experts_apart and route == "all-to-one" and config.moe_tokens == "worst"
            or grouped and route is not None and config.moe_tokens == "balanced")


# The step trainers of the libraries' own models, by (--impl, under FSDP2): module and function, imported only when a
# step runs (each imports its library: an optional extra). megatron's trains memcalc's GPT with megatron-core's
# modules (`_megatron_modules`); every other case trains memcalc's own GPT.
STEP_TRAINERS = {
    ("hf", ""): ("memcalc.probe.libs.hf_step", "measure_hf_step_on_rank"),
    ("hf", "fsdp"): ("memcalc.probe.libs.hf_fsdp", "measure_hf_fsdp_step_on_rank"),
    ("hf", "zero"): ("memcalc.probe.libs.hf_zero", "measure_hf_zero_step_on_rank"),
    ("torchtitan", ""): ("memcalc.probe.libs.torchtitan_step", "measure_torchtitan_step_on_rank"),
    ("torchtitan", "fsdp"): ("memcalc.probe.libs.torchtitan_step", "measure_torchtitan_fsdp_step_on_rank"),
    ("torchtitan", "pp"): ("memcalc.probe.libs.torchtitan_pp", "measure_torchtitan_pp_step_on_rank"),
    ("torchtitan", "pp fsdp"): ("memcalc.probe.libs.torchtitan_pp", "measure_torchtitan_pp_fsdp_step_on_rank"),
    ("megatron", ""): ("memcalc.probe.libs.megatron_step", "measure_megatron_step_on_rank"),
}


def _megatron_modules(config: ModelConfig) -> list[str]:
    """megatron-core's modules memcalc's GPT takes under --impl megatron: for latent attention (kv_lora_rank), for a
    mixture of experts (num_experts), or both."""
    used = (("MLASelfAttention", config.mla), ("MoELayer", config.moe)) if config.impl == "megatron" else ()
    return [module for module, uses in used if uses]


def _trainer(config: ModelConfig) -> Callable[..., StepMeasurement]:
    """memcalc's own GPT's step, or the one `STEP_TRAINERS` names, imported only then; the MoE runners take the
    route too."""
    sharding = "fsdp" if config.dp_shard is not None else "zero" if config.zero_stage is not None else ""
    key = (config.impl, " ".join(x for x in ("pp" if config.pp > 1 else "", sharding) if x))
    if key not in STEP_TRAINERS or config.impl == "megatron" and not _megatron_modules(config):
        return measure_step_on_rank
    runner(config.impl)  # ProbeError naming the extra to install when the library is missing
    module, function = STEP_TRAINERS[key]
    return getattr(importlib.import_module(module), function)


def _model(config: ModelConfig, route: str | None) -> str:
    """The model the step trains, in words: transformers' model of the config's family (memcalc.probe.libs.hf_step),
    torchtitan's Llama3Model (with qk_layernorm its Qwen3Model, with kv_lora_rank its DeepSeekV3Model) with its Qwen3
    MoE layers (DeepSeek-V3's: its own blocks with that MoE) (memcalc.probe.libs.torchtitan_step), its router
    forced."""
    forced = f", router forced {route}" if config.moe else ""
    if config.impl == "torchtitan":
        model = ("torchtitan's DeepSeekV3Model" if config.mla else "torchtitan's Qwen3Model" if config.qk_layernorm
                 else STEP_MODELS[config.impl])
        layers = "its MoE layers" if config.mla else "its Qwen3 MoE layers"
        return f"{model} with {layers}{forced}" if config.moe else model
    if config.impl == "hf":
        return f"transformers' {layer_family(config).architectures[0]}{forced}"
    modules = " and ".join(_megatron_modules(config))
    return STEP_MODELS[config.impl] + (f" with megatron-core's {modules}" if modules else "") + forced


def _check_fits(planned: list[tuple[Strategy, Timeline]]) -> None:
    """Refuse, in one line, a step whose predicted peak exceeds this machine's memory (warm-up and step alike)."""
    have, what = available("cpu")
    for strategy, predicted in planned:
        need = predicted.peak.bytes
        if have is not None and need > have:
            raise ConfigError(
                f"measure --step {strategy.name} would peak at {need:,} bytes ({human_bytes(need)}, the timeline's"
                f" prediction), but {what} is {have:,} bytes ({human_bytes(have)}); choose smaller sizes"
            )
