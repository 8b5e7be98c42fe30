"""The longest seq_len per policy: the boundary is exact, ordered as the policies' bytes, and the CLI draws it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flexengine.config import HardwareConfig, ModelConfig, conf_dir
from flexengine.memory.max_seq_len import longest_fitting, max_seq_len_table
from flexengine.memory.planner import ModelShape, PlanInputs, candidates_for, evaluate
from flexengine.model import build_hf_config

ROOT = Path(__file__).parents[2]
A100 = HardwareConfig(name="a100_80g", device="cuda", memory_gb=80, peak_tflops=312, host_memory_gb=128)


def _deepseek():
    arch = yaml.safe_load((conf_dir() / "model" / "deepseek7b.yaml").read_text())["model"]["arch"]
    return build_hf_config(ModelConfig(init="random", arch=arch))


def test_longest_fitting_is_the_boundary():
    cfg = _deepseek()
    m = ModelShape.from_hf_config(cfg)
    x = PlanInputs(seq_len=0, micro_batch=1, dtype_bytes=2, hardware=A100, chunk_size=1024)
    for label, memory in candidates_for("auto"):
        n = longest_fitting(m, x, memory)
        if n:
            assert evaluate(m, dataclasses.replace(x, seq_len=n), memory)["fits"], label
        assert not evaluate(m, dataclasses.replace(x, seq_len=n + 128), memory)["fits"], label


def test_long_rows_need_checkpointing_offload_and_tiles():
    rows = {r["label"]: r for r in max_seq_len_table(_deepseek(), PlanInputs(
        seq_len=0, micro_batch=1, dtype_bytes=2, hardware=A100, chunk_size=1024))}
    n = {label: r["max_seq_len"] for label, r in rows.items()}
    assert n["none"] < n["full"] < n["full + offload"] < n["full + offload + tiled MLP"]
    assert n["full"] < n["full + tiled MLP"]
    assert n["full + offload + tiled MLP"] >= 65536  # a 7B full fine-tune past 64K tokens on one 80 GB card
    best = rows["full + offload + tiled MLP"]
    assert best["memory"]["tiled_mlp"] == 4096 and best["memory"]["offload"]
    assert best["step_s"] > rows["full"]["step_s"] > 0  # longer rows, more recompute: slower steps


def test_cli_table_json_and_png(tmp_path):
    png = tmp_path / "maxlen.png"
    proc = subprocess.run([sys.executable, "-m", "flexengine.plan", "model=deepseek7b", "hardware=a100_80g",
                           "train.micro_batch=1", "model.lora.r=16", "plan.max_seq_len=true", f"plan.png={png}",
                           "plan.format=json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["trainable_fraction"] < 0.01 and report["micro_batch"] == 1
    assert {r["label"] for r in report["policies"]} >= {"none", "full", "full + offload + tiled MLP"}
    assert max(report["curves_gib"]["none"]) > 80 and png.stat().st_size > 10_000


def test_context_parallel_divides_activations_and_adds_gathered_kv():
    """cp ranks share a row: per-token bytes / cp, plus the whole row's K and V (and their gradients) in one
    block's attention; the attention FLOPs per rank are S^2 / cp, so longer rows fit on 8 GPUs than on 1."""
    from flexengine.memory.planner import gathered_kv_bytes

    cfg = _deepseek()
    m = ModelShape.from_hf_config(cfg)
    node = dataclasses.replace(A100, world_size=8)
    x1 = PlanInputs(seq_len=65536, micro_batch=1, dtype_bytes=2, hardware=node, chunk_size=1024)
    x8 = dataclasses.replace(x1, cp=8)
    full = candidates_for("auto")[6][1]  # "full"
    e1, e8 = evaluate(m, x1, full), evaluate(m, x8, full)
    assert e8["activation_bytes"] == pytest.approx(e1["activation_bytes"] / 8, rel=0.01)
    assert gathered_kv_bytes(m, x8) == 4 * 65536 * 4096 * 2 and gathered_kv_bytes(m, x1) == 0
    assert e8["terms"]["backward_workspace_bytes"] > evaluate(
        m, dataclasses.replace(x1, seq_len=8192), full)["terms"]["backward_workspace_bytes"]
    assert longest_fitting(m, x8, full) > 4 * longest_fitting(m, x1, full)
