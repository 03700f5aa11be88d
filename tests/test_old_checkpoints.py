"""A run written before the layers were always stacked restores: the fixture
``fixtures/list_layers_run`` is a 2-step llama-tiny run (AdamW, ``--no-scan-layers``, fsdp=8,
checkpoint at step 2) written by main at 90fc660, when such a run stored its layers as a list
(``params.layers.0.attn.wq.value``, and the optimizer's moments alike). Its checkpoint is
stacked on restore (`shardax.train.run.checkpoint.listed_layers`). ``expected.npz`` holds that
code's logits of the restored model for a fixed batch, ``expected.json`` its losses when it
resumed the run to step 4."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardax.cli import main
from shardax.train.generate import restore_model
from shardax.train.rundir import check_run

FIXTURE = Path(__file__).parent / "fixtures" / "list_layers_run"


@pytest.fixture
def old_run(tmp_path, monkeypatch):
    """A copy of the fixture's run, the working directory its own (its --data is relative)."""
    shutil.copytree(FIXTURE, tmp_path / "old")
    monkeypatch.chdir(tmp_path / "old")
    return tmp_path / "old" / "run"


def test_an_old_list_checkpoint_restores_stacked_with_the_same_logits(old_run):
    _, model, _ = restore_model(check_run(old_run))
    assert model.stacked and not isinstance(model.layers, nnx.List)
    expected = np.load(FIXTURE / "expected.npz")
    logits = np.asarray(model(jnp.asarray(expected["tokens"])))
    # The old code looped over a list; the plain forward scans the stack: same ops per layer.
    np.testing.assert_allclose(logits, expected["logits"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mesh", ["fsdp=8", "pp=2,fsdp=4"])
def test_an_old_list_run_resumes_with_the_losses_it_would_have_had(old_run, mesh):
    """The optimizer's moments are stacked too: steps 3 and 4 (AdamW) give the old code's
    losses. The run looped over its layers (its config says --no-scan-layers) and still does,
    over the stack's slices now; or it goes on as a pipeline over 'pp', which the old code
    refused for a list of layers."""
    argv = ["train", "--out", str(old_run), "--resume", "--steps", "4", "--mesh", mesh]
    assert main(argv) in (0, None)
    lines = (old_run / "metrics.jsonl").read_text().splitlines()
    losses = {r["step"]: r["loss"] for r in map(json.loads, lines)}
    want = json.loads((FIXTURE / "expected.json").read_text())["resumed_losses"]
    for step in (3, 4):
        np.testing.assert_allclose(losses[step], want[str(step)], rtol=1e-5)
