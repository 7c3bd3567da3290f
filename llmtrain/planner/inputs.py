"""The plan's inputs from a composed config: the machine (hardware group, plan.*), the workload (model, batch),
and the bytes per parameter."""

from __future__ import annotations

from dataclasses import replace

from llmtrain.catalog import ADAMW_MOMENTS, MOMENT_BYTES, OBJECTIVES, OPTIMIZERS, objective_of
from llmtrain.errors import ConfigError
from llmtrain.model import gpt_config, meta_model
from llmtrain.model.quantize import nf4_bytes_per_weight
from llmtrain.parallel.float8 import float8_weight_share
from llmtrain.planner.cost import GIB, FeatureSpeeds, Machine, Workload
from llmtrain.planner.hardware import memory_bandwidth_of, peak_flops_of, runs_experts_one_by_one
from llmtrain.planner.host import host_matmul_flops, host_memory_bandwidth, total_memory_bytes
from llmtrain.planner.links import Links
from llmtrain.planner.memory import StateBytes
from llmtrain.planner.rollout import Sampling


def llmtrain_state_bytes(cfg, bf16: bool) -> StateBytes:
    """What llmtrain itself holds: fp32 weights and gradients, AdamW's two moments (fp32, or 8-bit codes and their
    scales; Muon's matrices: one fp32 moment), activations (and FSDP's gathered copies) in the compute dtype (the
    blocks' Linear weights gathered in float8 under train.float8=tensorwise)."""
    sizes = StateBytes(param=4, grad=4, optimizer=ADAMW_MOMENTS * MOMENT_BYTES[32], compute=2 if bf16 else 4)
    return _with_precisions(sizes, cfg)


def configured_state_bytes(cfg, bf16: bool) -> StateBytes:
    p = cfg.plan
    sizes = StateBytes(param=p.param_bytes, grad=p.grad_bytes, optimizer=p.optimizer_bytes, compute=2 if bf16 else 4)
    return _with_precisions(sizes, cfg)


def _with_precisions(sizes: StateBytes, cfg) -> StateBytes:
    """`sizes` with optim.state_bits's moments (plan.optimizer_bytes counts two fp32 ones), train.float8's
    gathers and optim.offload's host-side state, then the optimizer's own moments."""
    fewer = ADAMW_MOMENTS * (MOMENT_BYTES[32] - MOMENT_BYTES[cfg.optim.state_bits])
    sizes = replace(
        sizes,
        optimizer=sizes.optimizer - fewer,
        float8_share=float8_gathered_share(cfg),
        optimizer_on_host=cfg.optim.offload,
        nf4=nf4_bytes_per_weight() if cfg.model.quantize_base == "nf4" else 0.0,
    )
    return _with_optimizer(sizes, cfg.optim.name)


def float8_gathered_share(cfg) -> float:
    """Under train.float8=tensorwise, the share of the blocks' Linear weights float8 converts (train.float8_layers),
    which FSDP gathers in float8; 0 otherwise."""
    if cfg.train.float8 != "tensorwise":
        return 0.0
    return float8_weight_share(meta_model(cfg.model, BLOCKS_ONLY_VOCABULARY), "tensorwise", cfg.train.float8_layers)


BLOCKS_ONLY_VOCABULARY = 16  # float8 converts inside the blocks only: the vocabulary's size changes no share


def _with_optimizer(sizes: StateBytes, optimizer: str) -> StateBytes:
    """`sizes` (AdamW's optimizer bytes) with `optimizer`'s own fp32 moments, its row's: `moments` outside the
    blocks' weight matrices, `matrix_moments` in them."""
    spec = OPTIMIZERS[optimizer]
    return replace(
        sizes,
        optimizer=sizes.optimizer - (ADAMW_MOMENTS - spec.moments) * MOMENT_BYTES[32],
        matrix_optimizer=sizes.optimizer - (ADAMW_MOMENTS - spec.matrix_moments) * MOMENT_BYTES[32],
    )


def plans_bf16(cfg) -> bool:
    """The precision a plan assumes: train.precision, where `auto` means bf16 on any hardware but the CPU."""
    return cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and cfg.hardware.name != "cpu")


def planned_vocab_size(cfg) -> int:
    """The vocabulary the model will have, without building the tokenizer."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    tokenizer = cfg.data.tokenizer
    if tokenizer.kind == "byte":
        return 257
    if tokenizer.kind == "bpe" and tokenizer.vocab_size:
        return tokenizer.vocab_size
    raise ConfigError(
        f"model.vocab_size is null and data.tokenizer.kind={tokenizer.kind} gives no size without loading it: "
        f"set model.vocab_size (e.g. 50257 for GPT-2's tokenizer)"
    )


def machine_for(cfg, world_size: int, ranks_per_node: int, bf16: bool) -> Machine:
    """The hardware config (and plan.measured) as the plan's Machine."""
    hw = cfg.hardware
    memory_gib = hw.device_memory_gib or total_memory_bytes() / GIB / ranks_per_node
    return Machine(
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        memory_bytes=memory_gib * GIB,
        reserved_bytes=cfg.plan.reserved_gib * GIB,
        peak_flops=_peak_flops(hw, ranks_per_node, bf16),
        mfu=cfg.hardware.mfu,
        links=Links(hw.intra_node_gbps, hw.inter_node_gbps, cfg.plan.measured),
        speeds=FeatureSpeeds(hw.compile_speed, hw.float8_speed, hw.document_mask_speed, hw.selective_recompute_speed),
        memory_bandwidth=_memory_bandwidth(cfg, ranks_per_node),
        expert_launch_s=hw.kernel_launch_us * 1e-6 if hw.device_name and runs_experts_one_by_one(hw.device_name) else 0,
    )


def _memory_bandwidth(cfg, ranks_per_node: int) -> float:
    """A rank's memory bandwidth, which only a rollout's decoding reads: its card's, found by the hardware's
    device_name (not known: inf, decoding counted as compute-bound); a CPU's, timed where the step samples."""
    hw = cfg.hardware
    if hw.device_name is not None:
        return memory_bandwidth_of(hw.device_name) or float("inf")
    samples = OBJECTIVES[objective_of(cfg.train.objective, cfg.data.source)].samples
    return host_memory_bandwidth(ranks_per_node) if samples else float("inf")


def _peak_flops(hw, ranks_per_node: int, bf16: bool) -> float:
    """A rank's peak FLOP/s for the run's precision: its card's, found by the hardware's device_name; a CPU's,
    timed."""
    if hw.device_name is None:
        return host_matmul_flops(ranks_per_node)
    peak = peak_flops_of(hw.device_name, bf16)
    if peak is None:
        raise ConfigError(
            f"hardware.device_name={hw.device_name!r} names no card of GPU_PEAK_BF16_FLOPS in "
            f"llmtrain/planner/hardware.py: add the card's dense bf16 peak there"
        )
    return peak


def workload_for(cfg, vocab_size: int, sizes: StateBytes) -> Workload:
    t = cfg.train
    objective, rl = OBJECTIVES[objective_of(cfg.train.objective, cfg.data.source)], cfg.rl
    return Workload(
        gpt=gpt_config(cfg.model, vocab_size),
        seq_len=t.seq_len,
        batch_size=t.batch_size,
        micro_batch_size=t.micro_batch_size,
        recompute=t.activation_checkpointing,
        sizes=sizes,
        parameters=int(cfg.plan.parameters) if cfg.plan.parameters else None,
        optimizer=cfg.optim.name,
        whole_matrices=cfg.optim.whole_matrices,
        loss="fused" if t.compile else "chunked",
        forwards_alone=objective.forwards_alone + (objective.samples and rl.beta > 0),  # GRPO's reference
        sampling=Sampling(cfg.rl.group_size, cfg.rl.max_new_tokens, cfg.rl.gather_weights)
        if objective.samples
        else None,
        compile=t.compile,
        float8=t.float8 != "none",
        document_mask=t.attention == "document",
    )
