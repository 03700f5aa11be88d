"""What the commands say while they work, as users meet it: `train` names each slow phase with
its elapsed seconds before the first step and prints the axis/replication findings that `plan`
and `verify` make; `plan --search` prints each candidate as it is compiled; lines fit the
terminal."""

from __future__ import annotations

import re
import subprocess
import time
from types import SimpleNamespace

import jax
from _cli import cli_command, cli_env, run_cli, wait_for_line

from shardax.plan.search import _fold
from shardax.train.build import abstract
from shardax.train.config import TrainConfig
from shardax.train.loop import axis_findings
from shardax.train.resolve import resolve
from shardax.train.run.report import Progress, fit, phase

FLAGS = ["--model", "llama-tiny", "--batch-size", "8", "--seq-len", "16"]
# The search's: 18 tokens do not split over 'cp' (see test_planner.py's SEARCHED).
SEARCH_FLAGS = ["--model", "llama-tiny", "--batch-size", "8", "--seq-len", "18"]


def test_train_says_compiling_with_seconds_before_the_first_step_and_the_wasted_axis(
        tmp_path):
    proc = run_cli("train", *FLAGS, "--mesh", "tp=8", "--steps", "2", "--log-every", "1",
                   "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()  # the phases, the banner and the steps: all on stdout

    def first(pattern: str) -> int:
        return next(i for i, line in enumerate(lines) if re.search(pattern, line))

    # the first line is said before the train stack loads; the backend starts after it
    assert lines[0] == "shardax train: loading the train stack and checking the flags ..."
    loaded = first(r"^shardax train: loading the train stack and checking the flags \.\.\. "
                   r"\d+\.\d s$")
    assert loaded < first(r"^shardax train: starting the backend and resolving the run \.\.\.$")
    compiled = first(r"^shardax train: compiling the train step \.\.\. \d+\.\d s$")
    assert first(r"^shardax train: compiling the train step \.\.\.$") < compiled
    assert (first(r"initialising the model \.\.\. \d+\.\d s") < compiled
            < first(r"^step +1 ") < first(r"^step +2 "))
    # llama-tiny's heads do not split 8 ways: the rule check says so, in the banner
    warning = first(r"^warning: params/.*wq.*'heads'.*replicated")
    assert warning < first(r"^step +1 ")
    assert "phase" not in proc.stderr and "compiling" not in proc.stderr


def _findings(**flags) -> list[str]:
    run = resolve(TrainConfig(model="llama-tiny", batch_size=8, seq_len=16, **flags))
    return axis_findings(run, abstract(run.model_config, run.tx, 0, run.mesh)[1].params)


def test_the_findings_name_a_wasted_axis_and_none_for_a_well_ruled_mesh():
    assert len(jax.devices()) == 8
    assert _findings() == [] and _findings(mesh="fsdp=4,tp=2") == []
    idle = _findings(mesh="fsdp=4,tp=2", rules="fsdp")
    assert idle == ["mesh axis 'tp' (size 2) splits neither the batch, the sequence, the "
                    "layers nor the MLP under --rules 'fsdp': its devices repeat the same "
                    "compute"]


def test_progress_lines_fit_the_width_and_break_between_fields():
    parts = ["step     5  loss 2.1234", "12,345 tok/s", "12 ms/step", "0.5 TFLOP/s/device",
             "MFU n/a"]
    lines = fit(parts, 40)
    assert all(len(line) <= 40 for line in lines) and len(lines) > 1
    assert " | ".join(p.strip() for line in lines for p in line.split(" | ")) == " | ".join(parts)


def test_plan_search_prints_each_candidate_as_it_is_compiled():
    proc = subprocess.Popen(
        cli_command("plan", *SEARCH_FLAGS, "--devices", "2", "--search", "--max-compiles", "2",
                    "--cache", "none", "--jobs", "1"),
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        header = wait_for_line(proc.stdout, r"^search: \d+ layouts", proc, 240)
        line = wait_for_line(proc.stdout, r"^  compiled 1/2: ", proc, 240)
        assert proc.poll() is None, "the first candidate came only at the end"
        assert "peak" in line and "--rules" in line
        rest = proc.stdout.read()
        assert proc.wait(120) == 0, rest[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert re.search(r"^  compiled 2/2: ", rest, re.M)
    before = re.search(r"search: \d+ layouts, (\d+) over", header)[1]
    assert re.search(rf"over \S+ GiB by formula \({before} before compiling", rest), rest


def test_variants_of_one_layout_fold_into_it():
    def est(**config):
        return SimpleNamespace(config={"mesh": "fsdp=8", "remat": "full", "attention": "auto",
                                       "scan_layers": False, **config})

    ranked = [est(), est(attention="xla"), est(remat="none"), est(scan_layers=True)]
    kept, variants = _fold(ranked)
    assert kept == [ranked[0], ranked[2]] and variants == [[ranked[1], ranked[3]], []]


def test_a_slow_step_and_a_slow_phase_still_show_time_moving(capsys):
    with Progress(3, 0, every=0.2) as progress:
        time.sleep(0.5)  # the first step, slower than the heartbeat
        progress.update(1)
    with phase("loading", every=0.2):
        time.sleep(0.5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 1/3 still running (the first one compiles the step): ")
    start = lines.index("shardax train: loading ...")
    assert all(line.startswith("step 1/3 still running") for line in lines[:start])
    assert "shardax train: loading ... 0 s so far" in lines[start + 1:-1]
    assert re.fullmatch(r"shardax train: loading \.\.\. 0\.\d s", lines[-1])
