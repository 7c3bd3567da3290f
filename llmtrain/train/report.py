"""What a person reads: the summary printed at start, and at the end summary.json plus loss.png."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmtrain.config import CheckpointConfig
    from llmtrain.train.loop import Components


def start_summary(parts: Components, *, chosen_by_planner: bool, memory: str, run_dir: str, resumed: str | None) -> str:
    """The lines printed before the first step: model, layout, batch, run length, data, memory, where it goes."""
    config, plan, gpt, facts = parts.config, parts.model.plan, parts.facts.shape, parts.facts
    t, m = config.train, config.model
    layout = ("auto -> " if chosen_by_planner else "") + plan.summary()
    precision = parts.model.precision_description
    micro_size, micro_count = plan.micro_batching()
    padding = gpt.padding_parameters
    tokens_per_step = t.batch_size * t.seq_len
    padded = f" (+{padding:,} vocabulary padding)" if padding else ""
    if facts.trained != facts.parameters:
        lora = gpt.lora
        padded += f", {facts.trained:,} of them trained: low-rank adapters of rank {lora.rank} on " + " ".join(
            lora.targets
        )
    return "\n".join(
        [
            f"model     {m.name}: {facts.parameters:,} parameters{padded} (n_layer {m.n_layer}, n_head {m.n_head}, "
            f"d_model {m.d_model}, vocab {gpt.vocab_size}, max_seq_len {m.max_seq_len})",
            f"layout    {layout} on {parts.runtime.device}, {precision}",
            *(f"          {note}" for note in parts.runtime.notes),
            f"batch     {t.batch_size} sequences x {t.seq_len} tokens = {tokens_per_step:,} tokens/step "
            f"(micro {micro_size} x accumulation {micro_count} x data-parallel {plan.dp_size})",
            f"run       {t.steps} steps = {t.steps * tokens_per_step:,} tokens; seed {config.seed}",
            f"data      {parts.data.description}",
            f"memory    {memory}",
            f"run dir   {run_dir}",
            f"saves     {_saves(config.checkpoint, run_dir)}",
            *([f"resumed   from {resumed}"] if resumed else []),
        ]
    )


def _saves(checkpoint: CheckpointConfig, run_dir: str) -> str:
    """When and where checkpoints are written, the first clock one's time of day included."""
    rules = [f"every {checkpoint.every} steps"] if checkpoint.every else []
    if checkpoint.every_minutes:
        first = time.strftime("%H:%M", time.localtime(time.time() + checkpoint.every_minutes * 60))
        rules.append(f"every {checkpoint.every_minutes:g} min (the first by {first})")
    where = checkpoint.dir or os.path.join(run_dir, "checkpoints")
    return ", ".join([*rules, "at the end and on a stop signal"]) + f", to {where}"


def end_summary(
    records: list[dict[str, Any]], wall_seconds: float, train_seconds: float, tokens_per_step: int
) -> dict[str, Any]:
    """Totals of a finished run. Throughput leaves out the first step, which pays for warm-up."""
    val = [r for r in records if "val_loss" in r]
    steady = records[1:] or records
    steady_seconds = sum(tokens_per_step / r["tokens_per_s"] for r in steady)
    summary = {
        "steps": records[-1]["step"],
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "final_val_loss": val[-1]["val_loss"] if val else None,
        "final_val_bpb": val[-1].get("val_bpb") if val else None,
        "tokens": records[-1]["step"] * tokens_per_step,
        "tokens_per_s": len(steady) * tokens_per_step / steady_seconds,
        "train_seconds": train_seconds,
        "wall_seconds": wall_seconds,
    }
    if any("rollout_seconds" in r for r in steady):  # reinforcement learning: the share of the steps spent sampling
        summary["rollout_share"] = sum(r.get("rollout_seconds", 0.0) for r in steady) / steady_seconds
    if any("trained_tokens" in r for r in records):  # fine-tuning: the targets trained, of the tokens seen
        summary["trained_tokens"] = sum(r.get("trained_tokens", 0) for r in records)
    scored = [r for r in records if "eval/seconds" in r]
    if scored:  # eval.tasks: the last scores, and what all the evaluations took
        summary["tasks"] = {key[5:]: value for key, value in scored[-1].items() if key.count("/") == 2}
        summary["task_seconds"] = sum(r["eval/seconds"] for r in scored)
    if any(r.get("mfu") is not None for r in steady):
        summary["mfu"] = sum(r["mfu"] for r in steady) / len(steady)
    if "peak_memory_gib" in records[-1]:
        for key in ("peak_memory_gib", "peak_reserved_gib"):
            summary[key] = max(r.get(key, 0.0) for r in records)
        summary["alloc_retries"] = records[-1].get("alloc_retries", 0)  # counts since the process started
    return summary


def format_end_summary(summary: dict[str, Any]) -> str:
    val = summary["final_val_loss"]
    lines = [
        f"done      {summary['steps']} steps, {summary['tokens']:,} tokens"
        + (f" ({summary['trained_tokens']:,} of them trained)" if "trained_tokens" in summary else "")
        + f" in {summary['wall_seconds']:.1f} s",
        f"loss      {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}"
        + (f" (val {val:.4f})" if val is not None else "")
        + (f", {summary['final_val_bpb']:.4f} bits per byte" if summary.get("final_val_bpb") else ""),
        f"speed     {summary['tokens_per_s']:,.0f} tokens/s"
        + (f", MFU {summary['mfu']:.1%}" if "mfu" in summary else ", MFU n/a")
        + (f"; sampling took {summary['rollout_share']:.0%} of the steps" if "rollout_share" in summary else ""),
    ]
    if "tasks" in summary:
        scores = ", ".join(f"{name} {value:.4f}" for name, value in summary["tasks"].items())
        lines.append(f"tasks     {scores} ({summary['task_seconds']:.1f} s evaluating)")
    if "peak_memory_gib" in summary:
        lines.append(
            f"memory    {summary['peak_memory_gib']:.2f} GiB peak allocated, {summary['peak_reserved_gib']:.2f} GiB "
            f"reserved"
            + (
                f"; the allocator flushed its cache {summary['alloc_retries']} times to find room (fragmentation, "
                f"slow steps): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or lower train.micro_batch_size"
                if summary["alloc_retries"]
                else ""
            )
        )
    if "interruptions" in summary:
        lines.append(f"restarted {len(summary['interruptions'])} time(s): " + "; ".join(summary["interruptions"]))
    if "unavailable" in summary.get("predicted", {}):
        lines.append(f"planner   no prediction: {summary['predicted']['unavailable']}")
    elif "predicted" in summary:
        p, measured = summary["predicted"], summary["tokens"] / summary["steps"] / summary["tokens_per_s"]
        memory = f" (measured {summary['peak_memory_gib']:.2f})" if "peak_memory_gib" in summary else ""
        sampling = f" ({p['sampling_s']:.3g} s sampling)" if p.get("sampling_s") else ""
        lines.append(
            f"planner   predicted {p['step_s']:.3g} s/step{sampling} on {p['hardware']}, measured {measured:.3g} s "
            f"({measured / p['step_s']:.2f}x); {p['peak_gib_per_rank']:.2f} GiB per rank{memory}; "
            f"{p['comm_gib_per_step']:.3g} GiB communicated per step"
        )
    if "profile" in summary:
        p = summary["profile"]
        busiest = ", ".join(f"{op['name']} {op['share']:.0%}" for op in p["top_operators"])
        lines.append(f"profile   steps {p['steps'][0]}-{p['steps'][1]} in {p['trace']}; busiest: {busiest}")
    if "compiled_graphs" in summary:
        lines.append(f"compile   {summary['compiled_graphs']} graphs compiled (torch.compile)")
    if "pipeline" in summary:
        p = summary["pipeline"]
        lines.append(
            f"pipeline  bubble {p['bubble_measured']:.2f} of compute time (ideal (p-1)/(v·m) = "
            f"{p['bubble_theory']:.2f}); peak micro-batches alive per rank {p['peak_in_flight']}; "
            f"chart pipeline.png"
        )
    return "\n".join(lines)


def plot_loss(records: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train", linewidth=1.2)
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation", markersize=4)
        for key in [key for key in val[-1] if key.startswith("val_loss/")]:  # a mixture's sources, each its own
            ax.plot([r["step"] for r in val], [r[key] for r in val], ".--", label=key[4:], markersize=3, linewidth=1)
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    rewarded = [r for r in records if "reward" in r]
    if rewarded:  # reinforcement learning: GRPO's loss says little, the reward says how it goes (reward.png)
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        ax.plot([r["step"] for r in rewarded], [r["reward"] for r in rewarded], label="reward", linewidth=1.2)
        held_out = [r for r in records if "val_reward" in r]
        if held_out:
            steps = [r["step"] for r in held_out]
            ax.plot(steps, [r["val_reward"] for r in held_out], "o-", label="validation", markersize=4)
        ax.set(xlabel="optimizer step", ylabel="mean reward", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(os.path.dirname(path), "reward.png"))
        plt.close(fig)
    scored = [r for r in records if "eval/seconds" in r]
    if scored:  # the companion picture: each task's accuracies over the run, beside loss.png
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        for key in [key for key in scored[-1] if key.count("/") == 2]:
            ax.plot([r["step"] for r in scored], [r[key] for r in scored], "o-", label=key[5:], markersize=4)
        ax.set(xlabel="optimizer step", ylabel="accuracy", title=title, ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(os.path.dirname(path), "tasks.png"))
        plt.close(fig)


def compiled_graphs() -> int:
    """Graphs torch.compile produced in this process so far (0 when nothing was compiled)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
