"""GPU-only checks of the paths the CPU cannot run, for `pytest -m gpu` on a CUDA machine: flex backward, compiled
flex training, offload overlap and the planner against the allocator. Skipped without CUDA. The comparators are
bench/gpu_check's (one definition: the one-shot `bash bench/gpu_check.sh` runs the same ones, in one process,
with their broken variants shown in its CPU dry run)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("mode", ["packed_doc", "packed_sliding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_backward_equals_dense_backward(mode, dtype):
    from gpu_check_scripts import flex_dense_agreement

    result = flex_dense_agreement(mode, dtype)
    assert result["ok"], result


def test_flex_with_a_wrong_mask_fails_the_comparison():
    from gpu_check_scripts import flex_dense_agreement

    assert not flex_dense_agreement("packed_doc", torch.float32, flex_mode="causal")["ok"]


def test_compiled_training_step_does_not_recompile_over_5_layouts():
    """train.compile=true (inductor blocks, flex inside, op-level SAC) through the trainer: new document layouts
    of one row shape are new BlockMask *inputs*, never a recompile (CompileWatch)."""
    from gpu_check_scripts import _compiles_over_steps, recompile_overrides

    stats = _compiles_over_steps(recompile_overrides(False, 2048), warmup=1, steps=5)
    assert stats["graphs"] == stats["recompiles"] == stats["graph_breaks"] == 0, stats
    assert stats["layouts"] >= 3, stats


def test_offload_copies_overlap_compute():
    """memory=offload at hidden 1024: copies on a side stream overlap compute kernels (bench/gpu_overlap.py's
    verdict: overlapped time against min(copy, compute), pinned copies only)."""
    from gpu_check_width import hidden_1024_offload_overrides
    from gpu_overlap import overlap_verdict, profile_step

    from flexengine.cli.common import compose_job
    from flexengine.run import build_trainer

    overrides = hidden_1024_offload_overrides()
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(compose_job(overrides), Path(out))
        trainer.train_step()  # warm-up: compile, pinned pools
        torch.cuda.synchronize()
        verdict = overlap_verdict(profile_step(trainer.train_step))
        trainer.metrics.close()
    print(json.dumps({k: verdict[k] for k in ("overlap_of_possible", "copy_us", "compute_us")}))
    assert verdict["ok"], verdict["reasons"]


@pytest.mark.parametrize("memory", ["none", "full"])
def test_planner_matches_max_memory_allocated_at_7b_width_8_layers(memory):
    """The planner's bytes (minus its CUDA reserve) against torch.cuda.max_memory_allocated over real training
    steps: llama2_7b width, 8 layers (at 2 the static terms hid a halved activation term), 8K rows."""
    from gpu_check_width import job_overrides, memory_verdict, run_steps

    r = run_steps(job_overrides()[f"planner_vs_allocator/{memory}"], steps=1)
    verdict = memory_verdict(r["planned_terms"], r["measured_device_bytes"])
    print(json.dumps({"memory": memory, **{k: verdict[k] for k in ("planned_gib", "measured_gib", "rel_error")}}))
    assert verdict["ok"], verdict
    if memory == "none":
        assert verdict["halved_activation_caught"], verdict
