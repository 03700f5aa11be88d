"""Every command and Python snippet in README.md and docs/*.md runs as written, or a test runs it.

Each fenced block of a doc is read (````python``, ````bash`` and the unlabelled blocks whose
lines are ``shardax`` commands); every Python block and every ``shardax ...`` / ``python ...``
command in it is, in this order:

- **not run** when the line before the block is ``<!-- not run: REASON -->`` (several hosts, an
  accelerator, a download, or a fragment whose ``...`` the reader fills in); the reason is
  required;
- **covered** when its first line is in ``COVERED`` below, which names the test that runs the
  same thing (that test must exist);
- **run** otherwise: the Python blocks of one doc in order in one fresh process (forked from
  one that has imported jax and shardax, `_cli.run_python`), sharing their names as a notebook
  would (8 emulated CPU devices, in an empty working directory), then its
  ``shardax ...`` commands one by one in that process (`shardax.cli.main`, what the entry point
  runs) and any other command in a process of its own, in that directory.

A new snippet is therefore run or explicitly accounted for; one test per doc file.
"""

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _cli import run_python

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^([ \t]*)```(\w*)\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!-- not run: (\S.*?) -->\s*$")
HIDDEN = re.compile(r"\bshardax (train|plan|generate|export|launch|verify)\s")
COMMAND = re.compile(r"^(?:\.venv/bin/)?(shardax \w+|python3?)(\s|$)")  # not "shardax train: ..."

# (doc, first line of the snippet or command) -> the test that runs the same thing.
COVERED: dict[tuple[str, str], str] = {
    # README: the commands after `make run` continue its run directory.
    ("README.md", 'print(train_step.plan(train_state, batch))'):
        "tests/test_plan.py::test_rows_cover_every_input_and_output_leaf",
    ("README.md", '.venv/bin/shardax generate --out runs/latest --prompt "def "'):
        "tests/test_train.py::test_generate_continues_the_prompt",
    ("README.md", ".venv/bin/shardax train --out runs/latest --steps 600 --resume "
                  "--mesh dp=2,fsdp=2,tp=2"):
        "tests/test_train.py::test_resume_onto_another_mesh_continues_training",
    ("docs/checkpoints.md",
     "from shardax.train.run.checkpoint import Checkpointer, abstract_state"):
        "tests/test_checkpoint.py::test_async_save_is_not_affected_by_donation",
    ("docs/checkpoints.md", 'ckpt = Checkpointer("runs/exp1/ckpt")'):
        "tests/test_checkpoint.py::test_resume_gives_bit_identical_training",
    ("docs/checkpoints.md", 'fsdp8 = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))'):
        "tests/test_checkpoint.py::test_resharding_restore_to_other_mesh_and_single_device",
    ("docs/context_parallel.md", 'cp = mesh.shape["cp"]'):
        "tests/test_parallel_train.py::test_context_parallel_matches_one_device",
    ("docs/expert_parallel.md", "shardax train --model llama-moe-aux-free-tiny --mesh "
                                "dp=2,fsdp=4 --batch-size 16 --grad-accum 2"):
        "tests/test_moe_balance.py::test_sharded_run_with_bias_equals_one_device",
    ("docs/context_parallel.md", "shardax train --mesh cp=4,fsdp=2"):
        "tests/test_parallel_train.py::test_context_parallel_matches_one_device",
    ("docs/data.md", "shardax train --data web/:0.7,code.jsonl:0.2,math/:0.1 --out runs/mix"):
        "tests/test_mixture_train.py::test_resume_is_bit_identical_and_logs_each_source_tokens",
    ("docs/data.md", "shardax train --resume --out runs/mix --data "
                     "web/:0.5,code.jsonl:0.3,math/:0.2"):
        "tests/test_mixture_train.py::test_resume_with_other_weights_keeps_every_source_position",
    ("docs/data.md", "shardax train --data wiki/ --val-data wiki/ --out runs/wiki"):
        "tests/test_datasets_on_disk.py::test_train_on_a_save_to_disk_folder",
    ("docs/data.md", "shardax train --data corpus/ notes.jsonl"):
        "tests/test_data.py::test_train_on_jsonl_with_a_hf_tokenizer_checkpoints_its_position",
    ("docs/data.md", "shardax train --model llama-small --tokenizer models/llama2 --data shards/ "
                     "--text-field content"):
        "tests/test_data.py::test_train_on_jsonl_with_a_hf_tokenizer_checkpoints_its_position",
    ("docs/data.md", "shardax train --model gpt2 --tokenizer models/gpt2 --data train.bin "
                     "--token-dtype uint16"):
        "tests/test_data.py::test_token_files",
    ("docs/evaluation.md", "shardax eval --out runs/a --tasks tiny_mc --include-path tasks/ "):
        "tests/test_lm_eval.py::test_eval_tasks_command_prints_the_table_and_writes_results",
    ("docs/evaluation.md", "shardax train --data corpus/ --out runs/a --eval-tasks tiny_mc "):
        "tests/test_lm_eval.py::test_eval_tasks_during_training_score_each_steps_state",
    ("docs/data.md", "shardax train --resume --out runs/a --val-data web_val.txt code_val.txt"):
        "tests/test_mixture_train.py::test_resume_with_new_val_data_trains_the_same_batches",
    ("docs/data.md", "shardax eval --out runs/wiki --data wiki/ --data-split test"):
        "tests/test_datasets_on_disk.py::test_eval_data_split_of_a_save_to_disk_folder",
    ("docs/expert_parallel.md", "from shardax.parallel.expert import moe_mlp, init_moe_params, "
                                "moe_param_specs, expert_capacity"):
        "tests/test_parallel_expert.py::test_init_and_specs",
    ("docs/expert_parallel.md", 'mesh = jax.make_mesh((4, 2), ("ep", "fsdp"), '
                                'axis_types=(AxisType.Auto,) * 2)'):
        "tests/test_parallel_expert.py::test_sharded_equals_reference",
    ("docs/expert_parallel.md", "shardax train --model llama-moe-tiny --mesh ep=4,fsdp=2"):
        "tests/test_parallel_train.py::test_moe_expert_parallel_matches_one_device",
    # Hugging Face: the tests use tiny models made by transformers instead of a download.
    ("docs/hugging_face.md", "from shardax import hf"):
        "tests/test_hf.py::test_sharded_load_reads_each_device_slice_once_and_nothing_else",
    ("docs/hugging_face.md", "from shardax.models import decode"):
        "tests/test_hf.py::test_kv_cache_equals_full_recompute_sharded_with_ragged_prompts",
    ("docs/hugging_face.md", "shardax train --init-from hf:models/Llama-3.2-1B --mesh fsdp=4,tp=2 "
                             "--seq-len 1024 --batch-size 16 --lr 2e-5 --steps 1000 "
                             "--out runs/llama-ft"):
        "tests/test_hf_cli.py::test_finetune_on_a_mesh_and_export_round_trips",
    ("docs/hugging_face.md", "shardax export --out runs/llama-ft --to export/llama-ft [--step 800] "
                             "[--max-shard-mb 2048] [--dtype bfloat16]"):
        "tests/test_hf_cli.py::test_finetune_on_a_mesh_and_export_round_trips",
    ("docs/hugging_face.md", 'shardax generate --from hf:export/llama-ft --prompt "def " '
                             '--prompts "class " "import " --max-tokens 64 --temperature 0.7'):
        "tests/test_hf_cli.py::test_generate_from_an_hf_dir_and_from_the_run",
    ("docs/hugging_face.md", 'shardax generate --out runs/llama-ft --prompt "def "'):
        "tests/test_hf_cli.py::test_generate_from_an_hf_dir_and_from_the_run",
    # Frameworks: each section's full program is an example that test_examples.py runs.
    ("docs/models_and_rules.md", 'param_mapping = LogicalAxisRules([("embed", "data")])'):
        "tests/test_examples.py::test_example_runs_and_trains",
    ("docs/models_and_rules.md", "def create():"):
        "tests/test_examples.py::test_example_runs_and_trains",
    ("docs/models_and_rules.md", "def train_step(model, optimizer, x, y):"):
        "tests/test_nnx_inplace.py::test_in_place_step_returning_the_loss",
    ("docs/models_and_rules.md", "def init_fn(key, x):"):
        "tests/test_examples.py::test_example_runs_and_trains",
    ("docs/models_and_rules.md", "from shardax.frameworks.linen import logical_axis_rules"):
        "tests/test_examples.py::test_example_runs_and_trains",
    ("docs/models_and_rules.md", "fsdp = FSDPShardingRule(min_fsdp_size=2**12)"):
        "tests/test_frameworks.py::"
        "test_equinox_model_with_python_fields_passed_whole_matches_one_device",
    ("docs/multi_host.md", "shardax launch --nproc 2 --devices-per-proc 4 -- shardax train "
                           "--mesh fsdp=-1 --steps 200 --out runs/mp"):
        "tests/test_multiprocess.py::test_two_processes_train_like_one_process",
    ("docs/multi_host.md", "shardax launch --nproc 2 --devices-per-proc 4 -- shardax train "
                           "--mesh fsdp=-1 --steps 200 --out runs/mp --resume"):
        "tests/test_multiprocess.py::"
        "test_two_process_checkpoint_resumes_in_two_processes_on_another_mesh",
    ("docs/observability.md", "shardax train --out runs/a --log-to jsonl,tensorboard,wandb"):
        "tests/test_observability.py::test_tensorboard_event_file_holds_the_scalars",
    ("docs/observability.md", "shardax train --out runs/a --profile-steps 10:13"):
        "tests/test_observability.py::test_profile_trace_covers_the_requested_steps",
    ("docs/parallelism.md", "from shardax.parallel import fsdp"):
        "tests/test_parallel_fsdp.py::test_forward_gradients_and_collectives",
    ("docs/parallelism.md", "shardax train --mesh pp=2,fsdp=2,tp=2 --pp-schedule circular "
                            "--virtual-stages 2 --microbatches 4"):
        "tests/test_parallel_train.py::test_pipeline_fsdp_tp_matches_one_device",
    ("docs/parallelism.md", "shardax train --mesh tp=8 --tp-mode async"):
        "tests/test_parallel_train.py::test_async_tensor_parallel_matches_one_device",
    ("docs/parallelism.md", "shardax train --mesh fsdp=4,tp=2 --sequence-parallel"):
        "tests/test_parallel_train.py::test_sequence_parallel_matches_one_device",
    ("docs/parallelism.md", "shardax train --mesh cp=4,fsdp=2"):
        "tests/test_parallel_train.py::test_context_parallel_matches_one_device",
    ("docs/parallelism.md", "shardax train --model llama-moe-tiny --mesh ep=4,fsdp=2"):
        "tests/test_parallel_train.py::test_moe_expert_parallel_matches_one_device",
    ("docs/pipeline_parallel.md", "def layer(p, h):"):
        "tests/test_parallel_pipeline.py::test_sgd_training_matches_single_device",
    ("docs/pipeline_parallel.md", "shardax train --mesh pp=2,fsdp=2,tp=2 --microbatches 4"):
        "tests/test_parallel_train.py::test_pipeline_fsdp_tp_matches_one_device",
    ("docs/pipeline_parallel.md", "shardax train --mesh pp=2,fsdp=2,tp=2 --pp-schedule circular "
                                  "--virtual-stages 2 --microbatches 4"):
        "tests/test_parallel_train.py::test_pipeline_fsdp_tp_matches_one_device",
    ("docs/pipeline_parallel.md", "shardax train --mesh pp=2,fsdp=4 --pp-schedule 1f1b "
                                  "--microbatches 16 --batch-size 64"):
        "tests/test_parallel_train.py::test_pipeline_fsdp_tp_matches_one_device",
    ("docs/pipeline_parallel.md", "shardax train --mesh pp=2,fsdp=2,tp=2 --tp-mode async "
                                  "--microbatches 2"):
        "tests/test_parallel_train.py::test_pipeline_with_async_tensor_parallel",
    ("docs/pipeline_parallel.md", "shardax train --mesh pp=2,fsdp=2,tp=2 --tp-mode sync "
                                  "--sequence-parallel --pp-schedule circular --virtual-stages 2 "
                                  "--microbatches 2"):
        "tests/test_parallel_train.py::test_pipeline_with_sequence_parallel_circular",
    ("docs/pipeline_parallel.md", "shardax train --mesh pp=2,cp=2,fsdp=2 --microbatches 2 "
                                  "--pp-schedule 1f1b"):
        "tests/test_parallel_train.py::test_pipeline_with_ring_attention",
    ("docs/pipeline_parallel.md", "shardax train --model llama-moe-tiny --mesh pp=2,ep=2,fsdp=2 "
                                  "--microbatches 1"):
        "tests/test_parallel_train.py::test_pipeline_with_experts",
    ("docs/pipeline_parallel.md", "shardax train --model llama-moe-tiny --mesh pp=2,ep=2,fsdp=2 "
                                  "--microbatches 4 --pp-schedule 1f1b"):
        "tests/test_parallel_train.py::test_pipeline_with_experts",
    ("docs/planning.md", "shardax plan --model llama-8b --mesh fsdp=64 --batch-size 256 "
                         "--seq-len 4096 --precision params=float32,compute=bfloat16 --remat full "
                         "--scan-layers --devices 64 --target h100 --hbm 80GiB"):
        "tests/test_planner.py::test_plan_command_line_prints_and_writes_json",
    ("docs/planning.md", "shardax plan --model llama-8b --batch-size 256 --seq-len 4096 "
                         "--precision params=float32,compute=bfloat16 --devices 64 --hbm 80GiB "
                         "--search --jobs 2"):
        "tests/test_planner.py::test_search_returns_only_fitting_layouts",
    ("docs/planning.md", "shardax train --model llama-tiny --steps 20 --log-every 2 "
                         "--out runs/cal"):
        "tests/test_planner.py::test_calibration_moves_estimates_toward_measured_step_times",
    ("docs/planning.md", "shardax plan --model llama-tiny --mesh fsdp=8 --target h100 "
                         "--calibrate runs/cal"):
        "tests/test_planner.py::test_calibration_moves_estimates_toward_measured_step_times",
    ("docs/planning.md", "shardax verify tests/fixtures/verify_steps.py:make_step --layouts "
                         "\"fsdp=8;fsdp=4,tp=2;dp=2,fsdp=2,tp=2\" --steps 3 --json cert.json"):
        "tests/test_verify.py::test_a_correct_step_matches_one_device_on_every_layout",
    ("docs/planning.md", "shardax plan --model llama-small --mesh fsdp=4 --target v5e "
                         "--topology 2x2"):
        "tests/test_topology.py::test_plan_compiles_for_a_tpu_slice_with_libtpu",
    ("docs/planning.md", "def make_linen_step():"):
        "tests/test_verify.py::test_a_linen_step_matches_one_device",
    ("docs/scaling_a_train_step.md", "plan = train_step.plan(state, batch)"):
        "tests/test_plan.py::test_rows_cover_every_input_and_output_leaf",
    ("docs/sharded_init.md", "from shardax.sharding import MeshShardingHelper, LogicalAxisRules"):
        "tests/test_examples.py::test_example_runs_and_trains",
    ("docs/sharded_init.md", "state = mesh.sjit(lambda: init_state(create_model, tx)[1]"):
        "tests/test_init.py::test_init_is_bit_identical_on_any_mesh",
    ("docs/precision_remat_accumulation.md",
     "from shardax.parallel.remat import checkpoint_in_order"):
        "tests/test_attention.py::test_checkpoint_in_order_recomputes_in_the_backward",
    ("docs/precision_remat_accumulation.md", "from shardax.rules import HostOffloadRule"):
        "tests/test_offload.py::test_host_offload_rule_places_leaves_in_pinned_host",
    ("docs/tensor_parallel.md", "shardax train --mesh fsdp=4,tp=2 --tp-mode sync"):
        "tests/test_parallel_train.py::test_sync_tensor_parallel_block_is_megatron",
    ("docs/tensor_parallel.md", "shardax train --mesh fsdp=4,tp=2 --sequence-parallel"):
        "tests/test_parallel_train.py::test_sequence_parallel_matches_one_device",
    ("docs/tensor_parallel.md", "shardax train --mesh tp=8 --tp-mode async"):
        "tests/test_parallel_train.py::test_async_tensor_parallel_matches_one_device",
}


def covered(doc: str, first: str) -> bool:
    """Whether a snippet (its first line) or a command of ``doc`` is in ``COVERED``."""
    return any(d == doc and first.startswith(key) for d, key in COVERED)


def blocks(doc: str) -> list[tuple[int, str, str, str | None]]:
    """``(line, language, text, not-run reason or None)`` of every fenced block of ``doc``."""
    text = (ROOT / doc).read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.search(before)
        code = textwrap.dedent(m.group(3)) if m.group(1) else m.group(3)
        out.append((text.count("\n", 0, m.start()) + 1, m.group(2), code,
                    reason.group(1) if reason else None))
    return out


def commands(block: str) -> list[str]:
    """The shell commands of a block, continuation lines joined, comments dropped."""
    lines = block.replace("\\\n", " ").splitlines()
    found = []
    for line in lines:
        line = re.sub(r"\s+#.*$", "", line).strip()
        if COMMAND.match(line):
            found.append(" ".join(line.split()))
    return found


def snippets(doc: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(python blocks, commands)`` of ``doc`` to run, after the not-run and covered ones."""
    python, shell = [], []
    for line, lang, text, reason in blocks(doc):
        if reason is not None:
            continue
        if lang == "python":
            first = text.strip().splitlines()[0]
            if not covered(doc, first):
                python.append((line, text))
        elif lang in ("bash", "sh", ""):
            shell += [(line, c) for c in commands(text) if not covered(doc, c)]
    return python, shell


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


RUNNER = textwrap.dedent("""
    import sys, traceback
    namespace = {"__name__": "__main__"}
    for line, source in BLOCKS:
        try:
            exec(compile(source, f"{DOC}:{line}", "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            sys.exit(f"{DOC}: the Python block at line {line} failed")
    if COMMANDS:
        from shardax.cli import main
    for line, command, argv in COMMANDS:
        status = main(argv)
        if status:
            sys.exit(f"{DOC}:{line}: {command}: exit status {status}")
""")


def _in_process(command: str) -> list[str] | None:
    """The arguments of a ``shardax ...`` command (run in the doc's one process, as the
    `shardax` entry point would: `shardax.cli.main`); None for any other command."""
    argv = shlex.split(command)
    return argv[1:] if Path(argv[0]).name == "shardax" else None


# doc -> the module of the optional extra it is about (marin-haliax needs Python 3.11+)
NEEDS = {"docs/named_tensors.md": "haliax"}


@pytest.mark.parametrize("doc", DOCS)
def test_doc_snippets_run(doc, tmp_path):
    if doc in NEEDS:
        pytest.importorskip(NEEDS[doc])
    python, shell = snippets(doc)
    commands = [(line, c, _in_process(c)) for line, c in shell if _in_process(c) is not None]
    if python or commands:
        script = f"DOC = {doc!r}\nBLOCKS = {python!r}\nCOMMANDS = {commands!r}\n{RUNNER}"
        result = run_python("-c", script, cwd=tmp_path, env=env())
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    for line, command in shell:
        if _in_process(command) is not None:
            continue
        result = subprocess.run(shlex.split(command), cwd=tmp_path, env=env(),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (
            f"{doc}:{line}: {command}\n{result.stdout}\n{result.stderr}")


def test_covered_snippets_name_tests_that_exist():
    """Every test `COVERED` names is defined in its file (a renamed or merged test leaves a
    snippet run by nothing)."""
    def defined(test: str) -> bool:
        path, _, name = test.partition("::")
        return re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.MULTILINE) is not None

    missing = [test for test in COVERED.values() if not defined(test)]
    assert not missing, missing


# Hugging Face model_type (the importer's `HF_MODEL_TYPES`) -> its name in the README's list of
# families; a type the importer learns must be named here, in the README and in the help.
HF_FAMILIES = {"llama": "Llama 2/3", "mistral": "Mistral", "qwen2": "Qwen2/3", "qwen3": "Qwen2/3",
               "gemma2": "Gemma 2/3", "gemma3_text": "Gemma 2/3", "mixtral": "Mixtral",
               "qwen2_moe": "Qwen2/3-MoE", "qwen3_moe": "Qwen2/3-MoE", "deepseek_v3": "DeepSeek-V3",
               "gpt_oss": "gpt-oss", "gpt2": "GPT-2"}


def test_hf_families_agree_in_help_readme_and_importer():
    """The model types `--init-from`'s help names, the README's list of families and the
    hugging_face.md table are the importer's own table, so none of them can drift."""
    import typing

    from shardax.hf.configs import HF_MODEL_TYPES
    from shardax.train.config import TrainConfig

    assert set(HF_FAMILIES) == set(HF_MODEL_TYPES)
    marker = typing.get_type_hints(TrainConfig, include_extras=True)["init_from"].__metadata__[0]
    help_types = re.search(r"model_type ([\w, ]+)\)", marker.help).group(1).split(", ")
    assert sorted(help_types) == sorted(HF_MODEL_TYPES)
    readme = re.search(r"Hugging Face models \(([^)]*)\)", (ROOT / "README.md").read_text())
    assert set(re.split(r",\s+", readme.group(1))) == set(HF_FAMILIES.values())
    table = (ROOT / "docs/hugging_face.md").read_text()
    assert all(f"| `{t}`" in table or f", `{t}` |" in table for t in HF_MODEL_TYPES)


def test_models_table_lists_every_config_with_its_size():
    """docs/models.md's table of sizes has one row per `shardax.models.CONFIGS` entry, with the
    parameter count `param_count` computes."""
    from shardax.models import CONFIGS, param_count

    text = (ROOT / "docs/models.md").read_text()
    table = text[text.index("| name | vocab | dim |"):].split("\n\n")[0]
    rows = {m.group(1): int(m.group(2).replace(",", "")) for m in
            re.finditer(r"^\| `([\w.-]+)` \|.*\| ([\d,]+)(?: \(.*\))? \|$", table, re.MULTILINE)}
    assert rows == {name: param_count(cfg) for name, cfg in CONFIGS.items()}
