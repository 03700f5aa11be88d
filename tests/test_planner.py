"""`shardax plan`: abstract compile = a real run's compiled memory; `--search` keeps only
layouts that fit; analytic pruning; the command line and its errors.

The real run is the tiny `train` run conftest.py shares with test_observability.py; its
`plan.json` holds the memory XLA reported for the step it ran; the plan compiles the same
configuration from shapes alone and must report the same bytes (exact: the same program). The
search test compiles two tiny layouts once (an on-disk cache serves the second search) and sets
the memory limit between their peaks.
"""

import dataclasses
import importlib
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from _cli import alive, assert_one_line_error, run_cli
from _reference import TINY_TRAIN

from shardax import models
from shardax.cli import main
from shardax.devices import device_spec
from shardax.errors import UsageError
from shardax.hlo import CollectiveOp, replica_groups
from shardax.plan import candidates, plan_config, search
from shardax.plan.calibrate import calibrate
from shardax.plan.command import parse_bytes
from shardax.plan.estimate import across_bytes, comm_seconds, train_command, usable_bytes
from shardax.plan.search import axes_across_hosts
from shardax.train.config import TrainConfig, check
from shardax.train.resolve import resolve

H100 = device_spec("h100")
BARE = dataclasses.replace(H100, reserved_bytes=0)  # memory limits of tiny layouts, in bytes
TINY = dict(model="llama-tiny", batch_size=TINY_TRAIN["batch_size"], seq_len=TINY_TRAIN["seq_len"])
# For the searches that compile: 30 tokens do not split over 'cp' (its load-balanced ring
# attention needs 2 x cp to divide the sequence), so no candidate is a ring-attention layout:
# those compile ~2.3x as long as the others (llama-tiny, cp=8: 10.1 s against fsdp=8's 4.3 s),
# and these tests need two layouts, not those.
SEARCHED = {**TINY, "seq_len": 30}


@pytest.fixture(scope="module")
def real_run(observed_run):
    """The shared tiny run of conftest.py (llama-tiny, batch 8 x 32, fsdp=4,tp=2, full remat)
    and the plan.json it wrote."""
    config, out, _ = observed_run
    return config, json.loads((out / "plan.json").read_text())


def test_plan_memory_equals_the_real_runs_compiled_memory(real_run):
    config, real = real_run
    est = plan_config(config, H100)
    assert est.compiled.memory == real["memory"]
    assert est.compiled.mesh == {"fsdp": 4, "tp": 2}
    m = real["memory"]
    assert est.compiled.peak_bytes == (m["argument_size_in_bytes"] + m["output_size_in_bytes"]
                                       - m["alias_size_in_bytes"] + m["temp_size_in_bytes"])
    assert {k: v["count"] for k, v in est.compiled.collectives.items()} == {
        k: v["count"] for k, v in real["collectives"].items()}
    assert est.fits and est.bubble == 0.0
    # Roofline: the compute term is the model FLOPs (x 8/6 on the layers under full remat)
    # split over fsdp x tp = 8 devices, at the H100's peak.
    assert 0 < est.compute_s < est.flops_per_device / (H100.peak_flops * H100.flops_fraction) \
        * 1.01
    assert est.comm_s > 0 and est.step_s == est.compute_s + est.comm_s - est.hidden_s
    assert 0 < est.hidden_s <= min(est.compute_s, est.comm_s)  # FSDP's gathers, under compute
    # Communication: bytes over bandwidth, plus a fixed latency per collective executed.
    count = sum(v["count"] for v in est.compiled.collectives.values())
    slow = dataclasses.replace(H100, collective_latency_s=1e-3)
    assert comm_seconds(est.compiled, slow)[0] - comm_seconds(est.compiled, H100)[0] \
        == pytest.approx(count * (1e-3 - H100.collective_latency_s))


def test_plan_command_line_prints_and_writes_json(real_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    config, real = real_run
    code = main(["plan", "--model", "llama-tiny", "--batch-size", "8", "--seq-len", "32",
                 "--mesh", "fsdp=4,tp=2", "--remat", "full", "--hbm", "1MiB", "--target",
                 "a100", "--json", str(tmp_path / "plan.json"), "--host-link-gbps", "12.5",
                 "--devices-per-host", "4", "--flops-fraction", "0.3",
                 "--collective-latency-us", "20", "--comm-overlap", "0"])
    out = capsys.readouterr().out
    assert code == 0
    assert "DOES NOT FIT" in out and "A100" in out  # a few MiB over a 1 MiB limit
    (line,) = [ln for ln in out.splitlines() if ln.startswith("assumptions: ")]
    for needle in ("A100, 312 TFLOP/s peak bf16 x 0.30 achievable", "4 devices per host",
                   "300 GB/s within a host and 12.5 GB/s across hosts", "x 0.75 achievable",
                   "+ 20 µs per collective; 0% of the all-gathers'"):
        assert needle in line, line
    assert "train it: shardax train --model llama-tiny --mesh fsdp=4,tp=2" in out
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["memory"] == real["memory"] and saved["fits"] is False
    assert saved["hidden_s"] == 0 and saved["step_s"] == saved["compute_s"] + saved["comm_s"]


def test_the_fsdp_mode_is_weighed_against_the_targets_memory():
    """`shardax plan` resolves `--fsdp-mode auto` against its target's memory, as `shardax
    train` does against the device's own: the gathered layers kept where they fit in a quarter
    (then the partitioner's FSDP holds as much and runs faster), re-gathered where not."""
    config = check(TrainConfig(**TINY, mesh="fsdp=8"))
    gathered = models.param_count(models.CONFIGS["llama-tiny"]) * 4  # float32
    tight = resolve(config, usable_bytes(BARE, 2 * gathered))
    roomy = resolve(config, usable_bytes(BARE, 8 * gathered))
    assert (tight.fsdp_mode, tight.fsdp_recompute) == ("explicit", True), tight.fsdp_why
    assert "exceed 25% of device memory" in tight.fsdp_summary()
    assert roomy.fsdp_mode == "xla" and "fit in 25% of device memory" in roomy.fsdp_why


def test_search_returns_only_fitting_layouts(tmp_path):
    base = TrainConfig(**SEARCHED)
    cache = tmp_path / "cache"
    first = search(base, BARE, 1e12, max_compiles=2, cache=cache)
    assert first.compiled == 2 and first.cached == 0 and len(first.ranked) == 2
    peaks = sorted(e.compiled.peak_bytes for e in first.ranked)
    assert peaks[0] < peaks[1], "the test needs two layouts of different peak memory"
    limit = (peaks[0] + peaks[1]) / 2
    second = search(base, BARE, limit, max_compiles=2, cache=cache)
    assert second.cached >= 1  # the layout that fits again, from the cache
    big = max(first.ranked, key=lambda e: e.compiled.peak_bytes).config
    assert big not in [e.config for e in second.ranked]
    # Left out either once compiled or before (the formula, recalibrated by the first
    # compiled peak, already puts it over).
    assert second.over_hbm + second.pruned_memory >= 1
    assert second.ranked and all(e.compiled.peak_bytes <= limit for e in second.ranked)
    steps = [e.step_s for e in first.ranked]
    assert steps == sorted(steps)
    assert first.ranked[0].to_dict()["command"].startswith("shardax train --model llama-tiny")


def test_search_prunes_by_formula_before_compiling(tmp_path):
    result = search(TrainConfig(**TINY), BARE, 1024, max_compiles=2, cache=tmp_path)
    # All but plain FSDP with full remat, which is always compiled (and here does not fit);
    # then the search tries again with pipelines, as nothing fits.
    assert result.ranked == [] and result.compiled + result.cached == 1
    assert result.pruned_memory == result.enumerated - 1 > 0


def test_candidates_are_valid_train_configurations():
    configs = candidates(TrainConfig(**TINY), 8, pipeline=True)
    meshes = {c.mesh for c in configs}
    assert {"dp=8", "fsdp=8", "fsdp=4,tp=2", "pp=2,fsdp=4", "cp=8"} <= meshes
    assert not any("ep=" in m for m in meshes)  # llama-tiny has no experts
    assert not any("tp=4" in m or "tp=8" in m for m in meshes)  # 2 KV heads
    for config in configs[:: max(len(configs) // 40, 1)]:  # a spread of them, checked fully
        resolve(check(config))
    moe = candidates(TrainConfig(model="llama-moe-tiny", batch_size=8, seq_len=32), 8)
    assert any("ep=4" in c.mesh for c in moe) and not any("ep=8" in c.mesh for c in moe)


def test_small_helpers():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("94GB") == 94e9
    with pytest.raises(ValueError, match="--hbm"):
        parse_bytes("lots")
    command = train_command({**TINY, "mesh": "pp=2,fsdp=4", "rules": "fsdp",
                             "scan_layers": True, "microbatches": 4})
    assert command == ("shardax train --model llama-tiny --mesh pp=2,fsdp=4 --rules fsdp "
                       "--batch-size 8 --seq-len 32 --microbatches 4")  # scanning: the default
    assert train_command({**TINY, "mesh": "fsdp=8", "rules": "fsdp", "scan_layers": False}) == (
        "shardax train --model llama-tiny --mesh fsdp=8 --rules fsdp --batch-size 8 --seq-len 32 "
        "--no-scan-layers")


# --hbm, --target and the other checks made before JAX starts: tests/test_cli_errors.py.
@pytest.mark.parametrize("flags, needle", [
    (["--mesh", "fsdp=3"], "fsdp=3"),  # found against the emulated devices
])
def test_bad_plan_input_is_one_line_and_exit_code_2(flags, needle):
    proc = run_cli("plan", *flags)
    assert_one_line_error(proc, "plan", needle)


def _compile_server(monkeypatch, tmp_path, compile_to: str) -> None:
    """The plan search's compile server (`shardax.plan.worker.serve`) with its
    ``compile_to(*args)`` replaced by the function of that name in ``compile_to`` (source;
    ``real`` is the real one); the compiles' files go to ``tmp_path``."""
    script = tmp_path / "compile_server.py"
    script.write_text("import os, time\nfrom shardax.plan import worker\nreal = worker.compile_to\n"
                      f"{textwrap.dedent(compile_to)}\nworker.compile_to = compile_to\n"
                      "worker.serve()\n")
    search_mod = importlib.import_module("shardax.plan.search")  # the module, not search()
    monkeypatch.setattr(search_mod, "COMPILE_SERVER", [sys.executable, str(script)])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_a_compiler_crash_costs_one_layout_also_with_one_job(tmp_path, monkeypatch):
    """XLA CHECK failures abort the process: the first compile's process aborts (as a crashing
    compiler would), and the search reports it and goes on, with --jobs 1."""
    marker = tmp_path / "crashed"
    _compile_server(monkeypatch, tmp_path, f"""
        def compile_to(*args):
            if not os.path.exists({str(marker)!r}):
                open({str(marker)!r}, 'w').close()
                os.abort()
            return real(*args)
        """)
    # Two layouts: the first crashes its compile server, the second compiles in a new one.
    result = search(TrainConfig(**SEARCHED), BARE, 1e12, max_compiles=2, jobs=1, cache=None)
    assert not list(tmp_path.glob("shardax-plan-*"))  # removed at the end
    assert marker.exists()
    assert len(result.failed) == 1 and "could not compile: killed by SIGABRT" in \
        result.failed[0], result.failed
    assert result.compiled == 1 and len(result.ranked) == 1


def test_a_compile_server_that_does_not_start_refuses_each_layout_saying_why(monkeypatch):
    search_mod = importlib.import_module("shardax.plan.search")
    monkeypatch.setattr(search_mod, "COMPILE_SERVER", [
        sys.executable, "-c", "import sys; sys.exit('shardax plan worker: no compiler here')"])
    result = search(TrainConfig(**TINY), BARE, 1e12, max_compiles=2, jobs=1, cache=None)
    # 2, then 2 more: with nothing fitting, the search goes on with pipeline layouts
    assert result.compiled == 0 and len(result.failed) == 4, result
    assert all("could not compile: the compile server ended (no compiler here)" in f
               for f in result.failed), result.failed


def test_the_budget_stops_the_compiles_running(tmp_path, monkeypatch):
    """Out of time with compiles running (compiles that never end: each writes its pid and
    sleeps): they are killed and counted as skipped, and the search's files are removed."""
    pids = tmp_path / "pids"
    pids.mkdir()
    _compile_server(monkeypatch, tmp_path, f"""
        def compile_to(*args):
            open(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()
            time.sleep(600)
        """)
    result = search(TrainConfig(**TINY), BARE, 1e12, max_compiles=2, jobs=2, cache=None,
                    budget_s=3)
    assert result.skipped_budget == 2 and result.compiled == 0 and not result.failed, result
    assert not list(tmp_path.glob("shardax-plan-*"))
    for pid in pids.iterdir():  # killed and reaped by the server before it exited
        assert not alive(int(pid.name)), pid.name


def test_pipelines_only_across_hosts_unless_asked():
    base = TrainConfig(model="llama-small", batch_size=16, seq_len=128)
    assert not any("pp=" in c.mesh for c in candidates(base, 8))  # one host of 8
    across = {c.mesh for c in candidates(base, 8, devices_per_host=4)}
    assert "pp=2,fsdp=4" in across and "pp=4,fsdp=2" not in across  # stages of whole hosts
    assert "pp=4,fsdp=2" in {c.mesh for c in candidates(base, 8, pipeline=True)}
    remats = {c.remat for c in candidates(base, 8)}
    assert {"none", "full", "save_dots"} <= remats and any(r.startswith("names:") for r in remats)
    long = {c.attention for c in candidates(dataclasses.replace(base, seq_len=1024), 8)}
    assert long == {"auto", "xla"}


def test_llama_small_on_8_devices_fits_plain_fsdp_with_full_remat():
    base = TrainConfig(model="llama-small", batch_size=16, seq_len=128)
    # One compile: plain FSDP with full remat is always compiled first (a second layout, the
    # analytically fastest one, would be ring attention over 'cp': ~35 s more here).
    result = search(base, H100, max_compiles=1, cache=None)
    assert result.compiled == 1
    assert any(e.config["mesh"] == "fsdp=8" and e.config["remat"] == "full"
               for e in result.ranked), [e.config for e in result.ranked]


def test_collectives_over_an_axis_spanning_hosts_use_the_slower_tier(real_run):
    config, _ = real_run  # fsdp=4,tp=2: 'tp' groups of 2 neighbours, 'fsdp' groups stride 2
    # Without remat: `checkpoint_in_order`'s ties move scalars from the device that holds the
    # elements they read, in groups of their own (4 bytes each, dozens per step).
    config = dataclasses.replace(config, remat="none")
    one_host = plan_config(config, H100)
    assert one_host.across_s == 0
    two_hosts = plan_config(config, dataclasses.replace(H100, devices_per_host=4))
    across = two_hosts.compiled.across["4"]
    assert 0 < across < sum(v["bytes"] * 2 for v in two_hosts.compiled.collectives.values())
    assert two_hosts.across_s == pytest.approx(across / (H100.host_link_bytes_per_s * 0.75))
    assert two_hosts.comm_s > one_host.comm_s
    tp_only = plan_config(dataclasses.replace(config, mesh="fsdp=4,tp=2"),
                          dataclasses.replace(H100, devices_per_host=2))
    assert tp_only.compiled.across["2"] == across  # the same groups: 'tp' stays inside


def test_replica_groups_in_every_spelling():
    assert replica_groups("replica_groups={{0,2},{1,3}}, to_apply=%a") == ((0, 2), (1, 3))
    assert replica_groups("replica_groups={}, to_apply=%a") is None
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x") == (
        (0, 4), (1, 5), (2, 6), (3, 7))
    mesh = "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, u"
    assert replica_groups(mesh) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert replica_groups("replica_groups=mesh['a'=2,'b'=4] {'a'}, d") == (
        (0, 4), (1, 5), (2, 6), (3, 7))
    # A permute's groups are the rings its pairs link (connected devices).
    assert replica_groups("source_target_pairs={{0,1},{1,0},{2,3},{3,2}}") == ((0, 1), (2, 3))
    ops = [CollectiveOp("a", "all-reduce", "f32", 10, 1, "main", ((0, 1), (2, 3))),
           CollectiveOp("g", "all-gather", "f32", 7, 1, "main", ((0, 2), (1, 3))),
           CollectiveOp("p", "all-gather", "f32", 5, 1, "main", None)]
    assert across_bytes(ops, 4) == {"1": 20 + 7 + 5, "2": 7 + 5}
    assert axes_across_hosts("pp=2,fsdp=4,tp=2", 8) == {"pp"}
    assert axes_across_hosts("pp=2,fsdp=4,tp=2", 4) == {"pp", "fsdp"}


def test_calibration_moves_estimates_toward_measured_step_times(real_run, capsys, monkeypatch):
    config, _ = real_run
    out = Path(config.out)
    device, (fit,) = calibrate([out], H100)
    assert fit.measured_s > 0 and fit.compute_at_peak_s > 0
    assert abs(fit.after_s - fit.measured_s) < abs(fit.before_s - fit.measured_s)
    assert fit.after_s == pytest.approx(fit.measured_s, rel=0.01)  # one run: matched
    assert device.flops_fraction < H100.flops_fraction  # a CPU is far from an H100's peak
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    code = main(["plan", "--model", "llama-tiny", "--batch-size", "8", "--seq-len", "32",
                 "--mesh", "fsdp=4,tp=2", "--remat", "full", "--target", "h100",
                 "--calibrate", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "calibration from 1 run(s)" in text and str(out) in text
    assert f"x {device.flops_fraction:.2f} achievable" in text.split("assumptions:")[1]
    with pytest.raises(UsageError, match="checkpoints: no config.json"):
        calibrate([out / "checkpoints"], H100)
