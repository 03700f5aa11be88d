"""``shardax eval --tasks`` (issue 37, lm-evaluation-harness): `ShardaxLM`'s log-likelihoods
equal the model's own per-token log-probabilities computed here from ``model(tokens)`` on one
device, on dp=8 and on fsdp=4,tp=2; a tiny local multiple-choice task's ``acc`` from
``simple_evaluate`` equals the accuracy hand-computed from those log-probabilities; a tiny
generation task gives the repo's own greedy KV-cache decoding; the command prints the table
and writes ``--output-path``; with torch, lm-eval's ``HFLM`` on the exported model agrees.
Uses conftest's shared ``observed_run`` (llama-tiny, byte tokenizer: a text's tokens are its
UTF-8 bytes, NUL (0) is end-of-text and the prefix token)."""

import importlib.util
import json
import os
import subprocess
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli import assert_one_line_error, read_metrics, run_cli
from _reference import TINY_TRAIN
from flax import nnx

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from shardax.cli import main  # noqa: E402
from shardax.errors import UsageError  # noqa: E402
from shardax.models import decode  # noqa: E402
from shardax.train.config import EvalConfig, TrainConfig, check, check_eval  # noqa: E402
from shardax.train.evaluate import load_model  # noqa: E402
from shardax.train.generate import restore_model  # noqa: E402
from shardax.train.harness import ShardaxLM, run_tasks  # noqa: E402
from shardax.train.loop import train  # noqa: E402
from shardax.train.rundir import check_run  # noqa: E402

QUESTIONS = [
    ("Q: 2 + 2 =\nA:", ["4", "5", "22"], 0),
    ("Q: the sky is\nA:", ["blue", "green", "loud", "dog"], 0),
    ("Q: cats say\nA:", ["moo", "meow", "quack"], 1),
    ("Q: water is\nA:", ["dry", "wet", "solid"], 1),
    ("Q: the sun rises in the\nA:", ["west", "north", "east"], 2),
    ("Q: ice is\nA:", ["hot", "warm", "cold", "old"], 2),
]
PROMPTS = ["the quick ", "Q: hello\nA:", "ab"]
MAX_GEN = 6
LONG = "a much longer context that goes on and on " * 4  # 172 bytes: over max_seq_len 128


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A directory with the tiny multiple-choice task ``tiny_mc`` and the tiny generation task
    ``tiny_gen`` (lm-eval YAMLs over jsonl files; the datasets cache stays in it)."""
    root = tmp_path_factory.mktemp("tasks")
    with open(root / "mc.jsonl", "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(root / "gen.jsonl", "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt": p, "target": "x"}) + "\n")
    for name, kind, rest in (
            ("tiny_mc", "multiple_choice", """\
                doc_to_text: "{{question}}"
                doc_to_choice: "{{choices}}"
                doc_to_target: "{{answer}}"
                metric_list:
                  - metric: acc"""),
            ("tiny_gen", "generate_until", f"""\
                doc_to_text: "{{{{prompt}}}}"
                doc_to_target: "{{{{target}}}}"
                generation_kwargs:
                  until: ["\\n"]
                  max_gen_toks: {MAX_GEN}
                  do_sample: false
                metric_list:
                  - metric: exact_match""")):
        data = root / ("mc.jsonl" if kind == "multiple_choice" else "gen.jsonl")
        (root / f"{name}.yaml").write_text(textwrap.dedent(f"""\
            task: {name}
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {data}
              cache_dir: {root / "hf_cache"}
            test_split: test
            output_type: {kind}
            """) + textwrap.dedent(rest) + "\n")
    return root


@pytest.fixture(scope="module")
def model_1(observed_run):
    """The run's model on one device, and the log-probability of ``continuation`` after
    ``context`` (byte strings) from its own logits, the context cut to the last 128 tokens
    of context + continuation as a model of max_seq_len 128 sees them."""
    _, out, _ = observed_run
    _, model, _ = restore_model(check_run(str(out)))
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, jax.devices()[0])
    model = nnx.merge(graphdef, state)
    # The state as an argument: nnx.scan (the stacked layers) does not run a module closed
    # over from outside the trace.
    log_probs = jax.jit(lambda state, ids: jax.nn.log_softmax(
        nnx.merge(graphdef, state)(ids)[0].astype(jnp.float32)))

    def forward(ids):
        return log_probs(state, ids)

    def logp(context: bytes, continuation: bytes) -> float:
        ids = list(context or b"\0") + list(continuation)
        ids = ids[-129:]
        # right-padded to 128 (one compile): a causal model's earlier logits do not see it
        logps = np.asarray(forward(jnp.asarray([ids[:-1] + [0] * (129 - len(ids))])))
        n = len(continuation)
        rows = np.arange(len(ids) - 1 - n, len(ids) - 1)
        return float(logps[rows, ids[-n:]].sum(dtype=np.float64))

    def likeliest(context: list[int]) -> int:
        return int(np.argmax(forward(jnp.asarray([context + [0] * (128 - len(context))]))[
            len(context) - 1]))

    return model, logp, likeliest


def _lm(out, mesh=None, batch_size=4) -> ShardaxLM:
    return ShardaxLM(*load_model(EvalConfig(out=str(out), mesh=mesh)), batch_size=batch_size)


def _local(tasks) -> TaskManager:
    """The task index of ``tasks`` alone (lm-eval's own ~15,000 take ~40 s to index)."""
    return TaskManager(include_path=str(tasks), include_defaults=False)


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


PAIRS = [("Q: 2 + 2 =\nA:", " 4"), ("", "hello"), ("Grüße ", "aus Köln"),
         (LONG, " end"), ("the sky is ", "blue")]


@pytest.mark.parametrize("mesh", [None, "fsdp=4,tp=2"])
def test_loglikelihood_is_the_models_own_log_probabilities(observed_run, model_1, mesh):
    _, out, _ = observed_run
    _, logp, _ = model_1
    lm = _lm(out, mesh)
    got = lm.loglikelihood(_requests("loglikelihood", PAIRS))
    # lm-eval moves a context's trailing spaces to the continuation
    want = [logp(c.rstrip().encode(), (c[len(c.rstrip()):] + x).encode()) for c, x in PAIRS]
    np.testing.assert_allclose([g for g, _ in got], want, rtol=1e-5)
    assert all(isinstance(g, bool) for _, g in got)
    # is_greedy: the model's likeliest token after a context, and another one
    context = list(PAIRS[0][0].encode())
    best = model_1[2](context)
    [(_, greedy), (_, other)] = lm._loglikelihood_tokens(
        [(None, context, [best]), (None, context, [best ^ 1])])
    assert greedy and not other
    # whole texts: after the prefix token (NUL), over rolling windows when over 128 tokens
    texts = ["Grüße aus Köln", LONG]
    rolled = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(t,) for t in texts]))
    short = texts[0].encode()
    long_ = LONG.encode()  # window 1: NUL + 127 bytes predicts 128; window 2: the rest
    want = [logp(b"", short), logp(b"", long_[:128]) + logp(long_[:128], long_[128:])]
    np.testing.assert_allclose(rolled, want, rtol=1e-5)


def test_multiple_choice_accuracy_is_the_hand_computed_one(observed_run, model_1, tasks):
    _, out, _ = observed_run
    _, logp, _ = model_1
    results = lm_eval.simple_evaluate(model=_lm(out, "fsdp=4,tp=2"), tasks=["tiny_mc"],
                                      task_manager=_local(tasks),
                                      log_samples=False)
    # lm-eval's default target delimiter: a space before each choice
    right = [int(np.argmax([logp(q.encode(), f" {c}".encode()) for c in choices]) == answer)
             for q, choices, answer in QUESTIONS]
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(np.mean(right), abs=1e-12)


def test_generation_task_is_the_repos_greedy_generation(observed_run, model_1, tasks):
    _, out, _ = observed_run
    results = lm_eval.simple_evaluate(model=_lm(out, "fsdp=4,tp=2"),
                                      tasks=["tiny_gen"],
                                      task_manager=_local(tasks))
    got = {s["doc"]["prompt"]: s["resps"][0][0] for s in results["samples"]["tiny_gen"]}
    # the repo's greedy KV-cache decoding on one device, ending at end-of-text (NUL)
    new = decode.generate(model_1[0], [list(p.encode()) for p in PROMPTS], MAX_GEN,
                          stop_ids=[0]).tokens
    want = {p: bytes(t).decode("utf-8", "replace").split("\0")[0].split("\n")[0]
            for p, t in zip(PROMPTS, new)}
    assert got == want


def test_eval_tasks_command_prints_the_table_and_writes_results(observed_run, tasks, tmp_path):
    _, out, _ = observed_run
    path = tmp_path / "results.json"
    proc = run_cli("eval", "--out", out, "--tasks", "tiny_mc", "--include-path", tasks,
                   "--output-path", path, "--batch-size", 8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = json.loads(path.read_text())["results"]["tiny_mc"]["acc,none"]
    assert 0 <= acc <= 1
    row = next(line for line in proc.stdout.splitlines() if "tiny_mc" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "acc" and float(cells[6]) == pytest.approx(acc, abs=1e-4), row
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


@pytest.mark.parametrize("flags, words", [
    (dict(num_fewshot=-1), ["--num-fewshot -1", ">= 0"]),
    (dict(include_path="missing/"), ["--include-path missing/", "no such directory"]),
    (dict(output_path="."), ["--output-path .", "directory"]),
    (dict(tasks=[], data=["README.md"], limit=5), ["--limit", "only with --tasks"]),
])
def test_bad_task_flags_name_the_flag(flags, words):
    with pytest.raises(UsageError) as e:
        check_eval(EvalConfig(**{"out": "runs/a", "tasks": ["tiny_mc"], **flags}))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_tasks_without_lm_eval_name_the_extra(monkeypatch, tmp_path, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lm_eval" else find_spec(name, *a))
    with pytest.raises(UsageError, match=r"pip install 'shardax\[eval\]'"):
        check_eval(EvalConfig(out="runs/a", tasks=["a,b"]))
    assert check_eval(EvalConfig(out="runs/a", data=["README.md"])).tasks == []
    # train --eval-tasks: at start-up, one line, exit 2 (the CLI's own check, no step run)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() rewrites it
    assert main(["train", "--out", str(tmp_path / "run"), "--eval-tasks", "tiny_mc"]) == 2
    assert_one_line_error(subprocess.CompletedProcess([], 2, "", capsys.readouterr().err),
                          "train", "--eval-tasks", "pip install 'shardax[eval]'")
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def trained_with_tasks(tasks, tmp_path_factory):
    """4 SGD steps with ``--eval-tasks tiny_mc --eval-tasks-every 2`` (checkpoints at 2, 4);
    TINY_TRAIN's train step: the persistent compilation cache holds it from other tests."""
    out = tmp_path_factory.mktemp("eval_tasks") / "run"
    config = TrainConfig(out=str(out), **TINY_TRAIN, eval_tasks=["tiny_mc"],
                         eval_tasks_every=2, include_path=str(tasks))
    return out, train(config)


def test_eval_tasks_during_training_score_each_steps_state(trained_with_tasks, tasks):
    """``eval/tiny_mc/acc`` is logged at steps 2 and 4 (in metrics.jsonl too) and equals
    ``shardax eval --tasks`` on that step's checkpoint (trained on fsdp=8, scored on dp=8)."""
    out, records = trained_with_tasks
    logged = {r["step"]: r["eval/tiny_mc/acc"] for r in read_metrics(out)
              if "eval/tiny_mc/acc" in r}
    assert sorted(logged) == [2, 4]
    assert {r["step"]: r["eval/tiny_mc/acc"] for r in records if "eval/tiny_mc/acc" in r} \
        == logged
    for step in (2, 4):
        config = check_eval(EvalConfig(out=str(out), tasks=["tiny_mc"], step=step,
                                       include_path=str(tasks)))
        assert run_tasks(config)["results"]["tiny_mc"]["acc,none"] == logged[step], step


@pytest.mark.parametrize("flags, words", [
    (dict(eval_limit=5), ["--eval-limit", "only with --eval-tasks"]),
    (dict(eval_tasks=["tiny_mc"], mesh="pp=2,fsdp=-1"), ["--eval-tasks", "'pp'", "shardax eval"]),
    (dict(eval_tasks=["tiny_mc"], eval_tasks_every=-1), ["--eval-tasks-every -1", ">= 0"]),
])
def test_bad_eval_tasks_flags_name_the_flag(flags, words):
    with pytest.raises(UsageError) as e:
        check(TrainConfig(**flags))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_hflm_on_the_export_gives_the_same_scores(observed_run, tasks, tmp_path):
    """lm-eval's own ``HFLM`` (torch, float32) on ``shardax export``'s directory: the same
    log-likelihoods, rolling log-likelihoods, accuracy and greedy generations (skipped
    without torch and transformers, which the suite does not install)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from lm_eval.models.huggingface import HFLM

    from shardax.train.config import ExportConfig, check_export
    from shardax.train.export import export_run

    _, out, _ = observed_run
    export_run(check_export(ExportConfig(out=str(out), to=str(tmp_path / "hf"))))
    ours = _lm(out, "fsdp=4,tp=2")
    theirs = HFLM(pretrained=str(tmp_path / "hf"), dtype="float32", batch_size=4, device="cpu")
    pairs = _requests("loglikelihood", PAIRS)
    np.testing.assert_allclose([x for x, _ in ours.loglikelihood(pairs)],
                               [x for x, _ in theirs.loglikelihood(pairs)], rtol=1e-5)
    texts = _requests("loglikelihood_rolling", [("Grüße aus Köln",), (LONG,)])
    np.testing.assert_allclose(ours.loglikelihood_rolling(texts),
                               theirs.loglikelihood_rolling(texts), rtol=1e-5)
    kwargs = {"until": ["\n"], "max_gen_toks": MAX_GEN, "do_sample": False}
    prompts = _requests("generate_until", [(p, dict(kwargs)) for p in PROMPTS])
    assert ours.generate_until(prompts) == theirs.generate_until(prompts)
    acc = [lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc"], task_manager=_local(tasks),
                                   log_samples=False)["results"]["tiny_mc"]["acc,none"]
           for lm in (ours, theirs)]
    assert acc[0] == acc[1]
