"""Every example runs as a user would run it (a fresh process, 8 emulated CPU devices) with a few
steps, exits 0, prints what it promises and trains: the last printed loss is below the first.
(The process is forked from one that has imported jax and shardax, `_cli.run_python`: no JAX
backend has started in it, so each example still sets its own devices.)"""

import os
import re
from pathlib import Path

import pytest
from _cli import compile_flags, run_python

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6  # every example prints the loss of step 0 and of step STEPS - 1

# example -> text its output must contain (the sharding it claims to set up)
EXAMPLES = {
    "mlp_data_parallel.py": ["('dp', None)", "held-out loss"],
    "llama_fsdp.py": ["state/params/layers/mlp/w_gate/value", "(None, 'fsdp', None)"],
    "llama_fsdp_tp.py": ["(None, 'fsdp', 'tp')", "(None, 'tp', 'fsdp')"],
    "gpt2_param_compute_mapping.py": ["-> P(None, 'data')", "-> P('data', None, None)",
                                      "w_fc after training: float32, P(None, 'data', None)"],
    "linen_logical.py": ["names ('layer', 'embed', 'hidden')", "P(None, None, 'model')",
                         "Adam mu of W2: P(None, 'model', None)"],
    "nnx_sharded_init.py": ["-> P(None, 'model')", "bit-identical to the single-device init: True"],
    "equinox_fsdp.py": ["params/layers/1/weight", "('fsdp', None)"],
    "haliax_gpt2.py": ["axes ('layers', 'mlp', 'embed') -> P(None, 'model', 'data')",
                       "Adam mu of c_fc: P(None, 'model', 'data')", "(equal within 1e-5: True)"],
}
NEEDS = {"haliax_gpt2.py": "haliax"}  # example -> the optional extra's module it imports
# examples with their own output (no loss line per step; those with a step count run STEPS):
# example -> text the output must contain
SELF_CHECKING = {
    "quickstart.py": ["step  29  loss"],
    "pipeline_classifier.py": [f"{STEPS} steps in"],
    "ring_attention.py": ["collective-permute in HLO: True, all-gather: False"],
    "moe_expert_parallel.py": [f"{STEPS} steps in", "all-to-all"],
    "tensor_parallel_async.py": [
        "all modes agree with each other and with the single-device result"],
}
LOSS = re.compile(r"^step\s+(\d+)\s+loss\s+([0-9.]+)", re.MULTILINE)
REWARD = re.compile(r"^step\s+(\d+)\s+reward\s+([0-9.]+)", re.MULTILINE)
REWARD_EXAMPLES = {"grpo_toy.py"}  # post-training examples: their mean reward rises


def run_example(name: str) -> str:
    # The example adds the device count itself; the suite's compile-time flags go with it.
    env = dict(os.environ, XLA_FLAGS=compile_flags(), PYTHONPATH=str(ROOT / "src"),
               JAX_PLATFORMS="cpu", SHARDAX_EXAMPLE_STEPS=str(STEPS))
    result = run_python(ROOT / "examples" / name, env=env, cwd=ROOT)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_and_trains(name):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    out = run_example(name)
    assert "8 devices" in out, out
    for needle in EXAMPLES[name]:
        assert needle in out, f"{needle!r} not in the output of {name}:\n{out}"
    losses = [(int(s), float(v)) for s, v in LOSS.findall(out)]
    assert [s for s, _ in losses][0] == 0 and losses[-1][0] == STEPS - 1, out
    assert losses[-1][1] < losses[0][1], f"{name}: loss did not fall: {losses}"


@pytest.mark.parametrize("name", sorted(SELF_CHECKING))
def test_example_runs_and_prints_its_check(name):
    out = run_example(name)
    for needle in SELF_CHECKING[name]:
        assert needle in out, f"{needle!r} not in the output of {name}:\n{out}"


@pytest.mark.parametrize("name", sorted(REWARD_EXAMPLES))
def test_example_reward_rises(name):
    out = run_example(name)
    assert "8 devices" in out, out
    rewards = [(int(s), float(v)) for s, v in REWARD.findall(out)]
    assert [s for s, _ in rewards] == list(range(STEPS)), out
    third = STEPS // 3
    first = sum(v for _, v in rewards[:third]) / third
    last = sum(v for _, v in rewards[-third:]) / third
    assert last > 2 * first and last > first + 0.1, f"{name}: reward did not rise: {rewards}"


def test_every_example_is_run():
    assert {p.name for p in (ROOT / "examples").glob("*.py")} == {
        *EXAMPLES, *SELF_CHECKING, *REWARD_EXAMPLES}
