"""Bad command lines as a user types them: one line on stderr naming the flag or file, exit
code 2, no traceback, nothing in the run directory touched, and (where the check can happen
before it) no JAX backend started.

The cheap cases run in ONE subprocess (`_cli.run_cli_batch`) that calls ``shardax.cli.main``
once per case and reports the exit code, stderr and whether a JAX backend was started: the
same code path as the ``shardax`` script, without paying the interpreter start-up per case.
A few cases also run through the real ``python -m shardax.cli`` entry point.
"""

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import cli_env, run_cli, run_cli_batch


def _snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                            p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()} | {
        str(p.relative_to(directory)) + "/": ("dir", 0)
        for p in sorted(directory.rglob("*")) if p.is_dir()}


def _config_json(**overrides) -> str:
    from shardax.train.config import TrainConfig, check

    # what a run writes: its checked config (defaults such as --lr filled in)
    return json.dumps({**check(TrainConfig()).to_json(), **overrides}, indent=2)


def _commit(run: Path, step: int) -> None:
    """A committed-looking (but empty) checkpoint step: enough for the checks that run before
    any checkpoint is read."""
    (run / "checkpoints" / str(step)).mkdir(parents=True)
    (run / "checkpoints" / str(step) / "commit_success.txt").write_text("ok")


def _make_fixtures(root: Path) -> dict[str, str]:
    """Run directories and files that the cases point at ({NAME} in an argv)."""
    paths = {}

    def path(name: str) -> Path:
        p = root / name
        paths[name] = str(p)
        return p

    path("a_file").write_text("not a directory\n")
    paths["under_a_file"] = str(root / "a_file" / "run")
    paths["unwritable"] = "/sys/shardax-test/run"  # EPERM even for root
    paths["missing"] = str(root / "missing-run")

    step3 = path("step3_run")  # a run at step 3 (its checkpoint is never read here)
    _commit(step3, 3)
    (step3 / "config.json").write_text(_config_json())
    (step3 / "metrics.jsonl").write_text('{"step": 3, "loss": 4.0}\n')

    mixed = path("mixture_run")  # a run on a two-source mixture of a_file and b_file
    _commit(mixed, 2)
    (mixed / "config.json").write_text(_config_json(data=[f"{root}/a_file:0.7",
                                                          f"{root}/b_file:0.3"]))

    garbage = path("garbage_config")
    _commit(garbage, 2)
    (garbage / "config.json").write_text('{"model": "llama-tiny", "steps": ')

    unknown = path("unknown_key")
    _commit(unknown, 2)
    (unknown / "config.json").write_text(_config_json(not_a_setting=1))

    tmp_only = path("tmp_only")  # a first save that never finished
    (tmp_only / "checkpoints" / "2.orbax-checkpoint-tmp-1700000000").mkdir(parents=True)
    (tmp_only / "config.json").write_text(_config_json())

    torn = path("torn_run")  # step folders without commit markers, plus the run's files
    for step in (2, 4):
        (torn / "checkpoints" / str(step) / "state").mkdir(parents=True)
    (torn / "config.json").write_text(_config_json())
    (torn / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in (1, 2, 3)))

    path("run.yaml").write_text("steps: 50\nbatch_size: 8\nmesh: dp=2,fsdp=-1\n"
                                "data: [a.txt, b.txt]\nresume: false\n")
    path("run.toml").write_text('steps = 50\nbatch-size = 8\nlr = 0.01\n')
    # The same settings as run.toml and run.yaml, in torchtitan-style sections.
    path("sectioned.toml").write_text('[training]\nsteps = 50\nbatch-size = 8\n'
                                      '[optimizer]\nlr = 0.01\n')
    path("sectioned.yaml").write_text("training: {steps: 50, batch_size: 8}\n"
                                      "parallelism:\n  mesh: dp=2,fsdp=-1\n"
                                      "data: {data: [a.txt, b.txt]}\nresume: false\n")
    path("bad_section.toml").write_text("[trainig]\nsteps = 10\n")
    path("bad_section_key.toml").write_text("[training]\nsteps = 10\nwarmup = 3\n")
    path("both_batches.toml").write_text("batch_size = 8\n[training]\n"
                                         "per_device_batch_size = 1\n")
    path("bad_weight.yaml").write_text("data: [web/:0.7, code.jsonl:-1]\n")
    path("bad.yaml").write_text("steps: [1, 2\n")
    path("unknown.toml").write_text("steps = 10\nwarmup = 3\n")
    path("typo.yaml").write_text("steps: ten\n")
    return paths


def _fill(text: str, paths: dict[str, str]) -> str:
    return re.sub(r"\{([^}]+)\}", lambda m: paths[m.group(1)], text)


# (name, argv, words the one line must contain); {NAME} is replaced by a fixture path.
CASES = [
    ("devices 0", ["train", "--devices", "0"], ["--devices 0"]),
    ("devices -1", ["train", "--devices", "-1"], ["--devices -1"]),
    ("generate devices 0", ["generate", "--out", "{step3_run}", "--devices", "0"],
     ["--devices 0"]),
    ("out is a file", ["train", "--out", "{a_file}"], ["--out", "is a file"]),
    ("out under a file", ["train", "--out", "{under_a_file}"], ["--out", "is a file"]),
    ("out unwritable", ["train", "--out", "{unwritable}"], ["--out", "cannot write"]),
    ("seed -1", ["train", "--seed", "-1"], ["--seed -1"]),
    ("seed huge", ["train", "--seed", "99999999999999999999999"], ["--seed"]),
    ("lr -1", ["train", "--lr", "-1"], ["--lr -1"]),
    ("lr nan", ["train", "--lr", "nan"], ["--lr nan"]),
    ("lr inf", ["train", "--lr", "inf"], ["--lr inf"]),
    ("steps 0", ["train", "--steps", "0"], ["--steps 0"]),
    ("steps not a number", ["train", "--steps", "ten"], ["--steps", "ten"]),
    ("unknown flag", ["train", "--stepz", "3"], ["--stepz", "--steps"]),
    ("unknown choice", ["train", "--optimizer", "adam"], ["--optimizer", "adam", "adamw"]),
    ("warmup -1", ["train", "--warmup-steps", "-1"], ["--warmup-steps -1", ">= 0"]),
    ("min lr ratio 2", ["train", "--min-lr-ratio", "2"], ["--min-lr-ratio 2.0", "[0, 1]"]),
    ("weight decay -1", ["train", "--weight-decay", "-1"], ["--weight-decay -1.0"]),
    ("clip nan", ["train", "--clip-grad-norm", "nan"], ["--clip-grad-norm nan"]),
    ("eval-every -1", ["train", "--eval-every", "-1"], ["--eval-every -1", "0: never"]),
    ("sgd warmup", ["train", "--optimizer", "sgd", "--warmup-steps", "5"],
     ["--warmup-steps", "sgd runs at a constant --lr"]),
    ("val-data without eval", ["train", "--eval-every", "0", "--val-data", "{a_file}"],
     ["--val-data with --eval-every 0"]),
    ("remat unknown", ["train", "--remat", "sometimes"], ["--remat", "sometimes", "names:"]),
    ("remat unknown name", ["train", "--remat", "names:q,query"], ["--remat", "query"]),
    ("remat no names", ["train", "--remat", "offload:"], ["--remat", "offload:"]),
    ("attention unknown", ["train", "--attention", "flash"], ["--attention", "flash"]),
    ("pack unknown", ["train", "--pack", "rows"], ["--pack", "rows"]),
    ("generate attention unknown", ["generate", "--out", "{step3_run}", "--attention", "flash"],
     ["--attention", "flash"]),
    ("plan remat unknown", ["plan", "--remat", "half"], ["--remat", "half"]),
    ("generate without --out", ["generate"], ["--out"]),
    ("precision float64", ["train", "--precision", "float64"], ["--precision", "float64"]),
    ("precision unknown", ["train", "--precision", "float7"], ["--precision"]),
    ("mesh syntax", ["train", "--mesh", "fsdp:8"], ["--mesh", "fsdp:8"]),
    ("mesh axis", ["train", "--mesh", "data=8"], ["--mesh", "data"]),
    ("model", ["train", "--model", "llama-huge"], ["llama-huge", "llama-tiny"]),
    ("resume-step without resume", ["train", "--resume-step", "2"], ["--resume-step"]),
    ("garbage config.json on resume", ["train", "--resume", "--out", "{garbage_config}"],
     ["config.json", "not valid JSON"]),
    ("unknown key in config.json on resume",
     ["train", "--resume", "--out", "{unknown_key}"], ["config.json", "not_a_setting"]),
    ("garbage config.json on generate", ["generate", "--out", "{garbage_config}"],
     ["config.json", "not valid JSON"]),
    ("unknown key in config.json on generate", ["generate", "--out", "{unknown_key}"],
     ["config.json", "not_a_setting"]),
    ("resume with only a tmp folder", ["train", "--resume", "--out", "{tmp_only}"],
     ["--resume", "no checkpoint"]),
    ("resume --steps below the run's step",
     ["train", "--resume", "--steps", "2", "--out", "{step3_run}"], ["--steps 2", "step 3"]),
    ("resume-step not committed",
     ["train", "--resume", "--resume-step", "2", "--out", "{step3_run}"],
     ["--resume-step 2", "[3]"]),
    ("data weight not a number", ["train", "--data", "{a_file}:abc"],
     ["--data entry '{a_file}:abc'", "not a number"]),
    ("data weight negative", ["train", "--data", "{a_file}:0.7,{a_file}:-1"],
     ["--data entry '{a_file}:-1'", "positive number"]),
    ("data weights on some entries", ["train", "--data", "{a_file}:0.7", "{a_file}"],
     ["--data entry '{a_file}' has no weight"]),
    ("data weight in a config file", ["train", "--config", "{bad_weight.yaml}"],
     ["--data entry 'code.jsonl:-1'", "positive number"]),
    ("resume drops a mixture source",
     ["train", "--resume", "--out", "{mixture_run}", "--data", "{a_file}:1"],
     ["--data ['{a_file}:1']", "its sources not"]),
    ("resume a changed setting", ["train", "--resume", "--seed", "1", "--out", "{step3_run}"],
     ["--seed 1", "was 0"]),
    ("fresh run over half-written checkpoints", ["train", "--out", "{torn_run}"],
     ["already holds checkpoints", "--resume"]),
    ("fresh run over a run", ["train", "--out", "{step3_run}"], ["already holds", "--resume"]),
    ("resume with only half-written checkpoints", ["train", "--resume", "--out", "{torn_run}"],
     ["--resume", "never committed"]),
    ("generate max-tokens -1", ["generate", "--out", "{step3_run}", "--max-tokens", "-1"],
     ["--max-tokens -1"]),
    ("generate temperature nan", ["generate", "--out", "{step3_run}", "--temperature", "nan"],
     ["--temperature nan"]),
    ("generate step not committed", ["generate", "--out", "{step3_run}", "--step", "2"],
     ["--step 2", "[3]"]),
    ("generate missing run", ["generate", "--out", "{missing}"], ["--out", "missing-run"]),
    ("generate not a run", ["generate", "--out", "{tmp_only}"], ["no checkpoint"]),
    ("eval without --out or --from", ["eval", "--data", "{step3_run}"], ["--out", "--from"]),
    ("eval with --out and --from", ["eval", "--out", "{step3_run}", "--from", "hf:{missing}",
                                    "--data", "{step3_run}"], ["--out", "--from"]),
    ("eval missing data", ["eval", "--out", "{step3_run}", "--data", "{missing}"],
     ["--data", "missing-run"]),
    ("eval seq-len 1", ["eval", "--out", "{step3_run}", "--data", "{step3_run}", "--seq-len",
                        "1"], ["--seq-len 1"]),
    ("config file garbage", ["train", "--config", "{bad.yaml}"], ["--config", "bad.yaml"]),
    ("config file unknown key", ["train", "--config", "{unknown.toml}"],
     ["--config", "warmup"]),
    ("config file wrong type", ["train", "--config", "{typo.yaml}"], ["--steps", "ten"]),
    ("config file missing", ["train", "--config", "{missing}.yaml"], ["--config"]),
    ("launch timeout -5", ["launch", "--nproc", "2", "--timeout", "-5", "--", "true"],
     ["--timeout", "-5"]),
    ("launch nproc 0", ["launch", "--nproc", "0", "--", "true"], ["--nproc", "0"]),
    ("profile-steps syntax", ["train", "--profile-steps", "ten"], ["--profile-steps", "ten"]),
    ("profile-steps empty range", ["train", "--profile-steps", "5:5"], ["--profile-steps",
                                                                        "5:5"]),
    ("log-to unknown tracker", ["train", "--log-to", "mlflow"], ["--log-to", "mlflow"]),
    ("peak-tflops -1", ["train", "--peak-tflops", "-1"], ["--peak-tflops -1"]),
    ("peak-tflops nan", ["train", "--peak-tflops", "nan"], ["--peak-tflops nan"]),
    ("plan top 0", ["plan", "--top", "0"], ["--top 0"]),
    ("plan objective", ["plan", "--objective", "orpo", "--data", "{a_file}"],
     ["--objective orpo", "sft"]),
    ("plan bad model", ["plan", "--model", "llama-huge"], ["llama-huge"]),
    ("plan hbm", ["plan", "--hbm", "lots"], ["--hbm 'lots'"]),
    ("plan target", ["plan", "--target", "abacus"], ["--target 'abacus'"]),
    ("plan comm-overlap 2", ["plan", "--comm-overlap", "2"], ["--comm-overlap 2"]),
    ("plan latency -1", ["plan", "--collective-latency-us", "-1"],
     ["--collective-latency-us -1"]),
    ("unknown command", ["trian"], ["trian", "train"]),
    ("unknown config section", ["train", "--config", "{bad_section.toml}"],
     ["{bad_section.toml}", "[trainig]", "training"]),
    ("unknown key in a config section", ["train", "--config", "{bad_section_key.toml}"],
     ["{bad_section_key.toml}", "'warmup'", "[training]"]),
    ("both batch sizes", ["train", "--batch-size", "8", "--per-device-batch-size", "1"],
     ["--per-device-batch-size", "--batch-size"]),
    ("both batch sizes in a config", ["train", "--config", "{both_batches.toml}"],
     ["{both_batches.toml}", "per_device_batch_size", "batch_size"]),
    ("per-device batch 0", ["train", "--per-device-batch-size", "0"],
     ["--per-device-batch-size 0", ">= 1"]),
    ("grpo group of 1", ["train", "--objective", "grpo", "--reward", "r.py:f",
                         "--group-size", "1"], ["--group-size 1", "at least 2"]),
    ("grpo packed", ["train", "--objective", "grpo", "--reward", "r.py:f", "--pack", "concat"],
     ["--pack concat", "--objective grpo"]),
    ("grpo batch of part groups", ["train", "--objective", "grpo", "--reward", "r.py:f",
                                   "--batch-size", "12"], ["--batch-size 12", "--group-size 8"]),
    ("eval limit without tasks", ["train", "--eval-limit", "5"],
     ["--eval-limit", "only with --eval-tasks"]),
    ("eval tasks under pp", ["train", "--eval-tasks", "tiny_mc", "--mesh", "pp=2,fsdp=-1"],
     ["--eval-tasks", "'pp'", "shardax eval"]),
    ("eval tasks every -1", ["train", "--eval-tasks", "tiny_mc", "--eval-tasks-every", "-1"],
     ["--eval-tasks-every -1", ">= 0"]),
]


# Valid command lines that print the effective config (and start nothing).
PRINT_CONFIG = [
    ["train", "--config", "{run.yaml}", "--steps", "70", "--print-config"],
    ["train", "--config", "{run.toml}", "--resume", "--print-config"],
    ["train", "--config", "{run.toml}", "--print-config"],
    ["train", "--config", "{sectioned.toml}", "--print-config"],
    ["train", "--config", "{run.yaml}", "--print-config"],
    ["train", "--config", "{sectioned.yaml}", "--print-config"],
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case of `CASES` and `PRINT_CONFIG` run once, in one subprocess; snapshots of the
    fixture files before and after."""
    root = tmp_path_factory.mktemp("cli_errors")
    paths = _make_fixtures(root)
    argvs = [[_fill(a, paths) for a in argv] for argv in
             [argv for _, argv, _ in CASES] + PRINT_CONFIG]
    before = _snapshot(root)
    out = [{"code": r.returncode, "err": r.stderr, "out": r.stdout, "backend": r.backend}
           for r in run_cli_batch(argvs, cwd=root)]
    by_name = dict(zip((name for name, _, _ in CASES), out))
    return by_name, before, _snapshot(root), paths, out[len(CASES):]


@pytest.mark.parametrize("name, argv, needles", CASES, ids=[c[0] for c in CASES])
def test_bad_command_line(name, argv, needles, results):
    by_name, _, _, paths, _ = results
    r = by_name[name]
    lines = r["err"].strip().splitlines()
    assert r["code"] == 2, r
    assert len(lines) == 1, r["err"]
    command = argv[0] if argv[0] in ("train", "plan", "generate", "eval", "launch") else None
    assert lines[0].startswith(f"shardax {command}: error: " if command else "shardax: error: ")
    assert "Traceback" not in r["err"]
    for needle in needles:
        assert _fill(needle, paths) in lines[0], (needle, lines[0])
    assert not r["backend"], "checked only after a JAX backend was started"


def test_bad_command_lines_touch_no_file(results):
    _, before, after, _, _ = results
    assert after == before
    assert not Path("/sys/shardax-test").exists()


@pytest.mark.parametrize("args, needle", [
    (["train", "--lr", "nan"], "--lr nan"),
    (["generate", "--out", "x", "--devices", "0"], "--devices 0"),
    (["launch", "--nproc", "2", "--timeout", "-5", "--", "true"], "--timeout"),
])
def test_the_shardax_entry_point_prints_one_line(args, needle, tmp_path):
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())


def test_config_file_flags_override_and_print_config(results):
    yaml_run, toml_run = results[4][:2]
    for r in (yaml_run, toml_run):
        assert r["code"] == 0 and not r["err"] and not r["backend"], r
    printed = json.loads(yaml_run["out"])
    assert printed["steps"] == 70  # the flag wins over the file
    assert printed["batch_size"] == 8 and printed["mesh"] == "dp=2,fsdp=-1"
    assert printed["data"] == ["a.txt", "b.txt"] and printed["resume"] is False
    assert printed["seq_len"] == 128  # neither: the default
    printed = json.loads(toml_run["out"])
    assert (printed["batch_size"], printed["lr"], printed["resume"]) == (8, 0.01, True)
    # --print-config trains nothing: test_bad_command_lines_touch_no_file


def test_a_sectioned_config_file_equals_the_flat_one(results):
    flat_toml, sectioned_toml, flat_yaml, sectioned_yaml = results[4][2:]
    for r in results[4][2:]:
        assert r["code"] == 0 and not r["err"], r
    assert sectioned_toml["out"] == flat_toml["out"]
    assert sectioned_yaml["out"] == flat_yaml["out"]
    assert json.loads(sectioned_toml["out"])["lr"] == 0.01


def test_every_setting_has_a_config_section():
    from shardax.train.config import SECTIONS, TrainConfig, hints

    placed = [k for keys in SECTIONS.values() for k in keys]
    assert sorted(placed) == sorted(hints(TrainConfig)), "each field in exactly one section"


def test_help_and_launch_need_only_the_core_install(tmp_path):
    """With flax, optax, orbax, tyro, rich, etils and matplotlib unimportable, ``shardax
    --help`` and ``shardax launch`` still work and ``shardax train`` says what to install."""
    blocker = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'flax', 'optax', 'orbax', 'tyro', 'rich', 'etils',\n"
        "                                  'matplotlib', 'grain', 'yaml'}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from shardax.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    script = tmp_path / "core_only.py"
    script.write_text(blocker)

    def run(*args):
        return subprocess.run([sys.executable, str(script), *args], env=cli_env(),
                              capture_output=True, text=True, timeout=120)

    help_ = run("--help")
    assert help_.returncode == 0 and "train" in help_.stdout and "launch" in help_.stdout
    launched = run("launch", "--nproc", "2", "--", sys.executable, "-c", "print('hello')")
    assert launched.returncode == 0, launched.stderr
    assert "[0] hello" in launched.stdout and "[1] hello" in launched.stdout
    train = run("train", "--steps", "3")
    assert train.returncode == 2
    assert train.stderr.count("\n") == 1 and "pip install 'shardax[train]'" in train.stderr
