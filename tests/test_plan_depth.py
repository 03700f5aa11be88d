"""Planning a deep model of listed layers from two shallow copies (`shardax.plan.depth`).

DeepSeek-V3's dense first layers and Gemma's sliding/global layers cannot be stacked, so the
planner compiled every one of them (DeepSeek-V3: over 400 s). It now compiles the model cut
to one and two repeats of its layers and extends the counts linearly: checked here against
compiling the whole (tiny) model, and through ``shardax plan`` on a DeepSeek-V3-shaped model
(61 layers: 3 dense, then 58 of 256 group-routed experts; small widths) on 64 devices with
'ep'.
"""

import json
from pathlib import Path

import pytest
from _cli import run_cli

from shardax import models
from shardax.plan import depth
from shardax.plan.estimate import _compile, compile_config
from shardax.plan.search import candidates
from shardax.train.config import TrainConfig
from shardax.train.resolve import _one_of_each_layer, resolve

DEEPSEEK = Path(__file__).parent / "fixtures" / "hf" / "deepseek_v3" / "config.json"


def test_repeats_of_the_listed_layers():
    assert depth.repeats(models.get_config("deepseek-v3")) == depth.Repeats(3, 1, 58, 0)
    gemma = models.LlamaConfig(n_layers=26, global_every=6, sliding_window=8)
    cut = depth.repeats(gemma)
    assert cut == depth.Repeats(0, 6, 4, 2) and cut.depth(1) == 8  # 26 = 4 x 6 + 2
    # Each layer of the cut keeps the kind it has in the full model.
    short = depth.shallow(gemma, cut, 1)
    assert [short.window_of(i) for i in range(6, 8)] == [gemma.window_of(i) for i in (24, 25)]
    assert depth.repeats(models.get_config("llama-8b")) is None  # stacks with --scan-layers
    assert depth.repeats(models.LlamaConfig(n_layers=4, global_every=2, sliding_window=8)) \
        is None  # 2 repeats: nothing to save


def _deepseek_dir(root: Path, **fields) -> Path:
    """The tiny DeepSeek-V3 fixture's config.json with ``fields`` changed (plan reads only
    the config)."""
    root.mkdir()
    cfg = {**json.loads(DEEPSEEK.read_text()), **fields}
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def test_extended_plan_equals_compiling_every_layer(tmp_path):
    """4 layers (1 dense, 3 MoE) on ep=2,fsdp=4: compiled at 2 and 3 layers and extended,
    the parameter, state and collective counts are those of compiling all 4; the temporaries
    within 0.5% (buffer packing is not exactly linear in the layers: 0.1% under XLA's default
    fusion emitters, 0.2% under the suite's classic ones; one MoE layer adds ~20% to them)."""
    d = _deepseek_dir(tmp_path / "ds4", num_hidden_layers=4)
    run = resolve(TrainConfig(init_from=f"hf:{d}", mesh="ep=2,fsdp=4", batch_size=8,
                              seq_len=16), weights=False)
    got, want = compile_config(run), _compile(run)
    assert got.depths == [2, 3] and want.depths == []
    temp = "temp_size_in_bytes"
    assert {k: v for k, v in got.memory.items() if k != temp} == {
        k: v for k, v in want.memory.items() if k != temp}
    assert got.memory[temp] == pytest.approx(want.memory[temp], rel=5e-3)
    assert got.collectives == want.collectives and got.across == want.across


def test_search_lists_the_layers_of_a_mixed_model_and_keeps_pp_out():
    found = candidates(TrainConfig(model="deepseek-v3", batch_size=64), 64)
    assert found and all(not c.scan_layers and "pp=" not in c.mesh for c in found)
    assert any("ep=" in c.mesh for c in found)


def test_plan_of_a_deepseek_v3_shaped_model_on_64_devices_with_ep(tmp_path):
    """DeepSeek-V3's layer kinds and routing at small widths: 61 layers (3 dense), 256
    experts top 8 from 4 of 8 groups, 1 shared; planned on 64 devices with ep=8,fsdp=8."""
    d = _deepseek_dir(tmp_path / "ds61", num_hidden_layers=61, first_k_dense_replace=3,
                      n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4)
    proc = run_cli("plan", "--init-from", f"hf:{d}", "--devices", 64, "--mesh", "ep=8,fsdp=8",
                   "--batch-size", 64, "--seq-len", 32, "--json", tmp_path / "plan.json",
                   timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "mesh ep=8, fsdp=8" in proc.stdout and ": fits" in proc.stdout, proc.stdout
    assert "61 listed layers: compiled at 4 and 5 layers and extended linearly to 61" \
        in proc.stdout
    # The model is named by the flag it came from.
    assert f"explicit does not run with --init-from hf:{d} (dropless experts" in proc.stdout
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["mesh"] == {"ep": 8, "fsdp": 8} and saved["fits"]


def test_fitting_fsdp_to_a_mixed_model_traces_one_layer_of_each_kind(tmp_path):
    """``--mesh fsdp=-1`` checks the leaf shapes of 3 dense + 1 MoE layers, not all 61 (44 s
    for deepseek-v3), and fits the mesh as before."""
    assert _one_of_each_layer(models.get_config("deepseek-v3")).n_layers == 4
    gemma = models.LlamaConfig(n_layers=26, global_every=6, sliding_window=8)
    assert _one_of_each_layer(gemma).n_layers == 6
    assert _one_of_each_layer(models.get_config("llama-8b")).n_layers == 32
    d = _deepseek_dir(tmp_path / "ds61", num_hidden_layers=61, first_k_dense_replace=3,
                      hidden_size=36)  # 36 / 8 does not split: fsdp=4 does
    run = resolve(TrainConfig(init_from=f"hf:{d}", batch_size=8, seq_len=16), weights=False)
    assert dict(run.mesh.shape) == {"dp": 2, "fsdp": 4}, run.mesh_why
    assert "fsdp=8 cannot split leaf" in run.mesh_why
