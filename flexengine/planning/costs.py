"""The step's terms that do not depend on the memory policy: weights, grads and optimizer states (sharded by
FSDP), FSDP's unsharded buffers, the host optimizer's bytes and seconds, PCIe and reduce-scatter traffic, and the
assumed constants (MFU, bandwidths) that turn bytes and FLOPs into seconds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from flexengine.core.config import HardwareConfig
from flexengine.core.device_speed import AttentionShape, DeviceSpeed, Gemm
from flexengine.core.parallel_spec import ReduceEvery
from flexengine.core.units import GiB
from flexengine.planning.activations import pointwise_bytes
from flexengine.planning.budget import device_budget
from flexengine.planning.shapes import ModelShape, PlanInputs, Workload, rank_workload

# The constants below are not derived from our code path; each names its source and is printed with every plan
# (`assumptions` in the JSON, the last lines of the table).
# Turns FLOPs into seconds when weighing recompute against offload traffic. torchtitan (docs/performance.md)
# reports 56.8-58.2 % MFU for Llama 3 8B with FSDP2 + compile on 64 A100s; a single-GPU 7B run with long rows
# and a flex mask reaches less, so the planner assumes 0.4. Only ratios of times use it (recompute vs PCIe).
ASSUMED_MFU = 0.4
# Memory bandwidth (GB/s) for memory-bound pointwise recompute, by hardware.name substring (vendor datasheets:
# A100 80GB SXM 2039, H100 SXM 3350, H200 4800); cpu: assumed 10 (a copy of 512 MiB measured 2.3 GB/s on
# this project's shared 2-core build machine under load); anything else: the A100 figure.
HBM_GB_S = {"h200": 4800.0, "h100": 3350.0, "a100": 2039.0, "cpu": 10.0}
DEFAULT_HBM_GB_S = 2039.0
# GPU<->GPU bandwidth (GB/s per GPU, one direction) that FSDP's gradient reduce-scatter achieves, by hardware.name
# substring. ESTIMATES, not measured here: the datasheets give NVLink 3 (A100 SXM) 600 GB/s and NVLink 4 (H100/H200
# SXM) 900 GB/s, both directions together; NCCL's collectives reach roughly 75-80 % of one direction's half
# (nccl-tests bus bandwidth on DGX A100 ~230 GB/s, DGX H100 ~360 GB/s). PCIe cards without NVLink: pcie_gb_s.
# hardware.interconnect_gb_s overrides it.
INTERCONNECT_GB_S = {"h200": 360.0, "h100": 360.0, "a100": 230.0}
# Eager blocks run each pointwise op (norms, RoPE, SwiGLU, residual adds) as its own kernel: every output is
# written and read back once (2x pointwise_bytes) in forward, and about twice that in backward (3 passes in all);
# a compiled block fuses them into the matmuls' neighbours. What compiling costs once: one graph shared by every
# block (compile.apply_compile), about a minute of inductor on a GPU host (assumed; CPU aot_eager: 1-3 s).
EAGER_POINTWISE_PASSES = 3
COMPILE_S = 60.0
FALLBACK_PEAK_TFLOPS = 100.0  # only to rank policies when the device's speed is unknown: never turned into hours
# The chunked loss's pointwise work, in passes over the fp32 [tokens, vocab] logits (each pass writes or reads
# 4 n V bytes): forward casts to fp32, log-softmax (read, write), the target gather; its recompute in backward the
# same again; backward's softmax gradient (read two, write one) and the cast back. Eager torch's kernels on CPU.
LOSS_POINTWISE_PASSES = 12
# Eager kernels per decoder block and micro-batch, forward and backward: HF's LLaMA block counted with a
# TorchDispatchMode (torch 2.13, transformers 5.24: 73 forward, 138 backward). Each pays the device's fixed cost per
# op (DeviceSpeed.op_us) whatever its size: at reduced width or short rows a third of a CPU step. A block that
# recomputes runs its forward's ops again; compiled blocks fuse them (not priced).
EAGER_OPS_PER_BLOCK = (73, 138)
# Where a plan's seconds come from (StepTime.source; the plan's table, "how long" and the run's summary say it)
MEASURED = "measured device speed"
ASSUMED = "assumed MFU x datasheet peak"
UNKNOWN = "unknown device speed"
# what a plan prints in place of hours where the speed is unknown: the ways to a known one
NO_SPEED = (
    "no hours: this device's speed is unknown. Plan for a named card (hardware=a100_80g, h100_80g, h200_141g: its "
    "datasheet peak at the assumed MFU), give hardware.peak_tflops, or plan on the machine itself with hardware=auto "
    "(its speed is measured), or measure the epoch from real steps: flexengine-doctor <the same overrides>"
)
# adamw_cpu_offload's host step per trainable parameter (flexengine.loop.host_adamw: bf16 slot -> fp32 scratch, fused
# AdamW, fp32 master -> bf16 slot, the copies): measured on this project's CPU, 1.19 ns of one core per parameter
# (bench/results/host_optimizer.json: 207M parameters, CPU seconds on one thread of a shared 2-core VM; the replaced
# foreach step took 5.65). For an A100's host this is an estimate, the same figure: the step is memory-bound and
# multi-threaded, and a DGX host gives each GPU more cores and memory channels than this VM has.
HOST_STEP_NS_PER_PARAM = 1.2


def static_bytes(m: ModelShape, x: PlanInputs) -> dict[str, int]:
    """Weights, grads and optimizer states (and autocast's weight copies) on this rank, by term: FSDP shards them."""
    world = max(1, x.hardware.world_size)  # FSDP shards weights, grads and optimizer states
    trainable = m.params * x.trainable_fraction
    weight = x.weight_bytes if x.weight_bytes is not None else x.dtype_bytes
    grad = x.grad_bytes if x.grad_bytes is not None else weight
    state = x.optimizer_state_bytes if x.optimizer_state_bytes is not None else weight
    copied = sum(autocast_copies(m, x).values())
    if x.frozen_weight_bytes is not None and x.trainable_fraction < 1.0:
        # LoRA: base matrices frozen in the compute dtype; norm weights and adapters in the master dtype
        frozen = m.params - m.norm_params
        weights = frozen * x.frozen_weight_bytes + (m.norm_params + trainable) * weight
    else:
        weights = m.params * weight
    out = {"weights_bytes": int(weights / world), "grads_bytes": int(trainable * grad / world)}
    if x.embedding_state_bytes is not None and x.trainable_fraction >= 1.0:
        embedding = m.vocab * m.hidden  # the input embedding's states replace its share of the others
        out["optimizer_bytes"] = int(2 * (trainable - embedding) * state / world)
        out["embedding_optimizer_bytes"] = int(embedding * x.embedding_state_bytes / world)
    else:
        out["optimizer_bytes"] = int(2 * trainable * state / world)  # AdamW: exp_avg + exp_avg_sq
    if x.compute_copy_bytes:
        out["compute_copy_bytes"] = int(copied * x.compute_copy_bytes / world)
    return out


def autocast_copies(m: ModelShape, x: PlanInputs) -> dict[str, int]:
    """Parameters autocast casts to bf16 and caches through the forward, by holder: "blocks" (all of them) and
    "lm_head". What its matmuls read: every matrix but the input embedding (a lookup; with tied embeddings lm_head
    reads it), not the norm weights (RMSNorm multiplies in fp32); under LoRA only the adapters (the frozen base is
    stored in bf16 already). Elements, unsharded."""
    if x.frozen_weight_bytes is not None and x.trainable_fraction < 1.0:
        return {"blocks": int(m.params * x.trainable_fraction), "lm_head": 0}
    lm_head = m.vocab * m.hidden
    return {"blocks": m.params - m.norm_params - lm_head * (1 if m.tied else 2), "lm_head": lm_head}


def fsdp_bytes(m: ModelShape, x: PlanInputs) -> dict[str, int]:
    """Unsharded FSDP2 buffers (parallel.apply_fsdp), 0 for one process.

    Each block is fully_shard-ed on its own: its weights are all-gathered for forward and again for backward,
    and FSDP2 prefetches the next block's all-gather while one computes (2 blocks gathered). The root (input
    embedding, final norm, lm_head) stays gathered through forward and backward. Unsharded gradients: see
    fsdp_unsharded_grads."""
    if x.hardware.world_size <= 1:
        return {}
    gathered = x.fsdp_param_bytes if x.fsdp_param_bytes is not None else x.dtype_bytes
    root = m.embedding_params + m.hidden
    return {
        "fsdp_gathered_weights_bytes": (2 * m.block_params + root) * gathered,
        "fsdp_unsharded_grads_bytes": sum(fsdp_unsharded_grads(m, x).values()),
    }


def fsdp_unsharded_grads(m: ModelShape, x: PlanInputs) -> dict[str, int]:
    """FSDP2's unsharded gradients at backward's peak, by part (bytes on this rank, any world size).

    What torch 2.13's FSDP2 holds (fsdp/_fully_shard/_fsdp_param_group.py post_backward, _fsdp_param.py,
    _fsdp_collectives.py foreach_reduce); the root (embeddings, final norm, lm_head) is one FSDP group like a block:
    - autograd computes each gradient in the gather dtype (the unsharded parameter's); the root's (lm_head's) from
      the start of backward, since the chunked loss is backward's first op.
    - reduce-scatter on (grad_accum 1, reduce_every=micro_batch, a window's last backward): post_backward copies a
      group's gradient into a reduce-scatter input in the reduce dtype and frees it; FSDP keeps one such input in
      flight by default, so one block's gradient and one reduce-scatter input at a time ("block_in_flight"), the
      root's gradient until the root's reduce-scatter at backward's end ("root").
    - reduce-scatter off (grad_accum > 1 with reduce_every=window: set_requires_gradient_sync(False) until the
      window's last micro-batch, `parallel.gradient_sync`): post_backward keeps every group's gradient, the root's
      too, as FSDPParam.unsharded_accumulated_grad in the reduce dtype through the window (to_accumulated_grad_if_
      needed; without a cast, reduce dtype = gather dtype and autograd adds into .grad in place): "block_sums",
      "root_sum". Under a cast each later backward's new gradient is autograd's, in the gather dtype, beside the sum
      until post_backward adds it in: the root's ("root") and one block's; the window's last backward copies one
      block's sum into a reduce-scatter input ("block_in_flight": the larger of the two).
    Not counted: the root's own reduce-scatter input at backward's end (root x reduce bytes, ~3.4 GB at deepseek-7B
    on 8 ranks under bf16_mixed's cast). By then every block's saved activations are freed, so the activation peak
    the plan adds on top covers it unless activations + workspace are smaller; a GPU measurement would settle it."""
    gather = x.fsdp_param_bytes if x.fsdp_param_bytes is not None else x.dtype_bytes
    reduce = x.fsdp_reduce_bytes
    block = m.block_params * x.trainable_fraction
    root = (m.embedding_params + m.hidden) if x.trainable_fraction >= 1.0 else 0  # LoRA: the root is frozen
    if x.grad_accum > 1 and x.reduce_every is ReduceEvery.WINDOW:
        casts = gather != reduce
        return {
            "block_sums": int(m.layers * block * reduce),
            "block_in_flight": int(block * max(gather, reduce)),
            "root_sum": root * reduce,
            "root": root * gather if casts else 0,
        }
    return {"block_in_flight": int(block * (gather + reduce)), "root": root * gather}


def eager_pointwise_s(m: ModelShape, x: PlanInputs) -> float:
    """Seconds per optimizer step that unfused pointwise ops add to eager (uncompiled) blocks: their bytes at the
    device's memory bandwidth (see EAGER_POINTWISE_PASSES)."""
    per_block = 2 * sum(pointwise_bytes(m, rank_workload(x)).values())
    bandwidth = device_rates(x.hardware, x.dtype_bytes).memory_bytes_s
    return x.grad_accum * m.layers * per_block * EAGER_POINTWISE_PASSES / bandwidth


def loss_seconds(m: ModelShape, w: Workload, rates: Rates) -> float:
    """One micro-batch's loss beyond lm_head's forward and backward matmuls (in the matmul term): the chunked
    loss's lm_head forward again in backward (not the fused loss's), and the cross-entropy's pointwise passes over
    the fp32 logits."""
    n = w.micro_batch * (w.seq_len - 1)
    rerun = 2 * n * m.hidden * m.vocab if w.loss_chunked and not w.fused_loss else 0
    passes = LOSS_POINTWISE_PASSES if rerun else LOSS_POINTWISE_PASSES - 4  # no recomputed forward
    return rerun / rates.matmul_flops_s + passes * 4 * n * m.vocab / rates.memory_bytes_s


def dispatch_seconds(m: ModelShape, x: PlanInputs, rates: Rates, recomputed_blocks: int) -> float:
    """One micro-batch's fixed per-op cost of eager blocks (EAGER_OPS_PER_BLOCK at the measured op cost); 0 for
    compiled blocks or without a measurement."""
    op_us = rates.speed.op_us if rates.speed is not None else None
    if x.compiled or not op_us:
        return 0.0
    forward, backward = EAGER_OPS_PER_BLOCK
    return (m.layers * (forward + backward) + recomputed_blocks * forward) * op_us * 1e-6


def recompute_seconds(flops_fraction: float, compute_s: float, pointwise_s: float) -> float:
    """What a memory policy's recompute adds to one micro-batch: its share of the FLOPs at the compute's own rate
    (the matmuls and attention it re-runs), and the pointwise ops it re-runs at the memory bandwidth."""
    return flops_fraction * compute_s + pointwise_s


def device_optimizer_seconds(m: ModelShape, x: PlanInputs, rates: Rates) -> float:
    """An on-device optimizer step with the gradient norm (the measured AdamW rate x trainable parameters); 0 for
    the host optimizer (host_optimizer_seconds) or without a measurement."""
    ns = rates.speed.optimizer_ns_per_param if rates.speed is not None else None
    if x.host_bytes_per_param or not ns:
        return 0.0
    return m.params * x.trainable_fraction / max(1, x.hardware.world_size) * ns * 1e-9


def interconnect_gb_s(hardware: HardwareConfig) -> float:
    """GPU<->GPU bandwidth for collectives: hardware.interconnect_gb_s, else INTERCONNECT_GB_S by name, else PCIe."""
    if hardware.interconnect_gb_s:
        return hardware.interconnect_gb_s
    name = (hardware.name or "").lower()
    return next((v for key, v in INTERCONNECT_GB_S.items() if key in name), hardware.pcie_gb_s)


def reduce_scatter_traffic(m: ModelShape, x: PlanInputs) -> tuple[int, float]:
    """(bytes each rank sends, seconds) of one step's gradient reduce-scatters: a ring reduce-scatter of the
    trainable gradients (in the reduce dtype) sends (world - 1) / world of them per rank, once per window or once
    per micro-batch (reduce_every). (0, 0.0) for one process."""
    world = max(1, x.hardware.world_size)
    if world == 1:
        return 0, 0.0
    reduces = x.grad_accum if x.reduce_every is ReduceEvery.MICRO_BATCH else 1
    sent = int(reduces * m.params * x.trainable_fraction * x.fsdp_reduce_bytes * (world - 1) / world)
    return sent, sent / (interconnect_gb_s(x.hardware) * 1e9)


@dataclass(frozen=True)
class Rates:
    """What turns a step's FLOPs and bytes into seconds on the target, and where the figures come from."""

    matmul_flops_s: float  # the matmuls' achieved FLOP/s (measured; or peak x ASSUMED_MFU, which folds in the rest)
    attention_flops_s: float  # the attention core's, counted as the planner counts its FLOPs
    memory_bytes_s: float
    source: str  # MEASURED | ASSUMED | UNKNOWN (ranking only: FALLBACK_PEAK_TFLOPS)
    speed: Optional[DeviceSpeed] = None  # the measurement, where it is one

    @property
    def measured(self) -> bool:
        """Per-term seconds: the pointwise ops, the loss and the optimizer step are priced on their own (an assumed
        MFU is an all-in figure that folds them in)."""
        return self.speed is not None

    @property
    def known(self) -> bool:
        """Whether the seconds are worth printing as time (an unknown speed still ranks policies)."""
        return self.source != UNKNOWN


def device_rates(hardware: HardwareConfig, dtype_bytes: int) -> Rates:
    """The target's rates in this compute dtype: its measured speed (core/device_speed), else the datasheet peak at
    ASSUMED_MFU, else FALLBACK_PEAK_TFLOPS, named UNKNOWN."""
    speed = next((s for s in hardware.speed if s.dtype_bytes == dtype_bytes), None)
    if speed is not None:
        attention = speed.attention_tflops or speed.matmul_tflops
        return Rates(speed.matmul_tflops * 1e12, attention * 1e12, speed.memory_gb_s * 1e9, MEASURED, speed)
    flops = (hardware.peak_tflops or FALLBACK_PEAK_TFLOPS) * 1e12 * ASSUMED_MFU
    return Rates(flops, flops, hbm_gb_s(hardware) * 1e9, ASSUMED if hardware.peak_tflops else UNKNOWN)


def speed_shapes(m: ModelShape, tokens: int, seq_len: int, chunk_size: int) -> tuple[list[Gemm], AttentionShape]:
    """The GEMMs of one micro-batch's forward (q, k, v, o, gate, up, down in every block; lm_head over a loss chunk)
    and its attention call: what core/device_speed measures for this model."""
    q, kv, h, f, L = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.hidden, m.intermediate, m.layers
    gemms = [Gemm(tokens, q, h, L), Gemm(tokens, kv, h, 2 * L), Gemm(tokens, h, q, L), Gemm(tokens, f, h, 2 * L)]
    rows = min(tokens, chunk_size) if chunk_size > 0 else tokens
    gemms += [Gemm(tokens, h, f, L), Gemm(rows, m.vocab, h, -(-tokens // rows))]
    return gemms, AttentionShape(m.heads, seq_len, m.head_dim)


def hbm_gb_s(hardware: HardwareConfig) -> float:
    """Memory bandwidth of the target (HBM_GB_S by hardware.name, else DEFAULT_HBM_GB_S)."""
    name = "cpu" if hardware.on_cpu else (hardware.name or "").lower()
    return next((v for key, v in HBM_GB_S.items() if key in name), DEFAULT_HBM_GB_S)


def assumptions(hardware: HardwareConfig) -> dict[str, Optional[float]]:
    """The constants a plan rests on (sources in the comments above their definitions; the budget's in
    planning/budget.py)."""
    budget = device_budget(hardware)
    return {
        "assumed_mfu": ASSUMED_MFU,
        "cuda_context_bytes": budget.context_bytes,
        "margin_bytes": budget.margin_bytes,
        "memory_gb_s": hbm_gb_s(hardware),
        "pcie_gb_s": hardware.pcie_gb_s,
        "peak_tflops": hardware.peak_tflops,
    }


def host_optimizer_bytes(m: ModelShape, x: PlanInputs) -> int:
    """Host bytes a CPU-offloaded optimizer holds on this rank: fp32 master, states and transfer slot per trainable
    parameter, plus one fp32 scratch of the largest tensor (LoRA's adapters: negligible)."""
    world = max(1, x.hardware.world_size)
    largest = m.largest_matrix / world if x.trainable_fraction == 1.0 else 0
    return int(m.params * x.trainable_fraction / world * x.host_bytes_per_param + largest * x.host_scratch_bytes)


def host_optimizer_seconds(m: ModelShape, x: PlanInputs, compute_s: float) -> tuple[float, int]:
    """(exposed seconds, PCIe bytes) of a host optimizer step (flexengine.loop.host_adamw) per optimizer step.

    Each trainable parameter crosses PCIe twice in the device dtype. The gradients go down during the window's last
    backward (2/3 of a micro-batch's compute; under torchrun the step downloads them itself, exposed); the host
    steps once the last one has landed (the clip needs the global norm), and each upload runs on the side stream
    under the next parameter's host step."""
    if not x.host_bytes_per_param:
        return 0.0, 0
    n = m.params * x.trainable_fraction / max(1, x.hardware.world_size)
    transfer = x.weight_bytes if x.weight_bytes is not None else x.dtype_bytes
    one_way_s = n * transfer / (x.hardware.pcie_gb_s * 1e9)
    under = 2 * compute_s / 3 if x.hardware.world_size <= 1 else 0.0
    host_s = n * HOST_STEP_NS_PER_PARAM * 1e-9
    exposed = host_s + max(0.0, one_way_s - host_s) + max(0.0, one_way_s - under)
    return exposed, int(2 * n * transfer)


def pinned_bound_bytes(host_budget: Optional[int], host_state: int) -> Optional[int]:
    """Pinned host bytes activation offload may hold on this rank: the rank's host budget less the optimizer
    state kept on the host (the planner's other host term); None when no budget is known (library use)."""
    return None if host_budget is None else max(0, host_budget - host_state)


# What a measured device speed replaces among a plan's assumptions: the MFU, the datasheet peak, the bandwidth
MEASURED_REPLACES = ("assumed_mfu", "peak_tflops", "memory_gb_s")


def assumed_and_measured(
    figures: dict[str, Optional[float]], source: str, dtype: str, hardware: HardwareConfig
) -> list[str]:
    """The plan's lines on what its step time rests on (figures: its `assumptions`; dtype: its compute dtype's
    name): what is assumed, and with a measured speed what was measured, never a measured figure's stand-in."""
    dtype_bytes = {"bfloat16": 2, "float32": 4}.get(dtype)
    speed = next((s for s in hardware.speed if s.dtype_bytes == dtype_bytes), None) if source == MEASURED else None
    assumed = {k: v for k, v in figures.items() if v is not None and not (speed and k in MEASURED_REPLACES)}
    lines = [
        "  assumed (sources in flexengine/planning/costs.py and budget.py): "
        + ", ".join(
            f"{k}={v:g}" if not k.endswith("_bytes") else f"{k.removesuffix('_bytes')}={v / GiB:.2f} GiB"
            for k, v in assumed.items()
        )
    ]
    if speed is not None:
        measured = {k: v for k, v in speed.as_dict().items() if isinstance(v, float)}
        lines.append(
            f"  measured ({speed.source or 'this device'}): " + ", ".join(f"{k}={v:g}" for k, v in measured.items())
        )
    return lines
