"""The cheapest memory policy that fits the card: every candidate's bytes and step time, and the choice.

A step holds weights, grads, optimizer states (adamw_8bit: the input embedding's in fp32), the activations
(`planning/activations.py`), backward's workspace, offload buffers in flight and FSDP's unsharded buffers
(`planning/costs.py`): `evaluate` returns every term by name and the plan prints them. Their sum must fit the card
less the CUDA context and a named fragmentation margin (`planning/budget.py`). Recompute costs FLOPs (at
ASSUMED_MFU) plus the bytes its pointwise ops move (at the memory bandwidth). The model's dimensions and the plan's
inputs: `planning/shapes.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from flexengine.core.config import MemoryConfig
from flexengine.core.memory_policies import MEMORY_POLICIES
from flexengine.core.parallel_spec import ReduceEvery
from flexengine.core.units import GiB
from flexengine.planning.activations import (
    ActivationEstimate,
    block_forward_flops,
    block_working_bytes,
    constant_bytes,
    estimate_activations,
    gathered_kv_bytes,
    loss_moments,
    loss_transient_bytes,
    memory_specs,
    resolve_tiles,
)
from flexengine.planning.budget import device_budget
from flexengine.planning.costs import (
    HOST_STEP_NS_PER_PARAM,
    Rates,
    assumptions,
    autocast_copies,
    device_optimizer_seconds,
    device_rates,
    dispatch_seconds,
    eager_pointwise_s,
    fsdp_bytes,
    host_optimizer_bytes,
    host_optimizer_seconds,
    interconnect_gb_s,
    loss_seconds,
    pinned_bound_bytes,
    recompute_seconds,
    reduce_scatter_traffic,
    static_bytes,
)
from flexengine.planning.plan import Candidate, DeviceTerms, MemoryUse, Plan, StepTime
from flexengine.planning.shapes import ModelShape, PlanInputs, Workload, rank_workload
from flexengine.surgery.memory.kinds import RecomputeKind, granularities
from flexengine.surgery.memory.layers import select_layers
from flexengine.surgery.memory.offload import OFFLOAD_BLOCKS_IN_FLIGHT
from flexengine.surgery.memory.spec import MemorySpec, Recompute

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# parallel.reduce_every choices the search weighs (auto): once per accumulation window, or every micro-batch
REDUCE_CHOICES = (ReduceEvery.WINDOW, ReduceEvery.MICRO_BATCH)


CANDIDATES: list[tuple[str, MemoryConfig]] = [
    ("none", MemoryConfig()),
    ("mlp-only", MemoryConfig(policy="selective", granularity="mlp")),
    ("attention-only", MemoryConfig(policy="selective", granularity="attention")),
    ("op-level SAC", MemoryConfig(policy="selective", granularity="ops")),
    ("full every_4", MemoryConfig(policy="full", layers="every_4")),
    ("full every_2", MemoryConfig(policy="full", layers="every_2")),
    ("full", MemoryConfig(policy="full")),
    ("offload", MemoryConfig(policy="offload")),
    ("full + offload", MemoryConfig(policy="full", offload=True)),
    # Long rows: the MLP's tokens x intermediate tensors exist one tile at a time, also inside the recompute.
    ("full + tiled MLP", MemoryConfig(policy="full", tiled_mlp="auto")),
    ("full + offload + tiled MLP", MemoryConfig(policy="full", offload=True, tiled_mlp="auto")),
]


def spread_layers(k: int, n_layers: int) -> str:
    """memory.layers for k checkpointed blocks of n spread evenly (select_layers' spread_<k>)."""
    return "all" if k >= n_layers else f"spread_{k}"


def chosen_blocks(specs: Sequence[MemorySpec]) -> list[MemorySpec]:
    """The blocks memory.layers selected: those that recompute or offload (a tiled MLP alone is every block's)."""
    return [spec for spec in specs if spec.recompute.recomputes or spec.offload]


def offloads(specs: Sequence[MemorySpec]) -> bool:
    """Whether any block keeps saved tensors in host memory."""
    return any(spec.offload for spec in specs)


def policy_family(specs: Sequence[MemorySpec]) -> tuple[RecomputeKind, bool]:
    """What the chosen blocks recompute and whether they offload: (NONE, False) is policy none, (NONE, True)
    plain offload; k, the number of chosen blocks, is what varies within a family."""
    chosen = chosen_blocks(specs)
    return (chosen[0].recompute, chosen[0].offload) if chosen else (Recompute.NONE, False)


def describe(specs: Sequence[MemorySpec]) -> str:
    """A short label of a policy: 'none', 'block k=16/32', 'ops k=32/32 + offload', 'offload k=8/32'."""
    tiled = " + tiled MLP" if any(spec.mlp_tile for spec in specs) else ""
    recompute, offload = policy_family(specs)
    k = f"k={len(chosen_blocks(specs))}/{len(specs)}"
    if not recompute.recomputes:
        return (f"offload {k}" if offload else "none") + tiled
    return f"{recompute.name} {k}" + (" + offload" if offload else "") + tiled


def search_space(n_layers: int, given: Optional[MemoryConfig] = None) -> list[MemoryConfig]:
    """Concrete policies the planner weighs: each MEMORY_POLICIES entry's own (`searched`) on k = 0..L blocks
    spread evenly, keeping the memory.* fields the user gave under memory=auto (layers, granularity, offload).
    memory.tiled_mlp=auto adds the MLP over token tiles to whole-block checkpointing (long rows), and to an
    explicit policy (untiled if that fits: the ranking prefers it)."""
    given = given or MemoryConfig(policy="auto", tiled_mlp="auto")
    if given.policy != "auto":  # an explicit policy is evaluated as given
        if given.tiled_mlp == "auto":
            return [dataclasses.replace(given, tiled_mlp=0), given]
        return [given]
    ks = [len(select_layers(given.layers, n_layers))] if given.layers is not None else range(n_layers + 1)
    grans = [given.granularity] if given.granularity is not None else granularities()
    offloads = [given.offload] if given.offload is not None else [False, True]
    layer_choices = [given.layers if given.layers is not None else spread_layers(k, n_layers) for k in ks if k]
    blocks: list[Optional[str]] = [None, *layer_choices]  # None: no block (k=0)
    out = [
        MemoryConfig(**fields)
        for layers in blocks
        for policy in MEMORY_POLICIES.values()
        for fields in policy.searched(layers, grans, offloads, given)
    ]
    tiles = given.tiled_mlp
    if tiles == "auto":  # tiling pays off only where the MLP's whole-row tensors still live: whole-block recompute
        out += [
            dataclasses.replace(mem, tiled_mlp="auto")
            for mem in out
            if MEMORY_POLICIES[mem.policy].tiles_when_auto and mem.layers == "all"
        ]
    elif tiles:
        out = [
            dataclasses.replace(mem, tiled_mlp=tiles)
            for mem in out
            if MEMORY_POLICIES[mem.policy].tiles_mlp(mem.granularity)
        ]
    return out


def evaluate(m: ModelShape, x: PlanInputs, memory: MemoryConfig) -> Candidate:
    """Device bytes (by term), host bytes, fit and estimated optimizer-step time of one concrete policy, from its
    per-block MemorySpecs: every cost below reads them, never memory.* strings."""
    memory = resolve_tiles(memory, m)
    specs = memory_specs(memory, m)
    if x.reduce_every is ReduceEvery.AUTO:  # one evaluation is one concrete plan; plan_memory weighs both
        x = dataclasses.replace(x, reduce_every=ReduceEvery.WINDOW)
    # Under CP every per-token tensor is this rank's seq_len / cp tokens; attention reads all keys (gathered K/V).
    w = rank_workload(x, max((spec.mlp_tile for spec in specs), default=0))
    # The share of the rank's (S / cp)^2 its queries attend, per layer: the mask modes' own count over the packed
    # rows when the corpus is known, else over one whole-row document (planning/specs.whole_row_pairs)
    attended = x.pairs.of_rank(x.cp)
    act = estimate_activations(m, w, specs, attended_fraction=attended)
    return Candidate(
        label=describe(specs),
        micro_batch=x.micro_batch,
        grad_accum=x.grad_accum,
        k=len(chosen_blocks(specs)),
        uses_offload=offloads(specs),
        memory=memory,
        specs=tuple(specs),
        usage=_memory_use(m, x, w, act),
        time=_step_time(m, x, w, act, attended),
    )


def _memory_use(m: ModelShape, x: PlanInputs, w: Workload, act: ActivationEstimate) -> MemoryUse:
    """Device bytes by term, host bytes, the budgets and whether the step fits them."""
    backward = _workspace_bytes(m, x, w, act)
    offload_resident = OFFLOAD_BLOCKS_IN_FLIGHT * max(act.offloaded_per_block, default=0)  # offload's bound x largest
    terms = DeviceTerms(
        **static_bytes(m, x),
        activation_bytes=act.total_bytes,
        backward_workspace_bytes=backward,
        offload_in_flight_bytes=offload_resident,
        **fsdp_bytes(m, x),
    )
    total = terms.total_bytes
    host_state = host_optimizer_bytes(m, x)  # masters/states a CPU optimizer keeps
    host = host_state + act.offloaded_bytes
    device = device_budget(x.hardware)  # the card less the CUDA context and the fragmentation margin
    # hardware.host_memory_gb is already this rank's share (flexengine.core.hardware divides by the node's ranks)
    host_budget = int((x.hardware.host_memory_gb or 0) * GiB) or None  # None: unchecked (library use)
    # On a CPU "device" the host memory is the device memory: one pool.
    budget, on_gpu = device.usable_bytes, not x.hardware.on_cpu
    fits = (total <= budget and (host_budget is None or host <= host_budget)) if on_gpu else total + host <= budget
    return MemoryUse(
        terms=terms,
        activation_bytes_per_block=tuple(act.per_block),
        offloaded_bytes=act.offloaded_bytes,
        workspace_bytes=backward + offload_resident,
        budget=device,
        host_bytes=host,
        host_budget_bytes=host_budget or 0,
        offload_pinned_bound_bytes=pinned_bound_bytes(host_budget, host_state),
        fits=fits,
    )


def _workspace_bytes(m: ModelShape, x: PlanInputs, w: Workload, act: ActivationEstimate) -> int:
    """Bytes beyond the held activations and the static terms at the step's peak: the loss at the forward's end,
    and in backward the loss or one block (its recompute, or its activations' gradients; by then the loss's and the
    final norm's saved tensors are freed). Autocast's weight copies (a static term: all cached at the forward's
    end) are gone in backward for blocks recomputed whole or op by op, whose autograd saves none; a recomputing
    block casts its own weights again, and lm_head's copy lives only in the loss (one process; sharded, FSDP's
    gathers are counted apart: no copy is subtracted). Measured with MemTracker: bench/planner_vs_memtracker.py."""
    copies = autocast_copies(m, x) if x.hardware.world_size <= 1 else {"blocks": 0, "lm_head": 0}
    one_block = int(copies["blocks"] * x.compute_copy_bytes) // m.layers
    released = act.recomputed_blocks * one_block
    lm_head = int(copies["lm_head"] * x.compute_copy_bytes)
    block = block_working_bytes(m, w, act.working) + gathered_kv_bytes(m, x)
    block += one_block if act.working.recomputes else 0
    # the loss's and the final norm's saved tensors are freed before backward reaches the blocks
    loss_side = constant_bytes(m, w, checkpointed=False)
    block -= sum(loss_side.get(name, 0) for name in ("final_norm", "loss_inputs", "log_probs"))
    loss = loss_moments(m, w)
    return max(loss["forward"], loss["backward"] - released, block - released - lm_head)


def _compute_seconds(
    m: ModelShape, x: PlanInputs, w: Workload, attended: float | tuple[float, ...], rates: Rates
) -> tuple[float, float, float]:
    """(FLOPs, matmul seconds, attention seconds) of one micro-batch's forward and backward."""
    # per-layer shares: the blocks' attention cores sum to L x the mean layer's (linear in the share)
    mean = attended if isinstance(attended, (int, float)) else sum(attended) / len(attended)
    forward = block_forward_flops(m, w, mean)
    matmuls = m.layers * sum(v for k, v in forward.items() if k != "attention_core") + 2 * w.tokens * m.hidden * m.vocab
    # backward: an input gradient per matmul (1x its forward), a weight gradient only where weights train (1x more:
    # LoRA's frozen base weights and lm_head get none, ~4N instead of 6N, as loop/flops.py counts), and the
    # attention core's two (dQ, dK/dV: 2x)
    weight_grads = 1 if x.trainable_fraction >= 1.0 else 0
    attention_flops = 3 * m.layers * forward["attention_core"]
    matmul_flops = (2 + weight_grads) * matmuls
    return (
        matmul_flops + attention_flops,
        matmul_flops / rates.matmul_flops_s,
        attention_flops / rates.attention_flops_s,
    )


def _step_time(
    m: ModelShape, x: PlanInputs, w: Workload, act: ActivationEstimate, attended: float | tuple[float, ...]
) -> StepTime:
    """The optimizer step's estimated seconds: compute, recompute (FLOPs and pointwise bytes), exposed offload
    traffic, the optimizer step and the gradient reduce-scatter not hidden by backward. With the device's measured
    speed (costs.device_rates) the matmuls and the attention core run at their own measured rates and the eager
    pointwise ops, the loss's passes and the device optimizer are priced too; at an assumed MFU those are folded
    into the MFU."""
    rates = device_rates(x.hardware, x.dtype_bytes)
    step_flops, matmul_s, attention_s = _compute_seconds(m, x, w, attended, rates)
    compute_s = matmul_s + attention_s
    traffic = act.offloaded_bytes / (x.hardware.pcie_gb_s * 1e9)  # one way, seconds
    exposed_s = max(0.0, traffic - compute_s / 3) + max(0.0, traffic - 2 * compute_s / 3)  # D2H || fwd, H2D || bwd
    recompute_fraction = act.recompute_flops / step_flops if step_flops else 0.0  # extra FLOPs / step FLOPs
    # Recomputed pointwise ops are memory-bound: their time is bytes / bandwidth, not FLOPs (SAC's whole cost).
    pointwise_s = act.recompute_pointwise_bytes / rates.memory_bytes_s
    recompute_s = recompute_seconds(recompute_fraction, compute_s, pointwise_s)
    host_s, host_pcie_bytes = host_optimizer_seconds(m, x, compute_s)
    optimizer_s = host_s + (device_optimizer_seconds(m, x, rates) if rates.measured else 0.0)
    eager_s = eager_pointwise_s(m, x)
    # priced per micro-batch only with a measured speed: an assumed MFU is an all-in figure
    unfused_s = eager_s / x.grad_accum if rates.measured and not x.compiled else 0.0
    unfused_s += dispatch_seconds(m, x, rates, act.recomputed_blocks)
    loss_s = loss_seconds(m, w, rates) if rates.measured else 0.0
    # FSDP2 reduce-scatters each block's gradient while the blocks before it run backward: only what the
    # backward (2/3 of a micro-batch's compute) cannot cover is exposed, per reduction
    reduce_bytes, reduce_s = reduce_scatter_traffic(m, x)
    reduces = x.grad_accum if x.reduce_every is ReduceEvery.MICRO_BATCH else 1
    reduce_exposed_s = reduces * max(0.0, reduce_s / reduces - 2 * compute_s / 3) if reduce_bytes else 0.0
    step_s = x.grad_accum * (compute_s + recompute_s + exposed_s + unfused_s + loss_s) + optimizer_s + reduce_exposed_s
    return StepTime(
        recompute_flops_fraction=recompute_fraction,
        recompute_pointwise_s=pointwise_s,
        offload_bytes_per_step=2 * act.offloaded_bytes * x.grad_accum,
        offload_exposed_s=exposed_s,
        optimizer_s=optimizer_s,
        host_optimizer_pcie_bytes_per_step=host_pcie_bytes,
        reduce_every=x.reduce_every,
        eager_pointwise_s=eager_s,
        reduce_scatter_bytes_per_step=reduce_bytes,
        reduce_scatter_s=reduce_s,
        reduce_exposed_s=reduce_exposed_s,
        step_s=step_s,
        cost=(recompute_s + exposed_s) / max(compute_s, 1e-12),
        matmul_s=x.grad_accum * matmul_s,
        attention_s=x.grad_accum * attention_s,
        pointwise_s=x.grad_accum * unfused_s,
        loss_s=x.grad_accum * loss_s,
        recompute_s=x.grad_accum * recompute_s,
        source=rates.source,
    )


def candidates_for(tiled_mlp: Any = "auto") -> list[tuple[str, MemoryConfig]]:
    """The policies the planner weighs, given memory.tiled_mlp: auto (with and without tiling), 0 (never tiled)
    or a number of tokens (every policy tiled so, except selective/mlp, which recomputes the MLP whole)."""
    if tiled_mlp == "auto":
        return list(CANDIDATES)
    plain = [(label, mem) for label, mem in CANDIDATES if not mem.tiled_mlp]
    if not tiled_mlp:
        return plain
    return [
        (f"{label} + tiled MLP", dataclasses.replace(mem, tiled_mlp=tiled_mlp))
        for label, mem in plain
        if MEMORY_POLICIES[mem.policy].tiles_mlp(mem.granularity)  # not around an MLP recomputed whole
    ]


def micro_batch_choices(micro_batch: int, grad_accum: int) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) pairs up to the given micro_batch that keep the rows per optimizer step."""
    rows = micro_batch * grad_accum
    return [(b, rows // b) for b in range(micro_batch, 0, -1) if rows % b == 0]


def _with_reduce_choices(shapes: list[tuple[int, int]], x: PlanInputs) -> list[tuple[int, int, ReduceEvery]]:
    """(micro_batch, grad_accum, reduce_every) to evaluate: both reductions under reduce_every=auto where they
    differ (FSDP over several ranks with accumulation), else the given one (auto: window)."""

    def choices(accum: int) -> tuple[ReduceEvery, ...]:
        if x.reduce_every is not ReduceEvery.AUTO:
            return (x.reduce_every,)
        return REDUCE_CHOICES if accum > 1 and x.hardware.world_size > 1 else (ReduceEvery.WINDOW,)

    return [(b, accum, r) for b, accum in shapes for r in choices(accum)]


def _rank(row: Candidate) -> tuple[float, bool, bool, int, int, int, bool]:
    """Cheapest estimated step first; ties (e.g. fully overlapped offload vs none) go to no offload, no MLP tiles,
    fewer checkpointed blocks, the larger micro-batch, the coarser recompute and one reduction per window. The
    policy is read from the candidate's MemorySpecs, not from its memory config's strings."""
    specs = row.specs
    return (
        round(row.time.step_s, 6),
        offloads(specs),
        any(spec.mlp_tile for spec in specs),
        len(chosen_blocks(specs)),
        -row.micro_batch,
        policy_family(specs)[0].coarseness,
        row.time.reduce_every is not ReduceEvery.WINDOW,
    )


def plan_memory(
    hf_config: PretrainedConfig,
    x: PlanInputs,
    given: Optional[MemoryConfig] = None,
    search_micro_batch: bool = False,
) -> Plan:
    """Every candidate policy's bytes and step time, the cheapest that fits, and what to change if none does.

    given: memory=auto's user-set fields (layers/granularity/offload) that the search must keep.
    search_micro_batch: also try smaller micro-batches (more accumulation, same rows per optimizer step)."""
    m = ModelShape.from_hf_config(hf_config)
    space = search_space(m.layers, given)
    if x.hardware.on_cpu:  # offloading to host memory saves nothing when the device is the host
        space = [mem for mem in space if not offloads(memory_specs(mem, m))] or space
    shapes = micro_batch_choices(x.micro_batch, x.grad_accum) if search_micro_batch else [(x.micro_batch, x.grad_accum)]
    rows = tuple(
        _candidate(m, dataclasses.replace(x, micro_batch=b, grad_accum=accum, reduce_every=reduce_every), mem, x)
        for b, accum, reduce_every in _with_reduce_choices(shapes, x)
        for mem in space
    )
    fitting = [row for row in rows if row.usage.fits]
    leanest = min(rows, key=lambda r: r.usage.terms.total_bytes + r.usage.host_bytes)  # when nothing fits
    best = min(fitting, key=_rank) if fitting else leanest
    return _plan(hf_config, m, x, rows, best, () if fitting else tuple(suggestions(m, x)))


def _candidate(m: ModelShape, x: PlanInputs, memory: MemoryConfig, given: PlanInputs) -> Candidate:
    """One candidate of the search: `evaluate`'s (priced with its own MemorySpecs, which it carries), its label
    naming the micro-batch where it differs from the given one, and a reduction every micro-batch."""
    candidate = evaluate(m, x, memory)
    shape = "" if x.micro_batch == given.micro_batch else f" mb={x.micro_batch}"
    shape += " reduce/mb" if x.reduce_every is ReduceEvery.MICRO_BATCH and x.grad_accum > 1 else ""
    return dataclasses.replace(candidate, label=candidate.label + shape)


def _plan(
    hf_config: PretrainedConfig,
    m: ModelShape,
    x: PlanInputs,
    rows: tuple[Candidate, ...],
    best: Candidate,
    hints: tuple[str, ...],
) -> Plan:
    """The plan: the chosen candidate, the assumptions, and every candidate."""
    w = rank_workload(x, micro_batch=best.micro_batch)
    per_block = {r.label: r.usage.activation_bytes_per_block for r in rows}
    return Plan(
        hf_config=hf_config.to_dict(),
        seq_len=x.seq_len,
        precision=x.precision,
        attention_pairs=x.pairs,
        dtype={2: "bfloat16", 4: "float32"}.get(x.dtype_bytes, f"{x.dtype_bytes} bytes"),
        chosen=best,
        assumptions={
            **assumptions(x.hardware),
            "host_step_ns_per_param": HOST_STEP_NS_PER_PARAM,
            "interconnect_gb_s": interconnect_gb_s(x.hardware),
        },
        # the first candidate (none, where searched) and the chosen one, in that order (a set's order follows
        # PYTHONHASHSEED: the JSON differed between two runs of one plan)
        activation_bytes_per_block={label: per_block[label] for label in dict.fromkeys((rows[0].label, best.label))},
        logits_bytes=constant_bytes(m, w, False).get("log_probs", 0) + loss_transient_bytes(m, w),
        pcie_seconds_per_step=best.time.offload_bytes_per_step / (x.hardware.pcie_gb_s * 1e9),
        candidates=rows,
        suggestions=hints,
    )


def k_table(plan: Plan) -> list[Candidate]:
    """The chosen family (granularity, offload, micro_batch) at every k: the "how many layers?" answer."""
    family = policy_family(plan.chosen.specs)
    if family == (Recompute.NONE, False):  # nothing needed: show what whole-block checkpointing would cost
        family = (Recompute.BLOCK, False)
    rows = [
        r
        for r in plan.candidates
        if r.micro_batch == plan.chosen.micro_batch
        and r.time.reduce_every == plan.chosen.time.reduce_every
        and (r.k == 0 or policy_family(r.specs) == family)
    ]
    return sorted(rows, key=lambda r: r.k)


def _fits(m: ModelShape, x: PlanInputs) -> bool:
    """Whether whole-block checkpointing, with or without offload, fits (the suggestions' probe)."""
    reductions = REDUCE_CHOICES if x.reduce_every is ReduceEvery.AUTO else (x.reduce_every,)
    return any(
        evaluate(m, dataclasses.replace(x, reduce_every=reduce_every), mem).usage.fits
        for mem in (MemoryConfig(policy="full"), MemoryConfig(policy="full", offload=True))
        for reduce_every in reductions
    )


def suggestions(m: ModelShape, x: PlanInputs) -> list[str]:
    """What would fit when nothing does: shorter rows, LoRA, 8-bit optimizer states, more GPUs."""
    out = []
    seq = x.seq_len
    while seq > 128 and not _fits(m, dataclasses.replace(x, seq_len=seq)):
        seq //= 2
    if seq < x.seq_len and _fits(m, dataclasses.replace(x, seq_len=seq)):
        # a lower bound only: _fits tries whole-block checkpointing alone, the search more (tiles, chunks)
        out.append(f"data.seq_len={seq} fits (longer rows may too: plan.max_seq_len=true finds the longest)")
    if x.micro_batch > 1 and _fits(m, dataclasses.replace(x, micro_batch=1)):
        out.append(f"train.micro_batch=1 train.grad_accum={x.micro_batch * x.grad_accum} fits (same rows per step)")
    if x.chunk_size <= 0 and _fits(m, dataclasses.replace(x, chunk_size=1024)):
        out.append("loss.chunk_size=1024 fits (chunked cross-entropy)")
    # LoRA's frozen base is stored in the compute dtype (precision.apply_precision)
    weight = x.weight_bytes if x.weight_bytes is not None else x.dtype_bytes
    frozen = x.frozen_weight_bytes if x.frozen_weight_bytes is not None else min(weight, x.dtype_bytes)
    if _fits(m, dataclasses.replace(x, trainable_fraction=0.01, frozen_weight_bytes=frozen)):
        out.append("LoRA (about 1% trainable parameters, model.lora.r=16) fits")
    if _fits(m, dataclasses.replace(x, optimizer_state_bytes=1)):
        out.append("8-bit AdamW states (optim.name=adamw_8bit) fit")
    for world in (2, 4, 8, 16, 32, 64):
        if world > x.hardware.world_size and _fits(
            m, dataclasses.replace(x, hardware=dataclasses.replace(x.hardware, world_size=world))
        ):
            out.append(f"{world} GPUs with FSDP (hardware.world_size={world}) fit")
            break
    return out or ["nothing in reach fits: use a smaller model or a larger card (hardware.memory_gb)"]
