"""Executed FLOPs per useful token: the executed count is the planner's own step FLOPs, the model's count is
loop/flops.py's model FLOPs of the same rows, and padding and recompute are named where they arise."""

from __future__ import annotations

import pytest

from flexengine.cli.common import compose_job
from flexengine.cli.plan import plan_work
from flexengine.core.hardware import assumed_hardware
from flexengine.planning.costs import ASSUMED_MFU
from flexengine.planning.specs import packed_pairs, planned_attention
from flexengine.resolve import resolve
from flexengine.surgery.model import build_hf_config

ROWS = [[600, 300, 100], [1000], [700]]  # document pieces of three 1,024-token rows (the last padded by 324)


def _work(*overrides: str, rows=ROWS):
    job = compose_job(["hardware=a100_80g", "attn=packed_doc", "data.seq_len=1024", *overrides])
    hf_config, hardware = build_hf_config(job.model), assumed_hardware(job.hardware)
    attention = planned_attention(job.attn, hf_config, hardware)
    pairs = packed_pairs(attention, rows, 1024, "test rows") if rows else None
    run = resolve(job, hf_config, hardware, attention=attention, pairs=pairs)
    return run.fit, plan_work(run, rows)


def test_executed_flops_are_the_planners_step_flops():
    """With no recompute, the executed count times the useful tokens is what the planner's compute time is made
    of (compute_s x peak x MFU): the report reads the planner's terms, it does not keep its own."""
    fit, work = _work("memory=none", "precision=bf16_mixed")
    t = fit.plan.chosen.time
    compute_s = (t.step_s - t.optimizer_s - t.reduce_exposed_s) / (fit.plan.chosen.grad_accum * (1 + t.cost))
    useful = sum(map(sum, ROWS)) / 3 * fit.plan.chosen.micro_batch
    planned = compute_s * fit.hardware.peak_tflops * 1e12 * ASSUMED_MFU
    # the chunked loss's lm_head re-run is executed work that the planner's assumed-MFU time leaves out (~2 %)
    executed = work.executed_flops - work.loss_recompute_flops
    assert work.recompute_flops == 0 and executed * useful == pytest.approx(planned, rel=1e-9)


def test_the_models_count_is_loop_flops_model_count_of_the_same_documents():
    """6N over the useful tokens and 12 FLOPs per allowed (query, key) pair, head and dim within the documents:
    loop/flops.py's TrainFlops.model_flops on a model built from the same config (lm_head charged at every useful
    token, as the planner prices it, rather than at the positions that predict)."""
    from transformers import AutoModelForCausalLM

    from flexengine.loop.flops import TrainFlops, layer_attended_pairs
    from flexengine.surgery.memory import apply_memory_policy
    from flexengine.surgery.memory.spec import block_memory_specs

    job = compose_job(["hardware=a100_80g", "attn=packed_doc", "data.seq_len=1024", "memory=none"])
    hf_config = build_hf_config(job.model)
    model = AutoModelForCausalLM.from_config(hf_config)
    apply_memory_policy(model, block_memory_specs(job.memory, hf_config.num_hidden_layers))  # what TrainFlops reads
    attention = planned_attention(job.attn, hf_config, assumed_hardware(job.hardware))
    flops = TrainFlops(model)
    useful = sum(map(sum, ROWS))
    pairs = [sum(layer) for layer in zip(*(layer_attended_pairs(attention, row, 4) for row in ROWS))]
    want = flops.model_flops(useful, useful, pairs) / useful
    _fit, work = _work("memory=none", "precision=bf16_mixed")
    assert work.model_flops == pytest.approx(want, rel=1e-9)


def test_padding_and_recompute_are_named():
    _fit, whole = _work("memory=none", "loss.chunk_size=0", rows=None)  # one whole-row document: nothing wasted
    assert whole.ratio == pytest.approx(1.0) and whole.padding_flops == 0 and whole.loss_recompute_flops == 0
    _fit, padded = _work("memory=none", "loss.chunk_size=0")
    slots, useful = 3 * 1024, sum(map(sum, ROWS))
    # the padding's matmuls, a share of the model's count diluted by the documents' attention (which has no padding)
    assert 0.8 * (slots - useful) / useful < padded.padding_flops / padded.model_flops < (slots - useful) / useful
    assert padded.ratio == pytest.approx(1 + padded.padding_flops / padded.model_flops)
    _fit, full = _work("memory=full", "memory.layers=all", "loss.chunk_size=0")
    assert 0.2 < full.recompute_flops / full.model_flops < 1 / 3  # every block forward again (not lm_head)
    assert full.ratio == pytest.approx(1 + (full.padding_flops + full.recompute_flops) / full.model_flops)
    assert full.loss_recompute_flops == 0 and "loss recompute +0.0 %" in full.describe()


def test_the_chunked_loss_names_its_lm_head_rerun():
    """Each checkpointed loss chunk runs lm_head's forward again in backward: 2 x hidden x vocab per token slot."""
    _fit, chunked = _work("memory=none", "loss.chunk_size=256")
    hf_config = build_hf_config(compose_job(["hardware=a100_80g"]).model)
    slots, useful = 3 * 1024, sum(map(sum, ROWS))
    want = 2 * hf_config.hidden_size * hf_config.vocab_size * slots / useful
    assert chunked.loss_recompute_flops == pytest.approx(want, rel=1e-9)
    _fit, unchunked = _work("memory=none", "loss.chunk_size=0")
    assert chunked.executed_flops - unchunked.executed_flops == pytest.approx(want, rel=1e-9)
    assert "loss recompute +0.0 %" not in chunked.describe()


def test_the_fused_loss_runs_no_lm_head_again():
    """loss.fused computes each chunk's gradients in the forward: the same work as chunked, less the re-run."""
    _fit, chunked = _work("memory=none", "loss.chunk_size=256")
    _fit, fused = _work("memory=none", "loss.chunk_size=256", "loss.fused=true")
    assert fused.loss_recompute_flops == 0 and chunked.loss_recompute_flops > 0
    assert fused.model_flops == chunked.model_flops
    assert chunked.executed_flops - fused.executed_flops == pytest.approx(chunked.loss_recompute_flops, rel=1e-12)
    assert "loss recompute +0.0 % (fused loss: no re-run)" in fused.describe()


def test_a_loss_chunk_that_covers_every_position_runs_nothing_again():
    """loss.chunk_size at or above the predicting positions is one piece (surgery/loss.py, Workload.loss_chunked):
    nothing to re-run, the unchunked loss's work, as loop/flops.py counts it."""
    _fit, one_piece = _work("memory=none", "loss.chunk_size=4096")  # a few rows of 1,023 predicting positions
    _fit, unchunked = _work("memory=none", "loss.chunk_size=0")
    assert one_piece.loss_recompute_flops == 0 and one_piece.executed_flops == unchunked.executed_flops
    assert "(the loss in one piece: no re-run)" in one_piece.describe()
