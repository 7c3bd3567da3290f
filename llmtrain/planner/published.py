"""Published measurements of real training runs, each as llmtrain would run it: what the planner's step times and
memory are checked against (llmtrain/bench/published_runs.py, tests/planner/test_planner.py) and what its efficiencies
are calibrated from (`hardware.mfu` of a100x8 and h100x8: the median HFU of each machine's MPT rows below).

Throughput. Source: MosaicML's llm-foundry, scripts/train/benchmarking/README.md ("MPT Training Benchmarks"), the tables
"H100 80GB BF16" and "A100 80GB with 1600 Gbps node-node interconnect (RoCE)": MPT models (GPT-2's block: biases,
LayerNorm, GELU at 4 x d_model, learned positions, a tied head, vocabulary 50,368) trained with FSDP FULL_SHARD in
bf16, each row a global batch, micro-batch, sequence length, GPU count, activation checkpointing on or off, and the
measured tokens per second per GPU, MFU and HFU. Their parameter counts (NumParams) are the shapes' exactly. The
rows here span every model size, short and long sequences, one node and eight, with and without checkpointing.

Memory and throughput. Source: torchtitan's benchmarks/llama3_h100_202412_torchtitan.md ("performance benchmarks
... at the end of 2024"): Llama 3.1 8B and 70B on H100s of 95 GiB (HBM2e, at 500 W, below the SXM part's peak)
with FSDP, context parallelism and tensor parallelism, bf16, sequences of 8K (torchtitan's default) to 256K, each
row a layout, local batch, activation checkpointing, torch.compile and float8 on or off, and the measured
tokens per second per GPU and memory per GPU (the largest over the GPUs of the CUDA allocator's reserved bytes,
which exceed the tensors' by its cache). Rows with asynchronous tensor parallelism, which llmtrain does not have,
are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
MPT_VOCABULARY = 50368
# MPT's sizes: (n_layer, d_model, n_head).
MPT_SHAPES = {
    "760m": (24, 1536, 12),
    "1b": (24, 2048, 16),
    "3b": (32, 2560, 32),
    "7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "30b": (48, 7168, 64),
    "70b": (80, 8192, 64),
}


@dataclass(frozen=True)
class PublishedRun:
    model: str  # an MPT_SHAPES name
    hardware: str  # conf/hardware/<name>.yaml
    gpus: int
    seq_len: int
    micro_batch: int
    batch: int  # sequences per step, all GPUs
    checkpointing: bool  # activation checkpointing of every block (llmtrain: full)
    tokens_per_gpu: float  # measured tokens per second per GPU
    hfu: float  # hardware FLOPs utilisation, recomputation counted
    parameters: int  # the source's NumParams

    def overrides(self) -> list[str]:
        """The llmtrain command line of this run (the planner reads the same config)."""
        n_layer, d_model, n_head = MPT_SHAPES[self.model]
        return [
            "model=gpt2",
            f"model.n_layer={n_layer}",
            f"model.d_model={d_model}",
            f"model.n_head={n_head}",
            f"model.vocab_size={MPT_VOCABULARY}",
            f"model.max_seq_len={self.seq_len}",
            f"train.seq_len={self.seq_len}",
            f"train.batch_size={self.batch}",
            f"train.micro_batch_size={self.micro_batch}",
            f"train.activation_checkpointing={'full' if self.checkpointing else 'none'}",
            "train.precision=bf16",
            f"hardware={self.hardware}",
            f"hardware.nodes={max(1, self.gpus // 8)}",
            "parallel=fsdp",
        ]


# model, hardware, GPUs, sequence, micro-batch, batch, checkpointing, tokens/s/GPU, HFU, NumParams: as published
PUBLISHED_RUNS = (
    PublishedRun("760m", "h100x8", 8, 2048, 24, 384, False, 63147, 0.3490, 760470528),
    PublishedRun("1b", "h100x8", 8, 2048, 14, 112, False, 45455, 0.4182, 1315950592),
    PublishedRun("1b", "h100x8", 8, 32768, 1, 32, False, 12025, 0.3354, 1378865152),
    PublishedRun("3b", "h100x8", 16, 2048, 10, 480, False, 24142, 0.4373, 2651837440),
    PublishedRun("7b", "h100x8", 8, 2048, 6, 48, False, 10643, 0.4644, 6658859008),
    PublishedRun("7b", "h100x8", 8, 8192, 8, 128, True, 6935, 0.4952, 6684024832),
    PublishedRun("13b", "h100x8", 8, 2048, 2, 16, False, 4792, 0.3979, 12853954560),
    PublishedRun("13b", "h100x8", 8, 4096, 10, 240, True, 4717, 0.5547, 12864440320),
    PublishedRun("30b", "h100x8", 8, 2048, 3, 504, True, 2002, 0.5082, 29975214080),
    PublishedRun("70b", "h100x8", 64, 2048, 8, 2048, True, 1039, 0.5676, 64862437376),
    PublishedRun("1b", "a100x8", 8, 2048, 14, 448, False, 20513, 0.5986, 1315950592),
    PublishedRun("7b", "a100x8", 8, 2048, 6, 96, False, 4641, 0.6423, 6658859008),
    PublishedRun("7b", "a100x8", 8, 8192, 8, 128, True, 3206, 0.7262, 6684024832),
    PublishedRun("13b", "a100x8", 8, 2048, 2, 48, False, 2262, 0.5957, 12853954560),
    PublishedRun("30b", "a100x8", 8, 2048, 3, 504, True, 916, 0.7374, 29975214080),
    PublishedRun("70b", "a100x8", 64, 2048, 8, 2048, True, 410, 0.7110, 64862437376),
)


def calibrating(runs: tuple[PublishedRun, ...] = PUBLISHED_RUNS) -> list[PublishedRun]:
    """The half of MPT's rows the step time is calibrated on: every other row of each machine in the table's order
    (its first, third, ...), whose median HFU is that machine's `hardware.mfu`. The other half tests it."""
    seen: dict[str, int] = {}
    chosen = []
    for run in runs:
        if seen.get(run.hardware, 0) % 2 == 0:
            chosen.append(run)
        seen[run.hardware] = seen.get(run.hardware, 0) + 1
    return chosen


TORCHTITAN_SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
LLAMA31_VOCABULARY = 128256
# Llama 3.1's sizes: (n_layer, d_model, n_head, n_kv_head, d_ff).
LLAMA31_SHAPES = {"8b": (32, 4096, 32, 8, 14336), "70b": (80, 8192, 64, 8, 28672)}


@dataclass(frozen=True)
class PublishedLlamaRun:
    model: str  # a LLAMA31_SHAPES name
    gpus: int
    layout: tuple[str, ...]  # llmtrain's parallel overrides for torchtitan's layout
    data_parallel: int  # the ranks the global batch is split over (torchtitan's FSDP degree)
    seq_len: int
    local_batch: int  # sequences per data-parallel rank per step, one micro-batch
    checkpointing: str  # llmtrain's train.activation_checkpointing for torchtitan's (selective op, full)
    compile: bool
    float8: bool  # torchtitan's tensorwise float8 on the blocks' Linear layers
    tokens_per_gpu: float  # measured tokens per second per GPU
    memory_gib: float  # measured peak reserved memory per GPU

    def overrides(self) -> list[str]:
        n_layer, d_model, n_head, n_kv_head, d_ff = LLAMA31_SHAPES[self.model]
        return [
            "model=llama3.2-1b",
            f"model.n_layer={n_layer}",
            f"model.d_model={d_model}",
            f"model.n_head={n_head}",
            f"model.n_kv_head={n_kv_head}",
            f"model.d_ff={d_ff}",
            "model.tie_embeddings=false",
            f"model.vocab_size={LLAMA31_VOCABULARY}",
            f"model.max_seq_len={self.seq_len}",
            f"train.seq_len={self.seq_len}",
            f"train.batch_size={self.local_batch * self.data_parallel}",
            f"train.micro_batch_size={self.local_batch}",
            f"train.activation_checkpointing={self.checkpointing}",
            f"train.compile={str(self.compile).lower()}",
            f"train.float8={'tensorwise' if self.float8 else 'none'}",
            "train.precision=bf16",
            "hardware=h100x8",
            "hardware.device_memory_gib=95",
            f"hardware.nodes={max(1, self.gpus // 8)}",
            *self.layout,
        ]


_FSDP, _CP = ("parallel=fsdp",), "parallel.cp"
# model, GPUs, layout, data-parallel ranks, sequence, local batch, checkpointing, compile, float8, tokens/s/GPU,
# memory GiB: tables 1-4 as published (table 4's 2-D row without async TP; tables 5 and 6 use it throughout)
PUBLISHED_LLAMA_RUNS = (
    PublishedLlamaRun("8b", 8, _FSDP, 8, 8192, 2, "selective", False, False, 5762, 82.4),
    PublishedLlamaRun("8b", 8, _FSDP, 8, 8192, 2, "selective", True, False, 6667, 77.0),
    PublishedLlamaRun("8b", 8, _FSDP, 8, 8192, 2, "selective", True, True, 8532, 76.8),
    PublishedLlamaRun("8b", 8, _FSDP, 8, 32768, 1, "full", True, True, 3890, 83.9),
    PublishedLlamaRun("8b", 8, (*_FSDP, f"{_CP}=2"), 4, 65536, 1, "full", True, True, 2540, 84.2),
    PublishedLlamaRun("8b", 8, (*_FSDP, f"{_CP}=4"), 2, 131072, 1, "full", True, True, 1071, 84.0),
    PublishedLlamaRun("8b", 8, (*_FSDP, f"{_CP}=8"), 1, 262144, 1, "full", True, True, 548, 84.5),
    PublishedLlamaRun("8b", 128, _FSDP, 128, 8192, 2, "selective", False, False, 5605, 67.0),
    PublishedLlamaRun("8b", 128, _FSDP, 128, 8192, 2, "selective", True, False, 6514, 62.0),
    PublishedLlamaRun("8b", 128, _FSDP, 128, 8192, 2, "selective", True, True, 8380, 61.8),
    PublishedLlamaRun("70b", 256, ("parallel=fsdp_tp", "parallel.tp=8"), 32, 8192, 16, "full", True, True, 829, 71.9),
)
# The rows h100x8's compile_speed and float8_speed come from: 8B on 8 GPUs at 8K eager, compiled, compiled with float8
# (each pair differs in the one feature). The eight others test them, the 128-GPU triple pair for pair.
TORCHTITAN_CALIBRATING = PUBLISHED_LLAMA_RUNS[:3]
