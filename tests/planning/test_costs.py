"""The plan's terms that do not depend on the memory policy (flexengine/planning/costs.py): weights, gradients and
AdamW states against what torch really allocates for a small model, FSDP's shards and buffers, traffic and
bandwidths, each against a figure worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flexengine.core.config import HardwareConfig
from flexengine.core.parallel_spec import ReduceEvery
from flexengine.planning import costs
from flexengine.planning.shapes import ModelShape, PlanInputs
from flexengine.surgery.model import build_meta_model

CUDA = HardwareConfig(name="a100_80g", device="cuda", memory_gb=80, pcie_gb_s=25)
SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)
M = ModelShape.from_hf_config(LlamaConfig(**SMALL))


def _inputs(world: int = 1, **kw) -> PlanInputs:
    return PlanInputs(
        seq_len=128, micro_batch=1, dtype_bytes=4, hardware=dataclasses.replace(CUDA, world_size=world), **kw
    )


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_fp32_adamw_terms_equal_what_torch_allocates():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    m = ModelShape.from_hf_config(model.config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.randint(0, 100, (1, 8)), labels=torch.randint(0, 100, (1, 8))).loss.backward()
    opt.step()
    states = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert costs.static_bytes(m, _inputs()) == {
        "weights_bytes": _bytes(model.parameters()),
        "grads_bytes": _bytes(p.grad for p in model.parameters()),
        "optimizer_bytes": _bytes(states),
    }


def test_fsdp_shards_every_static_term():
    m = M
    one, eight = costs.static_bytes(m, _inputs()), costs.static_bytes(m, _inputs(world=8))
    assert eight == {k: int(v / 8) for k, v in one.items()}


def test_lora_keeps_the_frozen_base_in_the_compute_dtype():
    m = M
    adapters = 1000
    x = _inputs(trainable_fraction=adapters / m.params, frozen_weight_bytes=2, weight_bytes=4, compute_copy_bytes=2)
    terms = costs.static_bytes(m, x)
    frozen = m.params - m.norm_params  # every matrix; the norm weights stay fp32 beside the adapters
    assert terms["weights_bytes"] == frozen * 2 + (m.norm_params + adapters) * 4
    assert terms["grads_bytes"] == adapters * 4 and terms["optimizer_bytes"] == 2 * adapters * 4
    assert terms["compute_copy_bytes"] == adapters * 2  # autocast copies only the fp32 adapters


@pytest.mark.parametrize("tied", [False, True])
def test_autocast_copies_every_matrix_a_matmul_reads(tied):
    cfg = LlamaConfig(**SMALL, tie_word_embeddings=tied)
    model = build_meta_model(cfg, torch.float32)
    blocks = sum(mod.weight.numel() for mod in model.model.layers.modules() if isinstance(mod, torch.nn.Linear))
    copies = costs.autocast_copies(ModelShape.from_hf_config(cfg), _inputs())
    # the lm_head reads its matrix (the embedding's, when tied); the embedding lookup and the norms read none
    assert copies == {"blocks": blocks, "lm_head": model.lm_head.weight.numel()}


def test_fsdp_buffers_by_hand():
    m = M
    assert costs.fsdp_bytes(m, _inputs()) == {}  # one process: nothing gathered
    x = _inputs(world=8, fsdp_param_bytes=2, fsdp_reduce_bytes=4)
    root = m.embedding_params + m.hidden  # embedding, lm_head and the final norm: one group
    terms = costs.fsdp_bytes(m, x)
    assert terms["fsdp_gathered_weights_bytes"] == (2 * m.block_params + root) * 2  # one computes, one prefetched
    # reduce-scatter each backward: one block's gradient (bf16) and its reduce input (fp32), the root's gradient
    assert costs.fsdp_unsharded_grads(m, x) == {"block_in_flight": m.block_params * 6, "root": root * 2}
    assert terms["fsdp_unsharded_grads_bytes"] == m.block_params * 6 + root * 2
    # sums kept through the window, in fp32
    window = dataclasses.replace(x, grad_accum=4, reduce_every=ReduceEvery.WINDOW)
    assert costs.fsdp_unsharded_grads(m, window) == {
        "block_sums": m.layers * m.block_params * 4,
        "block_in_flight": m.block_params * 4,
        "root_sum": root * 4,
        "root": root * 2,  # a cast: each backward's new root gradient (bf16) beside the fp32 sum
    }


def test_reduce_scatter_sends_world_minus_one_shares_per_reduction():
    m = M
    assert costs.reduce_scatter_traffic(m, _inputs()) == (0, 0.0)
    x = _inputs(world=4, grad_accum=2, reduce_every=ReduceEvery.MICRO_BATCH, fsdp_reduce_bytes=4)
    sent, seconds = costs.reduce_scatter_traffic(m, x)
    assert sent == int(2 * m.params * 4 * 3 / 4)  # twice a step, 3/4 of the fp32 gradients each time
    assert seconds == pytest.approx(sent / 230e9)  # an A100's NVLink estimate
    assert costs.reduce_scatter_traffic(m, dataclasses.replace(x, reduce_every=ReduceEvery.WINDOW))[0] == sent // 2


@pytest.mark.parametrize(
    ("hardware", "interconnect", "memory"),
    [
        (HardwareConfig(name="h200_141g", device="cuda"), 360.0, 4800.0),
        (HardwareConfig(name="NVIDIA A100-SXM4-80GB", device="cuda"), 230.0, 2039.0),
        (HardwareConfig(name="rtx4090", device="cuda", pcie_gb_s=32), 32.0, 2039.0),  # unknown: PCIe, A100's HBM
        (HardwareConfig(name="h100", device="cuda", interconnect_gb_s=100), 100.0, 3350.0),  # given: taken
        (HardwareConfig(name="h100", device="cpu"), 360.0, 10.0),  # the CPU's bandwidth, whatever the name
    ],
)
def test_bandwidths_by_hardware_name(hardware, interconnect, memory):
    assert costs.interconnect_gb_s(hardware) == interconnect and costs.hbm_gb_s(hardware) == memory


def test_host_optimizer_bytes_and_seconds_by_hand():
    m = M
    x = _inputs(world=2, host_bytes_per_param=14, host_scratch_bytes=4, weight_bytes=2)
    assert costs.host_optimizer_bytes(m, x) == int(m.params / 2 * 14 + m.largest_matrix / 2 * 4)
    assert costs.host_optimizer_seconds(m, _inputs(), compute_s=1.0) == (0.0, 0)  # no host optimizer
    one = dataclasses.replace(x, hardware=CUDA)
    n = m.params
    down = n * 2 / 25e9  # one way over PCIe, bf16
    host = n * costs.HOST_STEP_NS_PER_PARAM * 1e-9
    # the download hides under 2/3 of the last backward (3 s of compute: all of it); the upload under the host step
    exposed, traffic = costs.host_optimizer_seconds(m, one, compute_s=3.0)
    assert traffic == 2 * n * 2 and exposed == pytest.approx(host + max(0.0, down - host))


@pytest.mark.parametrize(("budget", "state", "bound"), [(None, 5, None), (10, 3, 7), (3, 10, 0)])
def test_pinned_bound_is_what_the_host_budget_leaves(budget, state, bound):
    assert costs.pinned_bound_bytes(budget, state) == bound


def _speed(dtype_bytes: int = 4, **kw) -> "costs.DeviceSpeed":
    figures = dict(matmul_tflops=0.02, memory_gb_s=5.0, attention_tflops=0.01, optimizer_ns_per_param=10.0)
    return costs.DeviceSpeed(**(figures | kw), dtype_bytes=dtype_bytes, source="measured on this machine (test)")


def test_the_rates_come_from_the_measured_speed_else_the_datasheet_else_nowhere():
    measured = costs.device_rates(dataclasses.replace(CUDA, peak_tflops=312.0, speed=(_speed(),)), 4)
    assert measured.source == costs.MEASURED and measured.measured and measured.known
    assert (measured.matmul_flops_s, measured.attention_flops_s, measured.memory_bytes_s) == (2e10, 1e10, 5e9)
    # a measurement in another dtype does not price this one: the datasheet does, at the assumed MFU
    assumed = costs.device_rates(dataclasses.replace(CUDA, peak_tflops=312.0, speed=(_speed(2),)), 4)
    assert assumed.source == costs.ASSUMED and not assumed.measured
    assert assumed.matmul_flops_s == pytest.approx(312e12 * costs.ASSUMED_MFU)
    unknown = costs.device_rates(HardwareConfig(name="cpu", device="cpu"), 4)
    assert unknown.source == costs.UNKNOWN and not unknown.known
    assert unknown.matmul_flops_s == pytest.approx(costs.FALLBACK_PEAK_TFLOPS * 1e12 * costs.ASSUMED_MFU)


def test_the_speed_shapes_are_the_blocks_matmuls_and_the_loss_chunks():
    gemms, attention = costs.speed_shapes(M, tokens=1000, seq_len=500, chunk_size=256)
    flops = sum(2 * g.m * g.n * g.k * g.count for g in gemms)
    q, kv = M.heads * M.head_dim, M.kv_heads * M.head_dim
    block = 2 * 1000 * M.hidden * (2 * q + 2 * kv + 3 * M.intermediate)
    assert flops == M.layers * block + 2 * 256 * 4 * M.hidden * M.vocab  # lm_head: 4 chunks of 256 rows
    assert (attention.heads, attention.seq_len, attention.head_dim) == (M.heads, 500, M.head_dim)


def test_a_measured_speed_prices_the_loss_and_the_device_optimizer():
    x = PlanInputs(seq_len=128, micro_batch=1, dtype_bytes=4, hardware=dataclasses.replace(CUDA, speed=(_speed(),)))
    rates = costs.device_rates(x.hardware, 4)
    n = 127
    w = dataclasses.replace(costs.rank_workload(x), chunk_size=64)  # two chunks: lm_head runs again in backward
    rerun = 2 * n * M.hidden * M.vocab / 2e10
    assert costs.loss_seconds(M, w, rates) == pytest.approx(rerun + costs.LOSS_POINTWISE_PASSES * 4 * n * M.vocab / 5e9)
    assert costs.device_optimizer_seconds(M, x, rates) == pytest.approx(M.params * 10e-9)
    assert costs.device_optimizer_seconds(M, dataclasses.replace(x, host_bytes_per_param=16.0), rates) == 0.0


def test_the_fused_loss_prices_no_lm_head_rerun():
    """The same chunks fused: no lm_head forward in backward, and not its pointwise passes (the unchunked count)."""
    x = PlanInputs(seq_len=128, micro_batch=1, dtype_bytes=4, hardware=dataclasses.replace(CUDA, speed=(_speed(),)))
    rates = costs.device_rates(x.hardware, 4)
    n = 127
    chunked = dataclasses.replace(costs.rank_workload(x), chunk_size=64)
    fused = dataclasses.replace(chunked, fused_loss=True)
    passes = costs.LOSS_POINTWISE_PASSES - 4
    assert costs.loss_seconds(M, fused, rates) == pytest.approx(passes * 4 * n * M.vocab / 5e9)
    rerun = 2 * n * M.hidden * M.vocab / 2e10 + 4 * 4 * n * M.vocab / 5e9  # the forward again: matmul and its passes
    assert costs.loss_seconds(M, chunked, rates) - costs.loss_seconds(M, fused, rates) == pytest.approx(rerun)
