"""The machines a run is planned for (the `hardware` group, conf/hardware/) and the planner's own keys (`plan.*`,
read by `python -m llmtrain.tools.plan` and `parallel=auto`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from llmtrain.domains import ExistingPath, Flag, Number, OneOf, Text, at_least, key, positive


@dataclass
class HardwareConfig:
    """The machines a run is planned for (conf/hardware/): what the planner's memory and time estimates use."""

    name: str = key(MISSING, Text(), "the machine description (`conf/hardware/<name>.yaml`)")
    nodes: int = key(1, at_least(1), "nodes")
    gpus_per_node: int = key(1, at_least(1), "devices (ranks) per node")
    device_memory_gib: Optional[float] = key(
        None,
        positive(),
        "memory of one device in GiB; null (cpu): the host's memory shared out over the ranks of the node",
    )
    intra_node_gbps: float = key(
        MISSING,
        positive(),
        "GB/s per device, one direction, to the other devices of its node (cpu: gloo's all-reduce bus bandwidth "
        "measured by `comm_bench` on a 2-core machine)",
    )
    inter_node_gbps: float = key(
        MISSING,
        positive(),
        "GB/s per device, one direction, across nodes (cpu: 1 Gbit/s Ethernet)",
    )
    mfu: float = key(
        0.4,
        Number(low=0, high=1, low_open=True),
        "fraction of the device's peak (its card's, by `device_name`; a CPU's, timed) a transformer's training "
        "compute reaches here, recomputation included (the planner's predicted step times), in eager bf16 without "
        "the features `*_speed` scales; a100x8's and h100x8's are the median HFU of half the published runs, the "
        "other half testing it ([planner.md](planner.md#held-to-published-runs))",
    )
    # What a feature does to the step's speed on this device (step speed with it / without it), as the device's
    # measurements give it: gpu_check's speed section (llmtrain/tools/gpu_check.py) or published pairs of runs
    # that differ only in it. 1: not measured here, counted as free.
    compile_speed: float = key(
        1.0, positive(), "step speed with `train.compile=true` against eager (the planner's predicted step times)"
    )
    float8_speed: float = key(
        1.0, positive(), "step speed with `train.float8` against the same run compiled in bf16 (the planner's)"
    )
    document_mask_speed: float = key(
        1.0,
        positive(),
        "step speed with `train.attention=document` (FlexAttention's masks) against the fused causal kernel",
    )
    selective_recompute_speed: float = key(
        1.0,
        positive(),
        "step speed with `train.activation_checkpointing=selective` against none (full recomputation's cost is "
        "counted as FLOPs: a forward more)",
    )
    kernel_launch_us: float = key(
        5.0,
        positive(),
        "microseconds the host takes to launch one CUDA kernel (about 5 on current drivers): what a mixture's experts "
        "cost beyond their FLOPs where torch has no fused grouped GEMM for the card (Ada, Ampere), each expert's "
        "matmuls then launched one by one after a host read of the counts (the planner's step time)",
    )
    peer_to_peer: bool = key(
        True,
        Flag(),
        "devices reach each other directly (NVLink, PCIe P2P) rather than through host memory",
    )
    device_name: Optional[str] = key(
        None,
        Text(),
        "part of the name torch gives the device this describes (`torch.cuda.get_device_name()`, e.g. `H200`): a "
        "run on such a GPU plans with this config whatever `hardware` says, at the card's dense bf16 peak from "
        "`GPU_PEAK_BF16_FLOPS` (`llmtrain/planner/hardware.py`, matched within this name); null: no GPU (cpu), "
        "whose peak is timed",
    )


@dataclass
class PlanConfig:
    """The planner's knobs (llmtrain.tools.plan; parallel=auto reads `measured`, `mfu` and `reserved_gib`)."""

    world_size: Optional[int] = key(
        None,
        at_least(1),
        "ranks the planner plans for; null: `hardware.nodes` × `hardware.gpus_per_node` (`parallel=auto`: the real "
        "world)",
    )
    # A float, so that 7.5e9 is accepted as the whole number it is (an int key refuses any float).
    parameters: Optional[float] = key(
        None,
        at_least(1),
        'plan model states for this many parameters instead of the model\'s ("what if"), e.g. 7.5e9',
    )
    param_bytes: float = key(2, positive(), "bytes per parameter of the weights (bf16; llmtrain itself keeps fp32: 4)")
    grad_bytes: float = key(2, positive(), "bytes per parameter of the gradients (bf16; llmtrain: 4)")
    optimizer_bytes: float = key(
        12,
        positive(),
        "bytes per parameter of the optimizer state (fp32 master copy + 2 AdamW moments; llmtrain: 8); under "
        "`optim=muon` the blocks' weight matrices keep one fp32 moment fewer (4 bytes less)",
    )
    layouts: str = key(
        "dp",
        OneOf(("dp", "all")),
        "`dp`: the data-parallel layouts; `all`: also tensor, pipeline and 3-D layouts",
    )
    measured: Optional[str] = key(
        None,
        ExistingPath("file"),
        "a `comm_bench.csv` whose measured bus bandwidths replace the hardware's link numbers; null: the planner "
        "tool uses the hardware's, and `parallel=auto` on more than one rank times the machine's collectives at start "
        "(a few seconds, cached in `data.cache_dir/links/` per host, world size and device)",
    )
    reserved_gib: float = key(
        1.0,
        Number(low=0),
        "per device, kept out of the plan: CUDA context, NCCL buffers, allocator fragmentation",
    )
    out: Optional[str] = key(
        None,
        Text(),
        "a file `llmtrain.tools.plan` writes its table to as JSON (the layouts, the pick and why); null: the printed "
        "table alone, nothing written",
    )
