"""``shardax plan --topology``: compiles for a TPU slice through libtpu (no TPU needed); without
libtpu, or for a target that is not a TPU, it is a one-line usage error.

The CLI runs as a subprocess (as a user runs it: its own device count and libtpu process)."""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
from _cli import assert_one_line_error, run_cli

from shardax.errors import UsageError
from shardax.plan.topology import topology_name

ROOT = Path(__file__).resolve().parents[1]
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
TINY = ["--model", "llama-tiny", "--batch-size", "8", "--seq-len", "64"]


def _plan(*args: str) -> subprocess.CompletedProcess:
    return run_cli("plan", *TINY, *args, cwd=ROOT)


@pytest.mark.parametrize("args, needle", [
    (["--target", "h100", "--topology", "2x2"], "--topology 2x2: needs a TPU --target"),
    pytest.param(["--target", "v5e", "--topology", "2x2"], "libtpu is not installed",
                 marks=pytest.mark.skipif(HAS_LIBTPU, reason="libtpu is installed here")),
])
def test_a_topology_shardax_cannot_compile_for_is_one_line_and_exit_code_2(args, needle):
    proc = _plan(*args)
    assert_one_line_error(proc, "plan", needle)


def test_topology_names():
    assert topology_name("tpu v5p", "2x2x1") == "v5p:2x2x1"
    assert topology_name("TPU v5 lite", "4x4") == "v5e:4x4"  # a device kind names it too
    with pytest.raises(UsageError, match="--topology '2by2': expected chips per dimension"):
        topology_name("v5p", "2by2")


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install libtpu; no TPU needed)")
def test_plan_compiles_for_a_tpu_slice_with_libtpu(tmp_path):
    proc = _plan("--target", "v5e", "--topology", "2x2", "--mesh", "fsdp=4", "--json",
                 str(tmp_path / "plan.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "memory and collectives from libtpu's compile for the TPU slice v5e:2x2" in proc.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["devices"] == 4 and plan["mesh"] == {"fsdp": 4}
    # the TPU compiler's program: machine code the CPU compile does not report
    assert plan["memory"]["generated_code_size_in_bytes"] > 0
    assert plan["collectives"]["reduce-scatter"]["count"] > 0
    proc = _plan("--target", "v5e", "--topology", "2x2", "--devices", "8")
    assert proc.returncode == 2 and proc.stderr.strip().endswith(
        "--devices 8: --topology 2x2 has 4 devices; leave --devices out"), proc.stderr
