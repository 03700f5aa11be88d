"""Writers that stay inside their folder, sizes checked up front and any device count, met the
way users meet them (``shardax ...`` in a subprocess).

One LoRA run of llama-tiny on 6 emulated devices (the default ``--mesh fsdp=-1`` must fit a
64-wide model to them) is trained into a run directory whose ``config.json``,
``metrics.jsonl``, ``loss.png`` and ``plan.json`` are planted symlinks to files outside it;
then one of its step folders becomes a symlink to another run's step and it resumes through
a rotation of old steps; then it is exported (merged, and as a PEFT adapter) into folders
whose files are planted symlinks. Nothing outside may change, every link is replaced by a
regular file, nothing is lost. The bad-input cases fail before a backend compiles anything.
"""

import hashlib
import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from _cli import run_cli_batch
from test_hostile_input import FIXTURE, one_line_error, shardax

from shardax.cli import main
from shardax.hf.configs import HF_MODEL_TYPES
from shardax.train.config import TrainConfig, UsageError, check
from shardax.train.run.checkpoint import list_steps
from shardax.train.rundir import check_run_dir

RUN = ["--batch-size", "12", "--seq-len", "32", "--optimizer", "sgd", "--lr", "0.03",
       "--log-every", "1", "--eval-every", "0", "--ckpt-every", "1", "--lora-rank", "2",
       "--devices", "6"]
RUN_FILES = ("config.json", "metrics.jsonl", "loss.png", "plan.json")
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", "special_tokens_map.json")
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def _plant(directory: Path, names, outside: Path) -> None:
    """Symlinks ``directory/name`` -> ``outside/name`` (files holding 'outside NAME')."""
    directory.mkdir(parents=True, exist_ok=True)
    outside.mkdir(parents=True, exist_ok=True)
    for name in names:
        (outside / name).write_text(f"outside {name}\n")
        (directory / name).symlink_to(outside / name)


def _assert_replaced(directory: Path, names, outside: Path) -> None:
    for name in names:
        assert (outside / name).read_text() == f"outside {name}\n", name
        path = directory / name
        assert not path.is_symlink() and path.is_file() and path.stat().st_size, name


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _parallel(*commands: tuple) -> list:
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: shardax(*args), commands))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The LoRA run (trained to step 3, its step 1 then linked to another run's copy, resumed
    to step 5) and what was planted around it."""
    root = tmp_path_factory.mktemp("writers")
    out, outside = root / "run", root / "outside"
    (np.arange(1 << 16) % 200).astype(np.uint16).tofile(root / "tokens.u16")
    _plant(out, (*RUN_FILES, "run.lock"), outside)
    data = ["--data", root / "tokens.u16"]
    first = shardax("train", *RUN, *data, "--steps", 3, "--out", out)
    assert first.returncode == 0, first.stderr[-3000:]
    other = root / "other" / "checkpoints" / "1"  # "another run's step"
    shutil.copytree(out / "checkpoints" / "1", other)
    shutil.rmtree(out / "checkpoints" / "1")
    (out / "checkpoints" / "1").symlink_to(other)
    before = _tree(other)
    resumed = shardax("train", *RUN, *data, "--steps", 5, "--resume", "--out", out)
    return SimpleNamespace(out=out, outside=outside, root=root, first=first, resumed=resumed,
                           other=other, other_before=before)


def test_the_default_mesh_fits_six_devices(run):
    """``--mesh fsdp=-1`` on 6 devices and a 64-wide model: fsdp=2 (the largest divisor of 6
    that divides every sharded dim), dp=3, said in the banner; config.json keeps fsdp=-1."""
    assert "mesh {'dp': 3, 'fsdp': 2}" in run.first.stdout, run.first.stdout[:2000]
    banner = [line for line in run.first.stdout.splitlines() if line.startswith("mesh: ")]
    assert len(banner) == 1 and banner[0].startswith(
        "mesh: --mesh fsdp=-1: fsdp=6 cannot split leaf "), run.first.stdout[:3000]
    assert "; fsdp=2 is the largest size that divides every dim it shards, dp=3" in banner[0]
    assert json.loads((run.out / "config.json").read_text())["mesh"] == "fsdp=-1"


def test_run_files_replace_planted_links(run):
    _assert_replaced(run.out, RUN_FILES, run.outside)
    assert (run.outside / "run.lock").read_text() == "outside run.lock\n"
    assert not (run.out / "run.lock").exists()  # the lock is gone with the run
    assert json.loads((run.out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 5


def test_the_rotation_keeps_a_linked_step_and_never_deletes_through_it(run):
    """The resumed run rotates old steps out (max 3 kept) past a step folder that is a link:
    the link is kept with a note, the step it leads to is untouched, training goes on."""
    proc = run.resumed
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "symlink" in line]
    assert len(notes) == 1 and notes[0].startswith(
        "shardax train: note: checkpoint step(s) 1 (a symlink to "), proc.stderr
    link = run.out / "checkpoints" / "1"
    assert link.is_symlink() and _tree(run.other) == run.other_before
    assert list_steps(run.out / "checkpoints")[0] == [1, 3, 4, 5]  # step 2 rotated out


def test_export_writes_only_inside_its_folder(run):
    """Links planted in the export folders (to files outside) are replaced, not written
    through, by the merged export and the PEFT export; an export folder that is itself a link
    is refused in one line."""
    full, peft, outside = run.root / "full", run.root / "peft", run.root / "outside-export"
    _plant(full, EXPORT_FILES, outside)
    _plant(peft, PEFT_FILES, outside)
    (run.root / "linked").symlink_to(outside)
    listing = sorted(p.name for p in outside.iterdir())
    merged, adapter, linked = _parallel(
        ("export", "--out", run.out, "--to", full),
        ("export", "--out", run.out, "--to", peft, "--adapter-only"),
        ("export", "--out", run.out, "--to", run.root / "linked"))
    for proc in (merged, adapter):
        assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_replaced(full, EXPORT_FILES, outside)
    _assert_replaced(peft, PEFT_FILES, outside)
    assert json.loads((peft / "adapter_config.json").read_text())["r"] == 2
    one_line_error(linked, "export", f"--to {run.root / 'linked'} is a symlink to {outside}")
    assert sorted(p.name for p in outside.iterdir()) == listing


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/mem is Linux's")
def test_bad_sizes_specs_and_run_folders_are_one_line_before_anything_is_written(tmp_path):
    """Each fails before a run directory is written or a model allocated: LoRA targets that
    match nothing, a LoRA rank beyond the weights, an explicit mesh that cannot shard, a
    verify file that is not Python, a --config that cannot be read, and run folders (--out,
    its checkpoints/) that are symlinks."""
    (tmp_path / "notes.txt").write_text("make_step = 1\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "linked-out").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "ckpt-linked").mkdir()
    (tmp_path / "ckpt-linked" / "checkpoints").symlink_to(tmp_path / "elsewhere")
    tiny = ["--steps", "2", "--batch-size", "12", "--seq-len", "32", "--devices", "6"]
    cases = [
        (("train", *tiny, "--lora-rank", "2", "--lora-targets", "nothing"),
         "train", "--lora-targets nothing: LoRA targets 'nothing' match no weight"),
        (("train", *tiny, "--lora-rank", "1000000"),
         "train", "--lora-rank 1000000: rank 1000000 exceeds", "the largest useful rank of weight"),
        (("train", *tiny, "--mesh", "fsdp=6"),
         "train", "--mesh 'fsdp=6' cannot shard the train state: leaf 'params/embed/value' of "
         "shape (256, 64)", "of total size 6"),
        (("verify", tmp_path / "notes.txt:make_step", "--layouts", "fsdp=2"),
         "verify", "notes.txt is not a Python file"),
        (("train", "--config", "/proc/self/mem"),
         "train", "--config /proc/self/mem: cannot read it"),
    ]
    argvs = [(*c[0], "--out", tmp_path / f"run{i}") if c[1] == "train" else c[0]
             for i, c in enumerate(cases)]
    procs = run_cli_batch([*argvs, ("train", "--out", tmp_path / "linked-out")])
    for (_, command, *needles), proc in zip(cases, procs):
        one_line_error(proc, command, *needles)
    one_line_error(procs[-1], "train", f"--out {tmp_path / 'linked-out'} is a symlink to")
    with pytest.raises(UsageError, match="checkpoints is a symlink to .* a run writes only "
                                         "inside --out"):
        check_run_dir(check(TrainConfig(out=str(tmp_path / "ckpt-linked"))))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-linked", "elsewhere", "linked-out", "notes.txt"]
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_plan_from_config_json_alone(tmp_path):
    """Planning sizes a model before its weights are downloaded (and names it, and its train
    command, by --init-from)."""
    (tmp_path / "model").mkdir()
    shutil.copy(FIXTURE / "config.json", tmp_path / "model" / "config.json")
    plan = shardax("plan", "--init-from", f"hf:{tmp_path / 'model'}", "--devices", "2",
                   "--batch-size", "8", "--seq-len", "32")
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "memory per device" in plan.stdout and "fits" in plan.stdout
    model = f"hf:{tmp_path / 'model'}"
    assert f"plan: {model} on 2 devices" in plan.stdout  # the model planned, not --model's
    assert f"train it: shardax train --init-from {model} --mesh" in plan.stdout


def test_init_from_help_lists_the_importers_model_types(capsys):
    """The help of --init-from (train, plan) and --from (generate) takes its list from the
    importer's own table, so it cannot drift."""
    for command in ("train", "generate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.replace("│", " ").split())
        assert all(f"{t}," in text or f"{t})" in text for t in HF_MODEL_TYPES), text
