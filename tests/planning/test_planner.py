"""The planner (flexengine/planning/planner.py): its search over policies, micro-batches and reductions, the terms
it adds up, and what it says when nothing fits. Its activation estimates: tests/planning/test_activations.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flexengine.core.config import HardwareConfig, MemoryConfig, ModelConfig
from flexengine.core.parallel_spec import ReduceEvery
from flexengine.planning.activations import block_bytes, memory_specs
from flexengine.planning.planner import evaluate, k_table, plan_memory, search_space, spread_layers
from flexengine.planning.shapes import ModelShape, PlanInputs, rank_workload
from flexengine.surgery.memory import select_layers
from flexengine.surgery.memory.offload import OFFLOAD_BLOCKS_IN_FLIGHT
from flexengine.surgery.model import build_hf_config
from tests.helpers import A100

DEEPSEEK = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=30,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=102400,
)


def test_plan_picks_cheapest_fitting_policy():
    cfg = build_hf_config(ModelConfig(init="random", arch=DEEPSEEK))
    plan = plan_memory(cfg, PlanInputs(seq_len=6144, micro_batch=1, dtype_bytes=2, hardware=A100, chunk_size=1024))
    rows = {r.label: r for r in plan.candidates}
    assert plan.chosen.usage.fits and rows[plan.chosen.label].usage.fits
    assert not rows["none"].usage.fits
    faster = [r for r in plan.candidates if r.time.step_s < rows[plan.chosen.label].time.step_s - 1e-6]
    assert all(not r.usage.fits for r in faster)
    assert (
        rows["block k=30/30"].usage.terms.activation_bytes
        < rows["ops k=30/30"].usage.terms.activation_bytes
        < rows["none"].usage.terms.activation_bytes
    )
    assert 0.25 < rows["block k=30/30"].time.recompute_flops_fraction < 0.34  # ~one extra forward of three
    # "how many layers?": the answer is a k strictly between 0 and L here, the fewest blocks of its family that fit
    family = k_table(plan)
    chosen = next(r for r in family if r.label == plan.chosen.label)
    assert [r.k for r in family] == list(range(31))
    assert all(not r.usage.fits for r in family if r.k < chosen.k)
    short = plan_memory(cfg, PlanInputs(seq_len=512, micro_batch=1, dtype_bytes=2, hardware=A100, chunk_size=1024))
    assert short.chosen.label == "none"  # nothing to save when everything fits


def test_spread_layers_and_search_space_respect_given_fields():
    assert spread_layers(4, 32) == "spread_4" and spread_layers(3, 3) == "all"
    assert select_layers("spread_4", 32) == [4, 12, 20, 28] and select_layers("spread_1", 3) == [1]
    assert all(len(set(select_layers(f"spread_{k}", 30))) == k for k in range(31))
    space = search_space(8)
    # none + k x (granularity x offload + plain offload) + whole-block checkpointing (+ offload) with a tiled MLP
    assert len(space) == 1 + 8 * (4 * 2 + 1) + 2
    fixed = search_space(8, MemoryConfig(policy="auto", granularity="ops", offload=False))
    assert {m.granularity for m in fixed} == {"ops", "block"} and not any(m.offload for m in fixed)
    assert {m.policy for m in fixed} == {"none", "selective"}  # "block" only on the none row's defaults
    layers = search_space(8, MemoryConfig(policy="auto", layers="every_2"))
    assert {m.layers for m in layers} == {"every_2"}
    explicit = MemoryConfig(policy="full", layers="first_3")
    assert search_space(8, explicit) == [explicit]


def test_micro_batch_search_keeps_rows_per_step():
    cfg = build_hf_config(ModelConfig(init="random", arch=DEEPSEEK))
    x = PlanInputs(
        seq_len=8192,
        micro_batch=4,
        grad_accum=2,
        dtype_bytes=2,
        hardware=A100,
        chunk_size=1024,
        weight_bytes=2,
        grad_bytes=2,
        optimizer_state_bytes=0,
        host_bytes_per_param=16,
    )
    plan = plan_memory(cfg, x, search_micro_batch=True)
    assert plan.chosen.usage.fits and plan.chosen.micro_batch * plan.chosen.grad_accum == 8
    assert {(r.micro_batch, r.grad_accum) for r in plan.candidates} == {(4, 2), (2, 4), (1, 8)}
    fixed = plan_memory(cfg, x)
    assert fixed.chosen.micro_batch == 4


def test_host_memory_is_a_budget_too():
    cfg = build_hf_config(ModelConfig(init="random", arch=DEEPSEEK))
    x = PlanInputs(
        seq_len=4096,
        micro_batch=1,
        dtype_bytes=2,
        hardware=A100,
        chunk_size=1024,
        weight_bytes=2,
        grad_bytes=2,
        optimizer_state_bytes=0,
        host_bytes_per_param=16,
    )
    assert plan_memory(cfg, x).chosen.usage.fits
    small_host = dataclasses.replace(A100, host_memory_gb=64)  # 6.9e9 x 16 bytes = 103 GiB of masters + states
    plan = plan_memory(cfg, dataclasses.replace(x, hardware=small_host))
    assert not plan.chosen.usage.fits and plan.chosen.usage.host_bytes > plan.chosen.usage.host_budget_bytes


def test_plan_says_what_would_fit():
    arch = dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    )
    cfg = build_hf_config(ModelConfig(init="random", arch=arch))
    small_card = HardwareConfig(
        name="24g", device="cuda", memory_gb=24, peak_tflops=100, pcie_gb_s=25, host_memory_gb=64
    )
    plan = plan_memory(cfg, PlanInputs(seq_len=8192, micro_batch=1, dtype_bytes=2, hardware=small_card))
    assert not plan.chosen.usage.fits
    text = " ".join(plan.suggestions)
    assert "LoRA" in text and "GPUs" in text


def _deepseek_inputs(**overrides) -> tuple:
    import yaml

    from flexengine.core.config import conf_dir

    arch = yaml.safe_load((conf_dir() / "model" / "deepseek7b.yaml").read_text())["model"]["arch"]
    cfg = build_hf_config(ModelConfig(name="deepseek7b", init="random", arch=arch))
    a100 = HardwareConfig(name="a100_80g", device="cuda", memory_gb=80, peak_tflops=312, pcie_gb_s=25)
    return cfg, PlanInputs(
        **{"seq_len": 6144, "micro_batch": 1, "dtype_bytes": 2, "hardware": a100, "chunk_size": 1024, **overrides}
    )


def test_every_term_is_named_and_adds_up_to_the_total():
    cfg, x = _deepseek_inputs()
    plan = plan_memory(cfg, x)
    assert sum(plan.chosen.usage.terms.to_json().values()) == plan.chosen.usage.terms.total_bytes
    assert plan.assumptions["assumed_mfu"] == 0.4 and plan.assumptions["memory_gb_s"] == 2039


def test_the_budget_leaves_the_cuda_context_and_a_named_margin():
    """A GPU plan fits the card less the CUDA context and max(5 %, 3 GiB): never the card itself."""
    cfg, x = _deepseek_inputs()
    plan = plan_memory(cfg, x)
    card, context, margin = (
        plan.chosen.usage.budget.card_bytes,
        plan.chosen.usage.budget.context_bytes,
        plan.chosen.usage.budget.margin_bytes,
    )
    assert card == 80 * 2**30 and context == int(0.8 * 2**30) and margin == int(0.05 * 80 * 2**30)
    assert plan.chosen.usage.budget.usable_bytes == card - context - margin
    assert plan.assumptions["margin_bytes"] == margin and plan.assumptions["cuda_context_bytes"] == context
    assert (
        plan.chosen.usage.terms.total_bytes <= plan.chosen.usage.budget.usable_bytes
        and "cuda_reserve_bytes" not in plan.chosen.usage.terms.to_json()
    )
    # the chosen plan uses the budget, not the card: the same job with no margin may keep more blocks
    given = dataclasses.replace(x.hardware, memory_margin_gb=0.0, cuda_context_gb=0.0)
    roomy = plan_memory(cfg, dataclasses.replace(x, hardware=given))
    assert (
        roomy.chosen.usage.budget.usable_bytes == card
        and roomy.chosen.usage.terms.total_bytes >= plan.chosen.usage.terms.total_bytes
    )


def test_adamw_8bit_counts_fp32_embedding_states():
    """V x h x 8 bytes: ~3.4 GB for deepseek7b's 102,400 x 4096 embedding."""
    from flexengine.core.optimizers import optimizer_spec

    cfg, x = _deepseek_inputs(optimizer_state_bytes=1.0)
    plain = plan_memory(cfg, x).chosen.usage.terms
    embedding_state_bytes = optimizer_spec("adamw_8bit").embedding_state_bytes  # torchao keeps them fp32
    with_fp32 = plan_memory(cfg, dataclasses.replace(x, embedding_state_bytes=embedding_state_bytes)).chosen.usage.terms
    assert with_fp32.embedding_optimizer_bytes == 102400 * 4096 * 8 == pytest.approx(3.36e9, rel=0.01)
    # the embedding's 8-bit states are replaced, not added to
    assert plain.optimizer_bytes - with_fp32.optimizer_bytes == 2 * 102400 * 4096


def test_fsdp_counts_gathered_blocks_root_and_unsharded_grads():
    cfg, x = _deepseek_inputs()
    m = ModelShape.from_hf_config(cfg)
    one = plan_memory(cfg, x).chosen.usage.terms
    assert one.fsdp_gathered_weights_bytes is None  # one process: nothing is gathered
    node = dataclasses.replace(x, hardware=dataclasses.replace(x.hardware, world_size=8), fsdp_param_bytes=2)
    terms = plan_memory(cfg, node).chosen.usage.terms
    root = 2 * 102400 * 4096 + 4096
    assert m.block_params == 4096 * 4096 * 4 + 3 * 4096 * 11008 + 2 * 4096
    assert terms.fsdp_gathered_weights_bytes == (2 * m.block_params + root) * 2
    # one block's bf16 gradient beside its fp32 reduce-scatter input; the root's bf16 gradient through backward
    assert terms.fsdp_unsharded_grads_bytes == m.block_params * (2 + 4) + root * 2
    # accumulating over micro-batches, gradients are reduced once per window: every group's fp32 sum stays unsharded,
    # the root's too (FSDP2's unsharded_accumulated_grad), beside one block's in flight and the root's new bf16 one
    window = plan_memory(cfg, dataclasses.replace(node, grad_accum=8)).chosen.usage.terms
    assert window.fsdp_unsharded_grads_bytes == (m.layers + 1) * m.block_params * 4 + root * (4 + 2)


@pytest.mark.parametrize("mode", ["fp32", "bf16_mixed", "bf16_sr", "bf16_cpu_master", "bf16_pure"])
@pytest.mark.parametrize("mixed_precision", [True, False])
def test_fsdp_bytes_follow_the_policy_the_precision_mode_applies(mode, mixed_precision):
    """The planner's FSDP gather and reduce dtypes are the ones apply_fsdp's policy really uses (the spec answers
    both): bf16-stored modes have no policy and reduce-scatter bf16 gradients (was counted as fp32), and
    bf16_mixed with parallel.mixed_precision=false gathers fp32 weights (was counted as bf16)."""
    from flexengine.core.config import JobConfig
    from flexengine.surgery.precision import SPECS
    from tests.helpers import plan_inputs_of

    spec = SPECS[mode]
    job = JobConfig()
    job.parallel.mixed_precision = mixed_precision
    cfg = _deepseek_inputs()[0]
    x = plan_inputs_of(job, dataclasses.replace(A100, world_size=8), spec, on_cuda=True, hf_config=cfg)
    policy = spec.fsdp_policy(torch.device("cuda"), mixed_precision)
    gather = policy.param_dtype if policy else spec.param_dtype
    reduce = policy.reduce_dtype if policy else spec.param_dtype
    assert (x.fsdp_param_bytes, x.fsdp_reduce_bytes) == (gather.itemsize, reduce.itemsize)
    assert x.fsdp_reduce_bytes == x.grad_bytes  # FSDP2 reduces (and accumulates) in the gradients' own dtype
    terms = plan_memory(cfg, dataclasses.replace(x, seq_len=1024, micro_batch=1, grad_accum=1)).chosen.usage.terms
    shape = ModelShape.from_hf_config(cfg)
    root = 2 * 102400 * 4096 + 4096
    in_flight = shape.block_params * (gather.itemsize + reduce.itemsize)  # autograd's gradient + reduce-scatter input
    assert terms.fsdp_unsharded_grads_bytes == in_flight + root * gather.itemsize


@pytest.mark.parametrize(
    ("strategy", "world_size", "mixed_precision", "copies"),
    [("fsdp", 8, True, False), ("fsdp", 8, False, True), ("ddp", 8, True, True), ("fsdp", 1, True, True)],
)
def test_no_autocast_weight_copy_is_counted_when_fsdp_casts(strategy, world_size, mixed_precision, copies):
    """bf16_mixed sharded over ranks with FSDP's policy runs without autocast (the trainer's compute context asks
    apply_fsdp's record), so it holds no autocast bf16 copy of the weights; without the policy (mixed_precision off),
    under DDP or on one process autocast casts and keeps one (the planner counted it always: 1.61 GiB per GPU for
    deepseek-7B on 8 GPUs)."""
    from flexengine.core.config import JobConfig
    from flexengine.surgery.precision import SPECS
    from tests.helpers import plan_inputs_of

    job = JobConfig()
    job.parallel.strategy, job.parallel.mixed_precision = strategy, mixed_precision
    spec = SPECS["bf16_mixed"]
    cfg = _deepseek_inputs()[0]
    x = plan_inputs_of(job, dataclasses.replace(A100, world_size=world_size), spec, on_cuda=True, hf_config=cfg)
    terms = plan_memory(cfg, dataclasses.replace(x, seq_len=1024, micro_batch=1, grad_accum=1)).chosen.usage.terms
    assert (terms.compute_copy_bytes is not None) == copies


def test_gradient_reduction_per_micro_batch_is_a_searched_dimension():
    """Per micro-batch: one block's unsharded gradient instead of every block's, for grad_accum x the ring
    reduce-scatter's (world - 1) / world of the fp32 gradients per rank, timed at the interconnect bandwidth."""
    from flexengine.planning.costs import INTERCONNECT_GB_S

    cfg, x = _deepseek_inputs(grad_accum=8)
    m = ModelShape.from_hf_config(cfg)
    node = dataclasses.replace(x, hardware=dataclasses.replace(x.hardware, world_size=8), fsdp_param_bytes=2)
    window = plan_memory(cfg, dataclasses.replace(node, reduce_every=ReduceEvery.WINDOW))
    per_mb = plan_memory(cfg, dataclasses.replace(node, reduce_every=ReduceEvery.MICRO_BATCH))
    held = window.chosen.usage.terms.fsdp_unsharded_grads_bytes - per_mb.chosen.usage.terms.fsdp_unsharded_grads_bytes
    root = m.embedding_params + m.hidden  # its fp32 sum, held through the window too
    assert held == m.layers * m.block_params * 4 - m.block_params * 2 + root * 4  # 25.4 GiB at 7B, freed
    sent = m.params * 4 * 7 / 8
    assert window.chosen.time.reduce_scatter_bytes_per_step == pytest.approx(sent, rel=1e-6)
    assert per_mb.chosen.time.reduce_scatter_bytes_per_step == pytest.approx(8 * sent, rel=1e-6)
    assert per_mb.chosen.time.reduce_scatter_s == pytest.approx(8 * sent / (INTERCONNECT_GB_S["a100"] * 1e9))
    assert per_mb.assumptions["interconnect_gb_s"] == INTERCONNECT_GB_S["a100"]
    # auto weighs both and takes the faster step; one process or one micro-batch has nothing to choose
    auto = plan_memory(cfg, dataclasses.replace(node, reduce_every=ReduceEvery.AUTO))
    assert {r.time.reduce_every for r in auto.candidates} == {ReduceEvery.WINDOW, ReduceEvery.MICRO_BATCH}
    assert auto.chosen.time.step_s == min(window.chosen.time.step_s, per_mb.chosen.time.step_s)
    single = plan_memory(cfg, dataclasses.replace(x, reduce_every=ReduceEvery.AUTO))
    assert {r.time.reduce_every for r in single.candidates} == {
        ReduceEvery.WINDOW
    } and single.chosen.time.reduce_scatter_s == 0
    # a slow interconnect makes per-micro-batch traffic visible in the step time
    slow = dataclasses.replace(node.hardware, interconnect_gb_s=1.0)
    slow_mb = plan_memory(cfg, dataclasses.replace(node, hardware=slow, reduce_every=ReduceEvery.MICRO_BATCH))
    assert slow_mb.chosen.time.reduce_exposed_s > 0 and slow_mb.chosen.time.step_s > per_mb.chosen.time.step_s


def test_the_8_gpu_deepseek_plan_reduces_per_micro_batch_instead_of_offloading(tmp_path):
    """experiment=deepseek7b_6k_a100 on 8 GPUs: holding the window's unsharded fp32 gradients (24 GiB per GPU)
    forced activation offload; reducing per micro-batch fits without it at no slower an estimated step."""
    from flexengine.cli.common import compose_job
    from flexengine.core.hardware import assumed_hardware
    from flexengine.planning.fit import plan_job
    from flexengine.resolve import resolved_job

    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    common = [
        "experiment=deepseek7b_6k_a100",
        "hardware.world_size=8",
        "model.init=random",
        "precision=bf16_mixed",
        "data.seq_len=8192",
    ]
    plans = {}
    for reduce_every in ("window", "auto"):
        job = compose_job([*common, f"data.path={tmp_path / 'd.jsonl'}", f"parallel.reduce_every={reduce_every}"])
        plans[reduce_every] = plan_job(job, build_hf_config(job.model), assumed_hardware(job.hardware))
    before, after = plans["window"], plans["auto"]
    assert before.plan.chosen.usage.fits and (
        before.plan.chosen.memory.policy == "offload" or before.plan.chosen.memory.offload
    )  # the old plan
    assert after.plan.chosen.usage.fits and after.plan.chosen.time.reduce_every is ReduceEvery.MICRO_BATCH
    assert after.plan.chosen.memory.policy != "offload" and not after.plan.chosen.memory.offload
    assert after.plan.chosen.time.step_s <= before.plan.chosen.time.step_s + 1e-9
    # what runs is what was planned: the resolved job tells the trainer to sync every micro-batch
    assert resolved_job(job, after).parallel.reduce_every == "micro_batch"


def test_sac_recompute_is_not_free():
    """Pointwise recompute is memory-bound: SAC costs time although it re-runs no matmul."""
    cfg, x = _deepseek_inputs()
    rows = {r.label: r for r in plan_memory(cfg, x).candidates}
    sac = rows["ops k=30/30"]
    assert sac.time.recompute_flops_fraction == 0.0
    assert 0.005 < sac.time.cost < rows["block k=30/30"].time.cost
    assert rows["none"].time.cost == 0.0


def test_lora_counts_frozen_base_in_bf16_without_a_compute_copy():
    """Under bf16_mixed LoRA the frozen base matrices are bf16 (precision.apply_precision): 2 bytes, no autocast copy;
    adapters (and the norm vectors kept for fp32 norm outputs) are fp32 masters with a bf16 copy of the adapters."""
    from flexengine.cli.doctor import compose_job
    from flexengine.core.hardware import assumed_hardware
    from flexengine.surgery.model import build_meta_model
    from flexengine.surgery.precision import precision_spec
    from tests.helpers import plan_inputs_of

    job = compose_job(
        ["model=deepseek7b", "model.init=random", "hardware=a100_80g", "model.lora.r=16", "loss.chunk_size=1024"]
    )
    cfg = build_hf_config(job.model)
    x = plan_inputs_of(job, assumed_hardware(job.hardware), precision_spec("bf16_mixed"), hf_config=cfg)
    terms = plan_memory(cfg, x).chosen.usage.terms
    h, L, f = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    params = sum(p.numel() for p in build_meta_model(cfg, torch.float32).parameters())
    norms = h * (2 * L + 1)
    lora = 16 * L * (4 * 2 * h + 3 * (h + f))  # q, k, v, o (MHA: h x h) and gate, up, down: r x (in + out)
    assert terms.weights_bytes == (params - norms) * 2 + (norms + lora) * 4
    assert terms.compute_copy_bytes == lora * 2  # autocast copies only the fp32 adapters
    assert terms.weights_bytes / 2**30 == pytest.approx(13.0, abs=0.1)  # was 25.7 GiB + 12.9 GiB copy


def test_offload_in_flight_is_offloads_bound_times_its_largest_block():
    """The term counts the blocks offload lets hold device memory at once (its OFFLOAD_BLOCKS_IN_FLIGHT), each as
    large as the largest offloaded block -- however many blocks offload: an average over every block of the model
    counted 8/30 of a block per slot when 8 of 30 offload."""
    cfg, x = _deepseek_inputs()
    m = ModelShape.from_hf_config(cfg)
    w = rank_workload(x)
    for family in (dict(policy="offload"), dict(policy="selective", granularity="ops", offload=True)):
        one_block = max(block_bytes(m, w, spec)[1] for spec in memory_specs(MemoryConfig(**family), m))
        assert one_block > 0
        for k in (1, 8, m.layers):
            plan = evaluate(m, x, MemoryConfig(**family, layers=spread_layers(k, m.layers)))
            assert plan.usage.terms.offload_in_flight_bytes == OFFLOAD_BLOCKS_IN_FLIGHT * one_block, (family, k)
    assert evaluate(m, x, MemoryConfig(policy="none")).usage.terms.offload_in_flight_bytes == 0


def test_a_row_too_long_is_told_a_length_that_fits_and_where_the_longest_is_found():
    """Before: `data.seq_len=122070 fits (at most; try values between 122070 and 1000000000)` -- a lower bound
    called a ceiling, and a range up to the length refused. Now: a length that fits, said to be one."""
    import re

    from flexengine.planning.max_seq_len import max_seq_len_table

    cfg, x = _deepseek_inputs(seq_len=10**9)
    plan = plan_memory(cfg, x)
    assert not plan.chosen.usage.fits
    said = next(s for s in plan.suggestions if s.startswith("data.seq_len="))
    shorter = int(re.fullmatch(r"data\.seq_len=(\d+) fits \(longer rows may too: plan\.max_seq_len=true .*\)", said)[1])
    assert plan_memory(cfg, dataclasses.replace(x, seq_len=shorter)).chosen.usage.fits
    longest = max(row["max_seq_len"] for row in max_seq_len_table(cfg, x))
    assert shorter <= longest < x.seq_len  # what the pointer finds is at least as long


def test_a_lora_step_skips_the_frozen_weights_gradients():
    """LoRA's frozen base weights and lm_head get no weight gradient: the step's matmul FLOPs are 4N-like, not 6N
    (loop/flops.py counts MFU the same way), so the planned step is ~2/3 of full fine-tuning's with the same policy;
    before, the planner timed a LoRA step as a full one (a 16.4 h vs 16.7 h corpus estimate)."""
    cfg, full = _deepseek_inputs()
    lora = dataclasses.replace(full, trainable_fraction=0.01)
    none = MemoryConfig(policy="none")
    t_full, t_lora = (plan_memory(cfg, x, given=none).chosen.time.step_s for x in (full, lora))
    assert 0.6 < t_lora / t_full < 0.72  # the attention core's backward still counts twice


def test_the_fused_loss_step_is_the_chunked_one_less_the_lm_head_rerun():
    """With a measured speed (the loss priced on its own): the fused loss's step differs from the chunked one's by
    lm_head's forward re-run in each micro-batch's backward, and its memory by the gradients it holds instead of
    the chunks' re-run (costs.loss_seconds, activations.fused_loss_moments)."""
    from flexengine.planning.activations import loss_moments
    from flexengine.planning.costs import device_rates, loss_seconds
    from tests.planning.test_costs import _speed

    cfg, chunked = _deepseek_inputs(seq_len=2048, grad_accum=2)
    speed = _speed(2, matmul_tflops=200.0, memory_gb_s=1500.0, attention_tflops=150.0)
    chunked = dataclasses.replace(chunked, hardware=dataclasses.replace(chunked.hardware, speed=(speed,)))
    fused = dataclasses.replace(chunked, fused_loss=True)
    none = MemoryConfig(policy="none")
    m = ModelShape.from_hf_config(cfg)
    plans = {x.fused_loss: evaluate(m, x, none) for x in (chunked, fused)}
    rates = device_rates(chunked.hardware, 2)
    n = 2047
    rerun = 2 * n * m.hidden * m.vocab / rates.matmul_flops_s + 4 * 4 * n * m.vocab / rates.memory_bytes_s
    assert plans[False].time.step_s - plans[True].time.step_s == pytest.approx(2 * rerun, rel=1e-9)
    assert plans[False].time.loss_s - plans[True].time.loss_s == pytest.approx(2 * rerun, rel=1e-9)
    assert loss_seconds(m, rank_workload(fused), rates) < loss_seconds(m, rank_workload(chunked), rates)
    # bytes: only the backward workspace moves, and it covers the fused loss's forward (its held gradients)
    terms = {fused: dict(plans[fused].usage.terms.items()) for fused in plans}
    workspace = {fused: terms[fused].pop("backward_workspace_bytes") for fused in terms}
    assert terms[True] == terms[False]
    assert workspace[True] >= loss_moments(m, rank_workload(fused))["forward"] > 0


def test_under_lora_the_fused_loss_holds_no_lm_head_weight_gradient():
    """LoRA freezes lm_head (an adapted one is refused by loss.fused): the fused loss's forward holds the hidden
    rows' gradient but no [V, H] weight gradient, so its moment is full fine-tuning's less that fp32 gradient
    (bf16_mixed: autocast over fp32 masters), and the plan's backward workspace shrinks with it."""
    from flexengine.planning.activations import loss_moments

    cfg, full = _deepseek_inputs(autocast=True, fused_loss=True, weight_bytes=4, grad_bytes=4, compute_copy_bytes=2)
    lora = dataclasses.replace(full, trainable_fraction=0.01, frozen_weight_bytes=2)
    m = ModelShape.from_hf_config(cfg)
    moments = {x.trainable_fraction: loss_moments(m, rank_workload(x)) for x in (full, lora)}
    weight_grad = m.vocab * m.hidden * 4
    assert moments[1.0]["forward"] - moments[0.01]["forward"] == weight_grad
    assert moments[1.0]["backward"] == weight_grad and moments[0.01]["backward"] == 0
    none = MemoryConfig(policy="none")
    workspace = {x.trainable_fraction: evaluate(m, x, none).usage.terms.backward_workspace_bytes for x in (full, lora)}
    assert workspace[1.0] - workspace[0.01] == weight_grad
