"""Mixture of experts: a block's MLP replaced by `num_experts` MLPs of which each token uses `top_k`, chosen by a
router (token-choice top-k, as Mixtral, OLMoE and DeepSeek), plus optional always-on shared experts.

- **Routing**: router logits in fp32, softmax over all experts, the top_k kept and renormalised to sum to 1
  (Mixtral's rule, and Qwen3-MoE's `norm_topk_prob`; transformers computes the same), or not (`renormalize`).
- **Dropless**: every token reaches its experts, whatever the load (no capacity factor, no dropped tokens), so the
  result depends only on the tokens, never on how they were batched or spread over ranks.
- **Balance**: the Switch Transformer / GShard auxiliary loss, coef · E · Σ_e f_e · P_e (f_e the share of routed
  slots expert e received, P_e its mean router probability), optionally the router z-loss (ST-MoE), coef ·
  mean(logsumexp(logits)²). Chosen over DeepSeek-V3's loss-free bias because it is a plain gradient term: it
  needs no state outside the weights, so checkpoints and every layout carry it unchanged. Both terms reach the
  router through `add_auxiliary_loss`, which leaves the block's output untouched and injects their gradient in
  backward, scaled like the micro-batch's loss (`auxiliary_loss_scale`), so pipelines need no extra outputs.
- **Context parallelism** gives a block only part of each sequence: the slot shares f_e are then summed over the
  ranks sharing the sequences (`sequence.summed`, one all-reduce of E counts), while P_e stays each rank's own
  mean, whose gradients the data-parallel average over those ranks turns into the whole sequence's (as it does
  for the loss and the z-loss).
- **Experts** are stored as stacked tensors (expert, in, out): expert parallelism shards their first dimension
  and sets `dispatch`, which sends each routed token to the rank holding its expert and back
  (llmtrain/parallel/expert.py).

The experts run as grouped GEMMs over the tokens sorted by expert (`torch._grouped_mm`, on CPU and on CUDA's
Hopper and Blackwell; the group boundaries stay on the device), so a block without expert parallelism never waits
for the host, and finer experts (DeepSeek's many narrow ones) cost about what a few wide ones do. On other GPUs
(Ada's sm_89: RTX 40xx, L40) torch has no fused kernel; the experts run one by one there, one host read per block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from llmtrain.catalog import MlpKind, imported
from llmtrain.model.lora import LoRAConfig
from llmtrain.model.quantize import dequantized, is_nf4


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 0  # 0: dense MLPs everywhere
    top_k: int = 2
    renormalize: bool = True  # the top_k probabilities divided by their sum (Qwen3-MoE's norm_topk_prob)
    every: int = 1  # block i is a mixture when (i + 1) % every == 0: 1 every block, 2 every second
    shared_experts: int = 0  # always-on experts beside the routed ones
    d_ff: int | None = None  # one expert's hidden width; None: the model's MLP width
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0

    def is_moe_block(self, index: int) -> bool:
        return self.num_experts > 0 and (index + 1) % self.every == 0


_LOSS_SCALE = [1.0]


@contextmanager
def auxiliary_loss_scale(scale: float) -> Iterator[None]:
    """The factor the trainer applies to this micro-batch's loss before backward (1 / micro-batches when it
    divides each loss; 1 under pipeline schedules, which scale the gradients afterwards): the auxiliary losses'
    gradients get the same, so they weigh as if added to every micro-batch's loss."""
    previous = _LOSS_SCALE[0]
    _LOSS_SCALE[0] = scale
    try:
        yield
    finally:
        _LOSS_SCALE[0] = previous


class _AuxiliaryLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.scale = _LOSS_SCALE[0]
        return output.view_as(output)

    @staticmethod
    def backward(ctx, output_grad: torch.Tensor):
        return output_grad, torch.full((), ctx.scale, device=output_grad.device)


def add_auxiliary_loss(output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`output` unchanged; in backward, `loss` is differentiated as if it were added to the training loss."""
    return _AuxiliaryLoss.apply(output, loss)


class HiddenSplit(Protocol):
    """How a mixture's inputs enter and its outputs leave experts whose hidden units are split over ranks (tensor
    parallelism sets one: parallel/tp.py's SplitExperts)."""

    def into(self, x: torch.Tensor) -> torch.Tensor:
        """Megatron's f: identity forward; backward sums the ranks' partial gradients."""
        ...

    def out_of(self, x: torch.Tensor) -> torch.Tensor:
        """Megatron's g: the ranks' partial sums summed forward; identity backward."""
        ...


def _recomputing() -> bool:
    """Whether this forward runs inside backward: activation checkpointing recomputing the block. (A compiled
    block's recomputation replays no Python, so it never gets here.)"""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts: the whole stack, or an expert-parallel rank's block of it (a DTensor's local part)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


# The compute capabilities (majors) with a fused grouped GEMM in torch._grouped_mm: Hopper (sm_90) and Blackwell
# (sm_100). Elsewhere (an RTX 4080 is sm_89) torch falls back to copying the group offsets to the host and looping,
# a host read in each of a block's ~9 grouped GEMMs (forward and backward); the experts' own loop reads the counts
# once per block and runs its matmuls (and their backward) without another.
FUSED_GROUPED_GEMM_MAJORS = (9, 10)


def _grouped_kernel_takes(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """torch._grouped_mm reads rows of 16 bytes at once (every weight's last dimension a multiple of 16 bytes),
    takes fp32, bf16 and fp16 on CPU, and bf16 only on CUDA (torch's documentation: fp32 there may have no kernel)
    and under torch.compile (its shape function refuses the rest); on CUDA only where it is fused."""
    aligned = all(w.shape[-1] * w.element_size() % 16 == 0 for w in weights)
    eager_cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()  # its compiled form takes bf16 only
    kinds = (torch.float32, torch.bfloat16, torch.float16) if eager_cpu else (torch.bfloat16,)
    fused = x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] in FUSED_GROUPED_GEMM_MAJORS
    return aligned and x.dtype in kinds and fused


class Experts(nn.Module):
    """`num_experts` MLPs of one kind (model.mlp) with stacked weights: w_in (E, d, f), w_gate (E, d, f) when the
    kind is gated, w_out (E, f, d). Under expert parallelism the weights are DTensors sharded on E and `forward` runs
    this rank's experts."""

    def __init__(self, num_experts: int, d_model: int, hidden: int, kind: MlpKind, lora: LoRAConfig):
        super().__init__()
        self.num_experts, self.d_model, self.hidden = num_experts, d_model, hidden
        self.activation: Callable[[torch.Tensor], torch.Tensor] = imported(kind.activation)
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, hidden)) if kind.gated else None
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        # Low-rank adapters per expert (model.lora.targets `experts_in`, `experts_out`), as PEFT adapts
        # transformers' fused experts: one A and B beside the input projections (gate then up, as their fused
        # gate_up_proj), one beside the output projection; stacked by expert as the weights are.
        width_in = hidden * (2 if kind.gated else 1)
        self.in_lora_a = self.in_lora_b = self.out_lora_a = self.out_lora_b = None
        if lora.adapts("experts_in"):
            self.in_lora_a = nn.Parameter(torch.empty(num_experts, d_model, lora.rank))
            self.in_lora_b = nn.Parameter(torch.empty(num_experts, lora.rank, width_in))
        if lora.adapts("experts_out"):
            self.out_lora_a = nn.Parameter(torch.empty(num_experts, hidden, lora.rank))
            self.out_lora_b = nn.Parameter(torch.empty(num_experts, lora.rank, d_model))
        self.scale = lora.scale if lora.enabled else 0.0
        self.adapting = self.in_lora_a is not None or self.out_lora_a is not None  # False: the base alone
        # Tensor parallelism (parallel/tp.py's SplitExperts): each rank holds a slice of every expert's hidden
        # units, so its outputs are partial sums, reduced by the MoE once per token.
        self.hidden_split: HiddenSplit | None = None

    def stack_shape(self, attribute: str) -> tuple[int, int, int]:
        """The whole stack `attribute` (w_in, w_gate, w_out) holds: (experts, in, out), however NF4 stores it."""
        return (self.num_experts, self.hidden, self.d_model) if attribute == "w_out" else (
            self.num_experts, self.d_model, self.hidden)  # fmt: skip

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: tokens sorted by (this rank's) expert, counts[e] of them for expert e (a tensor on x's device) -> each
        through its expert, in the same order. One grouped GEMM per weight over all experts, its group boundaries
        read on the device: no host sync. Where the grouped kernel does not apply (_grouped_kernel_takes), the
        experts run one by one, which reads the counts on the host. Experts NF4 holds (model.quantize_base) are
        dequantised by each matmul, forward and backward alike (_FrozenStack)."""
        weights = [_local(w) for w in (self.w_in, self.w_gate, self.w_out) if w is not None]
        adapters = [_local(a) for a in self._adapters() if a is not None]
        if torch.is_autocast_enabled(x.device.type):  # what autocast does for each expert's matmul
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), [w if is_nf4(w) else w.to(dtype) for w in weights]
            adapters = [a.to(dtype) for a in adapters]
        if not len(x):
            # No rows (an expert-parallel rank whose experts got no token): an empty result still joined to x, so
            # that backward reaches the exchange that brought x and every rank takes part in it, and to the
            # weights, whose gradient is then zero rather than none: FSDP reduce-scatters it with every other
            # rank's.
            return x[:0] + sum(w.sum() for w in (*weights, *adapters) if not is_nf4(w)) * 0
        shapes = [_FrozenStack.shape_of(w, counts.numel(), x.dtype) for w in weights]
        groups = _Groups.of(counts, _grouped_kernel_takes(x, [*shapes, *adapters]))
        return self._mlp(x, weights, adapters, lambda rows, w: _FrozenStack.matmul(rows, w, groups))

    def _adapters(self) -> tuple[torch.Tensor | None, ...]:
        """(in A, in B, out A, out B), None where not adapted, all None while adapters are disabled."""
        if not self.adapting:
            return (None,) * 4
        return self.in_lora_a, self.in_lora_b, self.out_lora_a, self.out_lora_b

    def merged(self, attribute: str) -> torch.Tensor:
        """Stack `attribute` (w_in, w_gate, w_out) as the experts compute with it: dequantised (E, in, out), its
        adapters' update A B · scale added (what an export without adapters holds)."""
        weight = getattr(self, attribute).detach()
        stack = _FrozenStack.whole(weight, self.num_experts, torch.float32) if is_nf4(weight) else weight.clone()
        a, b = (self.in_lora_a, self.in_lora_b) if attribute != "w_out" else (self.out_lora_a, self.out_lora_b)
        if a is None or b is None:
            return stack
        update = (a @ b).detach() * self.scale  # (E, in, width): the gate's columns, then the up-projection's
        if attribute != "w_out" and self.w_gate is not None:
            update = update[..., self.hidden :] if attribute == "w_in" else update[..., : self.hidden]
        return stack + update.to(stack.dtype)

    def _mlp(
        self, x: torch.Tensor, weights: list[torch.Tensor], adapters: list[torch.Tensor], matmul: Callable
    ) -> torch.Tensor:
        """The experts' MLP of `x` (the frozen or trained stacks through `matmul`), each adapted projection's
        low-rank update (x A) B · scale beside it."""
        factors = iter(adapters)
        in_adapted = self.adapting and self.in_lora_a is not None
        out_adapted = self.adapting and self.out_lora_a is not None
        update = matmul(matmul(x, next(factors)), next(factors)) * self.scale if in_adapted else None
        if self.w_gate is not None:
            w_in, w_gate, w_out = weights
            gate, up = matmul(x, w_gate), matmul(x, w_in)
            if update is not None:  # the gate's columns, then the up-projection's
                width = gate.shape[-1]
                gate, up = gate + update[..., :width], up + update[..., width:]
            hidden = self.activation(gate) * up
        else:
            w_in, w_out = weights
            projected = matmul(x, w_in)
            hidden = self.activation(projected if update is None else projected + update)
        out = matmul(hidden, w_out)
        if out_adapted:
            out = out + matmul(matmul(hidden, next(factors)), next(factors)) * self.scale
        return out


@dataclass(frozen=True)
class _Groups:
    """How a rank's rows split by expert for the experts' matmuls: as the grouped kernel's offsets, read on the
    device, or where it does not apply (_grouped_kernel_takes), as counts read on the host once a block, the
    experts then run one by one."""

    offsets: torch.Tensor | None
    counts: list[int] | None

    @classmethod
    def of(cls, counts: torch.Tensor, grouped: bool) -> _Groups:
        if grouped:
            return cls(counts.cumsum(0, dtype=torch.int32), None)
        return cls(None, counts.tolist())

    @property
    def experts(self) -> int:
        if self.counts is not None:
            return len(self.counts)
        assert self.offsets is not None
        return self.offsets.numel()

    def matmul(self, rows: torch.Tensor, stack: torch.Tensor) -> torch.Tensor:
        """rows @ each expert's matrix of `stack` (experts, in, out)."""
        if self.offsets is not None:  # (CPU's kernel is given both operands contiguous: see _FrozenStack.backward)
            return torch._grouped_mm(rows.contiguous(), stack.contiguous(), offs=self.offsets)
        assert self.counts is not None
        return _one_by_one(rows, stack, self.counts)


# Eager under torch.compile: traced, each expert's share of rows is a size dynamo specialises (0 and 1 apart from the
# rest), so every new pattern of empty experts would compile the block again.
@torch.compiler.disable
def _one_by_one(rows: torch.Tensor, stack: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """rows @ each expert's matrix of `stack`, the experts in turn, `counts[e]` rows each."""
    parts = [part @ stack[e] for e, part in enumerate(rows.split(counts)) if len(part)]
    return torch.cat(parts) if parts else rows.new_zeros(0, stack.shape[-1])


class _FrozenStack(torch.autograd.Function):
    """rows @ each expert's matrix of a frozen NF4 stack (E x in, out: quantize.py), grouped as `groups` says: the
    stack dequantised for the product and again for the input's gradient in backward, so a block holds its experts in
    the compute dtype only while it computes (autograd would otherwise keep every block's until backward), grouped
    kernel or not. A plain stack goes to the matmul as it is."""

    @staticmethod
    def shape_of(weight: torch.Tensor, experts: int, dtype: torch.dtype) -> torch.Tensor:
        """What the grouped kernel is asked to take: where NF4 holds the stack, its meta twin (experts, in, out) in
        the compute dtype."""
        if not is_nf4(weight):
            return weight
        rows, columns = weight.shape
        return torch.empty(experts, rows // experts, columns, dtype=dtype, device="meta")

    @staticmethod
    def whole(weight: torch.Tensor, experts: int, dtype: torch.dtype) -> torch.Tensor:
        """An NF4 stack of `experts` (experts x in, out) as (experts, in, out) in `dtype`."""
        return dequantized(weight).to(dtype).view(experts, -1, weight.shape[1])

    @staticmethod
    def matmul(rows: torch.Tensor, weight: torch.Tensor, groups: _Groups) -> torch.Tensor:
        if not is_nf4(weight):
            return groups.matmul(rows, weight)
        return _FrozenStack.apply(rows, weight, groups)

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, groups: _Groups) -> torch.Tensor:  # type: ignore[override]
        ctx.weight, ctx.groups = weight, groups  # NF4's codes and scales: held anyway as the parameter
        return groups.matmul(rows, _FrozenStack.whole(weight, groups.experts, rows.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        stack = _FrozenStack.whole(ctx.weight, ctx.groups.experts, grad.dtype).transpose(-1, -2)
        return ctx.groups.matmul(grad, stack), None, None


# (experts, tokens sorted by expert, tokens per expert) -> each token through its expert, in the same order
ExpertDispatch = Callable[[Experts, torch.Tensor, torch.Tensor], torch.Tensor]


class SequenceShare(Protocol):
    """Which share of every sequence a forward sees (context parallelism's ContextShard): `parts` ranks hold one
    part each, and `summed` adds a per-rank count over them."""

    parts: int

    def summed(self, counts: torch.Tensor) -> torch.Tensor: ...


class MoE(nn.Module):
    """Router, routed experts and shared experts of one block: (batch, seq, d) -> (batch, seq, d)."""

    def __init__(
        self,
        d_model: int,
        hidden: int,
        kind: MlpKind,
        moe: MoEConfig,
        make_shared: nn.Module | None,
        lora: LoRAConfig,
    ):
        super().__init__()
        self.moe = moe
        self.router = nn.Linear(d_model, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, d_model, hidden, kind, lora)
        self.shared = make_shared
        self.dispatch: ExpertDispatch | None = None  # expert parallelism: tokens to their experts' ranks and back
        self.sequence: SequenceShare | None = None  # context parallelism: this rank holds part of each sequence
        # Slots routed to each expert since the last `take_load`: the load-balance metric. A plain attribute, not
        # a buffer: layouts allocate and checkpoint buffers, and this is a running count.
        self.load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens).float()
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(self.moe.top_k, dim=-1)
        if self.moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)

        slots = chosen.flatten()
        order = slots.argsort(stable=True)
        # Slots per expert, counted on the device (bincount would read its largest slot on the host).
        counts = torch.zeros(self.moe.num_experts, dtype=torch.long, device=slots.device)
        counts.index_add_(0, slots, torch.ones_like(slots))
        token_of_slot = order // self.moe.top_k
        split = self.experts.hidden_split
        slot_weights = weights.flatten()[order, None]
        # Under tensor parallelism the partial sums are reduced per token, after the top_k slots of each token are
        # combined, and the input gradient per token, before they are copied out: 1/top_k of the traffic of
        # reducing every routed slot. A slot's routing weight then meets a partial output, so its gradient (one
        # number per slot) is reduced too; the router stays replicated, its gradients the same on every rank.
        expert_tokens = tokens
        if split is not None:
            expert_tokens, slot_weights = split.into(tokens), split.into(slot_weights)
        rows = expert_tokens[token_of_slot]
        routed = self.experts(rows, counts) if self.dispatch is None else self.dispatch(self.experts, rows, counts)
        # Each token's top_k outputs are weighted and summed in fp32, the routing weights' dtype, then cast to the
        # residual stream's: under autocast the experts answer in bf16 while the stream (and the shared experts'
        # sum below) stays fp32; under FSDP's bf16 parameters both are bf16. (torchtitan sums in fp32 too.)
        routed = routed.float() * slot_weights
        out = torch.zeros(tokens.shape, dtype=routed.dtype, device=tokens.device)
        out = out.index_add_(0, token_of_slot, routed).to(tokens.dtype)
        if split is not None:
            out = split.out_of(out)
        if self.shared is not None:
            out = out + self.shared(tokens)
        # A training step's routing, once: not validation's, not shape probes', not activation checkpointing's rerun.
        if self.training and torch.is_grad_enabled() and not _recomputing():
            self.load = counts.detach() if self.load is None else self.load + counts.detach()

        out = out.view(shape)
        loss = self.balance_loss(logits, probs, counts, len(tokens)) if self.training else None
        return add_auxiliary_loss(out, loss) if loss is not None else out

    def take_load(self) -> torch.Tensor:
        """The slots routed to each expert since the last call (zeros if none), and reset."""
        zeros = torch.zeros(self.moe.num_experts, dtype=torch.long, device=self.router.weight.device)
        load = self.load if self.load is not None else zeros
        self.load = None
        return load

    def balance_loss(
        self, logits: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor, n_tokens: int
    ) -> torch.Tensor | None:
        m = self.moe
        terms = []
        if m.aux_loss_coef > 0:
            if self.sequence is not None:
                counts, n_tokens = self.sequence.summed(counts), n_tokens * self.sequence.parts
            share = counts.float() / (n_tokens * m.top_k)
            terms.append(m.aux_loss_coef * m.num_experts * (share * probs.mean(dim=0)).sum())
        if m.z_loss_coef > 0:
            terms.append(m.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean())
        return sum(terms[1:], terms[0]) if terms else None


def expert_init_std(name: str, n_layer: int) -> float:
    """GPT-2's rule for the experts' stacked matrices: 0.02, scaled by 1/sqrt(2 n_layer) on the output projection."""
    return 0.02 / math.sqrt(2 * n_layer) if name.endswith("w_out") else 0.02
