"""Fixtures shared by the test files (the 8-device environment is set up by the
repository-root conftest.py)."""

import importlib.util
import os

import pytest

# No test reaches the Hugging Face Hub: hf:ORG/NAME resolves from the cache only.
os.environ["HF_HUB_OFFLINE"] = "1"

# Shared meshes: one `MeshShardingHelper` per layout for the whole session (per xdist worker).
# Tests that are about constructing a helper build their own.


@pytest.fixture(scope="session")
def fsdp8():
    """The 1-D mesh of all 8 devices on 'fsdp'."""
    from shardax.mesh import MeshShardingHelper

    return MeshShardingHelper([-1], ["fsdp"])


@pytest.fixture(scope="session")
def dp8():
    """The 1-D mesh of all 8 devices on 'dp'."""
    from shardax.mesh import MeshShardingHelper

    return MeshShardingHelper([-1], ["dp"])


@pytest.fixture(scope="session")
def dp2_fsdp4():
    """dp=2 x fsdp=4."""
    from shardax.mesh import MeshShardingHelper

    return MeshShardingHelper([2, -1], ["dp", "fsdp"])


@pytest.fixture(scope="session")
def dp_fsdp_tp():
    """dp=2 x fsdp=2 x tp=2."""
    from shardax.mesh import MeshShardingHelper

    return MeshShardingHelper([2, 2, 2], ["dp", "fsdp", "tp"])


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def observed_run(tmp_path_factory):
    """One tiny 4-step `shardax train` run shared by test_observability.py (trackers, profile,
    metrics) and test_planner.py (its plan.json against `shardax plan`): ``(config, out,
    records)``. Logs to the trackers that are installed (their tests skip otherwise) and
    profiles steps 2-3."""
    from shardax.train.config import TrainConfig
    from shardax.train.loop import train

    out = tmp_path_factory.mktemp("observed") / "run"
    os.environ.setdefault("WANDB_MODE", "offline")
    trackers = [name for name, module in (("tensorboard", "tensorboardX"), ("wandb", "wandb"))
                if _installed(module)]
    config = TrainConfig(
        model="llama-tiny", batch_size=8, seq_len=32, mesh="fsdp=4,tp=2", remat="full",
        out=str(out), steps=4, log_every=1, eval_every=2, ckpt_every=100,
        log_to=",".join(["jsonl", *trackers]), profile_steps="2:4")
    return config, out, train(config)
