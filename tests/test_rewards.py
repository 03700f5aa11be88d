"""GRPO reward functions from user code: loading by file or module, the weighted NaN-aware sum
and TRL's metric names against hand-computed tables, and one line naming the spec for each
bad reward."""

import sys
import textwrap

import numpy as np
import pytest

from shardax.errors import UsageError
from shardax.train.post.rewards import RewardError, RewardSet, load_reward, reward_metrics

REWARDS = """
def exact(prompts, completions, answer, **fields):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

def length(prompts, completions, **fields):
    return [float(len(c)) if c else None for c in completions]

def seen(prompts, completions, **fields):
    return [float(len(fields)) + len(prompts) for _ in completions]

def boom(prompts, completions, **fields):
    raise ValueError("no answer\\nin record")

def text(prompts, completions, **fields):
    return "1.0"

def short(prompts, completions, **fields):
    return [1.0]

def word(prompts, completions, **fields):
    return [1.0, "high", 0.0, 0.0]

def none(prompts, completions, **fields):
    return [None] * len(completions)

NOT_CALLABLE = 3
"""

PROMPTS = ["1+1=", "1+1=", "2+2=", "2+2="]
COMPLETIONS = ["2", "11", "", "4"]
RECORDS = [{"prompt": p, "answer": a, "level": 1}
           for p, a in [("1+1=", "2"), ("1+1=", "2"), ("2+2=", "4"), ("2+2=", "4")]]


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARDS)
    return str(path)


def test_file_and_module_specs_load(reward_file, tmp_path, monkeypatch):
    path_before = list(sys.path)
    exact = load_reward(f"{reward_file}:exact")
    assert exact(prompts=PROMPTS, completions=COMPLETIONS, answer=["2", "2", "4", "4"]) == [
        1.0, 0.0, 0.0, 1.0]
    assert sys.path == path_before  # the file's folder was on sys.path only while it ran
    (tmp_path / "pkg_rewards_t36").mkdir()
    (tmp_path / "pkg_rewards_t36" / "__init__.py").write_text("")
    (tmp_path / "pkg_rewards_t36" / "scores.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    length = load_reward("pkg_rewards_t36.scores:length")
    assert length(prompts=[], completions=["abc", ""]) == [3.0, None]


def test_weighted_sum_nan_and_metrics_equal_a_hand_table(reward_file):
    rewards = RewardSet([f"{reward_file}:exact", f"{reward_file}:length"], weights=[2.0, 0.5])
    total, per_function = rewards(PROMPTS, COMPLETIONS, RECORDS)
    # completions "2", "11", "", "4": exact 1 0 0 1; length 1 2 None 1;
    # total = 2*exact + 0.5*length, None skipped (nansum) -> 2.5 1.0 0.0 2.5
    assert total.dtype == np.float32
    np.testing.assert_array_equal(total, [2.5, 1.0, 0.0, 2.5])
    np.testing.assert_array_equal(per_function["exact"], [1, 0, 0, 1])
    np.testing.assert_array_equal(per_function["length"], [1, 2, np.nan, 1])
    metrics = reward_metrics(total, per_function, group_size=2)
    assert metrics == pytest.approx({
        "rewards/exact/mean": 0.5, "rewards/exact/std": np.std([1, 0, 0, 1], ddof=1),
        "rewards/length/mean": 4 / 3, "rewards/length/std": np.std([1, 2, 1], ddof=1),
        "reward": 1.5,
        # groups (2.5, 1.0) and (0.0, 2.5): ddof=1 stds 1.5/sqrt2 and 2.5/sqrt2
        "reward_std": (1.5 + 2.5) / np.sqrt(2) / 2})


def test_fields_are_the_other_columns_and_default_weights(reward_file):
    rewards = RewardSet([f"{reward_file}:seen", f"{reward_file}:exact"])
    total, per_function = rewards(PROMPTS, COMPLETIONS, RECORDS)
    # seen gets answer and level (not prompt) and 4 prompts: 2 + 4 = 6, plus exact at weight 1
    np.testing.assert_array_equal(per_function["seen"], [6.0] * 4)
    np.testing.assert_array_equal(total, [7.0, 6.0, 6.0, 7.0])


def test_all_none_is_zero_with_a_warning(reward_file):
    with pytest.warns(UserWarning, match="completion 0"):
        total, _ = RewardSet([f"{reward_file}:none"])(PROMPTS, COMPLETIONS, RECORDS)
    np.testing.assert_array_equal(total, [0.0] * 4)


@pytest.mark.parametrize("name, error, expected", [
    ("boom", RewardError, "raised ValueError: no answer in record"),
    ("text", RewardError, "returned str '1.0', expected a list of 4 numbers"),
    ("short", RewardError, "returned 1 values for 4 completions"),
    ("word", RewardError, "value 'high' at index 1 is not a finite number or None"),
    ("missing", UsageError, "has no 'missing'"),
    ("NOT_CALLABLE", UsageError, "NOT_CALLABLE is not callable (a int)"),
])
def test_bad_reward_functions_are_one_line_naming_the_spec(reward_file, name, error, expected):
    spec = f"{reward_file}:{name}"
    with pytest.raises(error) as info:
        RewardSet([spec])(PROMPTS, COMPLETIONS, RECORDS)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"--reward {spec}: ")
    assert expected in message


def test_bad_specs_are_one_line_naming_the_spec(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    pass\n")
    raises = tmp_path / "raises.py"
    raises.write_text(textwrap.dedent("""
        import no_such_module_t36
    """))
    notes = tmp_path / "notes.txt"
    notes.write_text("def f(): pass\n")
    cases = {
        "my_rewards.py": "expected file.py:function or package.module:function",
        f"{tmp_path}/absent.py:f": "no such file",
        f"{tmp_path}:f": "is not a regular file",
        f"{notes}:f": "is not a .py file",
        f"{broken}:f": "cannot import",
        f"{raises}:f": "ModuleNotFoundError: No module named 'no_such_module_t36'",
        "no_such_package_t36.rewards:f": "ModuleNotFoundError",
    }
    for spec, expected in cases.items():
        with pytest.raises(UsageError) as info:
            load_reward(spec)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"--reward {spec}: "), message
        assert expected in message, message
    assert "SyntaxError" in str(pytest.raises(UsageError, load_reward, f"{broken}:f").value)


def test_weights_must_match_the_rewards(reward_file):
    with pytest.raises(UsageError, match=r"^--reward-weights 1\.0: 1 weights for 2 --reward$"):
        RewardSet([f"{reward_file}:exact", f"{reward_file}:length"], weights=[1.0])
