"""The longest seq_len per policy: the boundary is exact, ordered as the policies' bytes, and the CLI draws it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flexengine.core.config import HardwareConfig, ModelConfig, conf_dir
from flexengine.core.errors import UserError
from flexengine.planning.max_seq_len import longest_fitting, max_seq_len_table, plot_memory_vs_seq_len
from flexengine.planning.planner import candidates_for, evaluate
from flexengine.planning.shapes import ModelShape, PlanInputs
from flexengine.surgery.model import build_hf_config
from tests.helpers import hide_package

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
            assert evaluate(m, dataclasses.replace(x, seq_len=n), memory).usage.fits, label
        assert not evaluate(m, dataclasses.replace(x, seq_len=n + 128), memory).usage.fits, label


def test_long_rows_need_checkpointing_offload_and_tiles():
    rows = {
        r["label"]: r
        for r in max_seq_len_table(
            _deepseek(), PlanInputs(seq_len=0, micro_batch=1, dtype_bytes=2, hardware=A100, chunk_size=1024)
        )
    }
    n = {label: r["max_seq_len"] for label, r in rows.items()}
    assert n["none"] < n["full"] < n["full + offload"] < n["full + offload + tiled MLP"]
    assert n["full"] < n["full + tiled MLP"]
    assert n["full + offload + tiled MLP"] >= 65536  # a 7B full fine-tune past 64K tokens on one 80 GB card
    best = rows["full + offload + tiled MLP"]
    assert best["memory"]["tiled_mlp"] == 4096 and best["memory"]["offload"]
    assert best["step_s"] > rows["full"]["step_s"] > 0  # longer rows, more recompute: slower steps


def test_cli_table_json_and_png(tmp_path):
    png = tmp_path / "maxlen.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexengine.plan",
            "model=deepseek7b",
            "hardware=a100_80g",
            "train.micro_batch=1",
            "model.lora.r=16",
            "plan.max_seq_len=true",
            f"plan.png={png}",
            "plan.format=json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["trainable_fraction"] < 0.01 and report["micro_batch"] == 1
    assert {r["label"] for r in report["policies"]} >= {"none", "full", "full + offload + tiled MLP"}
    assert max(report["curves_gib"]["none"]) > 80 and png.stat().st_size > 10_000


def test_the_plot_without_matplotlib_names_plan_png_the_extra_and_the_table_alone(tmp_path, monkeypatch):
    hide_package(monkeypatch, "matplotlib")
    with pytest.raises(UserError, match=r"plan\.png .*pip install 'flexengine\[plots\]', or plan\.png=null"):
        plot_memory_vs_seq_len({"none": [1.0, 2.0]}, [1024, 2048], 70.0, tmp_path / "p.png", "title")
    assert not (tmp_path / "p.png").exists()


def test_context_parallel_divides_activations_and_adds_gathered_kv():
    """cp ranks share a row: per-token bytes are a rank's S / cp tokens, except the whole row's K and V that
    attention gathers (held for backward when attention is not recomputed) and their gradients in backward.
    Hand computation for deepseek-7B (MHA: 32 KV heads x 128 = 4096 K/V width), 64K tokens over 8 ranks, bf16."""
    from flexengine.planning.activations import block_bytes, block_working_bytes, constant_bytes, gathered_kv_bytes
    from flexengine.planning.shapes import Workload, rank_workload
    from flexengine.surgery.attention.spec import AttnBackend
    from flexengine.surgery.memory.spec import MemorySpec

    cfg = _deepseek()
    m = ModelShape.from_hf_config(cfg)
    node = dataclasses.replace(A100, world_size=8)
    S, T, kd, p = 65536, 8192, 4096, 2  # row, this rank's share, K/V width, bf16
    x1 = PlanInputs(seq_len=S, micro_batch=1, dtype_bytes=p, hardware=node, chunk_size=1024)
    x8 = dataclasses.replace(x1, cp=8)
    local = Workload(1, T, p, AttnBackend.FLEX, 1024)  # the rank's tokens as if they were a row of their own
    assert rank_workload(x8) == dataclasses.replace(local, cp=8)
    # the gradients of the gathered K and V: 2 x S x 4096 x 2 bytes = 1 GiB; nothing without CP
    assert gathered_kv_bytes(m, x8) == 2 * S * kd * p == 2**30 and gathered_kv_bytes(m, x1) == 0
    # no recompute: a block holds the gathered K and V, (S - T) tokens more than its own, = 1.75 GiB
    extra_kv = 2 * (S - T) * kd * p
    assert block_bytes(m, rank_workload(x8), MemorySpec())[0] - block_bytes(m, local, MemorySpec())[0] == extra_kv
    full = candidates_for("auto")[6][1]  # "full": blocks keep only their input
    e1, e8 = evaluate(m, x1, full), evaluate(m, x8, full)
    assert (
        e8.usage.terms.activation_bytes
        == evaluate(m, dataclasses.replace(x1, seq_len=T), full).usage.terms.activation_bytes
    )
    assert e8.usage.terms.activation_bytes == pytest.approx(e1.usage.terms.activation_bytes / 8, rel=0.01)
    # backward re-runs one block: its working set at T tokens + the gathered K/V + their gradients, once the loss's
    # and the final norm's saved tensors are freed
    loss_side = constant_bytes(m, local, checkpointed=False)
    freed = loss_side["final_norm"] + loss_side["loss_inputs"]
    assert e8.usage.terms.backward_workspace_bytes == block_working_bytes(m, local) + extra_kv + 2 * S * kd * p - freed
    assert longest_fitting(m, x8, full) > 4 * longest_fitting(m, x1, full)


def test_parallel_cp_plans_rows_that_split_into_whole_blocks_per_rank():
    """parallel.cp reaches the planner (no separate plan option needed), and every longest row is a multiple of
    cp x 128 tokens (a row training could run), exact to that step."""
    from flexengine.cli.doctor import compose_job
    from flexengine.cli.plan_max_seq_len import build_max_seq_len

    job = compose_job(
        [
            "model=deepseek7b",
            "model.init=random",
            "hardware=a100_80g",
            "hardware.world_size=8",
            "parallel.cp=8",
            "train.micro_batch=1",
            "loss.chunk_size=1024",
        ]
    )
    report = build_max_seq_len(job, None)
    assert report["cp"] == 8 and report["world_size"] == 8
    lengths = {r["label"]: r["max_seq_len"] for r in report["policies"]}
    assert all(n % 1024 == 0 for n in lengths.values()) and lengths["full"] > 0
    m = ModelShape.from_hf_config(_deepseek())
    x = PlanInputs(
        seq_len=1024,
        micro_batch=1,
        dtype_bytes=2,
        hardware=dataclasses.replace(A100, world_size=8),
        chunk_size=1024,
        cp=8,
    )
    full = candidates_for("auto")[6][1]
    n = longest_fitting(m, x, full)
    assert n % 1024 == 0 and evaluate(m, dataclasses.replace(x, seq_len=n), full).usage.fits
    assert not evaluate(m, dataclasses.replace(x, seq_len=n + 1024), full).usage.fits


def test_a_windowed_models_table_prices_each_length_with_its_own_pair_count():
    """A window's share of seq_len^2 shrinks as rows grow: the table's step time at the longest fitting length is
    that length's own whole-row count (window band), not the share counted at the job's seq_len."""
    from flexengine.core.config import AttnConfig
    from flexengine.planning.max_seq_len import at_length
    from flexengine.planning.specs import whole_row_pairs
    from flexengine.surgery.attention.spec import resolve_attention_spec

    arch = yaml.safe_load((conf_dir() / "model" / "mistral7b.yaml").read_text())["model"]["arch"]
    cfg = build_hf_config(ModelConfig(init="random", arch=arch))  # sliding_window 4096 on every layer
    assert cfg.sliding_window == 4096
    attention = resolve_attention_spec(AttnConfig(mode="packed_sliding", backend="dense"), cfg)
    x = PlanInputs(seq_len=4096, micro_batch=1, dtype_bytes=2, hardware=A100, pairs=whole_row_pairs(attention, 4096))
    m = ModelShape.from_hf_config(cfg)
    table = max_seq_len_table(cfg, x, 0, pairs_at=lambda n: whole_row_pairs(attention, n))
    row = next(r for r in table if r["label"] == "full")
    memory = dict(candidates_for(0))["full"]
    n = row["max_seq_len"]
    assert n > 2 * 4096  # long enough for the window to matter
    own = evaluate(m, at_length(x, n, lambda k: whole_row_pairs(attention, k)), memory).time.step_s
    stale = evaluate(m, at_length(x, n), memory).time.step_s  # 4096's share (causal 0.5) reused at n
    assert row["step_s"] == own and own < stale


def test_the_longest_row_is_searched_over_precision_modes_and_lora():
    """deepseek-7B on one A100-80G (micro_batch 1, chunked loss): bf16_cpu_master's host-held masters and states
    reach 158,720 tokens of full fine-tuning and 348,544 under LoRA r=16; each row names the policy reaching it and
    what the host holds, and `longest_of` skips a mode that does not train correctly."""
    from flexengine.cli.common import compose_job
    from flexengine.core.hardware import assumed_hardware
    from flexengine.planning.fit import plan_specs
    from flexengine.planning.max_seq_len import longest_of, longest_over_modes
    from flexengine.planning.specs import planned_attention, whole_row_pairs
    from flexengine.resolve import with_lora_rank

    job = compose_job(
        ["model=deepseek7b", "model.init=random", "hardware=a100_80g", "train.micro_batch=1", "loss.chunk_size=1024"]
    )
    hf_config, hardware = build_hf_config(job.model), assumed_hardware(job.hardware)
    attention = planned_attention(job.attn, hf_config, hardware)
    specs = {r: plan_specs(with_lora_rank(job, r), hf_config, attention) for r in (0, 16)}
    master = dataclasses.replace(job.precision, mode="bf16_cpu_master")
    rows = longest_over_modes(
        specs, hf_config, hardware, master, job.optim, pairs_at=lambda n: whole_row_pairs(attention, n)
    )
    full, lora = longest_of(rows, 0), longest_of(rows, 16)
    assert full is not None and lora is not None
    assert full["max_seq_len"] >= 158_720 and lora["max_seq_len"] >= 348_544
    assert full["precision"] == lora["precision"] == "bf16_cpu_master" and "offload" in full["policy"]
    assert full["host_bytes"] > full["offloaded_bytes"] > 0  # host optimizer state plus the offloaded activations
    assert longest_of([{**full, "trains_correctly": False}], 0) is None
