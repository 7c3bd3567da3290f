"""Published measurements of real training runs, each as llmtrain would run it: what the planner's step times are
checked against (llmtrain/bench/published_runs.py, tests/test_planner.py) and what its efficiencies are
calibrated from (`hardware.mfu` of a100x8 and h100x8: the median HFU of each machine's rows below).

Source: MosaicML's llm-foundry, scripts/train/benchmarking/README.md ("MPT Training Benchmarks"), the tables
"H100 80GB BF16" and "A100 80GB with 1600 Gbps node-node interconnect (RoCE)": MPT models (GPT-2's block: biases,
LayerNorm, GELU at 4 x d_model, learned positions, a tied head, vocabulary 50,368) trained with FSDP FULL_SHARD in
bf16, each row a global batch, micro-batch, sequence length, GPU count, activation checkpointing on or off, and the
measured tokens per second per GPU, MFU and HFU. Their parameter counts (NumParams) are the shapes' exactly. The
rows here span every model size, short and long sequences, one node and eight, with and without checkpointing.
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
