"""The training objectives (train.objective): what a step optimizes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ObjectiveSpec:
    """What a step optimizes (llmtrain/train/objectives.py: an Objective), named by an import string and built for
    the job's model and data."""

    implementation: str  # "module:Class" of the Objective: (model, data, its two slices, config) make it whole
    description: str  # one line for train.objective's --help and docs/config.md
    # the data source it trains on, where no objective without one does (data=preference's pairs, data=rl's
    # prompts); None: any other source. train.objective=auto picks the first row of the job's source
    data: str | None = None
    # forward passes a step makes without gradients besides training's (DPO's reference and policy; GRPO's policy,
    # and its reference where rl.beta asks for one): the planner's step time counts them
    forwards_alone: int = 0
    samples: bool = False  # a step samples completions first (the planner counts the rollout's time and cache)
    # its loss measures progress, so one far above the recent median is a spike (train.on_spike judges it); GRPO's
    # is signed and centred on 0 (docs/rl.md), so only the non-finite rule guards its steps
    loss_is_progress: bool = True


# train.objective -> what a step optimizes; `auto` picks the data's (OBJECTIVE_OF_DATA).
OBJECTIVES: dict[str, ObjectiveSpec] = {
    "next_token": ObjectiveSpec(
        implementation="llmtrain.train.objectives:NextToken",
        description="the next-token cross-entropy over every target the data trains (fine-tuning: the answers')",
    ),
    "dpo": ObjectiveSpec(
        implementation="llmtrain.train.dpo:DirectPreference",
        description="Direct Preference Optimization on data=preference's pairs, the base (adapters off) as reference",
        data="preference",
        forwards_alone=2,
    ),
    "grpo": ObjectiveSpec(
        implementation="llmtrain.train.grpo_objective:GroupRelative",
        description="GRPO (and Dr. GRPO, DAPO: rl.loss) on data=rl's prompts, rewarded by data.reward",
        data="rl",
        forwards_alone=1,
        samples=True,
        loss_is_progress=False,
    ),
}
AUTO_OBJECTIVE = "auto"


def objective_of(objective: str, data_source: str) -> str:
    """train.objective resolved: `auto` is the first objective of the data's source (dpo on data=preference's
    pairs, grpo on data=rl's prompts), next_token on any other data."""
    if objective != AUTO_OBJECTIVE:
        return objective
    return next((name for name, spec in OBJECTIVES.items() if spec.data == data_source), "next_token")


# rl.gather_weights: how a rollout under FSDP gathers the sharded weights (parallel/sampling.py, planner/rollout.py).
WEIGHT_GATHERS = ("auto", "once", "per_token")

# rl.loss: how GRPO's per-token losses are reduced over the global batch (llmtrain/train/grpo.py), as TRL's
# GRPOTrainer names them.
RL_LOSSES: dict[str, str] = {
    "grpo": "each completion's mean over its tokens, then the mean over the completions (the paper's)",
    "dr_grpo": "the sum over every completion token over (completions x rl.max_new_tokens) (Dr. GRPO: no length bias)",
    "dapo": "the sum over every completion token over their number (DAPO's token-level mean)",
}


@dataclass(frozen=True)
class RewardSpec:
    """A built-in verifiable reward (llmtrain/data/rewards.py), by data.reward's name."""

    implementation: str  # "module:function" with TRL's convention; with takes_pattern, what makes one from a pattern
    description: str  # one line for data.reward's --help and docs/config.md
    takes_pattern: bool = False  # made from data.reward_pattern
    # (module, extra): the optional module it grades with, and the pyproject extra that installs it
    needs: tuple[str, str] | None = None


# data.reward's built-in names -> the function; any other value is "module:function".
REWARDS: dict[str, RewardSpec] = {
    "exact_number": RewardSpec(
        implementation="llmtrain.data.rewards:exact_number",
        description="1 where the completion's final number (GSM8K's `#### n` included) is the record's `answer`",
    ),
    "math": RewardSpec(
        implementation="llmtrain.data.rewards:math_answer",
        description="1 where HF's math-verify finds the completion's answer equal to the record's `answer` (LaTeX, "
        "fractions, sets, units; MATH's `\\boxed{}`, GSM8K's `#### n`), the `rl` extra",
        needs=("math_verify", "rl"),
    ),
    "regex": RewardSpec(
        implementation="llmtrain.data.rewards:matching",
        description="1 where the completion matches data.reward_pattern",
        takes_pattern=True,
    ),
}
