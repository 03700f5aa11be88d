"""``shardax train --objective grpo`` (`shardax.train.post.grpo_run`): a 3-step run of llama-tiny on
the bytes tokenizer logs TRL's GRPO metrics, a run stopped at step 2 and resumed equals the
straight one bit for bit, and bad GRPO input is one line, exit 2. The algorithm itself
(rollouts, advantages, loss, sharded = one device) is tested in test_grpo.py."""

import json
from pathlib import Path

import pytest
from _cli import assert_one_line_error, committed_steps, read_metrics, run_cli, stopped_at

from shardax.train.loop import TrainConfig, train

REWARD = '''
def digits(prompts, completions, answer, **fields):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + (a in c) for c, a in
            zip(completions, answer)]
'''

#: 3 GRPO steps of 2 prompts x 4 completions of 6 bytes, on fsdp=4 x tp=2, with a KL term
#: and 2 optimizer steps per rollout batch (so old log-probabilities and clipping are on).
GRPO = dict(objective="grpo", steps=3, batch_size=8, group_size=4, max_new_tokens=6,
            lr=0.03, optimizer="sgd", beta=0.04, num_iterations=2, ckpt_every=1,
            mesh="fsdp=4,tp=2")
#: What changes between two identical runs: timings.
TIMED = ("tokens_per_s/generation", "tokens_per_s/train")


def _inputs(root: Path) -> tuple[str, str]:
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                               for a, b in [(2, 3), (7, 1), (4, 4)]))
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return str(prompts), f"{reward}:digits"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The straight 3-step run and the same stopped at step 2 and resumed."""
    root = tmp_path_factory.mktemp("grpo_cli")
    prompts, reward = _inputs(root)
    config = dict(GRPO, data=[prompts], reward=[reward])
    straight = root / "straight"
    returned = train(TrainConfig(out=str(straight), **config))
    resumed = stopped_at(straight, root / "resumed", 2)
    train(TrainConfig(out=str(resumed), resume=True, **config))
    return straight, resumed, returned


def test_grpo_run_logs_trl_metrics_per_step(runs):
    straight, _, returned = runs
    records = read_metrics(straight)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records == json.loads(json.dumps(returned))
    for r in records:
        for key in ("reward", "reward_std", "kl", "clip_ratio", "completion_length", "loss",
                    "rewards/digits/mean", "tokens_per_s/generation", "tokens_per_s/train"):
            assert isinstance(r[key], float), (key, r)
        assert 0 < r["completion_length"] <= GRPO["max_new_tokens"]
        assert r["kl"] > 0  # the 2nd update of each batch is off the initial policy
    assert committed_steps(straight) == [1, 2, 3]
    saved = json.loads((straight / "config.json").read_text())
    assert saved["objective"] == "grpo" and saved["beta"] == 0.04


def test_grpo_resume_is_bit_identical(runs):
    straight, resumed, _ = runs
    want, got = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in got] == [1, 2, 3]
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMED}  # noqa: E731
    assert [strip(r) for r in got] == [strip(r) for r in want]


@pytest.mark.parametrize("case", ["missing_reward", "no_reward_file", "no_prompt_field"])
def test_bad_grpo_input_is_one_line(case, tmp_path):
    prompts, reward = _inputs(tmp_path)
    args = ["train", "--objective", "grpo", "--data", prompts, "--reward", reward,
            "--out", tmp_path / "run"]
    if case == "missing_reward":
        args = args[:5] + args[7:]
        needles = ["--reward"]
    elif case == "no_reward_file":
        args[6] = f"{tmp_path / 'nope.py'}:digits"
        needles = ["--reward", "nope.py", "no such file"]
    else:
        (tmp_path / "prompts.jsonl").write_text('{"question": "2+2="}\n')
        needles = ["prompts.jsonl:1", "'prompt'"]
    assert_one_line_error(run_cli(*args, cwd=tmp_path), "train", *needles)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_chat_prompts_are_the_templates_generation_prompts(name, tmp_path):
    """``messages`` (and TRL's conversational ``prompt``, a list of messages) become the
    text whose ids are ``apply_chat_template(..., add_generation_prompt=True)``'s; other
    columns stay for the rewards."""
    pytest.importorskip("jinja2")
    from shardax.data.chat import ChatTemplate
    from shardax.data.tokenizer import load_tokenizer
    from shardax.train.post.grpo_run import read_prompts

    chat = Path(__file__).parent / "fixtures" / "chat" / name
    convs = [json.loads(line)["messages"][:-1] for line in
             (chat.parent / "chat.jsonl").read_text().splitlines()[:2]]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": convs[0], "answer": "4"}) + "\n"
                    + json.dumps({"prompt": convs[1]}) + "\n")
    records, tok = read_prompts(str(path), str(chat)), load_tokenizer(chat)
    assert records[0]["answer"] == "4"
    for record, messages in zip(records, convs):
        assert tok.encode(record["prompt"]) == ChatTemplate(chat).prompt(messages)
