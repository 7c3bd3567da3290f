"""Verifiable rewards (llmtrain/data/rewards.py): the final number of an answer as GSM8K writes it, math-verify's
grading of GSM8K's and MATH's answers, a pattern, a function of the user's own imported by name, and several added
with weights, a function's None left out; data.reward one name or a list."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmtrain.data.rewards import (
    Rewards,
    answer_number,
    exact_number,
    final_number,
    matching,
    math_answer,
    reward_function,
    scored,
)
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
        ("see pages 10-12", 12.0),  # a hyphen between numbers is no minus sign
        ("the primes are 2,3,5", 5.0),  # commas not between groups of three digits part numbers
        ("roughly 1e3", 1000.0),
        ("x-2 is 2.5E-1", 0.25),
        ("it is -7", -7.0),
    ],
)
def test_the_final_number_is_gsm8ks_marked_one_or_else_the_last(text, number):
    assert final_number(text) == number


@pytest.mark.parametrize(
    "answer, number",
    [("72", 72.0), ("Natalia sold 48 + 24 = 72 clips.\n#### 72", 72.0), ("#### 1,234", 1234.0), ("1e3", 1000.0)]
    + [("10-12", None), ("2,3,5", None), ("48 + 24 = 72", None), ("none", None)],
)
def test_an_answer_is_one_number_or_none_and_never_a_guess(answer, number):
    assert answer_number(answer) == number


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
        ("shouting", r"^data.reward='shouting' is neither a built-in reward \(exact_number, math, regex\) nor"),
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


def test_a_reward_that_is_not_a_finite_number_is_refused_in_one_line_naming_its_function():
    """inf or NaN would zero its whole group's advantages silently, text is no score: each stops the run in one line
    naming the function; None leaves the completion unscored, and any number (a bool, a numpy float) is one."""

    def lucky(prompts, completions, **_):
        return [float("inf"), 1.0]

    def wordy(prompts, completions, **_):
        return ["good", 1.0]

    for function, shown in ((lucky, "inf"), (wordy, "'good'")):
        with pytest.raises(ConfigError, match=rf"^data.reward {function.__name__} returned {shown} for a completion"):
            scored([function], [1.0], ["p", "p"], ["a", "b"], {})
    totals, each = scored([lambda p, c, **_: [True, np.float32(0.5)]], [1.0], ["p"] * 2, ["a", "b"], {})
    assert totals == each[0] == [1.0, 0.5]


@pytest.mark.parametrize(
    "answer, completion, score",
    [
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "48 + 24 = 72, so she sold 72 clips.", 1.0),  # GSM8K
        ("#### 1,234", "The total is 1234.", 1.0),
        ("#### 72", "The answer is 71.", 0.0),
        ("\\boxed{\\frac{1}{2}}", "Half of them: $\\boxed{0.5}$", 1.0),  # MATH: a fraction as a decimal
        ("\\boxed{\\{1, 2\\}}", "The roots are $\\boxed{\\{2, 1\\}}$", 1.0),  # a set, in any order
        ("\\boxed{\\sqrt{2}}", "So $x = \\boxed{2^{1/2}}$", 1.0),
        ("\\boxed{\\frac{1}{3}}", "$\\boxed{0.33}$", 0.0),
        ("\\boxed{5}", "I cannot tell.", 0.0),
        ("no answer here", "\\boxed{5}", None),  # the record's answer parses to nothing: unscored
    ],
)
def test_the_math_reward_grades_gsm8k_and_math_answers_with_math_verify(answer, completion, score):
    pytest.importorskip("math_verify", reason="the math reward needs the rl extra: pip install -e '.[rl]'")
    assert math_answer(["p"], [completion], answer=[answer]) == [score]


def test_data_reward_takes_one_name_or_a_list():
    from types import SimpleNamespace

    for reward, names in (("exact_number", ["exact_number"]), (["exact_number", "regex"], ["exact_number", "regex"])):
        rewards = Rewards.of(SimpleNamespace(reward=reward, reward_weights=None, reward_pattern="x"))
        assert rewards.names == names and rewards.weights == [1.0] * len(names)
