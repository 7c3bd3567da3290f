"""The training objectives (train.objective): what a step optimizes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ObjectiveSpec:
    """What a step optimizes (llmtrain/train/objectives.py: an Objective), named by an import string and built for
    the job's model and data."""

    implementation: str  # "module:Class" of the Objective: (model, data, validation slice, config) make it whole
    description: str  # one line for train.objective's --help and docs/config.md
    pairs: bool = False  # it trains on data=preference's pairs (chosen, rejected), and nothing else does
    # forward passes a step makes without gradients besides training's (DPO's reference and policy): the planner's
    # step time counts them
    forwards_alone: int = 0


# train.objective -> what a step optimizes; `auto` picks the data's (OBJECTIVE_OF_DATA).
OBJECTIVES: dict[str, ObjectiveSpec] = {
    "next_token": ObjectiveSpec(
        implementation="llmtrain.train.objectives:NextToken",
        description="the next-token cross-entropy over every target the data trains (fine-tuning: the answers')",
    ),
    "dpo": ObjectiveSpec(
        implementation="llmtrain.train.dpo:DirectPreference",
        description="Direct Preference Optimization on data=preference's pairs, the base (adapters off) as reference",
        pairs=True,
        forwards_alone=2,
    ),
}
AUTO_OBJECTIVE = "auto"


def objective_of(objective: str, data_source: str) -> str:
    """train.objective resolved: `auto` is dpo on data=preference's pairs, next_token on any other data."""
    if objective != AUTO_OBJECTIVE:
        return objective
    return "dpo" if data_source == "preference" else "next_token"


@dataclass(frozen=True)
class RewardSpec:
    """A built-in verifiable reward (llmtrain/data/rewards.py), by data.reward's name."""

    implementation: str  # "module:function" with TRL's convention; with takes_pattern, what makes one from a pattern
    description: str  # one line for data.reward's --help and docs/config.md
    takes_pattern: bool = False  # made from data.reward_pattern


# data.reward's built-in names -> the function; any other value is "module:function".
REWARDS: dict[str, RewardSpec] = {
    "exact_number": RewardSpec(
        implementation="llmtrain.data.rewards:exact_number",
        description="1 where the completion's final number (GSM8K's `#### n` included) is the record's `answer`",
    ),
    "regex": RewardSpec(
        implementation="llmtrain.data.rewards:matching",
        description="1 where the completion matches data.reward_pattern",
        takes_pattern=True,
    ),
}
