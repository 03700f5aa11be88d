"""`shardax verify`: a correct step matches one device on every layout; a shard_map step
missing its psum fails (exit 1, naming the leaf); a rule leaving a large leaf replicated warns.

The CLI runs as a subprocess (its own emulated device count, as a user runs it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from _processes import assert_one_line_error
from jax.sharding import PartitionSpec as P

from shardax import FSDPShardingRule, LogicalAxisRules, TreePathShardingRule
from shardax.plan.verify import load_step, parse_layouts, verify
from shardax.rulecheck import rule_findings
from shardax.train.config import UsageError

ROOT = Path(__file__).resolve().parents[1]
STEPS = ROOT / "tests" / "fixtures" / "verify_steps.py"
LINEN_RULES = LogicalAxisRules([("embed", "fsdp"), ("mlp", "tp")])  # verify_steps.py's


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "shardax.cli", "verify", *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_a_correct_step_matches_one_device_on_every_layout(tmp_path):
    proc = _cli(f"{STEPS}:make_step", "--layouts", "fsdp=8;fsdp=4,tp=2;dp=2,fsdp=2,tp=2",
                "--steps", "3", "--json", str(tmp_path / "cert.json"))
    assert proc.returncode == 0, proc.stderr
    assert "all 3 layout(s) match one device" in proc.stdout
    cert = json.loads((tmp_path / "cert.json").read_text())
    assert cert["ok"] and cert["steps"] == 3 and len(cert["layouts"]) == 3
    tp = cert["layouts"][1]
    assert tp["layout"] == "fsdp=4,tp=2" and tp["devices"] == 8
    assert tp["grad_diff"] <= 1e-4 and tp["param_diff"] <= 1e-4 and tp["loss_diff"] <= 1e-4
    assert tp["memory"]["argument_size_in_bytes"] > 0
    assert tp["collectives"]["all-gather"]["count"] + tp["collectives"]["all-reduce"]["count"]


def test_explicit_shard_map_step_passes_and_missing_psum_fails_naming_the_leaf():
    report = verify(load_step(f"{STEPS}:make_tp_step"), parse_layouts("tp=2;fsdp=2,tp=4"))
    assert report.ok, [r.line() for r in report.layouts]
    proc = _cli(f"{STEPS}:make_missing_psum_step", "--layouts", "fsdp=2;tp=2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("shardax verify: error: layout tp=2 differs from one device in ")
    assert "in grads['w" in line, line  # the leaf the missing reduction corrupts most
    assert "fsdp=2 (2 devices): same" in proc.stdout  # no 'tp' axis: nothing to forget


def test_an_nnx_step_matches_one_device():
    report = verify(load_step(f"{STEPS}:make_nnx_step"), parse_layouts("fsdp=4;fsdp=2"))
    assert report.ok, [r.line() for r in report.layouts]
    assert "kernel" in report.layouts[0].grad_leaf + report.layouts[0].param_leaf or \
        "bias" in report.layouts[0].grad_leaf + report.layouts[0].param_leaf


def test_a_linen_step_matches_one_device():
    report = verify(load_step(f"{STEPS}:make_linen_step"), parse_layouts("fsdp=4;fsdp=2,tp=2"),
                    steps=2)
    assert report.ok, [r.line() for r in report.layouts]
    assert "Dense_" in report.layouts[1].grad_leaf + report.layouts[1].param_leaf
    assert report.layouts[1].collectives["all-gather"]["count"]


def test_an_equinox_module_matches_one_device():
    pytest.importorskip("equinox")
    report = verify(load_step(f"{STEPS}:make_equinox_step"), parse_layouts("fsdp=4;fsdp=2,tp=2"),
                    steps=2)
    assert report.ok, [r.line() for r in report.layouts]
    assert ".layers[" in report.layouts[0].grad_leaf


def test_a_large_leaf_left_replicated_and_a_rule_conflict_are_warnings_naming_them(tmp_path):
    proc = _cli(f"{STEPS}:make_replicated_step", "--layouts", "fsdp=4", "--steps", "1",
                "--json", str(tmp_path / "cert.json"))
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        "warning: fsdp=4: params['table'] (512x512 float32, 1.00 MiB) is replicated on all 4 "
        "devices: no rule shards it",
        "warning: fsdp=4: rule conflict: params['w1']: rules 'w1' (P('fsdp', None)) "
        "and 'w' (P(None, 'fsdp')) both match: the first wins"], proc.stdout
    (layout,) = json.loads((tmp_path / "cert.json").read_text())["layouts"]
    assert [(f["kind"], f["leaf"]) for f in layout["rule_findings"]] == [("conflict",
                                                                         "params['w1']")]


def _mesh(**sizes):
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                         axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))


def test_rule_axes_silently_dropped_are_found():
    fsdp = rule_findings(FSDPShardingRule(min_fsdp_size=0),
                         {"odd": np.zeros((6, 10)), "ok": np.zeros((8, 3))}, _mesh(fsdp=4, tp=2))
    assert [(f.kind, f.leaf) for f in fsdp] == [("dropped", 0)]
    assert "no dim of shape (6, 10) divides by 'fsdp' (size 4)" in fsdp[0].message
    assert not rule_findings(FSDPShardingRule(min_fsdp_size=0), {"odd": np.zeros((6, 10))},
                             _mesh(fsdp=1, tp=2))  # no fsdp in this layout: nothing to drop
    params = load_step(f"{STEPS}:make_linen_step").init_fn(jax.random.key(0))
    typo = LogicalAxisRules([("embed", "fsdp"), ("mlp", "model")])  # the mesh says 'tp'
    found = rule_findings(typo, params, _mesh(fsdp=2, tp=2))
    assert {f.kind for f in found} == {"dropped"} and len(found) == 2, found
    assert "logical name 'mlp' of dim 1 maps to ['model'], not mesh axes ('fsdp', 'tp')" in \
        found[0].message
    assert not rule_findings(LINEN_RULES, params, _mesh(fsdp=2, tp=2))


def test_rule_conflicts_are_found():
    params = load_step(f"{STEPS}:make_linen_step").init_fn(jax.random.key(0))
    twice = LogicalAxisRules([("embed", "fsdp"), ("mlp", "fsdp")])
    found = rule_findings(twice, params, _mesh(fsdp=2))
    assert [f.kind for f in found] == ["conflict", "conflict"], found
    assert "mesh axis 'fsdp' is wanted by dim 1 ('embed') and dim 0 ('mlp')" in \
        " ".join(f.message for f in found)
    tree = {"w1": np.zeros((8, 8)), "w2": np.zeros((8, 8))}
    paths = TreePathShardingRule(("w1", P("fsdp")), ("w", P(None, "fsdp")), (".*", P()))
    assert [f.leaf for f in rule_findings(paths, tree, _mesh(fsdp=2))] == [0]  # '.*': default
    same = TreePathShardingRule(("w1", P("fsdp")), ("w", P("fsdp", None)))
    assert not rule_findings(same, tree, _mesh(fsdp=2))  # the same spec: no conflict


@pytest.mark.parametrize("args, needle", [
    (["nope.py:make_step", "--layouts", "fsdp=2"], "no file nope.py"),
    ([f"{STEPS}:missing", "--layouts", "fsdp=2"], "has no function missing"),
    ([f"{STEPS}:make_step", "--layouts", "fsdp=x"], "--layouts 'fsdp=x'"),
    ([f"{STEPS}:make_step"], "--layouts"),
])
def test_bad_verify_input_is_one_line_and_exit_code_2(args, needle):
    proc = _cli(*args)
    assert_one_line_error(proc, "verify", needle)


def test_rules_naming_an_axis_no_layout_has_are_a_usage_error():
    step = load_step(f"{STEPS}:make_step")  # its rules name 'fsdp' and 'tp'
    with pytest.raises(UsageError, match="the rules do not apply: .*unknown mesh axis 'fsdp'"):
        verify(step, parse_layouts("dp=2"), steps=1)


def test_layouts_parse():
    assert parse_layouts("fsdp=8; dp=2,tp=4;") == [{"fsdp": 8}, {"dp": 2, "tp": 4}]
    with pytest.raises(UsageError, match="no -1"):
        parse_layouts("fsdp=-1")
