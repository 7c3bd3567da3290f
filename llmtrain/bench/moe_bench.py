"""Mixture of experts on this machine: its speed against a dense model with as many active parameters, and how
evenly its experts are loaded over a short run with and without the balance loss.

    python -m llmtrain.bench.moe_bench                               # moe-tiny, on this CPU or GPU
    python -m llmtrain.bench.moe_bench --preset mixtral-tiny --steps 200 --skip-load

Speed: one process runs forward, backward and an AdamW step of the preset and of its dense twin (the same model
with no experts and its MLPs widened so that a token meets as many parameters) on random tokens, and prints
tokens/s of each and their ratio. The gap is the price of routing: the router, the sort by expert and the grouped
matmul over the experts instead of one large one.

Granularity: the same at equal active and total parameters with finer experts, as DeepSeek's (--granularity
1,2,4,8: g times the experts, each 1/g as wide, g times the top-k: 8 -> 64 experts for moe-tiny), each step time
against the preset's. Experts run as one grouped GEMM, so finer experts should cost little more; a loop over the
experts would grow with their number.

Load: train.py trains the preset `--steps` steps on the standard library's text twice, with
model.moe.aux_loss_coef as configured and at 0, and prints each run's share of the routed slots per expert over
its last 10 steps and the busiest expert's load over the mean (1 = perfectly even).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from llmtrain.config import mlp_width
from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.model import build_model, meta_model, num_parameters
from llmtrain.model.flops import inactive_expert_parameters
from llmtrain.tools import compose_config

REPO = Path(__file__).resolve().parents[2]
VOCAB = 4096


def active_parameters(model_cfg) -> int:
    """The parameters a token meets (the top_k routed experts, not all), from the model's shapes alone."""
    model = meta_model(model_cfg, VOCAB)
    return num_parameters(model) - inactive_expert_parameters(model.cfg)


def dense_twin(overrides: list[str]) -> list[str]:
    """Overrides making the preset dense, its MLP width (a multiple of 16) chosen so that a token meets as many
    parameters as in the mixture."""
    target = active_parameters(compose_config(overrides).model)
    dense = [*overrides, "model.moe.num_experts=0"]
    dense_cfg = compose_config(dense).model
    # A token meets a + b x d_ff parameters: two widths give the line, the multiple of 16 nearest its solution.
    low, high = (active_parameters(OmegaConf.merge(dense_cfg, {"d_ff": f})) for f in (16, 32))
    exact = 16 + (target - low) * 16 / (high - low)
    width = min(max(16 * round(exact / 16), 16), 16 * dense_cfg.d_model)
    return [*dense, f"model.d_ff={width}"]


def tokens_per_second(models: dict[str, list[str]], batch: int, seq_len: int, device: str, repeats: int) -> dict:
    """Each model's parameters and tokens/s over training steps (forward, backward, AdamW) on random tokens. The
    models take turns step by step, so that a machine's drifting speed weighs on all of them alike."""
    built = {
        name: build_model(compose_config(overrides).model, VOCAB, seed=0).to(device)
        for name, overrides in models.items()
    }
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in built.items()}
    tokens = torch.randint(0, VOCAB, (batch, seq_len + 1), device=device)
    times: dict[str, list[float]] = {name: [] for name in built}
    for step in range(repeats + 2):  # two warm-up steps
        for name, model in built.items():
            start = time.perf_counter()
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    return {
        name: {
            "parameters": num_parameters(model),
            "active_parameters": num_parameters(model) - inactive_expert_parameters(model.cfg),
            "tokens_per_s": batch * seq_len / statistics.median(times[name]),
        }
        for name, model in built.items()
    }


def granularity_sweep(mixture: list[str], factors: list[int], args: argparse.Namespace, device: str) -> list[dict]:
    """The preset with g times as many experts, 1/g as wide, g times the top-k, for each g: its shape and tokens/s."""
    cfg = compose_config(mixture).model
    moe = cfg.moe
    width = moe.d_ff or mlp_width(cfg.d_model, cfg.d_ff, cfg.mlp)
    shapes = {g: {"experts": moe.num_experts * g, "top_k": moe.top_k * g, "width": width // g} for g in factors}
    models = {
        str(g): [
            *mixture,
            f"model.moe.num_experts={shape['experts']}",
            f"model.moe.top_k={shape['top_k']}",
            f"model.moe.d_ff={shape['width']}",
        ]
        for g, shape in shapes.items()
    }
    speeds = tokens_per_second(models, args.batch, args.seq_len, device, args.repeats)
    return [{"granularity": g, **shape, "tokens_per_s": speeds[str(g)]["tokens_per_s"]} for g, shape in shapes.items()]


def expert_shares(overrides: list[str], steps: int, workdir: Path) -> dict:
    """Train `steps` steps and return the last 10 steps' share of slots per expert and the imbalance."""
    run_dir = workdir / f"run{len(list(workdir.iterdir()))}"
    args = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", "data=stdlib",
            "logging.wandb.mode=disabled", f"train.steps={steps}", "train.eval_every=0", *overrides]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, cwd=workdir)
    if done.returncode:
        raise SystemExit(f"train.py failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loads = [record["expert_load"] for record in records if "expert_load" in record][-10:]
    totals = [sum(load[e] for load in loads) for e in range(len(loads[0]))]
    shares = [total / sum(totals) for total in totals]
    return {"shares": shares, "imbalance": max(shares) * len(shares), "final_loss": records[-1].get("loss")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="moe-tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100, help="training steps of each load run")
    parser.add_argument("--skip-load", action="store_true", help="only the speed comparisons")
    parser.add_argument("--granularity", default="1,2,4,8", help="expert granularities to time ('' to skip)")
    args, overrides = parser.parse_known_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mixture = [f"model={args.preset}", f"model.max_seq_len={max(args.seq_len, 256)}", *overrides]
    rows = tokens_per_second(
        {args.preset: mixture, "dense twin": dense_twin(mixture)}, args.batch, args.seq_len, device, args.repeats
    )
    print(f"speed on {device}, batch {args.batch} x {args.seq_len} tokens, median of {args.repeats} steps")
    print(f"{'model':>14} {'parameters':>12} {'active':>12} {'tokens/s':>10}")
    for name, row in rows.items():
        print(f"{name:>14} {row['parameters']:>12,} {row['active_parameters']:>12,} {row['tokens_per_s']:>10,.0f}")
    ratio = rows[args.preset]["tokens_per_s"] / rows["dense twin"]["tokens_per_s"]
    print(f"{args.preset} runs at {ratio:.2f}x the dense twin's tokens/s")
    print(json.dumps({"speed": rows, "ratio": ratio}))
    factors = [int(g) for g in args.granularity.split(",") if g]
    if factors:
        sweep = granularity_sweep(mixture, factors, args, device)
        print(f"{'experts':>8} {'top_k':>6} {'width':>6} {'tokens/s':>10} {'step time vs first':>19}")
        for row in sweep:
            slower = sweep[0]["tokens_per_s"] / row["tokens_per_s"]
            print(
                f"{row['experts']:>8} {row['top_k']:>6} {row['width']:>6} {row['tokens_per_s']:>10,.0f} {slower:>19.2f}"
            )
        print(json.dumps({"granularity": sweep}))
    if args.skip_load:
        return
    coef = compose_config(mixture).model.moe.aux_loss_coef
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            f"aux_loss_coef={coef}": expert_shares(mixture, args.steps, Path(tmp)),
            "aux_loss_coef=0": expert_shares([*mixture, "model.moe.aux_loss_coef=0"], args.steps, Path(tmp)),
        }
    experts = compose_config(mixture).model.moe.num_experts
    print(f"share of routed slots per expert over steps {args.steps - 9}-{args.steps} (even: {1 / experts:.3f})")
    for name, run in runs.items():
        shares = " ".join(f"{share:.3f}" for share in run["shares"])
        print(f"{name:>20}: {shares}  busiest/mean {run['imbalance']:.2f}, loss {run['final_loss']:.3f}")
    print(json.dumps({"load": runs}))


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
