"""Trackers, profiler traces and MFU: files read back, FLOPs checked against XLA.

One tiny `train` run (conftest.py's ``observed_run``, shared with test_planner.py) logs to all
three trackers and profiles two steps; the tests read what it wrote with readers independent of
the writers (a TFRecord / Event-protobuf parser for TensorBoard, a LevelDB-log / W&B-protobuf
parser for wandb's offline run, gzip + JSON for the Perfetto trace). The FLOPs formula is
compared with XLA's cost analysis of the compiled step.
"""

import gzip
import json
import math
import os
import struct
import subprocess
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from _cli import cli_command, cli_env
from _reference import init_train_state

from shardax import models
from shardax.devices import device_spec
from shardax.layout import Layout
from shardax.train.run.mfu import flops_per_token, matmul_params, mfu
from shardax.train.run.profiler import parse_profile_steps, trace_files
from shardax.train.run.trackers import parse_log_to
from shardax.train.step import train_step

SRC = Path(__file__).resolve().parents[1] / "src"
SCALARS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s",
           "tflops_per_device")


@pytest.fixture(scope="module")
def run(observed_run):
    """The shared tiny run of conftest.py (llama-tiny, fsdp=4,tp=2, 4 steps, every installed
    tracker, steps 2-3 profiled): ``(out, records)``."""
    _, out, records = observed_run
    return out, records


def _tfrecords(path: Path):
    data, pos = path.read_bytes(), 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        yield data[pos + 12:pos + 12 + length]  # after length and its CRC
        pos += 12 + length + 4  # and the data's CRC


def test_jsonl_has_every_scalar_and_mfu_is_na_on_cpu(run):
    out, records = run
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines == records
    last = lines[-1]
    for key in SCALARS:
        value = last.get(key)
        assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
    for key in ("loss", "val_loss", "grad_norm", "tokens_per_s", "step_time_s"):
        assert last[key] > 0, (key, last[key])
    assert last["mfu"] is None  # CPU: no peak FLOP/s
    assert "memory_gib" not in last  # CPU devices report no memory stats
    per_token = flops_per_token(models.get_config("llama-tiny"), 32)
    assert last["tflops_per_device"] == pytest.approx(
        per_token * last["tokens_per_s"] / 8 / 1e12, rel=1e-9)


def test_tensorboard_event_file_holds_the_scalars(run):
    pytest.importorskip("tensorboardX")
    from tensorboardX.proto import event_pb2

    out, records = run
    (events_file,) = (out / "tensorboard").glob("events.out.tfevents.*")
    scalars: dict[str, dict[int, float]] = {}
    for raw in _tfrecords(events_file):
        event = event_pb2.Event.FromString(raw)
        for value in event.summary.value:
            if value.HasField("simple_value"):
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    for key in SCALARS:
        want = {r["step"]: r[key] for r in records if key in r}
        assert scalars[key].keys() == want.keys(), key
        assert list(scalars[key].values()) == pytest.approx(list(want.values()), rel=1e-6)
    assert "mfu" not in scalars  # None is not logged


def _wandb_history(run_file: Path) -> list[dict]:
    """History rows of a ``.wandb`` file: a LevelDB-style log of W&B ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, buf, rows = run_file.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment: a whole record
            record = wandb_internal_pb2.Record.FromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in record.history.item})
    return rows


def test_wandb_offline_run_holds_the_scalars(run):
    pytest.importorskip("wandb")
    out, records = run
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    rows = _wandb_history(run_file)
    by_step = {row["_step"]: row for row in rows}
    for r in records:
        for key in SCALARS:
            if key in r:
                assert by_step[r["step"]][key] == pytest.approx(r[key], rel=1e-6), key


def test_profile_trace_covers_the_requested_steps(run):
    out, _ = run
    files = trace_files(out / "profile")
    assert any(f.name.endswith(".xplane.pb") for f in files), files
    (perfetto,) = [f for f in files if f.name == "perfetto_trace.json.gz"]
    events = json.loads(gzip.open(perfetto).read())["traceEvents"]
    steps = sorted(int(e["args"]["step_num"]) for e in events
                   if e.get("name") == "train" and "step_num" in e.get("args", {}))
    assert steps == [2, 3]  # --profile-steps 2:4


def test_parsers_name_the_flag():
    assert parse_profile_steps("10:13") == range(10, 13)
    assert parse_profile_steps("") is None
    for bad in ("a:b", "5:5", "0:2"):
        with pytest.raises(ValueError, match="--profile-steps"):
            parse_profile_steps(bad)
    assert parse_log_to("wandb,jsonl") == ["jsonl", "wandb"]
    with pytest.raises(ValueError, match="--log-to.*'mlflow'"):
        parse_log_to("mlflow")


def _cli_env(extra_path: Path) -> dict[str, str]:
    """`cli_env` with ``extra_path`` first on the path."""
    env = cli_env()
    return {**env, "PYTHONPATH": os.pathsep.join((str(extra_path), env["PYTHONPATH"]))}


def test_missing_extra_is_one_line_naming_it(tmp_path):
    blocked = tmp_path / "blocked"
    (blocked / "tensorboardX").mkdir(parents=True)
    (blocked / "tensorboardX" / "__init__.py").write_text("raise ImportError('not here')\n")
    proc = subprocess.run(
        cli_command("train", "--log-to", "jsonl,tensorboard", "--out", tmp_path / "run"),
        env=_cli_env(blocked), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "pip install 'shardax[tensorboard]'" in lines[0]
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- MFU


def test_flops_formula_matches_xla_cost_analysis():
    """6N + 12·L·d·T against the FLOPs XLA counts in the compiled train step (one device,
    layers unrolled: XLA's cost analysis counts a scanned body once). Within 10%: the formula
    leaves out elementwise work (norms, softmax, SGD update)."""
    config = models.get_config("llama-tiny", dim=128, mlp_dim=384, max_seq_len=128)
    tx = optax.sgd(0.1)
    graphdef, state = init_train_state(config, tx, abstract=True)
    batch = (jax.ShapeDtypeStruct((8, 128), jnp.int32),) * 2
    compiled = jax.jit(partial(train_step, graphdef=graphdef, tx=tx,
                               layout=Layout(scan_layers=False))).lower(state, batch).compile()
    cost = compiled.cost_analysis()
    xla_flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    formula = flops_per_token(config, 128) * 8 * 128
    assert xla_flops == pytest.approx(formula, rel=0.10)


def test_matmul_params_leave_out_lookups_and_unrouted_experts():
    tiny = models.get_config("llama-tiny")
    assert matmul_params(tiny) == models.param_count(tiny) - 256 * 64
    small = models.get_config("llama-small")  # tied: the table is also the output matmul
    assert matmul_params(small) == models.param_count(small)
    moe = models.get_config("llama-moe-tiny")  # 4 experts, top 2: 2 of 4 MLPs per layer
    assert matmul_params(moe) == (models.param_count(moe) - 256 * 64
                                  - 4 * 2 * 3 * 64 * 128)


def test_device_table_and_mfu():
    assert device_spec("NVIDIA H100 80GB HBM3").peak_flops == 989e12
    assert device_spec("NVIDIA H100 PCIe").peak_flops == 756e12
    assert device_spec("TPU v5 lite").name == "TPU v5e"
    assert device_spec("TPU v5p").name == "TPU v5p"
    assert device_spec("TPU v6 lite").name == "TPU v6e"
    assert device_spec("cpu") is None
    assert mfu(4e14, 1e15, 2) == pytest.approx(0.2)
    assert mfu(4e14, None, 2) is None
