"""Verifiable rewards (llmtrain/data/rewards.py): the final number of an answer as GSM8K writes it, a pattern, a
function of the user's own imported by name, and several added with weights, a function's None left out."""

from __future__ import annotations

import math

import pytest

from llmtrain.data.rewards import exact_number, final_number, matching, reward_function, scored
from llmtrain.errors import ConfigError


@pytest.mark.parametrize(
    "text, number",
    [
        ("The answer is 42.", 42.0),
        ("She had 3 apples, then 5: 8 in all", 8.0),
        ("Natalia sold 48/2 = 24 clips in May.\n#### 1,234", 1234.0),
        ("#### -3, not 5", -3.0),
        ("half of it: .5", 0.5),
        ("no number at all", None),
        ("#### none after the mark", None),
    ],
)
def test_the_final_number_is_gsm8ks_marked_one_or_else_the_last(text, number):
    assert final_number(text) == number


def test_exact_number_scores_the_final_number_against_the_answer():
    answers = ["Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", "no number"]
    completions = ["48 + 24 = 72, so the answer is 72", "It is 71.", "72"]
    assert exact_number(["p"] * 3, completions, answer=answers) == [1.0, 0.0, None]


def test_a_users_reward_is_imported_by_name_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions, **columns):\n    return [1.0 if len(c) < 5 else 0.0 for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # undone after the test, as the working directory is
    assert reward_function("my_rewards:short")(["p", "p"], ["abc", "abcdef"]) == [1.0, 0.0]
    for name, refusal in (
        ("my_rewards:missing", r"^data.reward=my_rewards:missing: .*imported from the working directory"),
        ("nowhere:reward", r"^data.reward=nowhere:reward: No module named 'nowhere'"),
        ("shouting", r"^data.reward='shouting' is neither a built-in reward \(exact_number, regex\) nor module"),
        ("regex", r"^data.reward=regex matches a pattern: set data.reward_pattern"),
    ):
        with pytest.raises(ConfigError, match=refusal) as refused:
            reward_function(name)
        assert "\n" not in str(refused.value)


def test_rewards_add_up_with_weights_and_a_none_left_out():
    """TRL's rule: each function's scores times its weight, summed over the functions that scored the completion
    (NaN where none did)."""
    boxed = matching(r"\\boxed\{\d+\}")
    completions = ["\\boxed{72}", "72", "\\boxed{71}"]
    totals, each = scored(
        [exact_number, boxed], [1.0, 0.5], ["p"] * 3, completions, {"answer": ["72", "no number", "72"]}
    )
    assert totals == [1.5, 0.0, 0.5]
    assert each[0][0] == 1.0 and math.isnan(each[0][1]) and each[1] == [1.0, 0.0, 1.0]
    totals, _ = scored([exact_number], [1.0], ["p"], ["72"], {"answer": ["none"]})
    assert math.isnan(totals[0])
