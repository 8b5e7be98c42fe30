"""Bytes one forward holds for backward, per decoder block and per batch, and what recomputing them costs.

Activations per decoder block: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", eq. 2) count `sbh(34 + 5as/h)` bytes per layer for a 16-bit GPT block. Adapted to a LLaMA block
(RMSNorm, RoPE, GQA, SwiGLU, no dropout) with fused flash/flex attention, with T = micro_batch x seq_len tokens,
h hidden, a query heads, k kv heads, d head_dim, f intermediate, p bytes per activation element, r bytes per
residual-stream element (4 under autocast over fp32 weights, where the embedding's output and every residual add
stay fp32; else p):

    per block = T x [ 2 x ((4 + r) h + 4)      two RMSNorms: fp32 input (or its fp32 copy), normalised, rsqrt
                    + p h (c_attn + c_mlp)     the norms' outputs the projections read: one each, or under
                                               autocast one bf16 cast per projection (q, k, v: 3; gate, up: 2)
                    + p (2ad + 2kd)            q and k after RoPE, v, attention output
                    + 4a                       attention log-sum-exp (fp32)
                    + 4p f ]                   SwiGLU: gate, silu(gate), up, silu(gate) * up
              (+ B S^2 p                       dense backend only: SDPA's float copy of the boolean mask)

RoPE's products save only the shared cos/sin tables (they do not require grad). Flex returns its output in q's
stride order, so o_proj's input is a view of it (the dense backend's concatenated chunks are copied: + T p ad).
No [S, S] term: flash/flex attention keeps O(S) per head, where the published formula's 5as/h term is the S^2
score/softmax/dropout. Per batch, outside the blocks: rotary cos/sin (2 T d r), the final norm ((4 + r) T h), the
loss inputs (T h r + 16 T) and, unchunked, the fp32 log-probabilities (T V 4); the dense backend's [B, 1, S, S]
bool mask (held by checkpoint closures) once per batch. Validated against flexengine.surgery.memory.meter
(tests/planning/test_activations.py, fp32 on CPU) and against PyTorch's MemTracker over a deepseek-7B-wide bf16 step
(bench/planner_vs_memtracker.py; tests/planning/test_planner_vs_memtracker.py). Eager blocks: a compiled block's
partitioner may keep less (cheap pointwise outputs recomputed), never more.

Recompute costs FLOPs plus the bytes its pointwise ops move: SAC keeps every matmul but still re-runs norms, RoPE
and SwiGLU. Which parts and ops each recompute re-runs, and which bytes it keeps, is its kind's (surgery/memory/
kinds.py: `flops`, `pointwise_ops`, `held_bytes`, `working`; `MemorySpec.recompute_flops`), shared with
loop/flops.py; this module prices the parts and inventories (`block_recompute_parts`, `pointwise_bytes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from flexengine.core.config import MemoryConfig
from flexengine.planning.shapes import ModelShape, PlanInputs, Workload
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.fused_loss import vocab_slice_rows
from flexengine.surgery.memory.kinds import RecomputeKind
from flexengine.surgery.memory.spec import BlockFlops, MemorySpec, Recompute, block_memory_specs
from flexengine.surgery.memory.tiled_mlp import auto_tile_tokens


def block_inventory(m: ModelShape, w: Workload) -> dict[str, dict[str, int]]:
    """Bytes one block (policy none) holds for backward, by sub-layer and tensor (see the module formula)."""
    T, p, h, r = w.tokens, w.act_bytes, m.hidden, w.residual_bytes
    ad, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim

    def norm(readers: int) -> dict[str, int]:
        # the fp32 input (the block's residual, or its fp32 copy), x * rsqrt as weight * saves it (cast back to
        # the residual's dtype first), and the output the projections read: shared, or one bf16 copy per
        # projection when autocast casts it for each
        return {
            "input_fp32": 4 * T * h,
            "normalised": r * T * h,
            "scaled_output": p * T * h * (readers if w.autocast else 1),
            "rsqrt": 4 * T,
        }

    # flex saves its K and V inputs: under context parallelism the whole row's, all-gathered (cp x T tokens)
    attention = {
        "q_rope": p * T * ad,
        "k_rope": p * T * w.cp * kd,
        "v": p * T * w.cp * kd,
        "attn_out": p * T * ad,
        "logsumexp": 4 * T * m.heads,
    }
    # flex returns its output in q's stride order ([B, S, H, D] memory, as HF's q is a transposed view), so
    # o_proj's input (out.transpose(1, 2).contiguous()) is a view of attn_out; so is varlen's output
    if w.backend is AttnBackend.DENSE:
        attention["float_mask"] = p * w.dense_mask_elements  # SDPA's float copy of each chunk's bool mask
        if w.seq_len > w.dense_chunk:  # the chunks' outputs are concatenated [B, H, S, D]: o_proj gets a copy
            attention["o_proj_input"] = p * T * ad
    mlp = {
        "gate": p * T * m.intermediate,
        "silu": p * T * m.intermediate,
        "up": p * T * m.intermediate,
        "down_input": p * T * m.intermediate,
    }
    return {"norm1": norm(m.attention_inputs), "attention": attention, "norm2": norm(m.mlp_inputs), "mlp": mlp}


def sac_inventory(m: ModelShape, w: Workload) -> dict[str, int]:
    """Bytes one block holds under op-level SAC: its input plus every matmul and attention output."""
    T, p, h = w.tokens, w.act_bytes, m.hidden
    ad, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {
        "block_input": w.residual_bytes * T * h,
        "q": p * T * ad,
        "k": p * T * kd,
        "v": p * T * kd,
        "attn_out": p * T * ad,
        "logsumexp": 4 * T * m.heads,
        "attn_proj_out": p * T * h,
        "gate": p * T * m.intermediate,
        "up": p * T * m.intermediate,
        "mlp_out": p * T * h,
    }


def block_bytes(m: ModelShape, w: Workload, spec: MemorySpec) -> tuple[int, int]:
    """(device bytes, host bytes) one block holds under its MemorySpec (its recompute kind's `held_bytes`)."""
    inv = block_inventory(m, w)
    if spec.tiles_mlp(w.tokens) and not spec.recompute.keeps_tile_outputs:
        # per-tile checkpoints keep only views of the MLP input (norm2's output, already counted). Under SAC the
        # tiles' matmul outputs still land in its cache: measured unchanged.
        inv["mlp"] = {}
    held = spec.recompute.held_bytes(inv, sac_inventory(m, w), w.residual_bytes * w.tokens * m.hidden)
    return (0, held) if spec.offload else (held, 0)


def block_working_bytes(m: ModelShape, w: Workload, recompute: RecomputeKind = Recompute.BLOCK) -> int:
    """Bytes one block's backward makes at once beside what the forward holds: the gradient coming down the
    residual stream, and by what the block recomputes (measured with MemTracker, bench/planner_vs_memtracker.py):
    BLOCK (and ATTENTION / MLP, at most as much) its whole inventory re-run, whose MLP part also has two gradients
    of [tokens, intermediate] in flight (~6 such tensors at the MLP's backward peak); OPS the same less what SAC's
    cache holds (v, attention output and log-sum-exp, gate and up); NONE (it kept its activations) the MLP's
    gradients only (4 such tensors). The MLP's for one tile when it is tiled; or the second norm's backward, if
    larger."""
    T = w.tokens
    incoming = w.residual_bytes * T * m.hidden
    inv = block_inventory(m, w)
    mlp_parts = inv.pop("mlp")
    inv, mlp = recompute.working(inv, mlp_parts, 4 * w.act_bytes * T * m.intermediate)
    tiled = mlp * min(w.mlp_tile, T) // T if w.mlp_tiled else mlp
    remade = sum(sum(part.values()) for part in inv.values())
    # The second norm's backward comes after the MLP's, whose tensors (and the norm's output) are freed by then;
    # RMSNorm's backward works in fp32: 5 [tokens, hidden] fp32 tensors at once (MemTracker, mistral-7B at 32K).
    # It outgrows the MLP's moment when the MLP is tiled.
    norm2 = inv.get("norm2", {})
    norm = remade - norm2.get("scaled_output", 0) - norm2.get("normalised", 0) + 5 * 4 * T * m.hidden
    return incoming + max(remade + tiled, norm)


def block_forward_flops(m: ModelShape, w: Workload, attended_fraction: float = 0.5) -> dict[str, float]:
    """Forward FLOPs of one block by matmul (2 per multiply-add); attention core scaled by keys attended."""
    T, h = w.tokens, m.hidden
    ad, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {
        "qkv_proj": 2 * T * h * (ad + 2 * kd),
        "attn_out_proj": 2 * T * ad * h,
        "attention_core": 4 * w.micro_batch * m.heads * w.seq_len**2 * m.head_dim * attended_fraction,
        "gate_up_proj": 4 * T * h * m.intermediate,
        "mlp_out_proj": 2 * T * h * m.intermediate,
    }


def pointwise_bytes(m: ModelShape, w: Workload) -> dict[str, int]:
    """Bytes written by the pointwise ops of one block's forward, by op, read from HF's LLaMA code path.

    LlamaRMSNorm: to(fp32), pow, mean, +eps/rsqrt, x*rsqrt (all fp32), to(dtype), weight* (two per block);
    apply_rotary_pos_emb per q/k: x*cos, rotate_half (neg of one half, cat), *sin, add = 4.5 tensors of x's
    size; SwiGLU: silu(gate), *up; two residual adds."""
    T, p, h, f = w.tokens, w.act_bytes, m.hidden, m.intermediate
    ad, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    casts = (4 + p) * h if p < 4 else 0  # to(fp32) and back are no-ops for fp32 activations
    norm = T * ((8 + p) * h + casts + 12)  # pow, x*rsqrt (fp32), weight* (p), mean/+eps/rsqrt (fp32 per token)
    return {
        "norm1": norm,
        "rope": int(4.5 * p * T * (ad + kd)),
        "norm2": norm,
        "swiglu": 2 * p * T * f,
        "residual": 2 * p * T * h,
    }


def block_recompute_parts(
    m: ModelShape, w: Workload, attended_fraction: float = 0.5, count_attention_core: bool = True
) -> BlockFlops:
    """One block's forward FLOPs by the parts a recompute re-runs (no LoRA here: no `*_end` terms).
    count_attention_core=False matches FlopCounterMode on CPU, which has no formula for the CPU flash-attention
    kernel."""
    f = block_forward_flops(m, w, attended_fraction)
    return BlockFlops(
        attention_inputs=f["qkv_proj"],
        attention_core=f["attention_core"] if count_attention_core else 0.0,
        attention_output=f["attn_out_proj"],
        mlp_inputs=f["gate_up_proj"],
    )


def recompute_flops_per_block(
    m: ModelShape,
    w: Workload,
    granularity: RecomputeKind,
    attended_fraction: float = 0.5,
    count_attention_core: bool = True,
) -> float:
    """Extra forward FLOPs backward spends re-running one block checkpointed at `granularity` (its kind's `flops`)."""
    return granularity.flops(block_recompute_parts(m, w, attended_fraction, count_attention_core))


def constant_bytes(m: ModelShape, w: Workload, checkpointed: bool) -> dict[str, int]:
    """Bytes held once per micro-batch outside the blocks (saved for backward)."""
    T, r = w.tokens, w.residual_bytes
    n = w.micro_batch * (w.seq_len - 1)  # next-token targets (all valid: the worst case)
    out = {
        "rotary_cos_sin": 2 * T * m.head_dim * r,  # HF casts cos/sin to the embeddings' dtype
        "final_norm": (4 + r) * T * m.hidden + 4 * T,
        "loss_inputs": n * m.hidden * r + 16 * n,
    }  # hidden rows (lm_head's input), int64 row index
    # (index_select's backward) and int64 targets (cross-entropy's backward); the positions come from the loader
    if w.chunk_size <= 0 or n <= w.chunk_size:
        out["log_probs"] = 4 * n * m.vocab  # CE keeps fp32 log-softmax of all [tokens, vocab]
    if w.backend is AttnBackend.DENSE and checkpointed:
        out["bool_mask"] = w.dense_mask_elements  # the chunks' bool masks, kept alive by the checkpoint closures
    return out


def loss_moments(m: ModelShape, w: Workload) -> dict[str, int]:
    """Peak bytes lm_head + CE add to what the forward holds (`constant_bytes`) and to the static terms, at the
    forward's end ("forward") and in backward ("backward").

    In one piece (loss.chunk_size=0 or a single chunk): the logits (p), their fp32 log-probs and gradient.
    Chunked, each chunk a checkpoint re-run in backward: autograd sums lm_head's weight gradient over the chunks
    (V x h in the compute dtype) out of place, and so the loss inputs' gradient (each chunk's slice backward is a
    whole [n, h] tensor). Forward: one chunk's logits, fp32 logits and log-probs. Backward, the larger of a chunk's
    CE backward (the weight-gradient sum so far, the log-probs, their gradient and the logits' gradient, fp32, and
    the inputs' gradient) and the adding of a chunk's weight gradient to the sum (sum, new and result: 3 x V x h,
    and the inputs' gradient) -- by then the chunk's autocast copy of lm_head's weight, which the static terms
    count, is freed. Measured with MemTracker (bench/planner_vs_memtracker.py). Fused (loss.fused):
    `fused_loss_moments`."""
    n = w.micro_batch * (w.seq_len - 1)
    p, V = w.act_bytes, m.vocab
    if not w.loss_chunked:
        return {"forward": n * V * (p + 4 + 4), "backward": n * V * (p + 4 + 4)}
    if w.fused_loss:
        return fused_loss_moments(m, w)
    rows = w.chunk_size
    weight_grad = V * m.hidden * p
    inputs_grad = n * m.hidden * w.residual_bytes
    autocast_copy = weight_grad if w.autocast else 0
    ce_backward = weight_grad + 3 * 4 * rows * V + inputs_grad
    accumulate = 3 * weight_grad - autocast_copy + inputs_grad
    return {"forward": rows * V * (p + 4 + 4), "backward": max(ce_backward, accumulate)}


def fused_loss_moments(m: ModelShape, w: Workload) -> dict[str, int]:
    """`loss_moments` of the fused loss (surgery/fused_loss.py), which holds the hidden rows' gradient (the size of
    the rows `constant_bytes` counts as loss inputs, which it replaces once the forward returns) and lm_head's
    weight gradient where it trains (not under LoRA), summed in the weight's dtype (fp32 masters under autocast),
    from its forward to its backward. Forward, beside them: the rows themselves and one chunk's logits, in the
    compute dtype and in fp32 (one tensor in fp32), the fp32 buffer then turned into their gradient, cast back, next
    to the chunk's hidden-row gradient before it is copied into the whole one, or under autocast a vocabulary slice's
    weight gradient in the compute dtype before it is added to the fp32 sum. Backward scales both in place (the
    weight's becomes its .grad, which the static terms count). Measured: tests/surgery/test_fused_loss.py."""
    rows, p, V = w.chunk_size, w.act_bytes, m.vocab
    weight_grad = V * m.hidden * (4 if w.autocast else p) if w.head_trains else 0
    inputs = w.micro_batch * (w.seq_len - 1) * m.hidden * w.residual_bytes
    cast = p if p < 4 else 0  # fp32 compute: .float() returns the logits themselves
    # the chunk's hidden-row gradient, or under autocast one vocabulary slice's weight gradient before it is added
    sliced = w.autocast and w.head_trains
    product = m.hidden * p * max(rows, min(V, vocab_slice_rows(rows)) if sliced else 0)
    chunk = max(rows * V * (4 + cast), rows * V * p + product)
    return {"forward": inputs + weight_grad + chunk, "backward": weight_grad}


def loss_transient_bytes(m: ModelShape, w: Workload) -> int:
    """Peak bytes lm_head + CE add to what the forward holds and to the static terms (`loss_moments`)."""
    return max(loss_moments(m, w).values())


@dataclass
class ActivationEstimate:
    """Planner's counterpart of meter.ActivationReport (holder attribution: a block counts what it saves)."""

    total_bytes: int  # device
    per_block: list[int]
    other_bytes: int
    offloaded_bytes: int
    recompute_flops: float  # extra forward FLOPs per micro-batch (attention core at the given attended fraction)
    recompute_pointwise_bytes: int = 0  # bytes the re-run pointwise ops move per micro-batch (memory-bound)
    offloaded_per_block: list[int] = field(default_factory=list)  # host bytes of each block (0: not offloaded)
    working: RecomputeKind = Recompute.BLOCK  # the recompute whose backward makes the most (block_working_bytes): BLOCK
    # if a block is checkpointed whole, by sub-module or in MLP tiles, else OPS if one is op by op, else NONE
    recomputed_blocks: int = 0  # blocks checkpointed whole or op by op: nothing of theirs is saved by autograd


def estimate_activations(
    m: ModelShape,
    w: Workload,
    specs: Sequence[MemorySpec],
    attended_fraction: float | Sequence[float] = 0.5,
    count_attention_core: bool = True,
) -> ActivationEstimate:
    """Bytes a forward under one MemorySpec per block (`memory_specs`) holds for backward, per block and in total."""
    # per block: its layer's share of seq_len^2 attended (layers whose masks differ, e.g. windowed ones)
    if isinstance(attended_fraction, (int, float)):
        shares = [float(attended_fraction)] * len(specs)
    else:
        shares = list(attended_fraction)
    if len(shares) != len(specs):  # pairs counted on another model (planning/specs.plan_specs counts per layer)
        raise ValueError(f"attended pairs of {len(shares)} layers for a model of {len(specs)} blocks")
    parts = {f: block_recompute_parts(m, w, f, count_attention_core) for f in set(shares)}
    ops = pointwise_bytes(m, w)
    per_block, offloaded, flops, pointwise = [], [], 0.0, 0
    for spec, share in zip(specs, shares, strict=True):
        dev, off = block_bytes(m, w, spec)
        per_block.append(dev)
        offloaded.append(off)
        tiled = spec.tiles_mlp(w.tokens)  # every tile re-runs gate_proj + up_proj and SwiGLU in backward
        flops += spec.recompute_flops(parts[share], tiled)
        # memory-bound: each re-run op's output is written once and read once by its consumer (2x its bytes)
        pointwise += 2 * sum(ops[name] for name in spec.recomputed_pointwise_ops(tiled))
    # Only a checkpoint around attention keeps the attention kwargs (the dense mask) alive in its closure.
    holds_mask = any(spec.recompute.wraps_attention for spec in specs)
    other = sum(constant_bytes(m, w, checkpointed=holds_mask).values())
    kinds = [Recompute.BLOCK if spec.tiles_mlp(w.tokens) else spec.recompute for spec in specs]
    working = max(kinds, key=lambda k: k.working_rank, default=Recompute.NONE)
    whole = sum(spec.recompute.whole_block for spec in specs)
    return ActivationEstimate(
        sum(per_block) + other, per_block, other, sum(offloaded), flops, pointwise, offloaded, working, whole
    )


def resolve_tiles(memory: MemoryConfig, m: ModelShape) -> MemoryConfig:
    """memory.tiled_mlp=auto as a number: ALST's hidden_size tokens per tile."""
    if memory.tiled_mlp != "auto":
        return memory
    return dataclasses.replace(memory, tiled_mlp=auto_tile_tokens(m.hidden))


def memory_specs(memory: MemoryConfig, m: ModelShape) -> tuple[MemorySpec, ...]:
    """A concrete memory.* (tiled_mlp=auto allowed) as the per-block MemorySpecs every cost reads: the one place
    the planner turns a memory config into specs."""
    return block_memory_specs(resolve_tiles(memory, m), m.layers)


# Not counted under CP: the whole-row block mask ContextParallel.shard builds per window before each micro-batch's
# forward (786,432 tokens: 0.56 GiB of block indices, 1.4 GiB at the peak of building, measured on CPU). It is
# freed before the forward, while no activations exist, so it stays under the step's peak; the per-rank CP masks
# kept through the step are ~75 MB per window at cp 8 (README, "Context parallelism").
def gathered_kv_bytes(m: ModelShape, x: PlanInputs) -> int:
    """Context parallelism: the gradients of one block's all-gathered K and V (the whole row's, before
    flex_cp_allgather's backward reduce-scatters them to this rank's share); 0 without CP. The gathered K and V
    themselves are in the block's inventory (`block_inventory`, Workload.cp)."""
    if x.cp <= 1:
        return 0
    return 2 * x.micro_batch * x.seq_len * m.kv_heads * m.head_dim * x.dtype_bytes
