"""A bytes model of one training step, from the HF config alone (no weights are allocated), and the cheapest
memory policy that fits the card.

Activations per decoder block: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", eq. 2) count `sbh(34 + 5as/h)` bytes per layer for a 16-bit GPT block. Adapted to a LLaMA block
(RMSNorm, RoPE, GQA, SwiGLU, no dropout) with fused flash/flex attention, with T = micro_batch x seq_len tokens,
h hidden, a query heads, k kv heads, d head_dim, f intermediate, p bytes per activation element:

    per block = T x [ 2 x ((4 + 2p) h + 4)    two RMSNorms: fp32 input copy, normalised, scaled output, rsqrt
                    + p (2ad + 2kd)            q and k after RoPE, v, attention output
                    + 4a                       attention log-sum-exp (fp32)
                    + 4p f ]                   SwiGLU: gate, silu(gate), up, silu(gate) * up
              (+ T x p ad                      flex: o_proj's contiguous copy of the attention output)
              (+ B S^2 p                       dense backend only: SDPA's float copy of the boolean mask)

RoPE's products save only the shared cos/sin tables (they do not require grad). No [S, S] term: flash/flex
attention keeps O(S) per head, where the published formula's 5as/h term is the S^2 score/softmax/dropout.
Per batch, outside the blocks: rotary cos/sin (2 T d p), the final norm ((4 + p) T h), the loss inputs
(T h p + 16 T) and, unchunked, the fp32 log-probabilities (T V 4); the dense backend's [B, 1, S, S] bool mask
(held by checkpoint closures) once per batch. Validated against flexengine.surgery.memory.meter in tests/memory.

The step adds weights, grads, optimizer states (adamw_8bit: the input embedding's in fp32), backward's
workspace, offload buffers in flight, FSDP's unsharded buffers and the CUDA reserve: `evaluate` returns every
term by name and the plan prints them. Recompute costs FLOPs (at ASSUMED_MFU) plus the bytes its pointwise ops
move (at the memory bandwidth): SAC keeps every matmul but still re-runs norms, RoPE and SwiGLU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from flexengine.core.config import HardwareConfig, MemoryConfig
from flexengine.core.units import GiB
from flexengine.surgery.family import Family, resolve_family
from flexengine.surgery.memory.layers import select_layers
from flexengine.surgery.memory.tiled_mlp import auto_tile_tokens

# The constants below are not derived from our code path; each names its source and is printed with every plan
# (`assumptions` in the JSON, the last lines of the table).
# Turns FLOPs into seconds when weighing recompute against offload traffic. torchtitan (docs/performance.md)
# reports 56.8-58.2 % MFU for Llama 3 8B with FSDP2 + compile on 64 A100s; a single-GPU 7B run with long rows
# and a flex mask reaches less, so the planner assumes 0.4. Only ratios of times use it (recompute vs PCIe).
ASSUMED_MFU = 0.4
# CUDA context + caching-allocator headroom on a GPU: the context alone takes 0.5-0.8 GiB on the first CUDA
# call (PyTorch forum threads 73021 and 81330: 723 MiB and ~800 MiB), the rest absorbs fragmentation.
CUDA_RESERVE_BYTES = 1 * GiB
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
# FSDP reduce-scatters gradients in fp32 (parallel.apply_fsdp's MixedPrecisionPolicy reduce_dtype)
REDUCE_BYTES = 4
# parallel.reduce_every choices the search weighs (auto): once per accumulation window, or every micro-batch
REDUCE_CHOICES = ("window", "micro_batch")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a LLaMA-style decoder that the bytes model needs."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    params: int
    tied: bool = False  # lm_head shares the input embedding

    @property
    def embedding_params(self) -> int:
        """Input embedding plus lm_head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def norm_params(self) -> int:
        """Norm weights: two per block and the final norm (the 1-D parameters `precision.cast_frozen` keeps)."""
        return self.hidden * (2 * self.layers + 1)

    @property
    def largest_matrix(self) -> int:
        """Elements of the largest weight matrix (the embedding, unless the MLP or attention is wider)."""
        return max(self.vocab, self.intermediate, self.heads * self.head_dim) * self.hidden

    @property
    def block_params(self) -> int:
        """Parameters of one decoder block."""
        return (self.params - self.embedding_params - self.hidden) // self.layers

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelShape":
        """Read an HF config (LLaMA/Mistral/Qwen2-style names); parameters counted analytically."""
        h, a = cfg.hidden_size, cfg.num_attention_heads
        k = getattr(cfg, "num_key_value_heads", None) or a
        d = getattr(cfg, "head_dim", None) or h // a
        f, L, V = cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
        per_layer = h * (a * d + 2 * k * d) + a * d * h + 3 * h * f + 2 * h
        if getattr(cfg, "attention_bias", False):
            per_layer += a * d + 2 * k * d + h
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        embeddings = V * h * (1 if tied else 2)
        return cls(h, a, k, d, f, L, V, L * per_layer + embeddings + h, tied)

    def lora_params(self, r: int, target_modules: list[str], family: Family) -> int:
        """Adapter parameters of rank r on the targeted projections: r x (in + out) per adapted Linear."""
        h, f = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention, mlp = family.attention, family.mlp  # projection names in role order: q, k, v / gate, up
        shapes = {
            **dict(zip(attention.inputs, ((h, q), (h, kv), (h, kv)))),
            attention.output: (q, h),
            **dict.fromkeys(mlp.inputs, (h, f)),
            mlp.output: (f, h),
        }
        return self.layers * sum(r * sum(shapes[t]) for t in target_modules if t in shapes)


@dataclass(frozen=True)
class Workload:
    """One micro-batch: its shape, activation dtype and attention backend."""

    micro_batch: int
    seq_len: int
    act_bytes: int = 2  # bytes per activation element: 2 (bf16), 4 (fp32)
    backend: str = "flex"  # flex | varlen (CPU per-document SDPA) | dense (the CPU reference; adds S^2 mask terms)
    chunk_size: int = 0  # loss.chunk_size
    mlp_tile: int = 0  # memory.tiled_mlp: tokens per MLP tile (0 = untiled)
    doc_len: int = 0  # dense backend: documents of this many tokens back to back (0 = one per row, the worst case)
    dense_chunk: int = 512  # dense backend: attn.dense_chunk, queries per SDPA call
    cp: int = 1  # context parallelism: seq_len is this rank's share of a row of cp x seq_len tokens, whose K and V
    # attention gathers whole (torch's flex CP path) and holds for its backward

    @property
    def tokens(self) -> int:
        """T = B x S."""
        return self.micro_batch * self.seq_len

    @property
    def dense_mask_elements(self) -> int:
        """Mask elements of the dense backend's per-chunk SDPA calls: each chunk's queries x the keys from the
        earliest document start in it (exact for documents of doc_len tokens back to back)."""
        total = 0
        for q_start in range(0, self.seq_len, self.dense_chunk):
            q_end = min(q_start + self.dense_chunk, self.seq_len)
            kv_start = (q_start // self.doc_len) * self.doc_len if self.doc_len else 0
            total += (q_end - q_start) * (q_end - kv_start)
        return self.micro_batch * total

    @property
    def mlp_tiled(self) -> bool:
        """Whether the MLP really runs in more than one tile (tiled_mlp_forward skips a single tile)."""
        return 0 < self.mlp_tile < self.tokens


def block_inventory(m: ModelShape, w: Workload) -> dict[str, dict[str, int]]:
    """Bytes one block (policy none) holds for backward, by sub-layer and tensor (see the module formula)."""
    T, p, h = w.tokens, w.act_bytes, m.hidden
    ad, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim

    def norm() -> dict[str, int]:
        return {"input_fp32": 4 * T * h, "normalised": p * T * h, "scaled_output": p * T * h, "rsqrt": 4 * T}

    # flex saves its K and V inputs: under context parallelism the whole row's, all-gathered (cp x T tokens)
    attention = {
        "q_rope": p * T * ad,
        "k_rope": p * T * w.cp * kd,
        "v": p * T * w.cp * kd,
        "attn_out": p * T * ad,
        "logsumexp": 4 * T * m.heads,
    }
    if w.backend == "flex":
        attention["o_proj_input"] = p * T * ad  # CPU flash returns [B, S, H, D] already; flex's copy assumed
    elif w.backend == "dense":
        attention["float_mask"] = p * w.dense_mask_elements  # SDPA's float copy of each chunk's bool mask
        if w.seq_len > w.dense_chunk:  # the chunks' outputs are concatenated [B, H, S, D]: o_proj gets a copy
            attention["o_proj_input"] = p * T * ad
    # varlen: its output is already [B, S, H, D], so o_proj's input is a view of attn_out: nothing more
    mlp = {
        "gate": p * T * m.intermediate,
        "silu": p * T * m.intermediate,
        "up": p * T * m.intermediate,
        "down_input": p * T * m.intermediate,
    }
    return {"norm1": norm(), "attention": attention, "norm2": norm(), "mlp": mlp}


def sac_inventory(m: ModelShape, w: Workload) -> dict[str, int]:
    """Bytes one block holds under op-level SAC: its input plus every matmul and attention output."""
    T, p, h = w.tokens, w.act_bytes, m.hidden
    ad, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {
        "block_input": p * T * h,
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


def block_bytes(m: ModelShape, w: Workload, recompute: Optional[str], offload: bool) -> tuple[int, int]:
    """(device bytes, host bytes) one block holds. recompute: None | block | attention | mlp | ops."""
    inv = block_inventory(m, w)
    if w.mlp_tiled and recompute != "ops":
        # per-tile checkpoints keep only views of the MLP input (norm2's output, already counted). Under SAC the
        # tiles' matmul outputs still land in its cache: measured unchanged.
        inv["mlp"] = {}
    if recompute is None:
        held = sum(sum(part.values()) for part in inv.values())
    elif recompute == "block":
        held = w.act_bytes * w.tokens * m.hidden  # the checkpoint's input
    elif recompute == "ops":
        held = sum(sac_inventory(m, w).values())
    else:  # attention | mlp: that sub-layer keeps only its (already counted) normalised input
        held = sum(sum(part.values()) for name, part in inv.items() if name != recompute)
    return (0, held) if offload else (held, 0)


def block_working_bytes(m: ModelShape, w: Workload) -> int:
    """Bytes of one block's tensors re-materialised at once in backward (its recompute, or the activation
    gradients of its size): the whole inventory, whose MLP part also has two gradients of [tokens, intermediate]
    in flight (measured: ~6 such tensors at the MLP's backward peak) -- for one tile when the MLP is tiled."""
    inv = block_inventory(m, w)
    mlp = sum(inv.pop("mlp").values()) * 6 // 4
    tiled = mlp * min(w.mlp_tile, w.tokens) // w.tokens if w.mlp_tiled else mlp
    return sum(sum(part.values()) for part in inv.values()) + tiled


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


# Which pointwise ops each recompute granularity re-runs (a checkpoint around self_attn/mlp leaves the norms
# and residual adds outside; op-level SAC recomputes every pointwise op of the block).
_POINTWISE_RECOMPUTED = {
    "block": ("norm1", "rope", "norm2", "swiglu", "residual"),
    "ops": ("norm1", "rope", "norm2", "swiglu", "residual"),
    "attention": ("rope",),
    "mlp": ("swiglu",),
}


def recompute_pointwise_bytes_per_block(m: ModelShape, w: Workload, granularity: str) -> int:
    """Bytes moved by the pointwise ops one block re-runs in backward: each recomputed output is written once
    and read once by its consumer (2x its bytes). Memory-bound: time = bytes / memory bandwidth."""
    ops = pointwise_bytes(m, w)
    return 2 * sum(ops[name] for name in _POINTWISE_RECOMPUTED[granularity])


def recompute_flops_per_block(
    m: ModelShape, w: Workload, granularity: str, attended_fraction: float = 0.5, count_attention_core: bool = True
) -> float:
    """Extra forward FLOPs backward spends re-running one checkpointed block at `granularity`.

    Non-reentrant checkpointing stops recomputing once the last tensor backward needs exists, so the region's
    final projection (o_proj / down_proj, whose output nothing saves) is never re-run. ops (SAC) recomputes
    only pointwise ops: 0 matmul FLOPs. count_attention_core=False matches FlopCounterMode on CPU, which has no
    formula for the CPU flash-attention kernel."""
    f = block_forward_flops(m, w, attended_fraction)
    core = f["attention_core"] if count_attention_core else 0.0
    return {
        "block": f["qkv_proj"] + core + f["attn_out_proj"] + f["gate_up_proj"],
        "attention": f["qkv_proj"] + core,
        "mlp": f["gate_up_proj"],
        "ops": 0.0,
    }[granularity]


def constant_bytes(m: ModelShape, w: Workload, checkpointed: bool) -> dict[str, int]:
    """Bytes held once per micro-batch outside the blocks (saved for backward)."""
    T, p = w.tokens, w.act_bytes
    n = w.micro_batch * (w.seq_len - 1)  # next-token targets (all valid: the worst case)
    out = {
        "rotary_cos_sin": 2 * T * m.head_dim * p,
        "final_norm": (4 + p) * T * m.hidden + 4 * T,
        "loss_inputs": n * m.hidden * p + 16 * n,
    }  # hidden rows (lm_head's input), int64 row index
    # (index_select's backward) and int64 targets (cross-entropy's backward); the positions come from the loader
    if w.chunk_size <= 0 or n <= w.chunk_size:
        out["log_probs"] = 4 * n * m.vocab  # CE keeps fp32 log-softmax of all [tokens, vocab]
    if w.backend == "dense" and checkpointed:
        out["bool_mask"] = w.dense_mask_elements  # the chunks' bool masks, kept alive by the checkpoint closures
    return out


def loss_transient_bytes(m: ModelShape, w: Workload) -> int:
    """Peak extra bytes of lm_head + CE: logits (p), fp32 log-probs and their gradient, for one chunk."""
    n = w.micro_batch * (w.seq_len - 1)
    rows = n if w.chunk_size <= 0 else min(n, w.chunk_size)
    return rows * m.vocab * (w.act_bytes + 4 + 4)


@dataclass
class ActivationEstimate:
    """Planner's counterpart of meter.ActivationReport (holder attribution: a block counts what it saves)."""

    total_bytes: int  # device
    per_block: list[int]
    other_bytes: int
    offloaded_bytes: int
    recompute_flops: float  # extra forward FLOPs per micro-batch (attention core at the given attended fraction)
    recompute_pointwise_bytes: int = 0  # bytes the re-run pointwise ops move per micro-batch (memory-bound)


def estimate_activations(
    m: ModelShape, w: Workload, memory: MemoryConfig, attended_fraction: float = 0.5, count_attention_core: bool = True
) -> ActivationEstimate:
    """Bytes a forward under `memory` (a concrete policy) holds for backward, per block and in total."""
    w = dataclasses.replace(w, mlp_tile=resolve_tiles(memory, m).tiled_mlp)
    chosen = set(select_layers(memory.layers, m.layers)) if memory.policy != "none" else set()
    recompute = memory.policy in ("full", "selective")
    offload = memory.policy == "offload" or memory.offload
    per_block, host, flops, pointwise = [], 0, 0.0, 0
    for i in range(m.layers):
        sel = i in chosen
        gran = memory.granularity if (sel and recompute) else None
        dev, off = block_bytes(m, w, gran, sel and offload)
        per_block.append(dev)
        host += off
        if gran is not None:
            flops += recompute_flops_per_block(m, w, gran, attended_fraction, count_attention_core)
            pointwise += recompute_pointwise_bytes_per_block(m, w, gran)
        if w.mlp_tiled:  # every tile re-runs gate_proj + up_proj and SwiGLU in backward (FlopCounterMode-checked)
            flops += recompute_flops_per_block(m, w, "mlp", attended_fraction, count_attention_core)
            pointwise += recompute_pointwise_bytes_per_block(m, w, "mlp")
    # Only a checkpoint around attention keeps the attention kwargs (the dense mask) alive in its closure.
    holds_mask = bool(chosen) and recompute and memory.granularity != "mlp"
    other = sum(constant_bytes(m, w, checkpointed=holds_mask).values())
    return ActivationEstimate(sum(per_block) + other, per_block, other, host, flops, pointwise)


def resolve_tiles(memory: MemoryConfig, m: ModelShape) -> MemoryConfig:
    """memory.tiled_mlp=auto as a number: ALST's hidden_size tokens per tile."""
    if memory.tiled_mlp != "auto":
        return memory
    return dataclasses.replace(memory, tiled_mlp=auto_tile_tokens(m.hidden))


# -- the step budget and the choice -----------------------------------------------------------------------

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


GRANULARITIES = ("block", "attention", "mlp", "ops")  # what a checkpointed block recomputes
FALLBACK_PEAK_TFLOPS = 100.0  # only to weigh recompute against PCIe time when the device's peak is unknown
# adamw_cpu_offload's host step per trainable parameter (flexengine.loop.host_adamw: bf16 slot -> fp32 scratch, fused
# AdamW, fp32 master -> bf16 slot, the copies): measured on this project's CPU, 1.19 ns of one core per parameter
# (bench/results/host_optimizer.json: 207M parameters, CPU seconds on one thread of a shared 2-core VM; the replaced
# foreach step took 5.65). For an A100's host this is an estimate, the same figure: the step is memory-bound and
# multi-threaded, and a DGX host gives each GPU more cores and memory channels than this VM has.
HOST_STEP_NS_PER_PARAM = 1.2


def spread_layers(k: int, n_layers: int) -> str:
    """memory.layers for k checkpointed blocks of n spread evenly (select_layers' spread_<k>)."""
    return "all" if k >= n_layers else f"spread_{k}"


def describe(memory: MemoryConfig, n_layers: int) -> str:
    """A short label of a concrete policy: 'none', 'block k=16/32', 'ops k=32/32 + offload', 'offload k=8/32'."""
    tiled = " + tiled MLP" if memory.tiled_mlp else ""
    if memory.policy == "none":
        return "none" + tiled
    k = len(select_layers(memory.layers, n_layers))
    if memory.policy == "offload":
        return f"offload k={k}/{n_layers}" + tiled
    return f"{memory.granularity} k={k}/{n_layers}" + (" + offload" if memory.offload else "") + tiled


def search_space(n_layers: int, given: Optional[MemoryConfig] = None) -> list[MemoryConfig]:
    """Concrete policies the planner weighs: k = 0..L checkpointed blocks spread evenly x granularity x offload
    (checkpoint inputs in host memory), and plain activation offload of k blocks. memory.* fields the user
    gave under memory=auto (layers, granularity, offload) fix those dimensions. memory.tiled_mlp=auto adds the
    MLP over token tiles to whole-block checkpointing (long rows), and to an explicit policy (untiled if that
    fits: the ranking prefers it)."""
    given = given or MemoryConfig(policy="auto", tiled_mlp="auto")
    if given.policy != "auto":  # an explicit policy is evaluated as given
        if given.tiled_mlp == "auto":
            return [dataclasses.replace(given, tiled_mlp=0), given]
        return [given]
    ks = [len(select_layers(given.layers, n_layers))] if given.layers is not None else range(n_layers + 1)
    grans = [given.granularity] if given.granularity is not None else GRANULARITIES
    offloads = [given.offload] if given.offload is not None else [False, True]
    out = [MemoryConfig(policy="none")] if (given.offload is not True and given.layers is None) else []
    for k in ks:
        if k == 0:
            continue
        layers = given.layers if given.layers is not None else spread_layers(k, n_layers)
        for gran in grans:
            policy = "full" if gran == "block" else "selective"
            out += [MemoryConfig(policy=policy, layers=layers, granularity=gran, offload=off) for off in offloads]
        if True in offloads and given.granularity is None:
            out.append(MemoryConfig(policy="offload", layers=layers))
    tiles = given.tiled_mlp
    if tiles == "auto":  # tiling pays off only where the MLP's whole-row tensors still live: whole-block recompute
        out += [
            dataclasses.replace(mem, tiled_mlp="auto") for mem in out if mem.policy == "full" and mem.layers == "all"
        ]
    elif tiles:
        out = [
            dataclasses.replace(mem, tiled_mlp=tiles)
            for mem in out
            if not (mem.policy == "selective" and mem.granularity == "mlp")
        ]
    return out


@dataclass
class PlanInputs:
    """Everything a plan depends on besides the model shape (bytes per parameter from the precision mode)."""

    seq_len: int
    micro_batch: int
    dtype_bytes: int  # activation bytes per element (and parameter bytes unless weight_bytes is given)
    hardware: HardwareConfig
    chunk_size: int = 0
    backend: str = "flex"
    grad_accum: int = 1
    optimizer_state_bytes: Optional[float] = None  # bytes per AdamW state element (x2 states); None = param dtype
    trainable_fraction: float = 1.0  # LoRA-style: fraction of parameters with grads and optimizer state
    embedding_state_bytes: Optional[float] = None  # per input-embedding element when its optimizer states differ
    # from the rest (adamw_8bit keeps them in fp32: precision.EMBEDDING_STATE_BYTES); None = like every parameter
    fsdp_param_bytes: Optional[int] = None  # bytes per element FSDP gathers weights in (bf16 under its mixed
    # precision on CUDA); None = dtype_bytes. Used only when hardware.world_size > 1.
    weight_bytes: Optional[float] = None  # bytes per stored parameter; None = dtype_bytes
    grad_bytes: Optional[float] = None  # bytes per gradient element; None = weight bytes
    compute_copy_bytes: float = 0.0  # per parameter: autocast's low-precision weight copies (bf16_mixed)
    frozen_weight_bytes: Optional[float] = None  # per frozen matrix element when trainable_fraction < 1 (LoRA's
    # base weights, stored in the compute dtype with no autocast copy: precision.cast_frozen); None = weight bytes
    host_bytes_per_param: float = 0.0  # per trainable parameter in host memory (CPU-offloaded masters/states)
    host_scratch_bytes: float = 0.0  # per element of the largest trainable tensor: the host step's fp32 scratch
    precision: str = ""  # the precision mode these bytes come from (for reports)
    cp: int = 1  # context-parallel degree: each of cp ranks holds seq_len / cp tokens of every row (torchtitan's
    # layout: FSDP shards over all hardware.world_size ranks, cp of which share a row)
    reduce_every: str = "window"  # FSDP gradient reduce-scatter: window (once per step; every block's unsharded
    # gradient lives through the accumulation window) | micro_batch (each backward) | auto (plan_memory weighs both)


def rank_workload(x: PlanInputs, mlp_tile=0, micro_batch: Optional[int] = None) -> Workload:
    """One rank's micro-batch: under context parallelism its seq_len / cp tokens of every row (the whole row's
    K and V gathered in attention)."""
    return Workload(
        x.micro_batch if micro_batch is None else micro_batch,
        -(-x.seq_len // x.cp),
        x.dtype_bytes,
        x.backend,
        x.chunk_size,
        mlp_tile,
        cp=x.cp,
    )


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


def _static_bytes(m: ModelShape, x: PlanInputs) -> dict[str, int]:
    world = max(1, x.hardware.world_size)  # FSDP shards weights, grads and optimizer states
    trainable = m.params * x.trainable_fraction
    weight = x.weight_bytes if x.weight_bytes is not None else x.dtype_bytes
    grad = x.grad_bytes if x.grad_bytes is not None else weight
    state = x.optimizer_state_bytes if x.optimizer_state_bytes is not None else weight
    copied = m.params  # parameters autocast keeps a bf16 copy of
    if x.frozen_weight_bytes is not None and x.trainable_fraction < 1.0:
        # LoRA: base matrices frozen in the compute dtype; norm weights and adapters in the master dtype
        frozen = m.params - m.norm_params
        weights = frozen * x.frozen_weight_bytes + (m.norm_params + trainable) * weight
        copied = trainable
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


def fsdp_bytes(m: ModelShape, x: PlanInputs) -> dict[str, int]:
    """Unsharded FSDP2 buffers (parallel.apply_fsdp), 0 for one process.

    Each block is fully_shard-ed on its own: its weights are all-gathered for forward and again for backward,
    and FSDP2 prefetches the next block's all-gather while one computes (2 blocks gathered). The root (input
    embedding, final norm, lm_head) stays gathered through forward and backward. Gradients are unsharded per
    block until its reduce-scatter, in the fp32 reduce dtype; the root's (lm_head's from the start of backward)
    until the root's reduce-scatter at its end, in the compute dtype. With grad_accum > 1 and reduce_every=window
    the trainer reduces once per accumulation window (`parallel.gradient_sync`: set_requires_gradient_sync(False)
    until the last micro-batch), so every block's unsharded gradient lives through the window; reduce_every=
    micro_batch reduce-scatters in every backward and holds one block's at a time."""
    world = max(1, x.hardware.world_size)
    if world == 1:
        return {}
    gathered = x.fsdp_param_bytes if x.fsdp_param_bytes is not None else x.dtype_bytes
    root = m.embedding_params + m.hidden
    root_trainable = root if x.trainable_fraction >= 1.0 else 0  # LoRA: embeddings and lm_head are frozen
    unsharded_blocks = m.layers if x.grad_accum > 1 and x.reduce_every == "window" else 1
    return {
        "fsdp_gathered_weights_bytes": (2 * m.block_params + root) * gathered,
        "fsdp_unsharded_grads_bytes": int(
            unsharded_blocks * m.block_params * x.trainable_fraction * REDUCE_BYTES + root_trainable * gathered
        ),
    }


def eager_pointwise_s(m: ModelShape, x: PlanInputs) -> float:
    """Seconds per optimizer step that unfused pointwise ops add to eager (uncompiled) blocks: their bytes at the
    device's memory bandwidth (see EAGER_POINTWISE_PASSES)."""
    per_block = 2 * sum(pointwise_bytes(m, rank_workload(x)).values())
    return x.grad_accum * m.layers * per_block * EAGER_POINTWISE_PASSES / (hbm_gb_s(x.hardware) * 1e9)


def interconnect_gb_s(hardware: HardwareConfig) -> float:
    """GPU<->GPU bandwidth for collectives: hardware.interconnect_gb_s, else INTERCONNECT_GB_S by name, else PCIe."""
    if hardware.interconnect_gb_s:
        return hardware.interconnect_gb_s
    name = (hardware.name or "").lower()
    return next((v for key, v in INTERCONNECT_GB_S.items() if key in name), hardware.pcie_gb_s)


def reduce_scatter_traffic(m: ModelShape, x: PlanInputs) -> tuple[int, float]:
    """(bytes each rank sends, seconds) of one step's gradient reduce-scatters: a ring reduce-scatter of the
    trainable fp32 gradients sends (world - 1) / world of them per rank, once per window or once per micro-batch
    (reduce_every). (0, 0.0) for one process."""
    world = max(1, x.hardware.world_size)
    if world == 1:
        return 0, 0.0
    reduces = x.grad_accum if x.reduce_every == "micro_batch" else 1
    sent = int(reduces * m.params * x.trainable_fraction * REDUCE_BYTES * (world - 1) / world)
    return sent, sent / (interconnect_gb_s(x.hardware) * 1e9)


def hbm_gb_s(hardware: HardwareConfig) -> float:
    """Memory bandwidth of the target (HBM_GB_S by hardware.name, else DEFAULT_HBM_GB_S)."""
    name = (hardware.name or "").lower() if hardware.device != "cpu" else "cpu"
    return next((v for key, v in HBM_GB_S.items() if key in name), DEFAULT_HBM_GB_S)


def assumptions(hardware: HardwareConfig) -> dict[str, float]:
    """The constants a plan rests on (sources in the comments above their definitions)."""
    return {
        "assumed_mfu": ASSUMED_MFU,
        "cuda_reserve_bytes": CUDA_RESERVE_BYTES if hardware.device != "cpu" else 0,
        "memory_gb_s": hbm_gb_s(hardware),
        "pcie_gb_s": hardware.pcie_gb_s,
        "peak_tflops": hardware.peak_tflops,
    }


def evaluate(m: ModelShape, x: PlanInputs, memory: MemoryConfig) -> dict:
    """Device bytes (by term), host bytes, fit and estimated optimizer-step time of one concrete policy."""
    memory = resolve_tiles(memory, m)
    if x.reduce_every == "auto":  # one evaluation is one concrete plan; plan_memory weighs both reductions
        x = dataclasses.replace(x, reduce_every="window")
    # Under CP every per-token tensor is this rank's seq_len / cp tokens; attention reads all keys (gathered K/V).
    w = rank_workload(x, memory.tiled_mlp)
    # A causal row attends half its keys; local queries see all seq_len keys: S^2 / cp, i.e. (S / cp)^2 x cp.
    attended = 0.5 * x.cp
    act = estimate_activations(m, w, memory, attended_fraction=attended)
    static = _static_bytes(m, x)
    on_gpu = x.hardware.device != "cpu"
    # Backward re-materialises one block at a time (recompute, or activation grads of its size), plus the loss.
    backward = max(block_working_bytes(m, w) + gathered_kv_bytes(m, x), loss_transient_bytes(m, w))
    offload_resident = 2 * max(act.offloaded_bytes // max(1, m.layers), 0)  # in flight + prefetched block
    terms = {
        **static,
        "activation_bytes": act.total_bytes,
        "backward_workspace_bytes": backward,
        "offload_in_flight_bytes": offload_resident,
        "cuda_reserve_bytes": CUDA_RESERVE_BYTES if on_gpu else 0,
        **fsdp_bytes(m, x),
    }
    total = sum(terms.values())
    host_state = host_optimizer_bytes(m, x)  # masters/states a CPU optimizer keeps
    host = host_state + act.offloaded_bytes
    budget = int(x.hardware.memory_gb * GiB)
    # hardware.host_memory_gb is already this rank's share (flexengine.core.hardware divides by the node's ranks)
    host_budget = int((x.hardware.host_memory_gb or 0) * GiB) or None  # None: unchecked (library use)
    # On a CPU "device" the host memory is the device memory: one pool.
    fits = (total <= budget and (host_budget is None or host <= host_budget)) if on_gpu else total + host <= budget
    blocks_flops = m.layers * sum(block_forward_flops(m, w, attended).values())
    step_flops = 3 * (blocks_flops + 2 * w.tokens * m.hidden * m.vocab)  # forward + 2x backward
    peak = x.hardware.peak_tflops or FALLBACK_PEAK_TFLOPS
    compute_s = step_flops / (peak * 1e12 * ASSUMED_MFU)
    traffic = act.offloaded_bytes / (x.hardware.pcie_gb_s * 1e9)  # one way, seconds
    exposed_s = max(0.0, traffic - compute_s / 3) + max(0.0, traffic - 2 * compute_s / 3)  # D2H || fwd, H2D || bwd
    recompute_fraction = act.recompute_flops / step_flops if step_flops else 0.0  # extra FLOPs / step FLOPs
    # Recomputed pointwise ops are memory-bound: their time is bytes / bandwidth, not FLOPs (SAC's whole cost).
    pointwise_s = act.recompute_pointwise_bytes / (hbm_gb_s(x.hardware) * 1e9)
    recompute_s = recompute_fraction * compute_s + pointwise_s
    optimizer_s, host_pcie_bytes = host_optimizer_seconds(m, x, compute_s)
    # FSDP2 reduce-scatters each block's gradient while the blocks before it run backward: only what the
    # backward (2/3 of a micro-batch's compute) cannot cover is exposed, per reduction
    reduce_bytes, reduce_s = reduce_scatter_traffic(m, x)
    reduces = x.grad_accum if x.reduce_every == "micro_batch" else 1
    reduce_exposed_s = reduces * max(0.0, reduce_s / reduces - 2 * compute_s / 3) if reduce_bytes else 0.0
    step_s = x.grad_accum * (compute_s + recompute_s + exposed_s) + optimizer_s + reduce_exposed_s
    return {
        "memory": dataclasses.asdict(memory),
        "activation_bytes": act.total_bytes,
        "activation_bytes_per_block": act.per_block,
        "offloaded_bytes": act.offloaded_bytes,
        "workspace_bytes": backward + offload_resident + terms["cuda_reserve_bytes"],
        "total_bytes": total,
        "budget_bytes": budget,
        "host_bytes": host,
        "host_budget_bytes": host_budget or 0,
        "offload_pinned_bound_bytes": pinned_bound_bytes(host_budget, host_state),
        "fits": fits,
        "terms": terms,
        "recompute_flops_fraction": recompute_fraction,
        "recompute_pointwise_s": pointwise_s,
        "offload_bytes_per_step": 2 * act.offloaded_bytes * x.grad_accum,
        "offload_exposed_s": exposed_s,
        "optimizer_s": optimizer_s,
        "host_optimizer_pcie_bytes_per_step": host_pcie_bytes,
        "reduce_every": x.reduce_every,
        "eager_pointwise_s": eager_pointwise_s(m, x),
        "reduce_scatter_bytes_per_step": reduce_bytes,
        "reduce_scatter_s": reduce_s,
        "reduce_exposed_s": reduce_exposed_s,
        "step_s": step_s,
        "cost": (recompute_s + exposed_s) / max(compute_s, 1e-12),
        **static,
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
        if not (mem.policy == "selective" and mem.granularity == "mlp")
    ]


def micro_batch_choices(micro_batch: int, grad_accum: int) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) pairs up to the given micro_batch that keep the rows per optimizer step."""
    rows = micro_batch * grad_accum
    return [(b, rows // b) for b in range(micro_batch, 0, -1) if rows % b == 0]


def _with_reduce_choices(shapes: list[tuple[int, int]], x: PlanInputs) -> list[tuple[int, int, str]]:
    """(micro_batch, grad_accum, reduce_every) to evaluate: both reductions under reduce_every=auto where they
    differ (FSDP over several ranks with accumulation), else the given one (auto: window)."""
    out = []
    for b, accum in shapes:
        if x.reduce_every != "auto":
            choices: tuple = (x.reduce_every,)
        else:
            choices = REDUCE_CHOICES if accum > 1 and x.hardware.world_size > 1 else ("window",)
        out += [(b, accum, r) for r in choices]
    return out


def _rank(row: dict) -> tuple:
    # Cheapest estimated step first; ties (e.g. fully overlapped offload vs none) go to no offload, fewer
    # checkpointed blocks, the larger micro-batch, the coarser granularity and one reduction per window.
    return (
        round(row["step_s"], 6),
        row["uses_offload"],
        bool(row["memory"]["tiled_mlp"]),
        row["k"],
        -row["micro_batch"],
        GRANULARITIES.index(row["memory"]["granularity"]),
        row["reduce_every"] != "window",
    )


def pinned_bound_bytes(host_budget: Optional[int], host_state: int) -> Optional[int]:
    """Pinned host bytes activation offload may hold on this rank: the rank's host budget less the optimizer
    state kept on the host (the planner's other host term); None when no budget is known (library use)."""
    return None if host_budget is None else max(0, host_budget - host_state)


def plan_memory(
    hf_config, x: PlanInputs, given: Optional[MemoryConfig] = None, search_micro_batch: bool = False
) -> dict:
    """Every candidate policy's bytes and step time, the cheapest that fits, and what to change if none does.

    given: memory=auto's user-set fields (layers/granularity/offload) that the search must keep.
    search_micro_batch: also try smaller micro-batches (more accumulation, same rows per optimizer step)."""
    m = ModelShape.from_hf_config(hf_config)
    space = search_space(m.layers, given)
    if x.hardware.device == "cpu":  # offloading to host memory saves nothing when the device is the host
        space = [mem for mem in space if not _offloads(mem)] or space
    shapes = micro_batch_choices(x.micro_batch, x.grad_accum) if search_micro_batch else [(x.micro_batch, x.grad_accum)]
    rows = []
    for b, accum, reduce_every in _with_reduce_choices(shapes, x):
        xb = dataclasses.replace(x, micro_batch=b, grad_accum=accum, reduce_every=reduce_every)
        for mem in space:
            row = evaluate(m, xb, mem)
            per_micro_batch = " reduce/mb" if reduce_every == "micro_batch" and accum > 1 else ""
            rows.append(
                {
                    "label": describe(mem, m.layers) + ("" if b == x.micro_batch else f" mb={b}") + per_micro_batch,
                    "micro_batch": b,
                    "grad_accum": accum,
                    "k": 0 if mem.policy == "none" else len(select_layers(mem.layers, m.layers)),
                    "uses_offload": _offloads(mem),
                    **row,
                }
            )  # row["memory"]: tiles resolved
    fitting = [r for r in rows if r["fits"]]
    best = min(fitting, key=_rank) if fitting else min(rows, key=lambda r: r["total_bytes"] + r["host_bytes"])
    w = rank_workload(x, micro_batch=best["micro_batch"])
    per_block = {r["label"]: r.pop("activation_bytes_per_block") for r in rows}
    plan = {
        "hf_config": hf_config.to_dict(),
        "seq_len": x.seq_len,
        "micro_batch": best["micro_batch"],
        "grad_accum": best["grad_accum"],
        "reduce_every": best["reduce_every"],
        "precision": x.precision,
        "dtype": {2: "bfloat16", 4: "float32"}.get(x.dtype_bytes, f"{x.dtype_bytes} bytes"),
        **{
            key: best[key]
            for key in (
                "weights_bytes",
                "grads_bytes",
                "optimizer_bytes",
                "activation_bytes",
                "workspace_bytes",
                "total_bytes",
                "terms",
                "budget_bytes",
                "host_bytes",
                "host_budget_bytes",
                "offload_pinned_bound_bytes",
                "fits",
                "memory",
                "step_s",
                "optimizer_s",
                "recompute_flops_fraction",
                "recompute_pointwise_s",
                "offload_bytes_per_step",
                "reduce_scatter_bytes_per_step",
                "eager_pointwise_s",
                "reduce_scatter_s",
                "reduce_exposed_s",
            )
        },
        "assumptions": {
            **assumptions(x.hardware),
            "host_step_ns_per_param": HOST_STEP_NS_PER_PARAM,
            "interconnect_gb_s": interconnect_gb_s(x.hardware),
        },
        "activation_bytes_per_block": {label: per_block[label] for label in {rows[0]["label"], best["label"]}},
        "logits_bytes": sum(v for k, v in constant_bytes(m, w, False).items() if k == "log_probs")
        + loss_transient_bytes(m, w),
        "policy": best["label"],
        "pcie_seconds_per_step": best["offload_bytes_per_step"] / (x.hardware.pcie_gb_s * 1e9),
        "candidates": rows,
        "suggestions": [] if fitting else suggestions(m, x),
    }
    return plan


def k_table(plan: dict) -> list[dict]:
    """The chosen family (granularity, offload, micro_batch) at every k: the "how many layers?" answer."""
    best = plan["memory"]
    family = [
        r
        for r in plan["candidates"]
        if r["micro_batch"] == plan["micro_batch"]
        and r["reduce_every"] == plan["reduce_every"]
        and (
            r["k"] == 0
            or (
                r["memory"]["policy"] == best["policy"]
                and r["memory"]["granularity"] == best["granularity"]
                and r["memory"]["offload"] == best["offload"]
            )
        )
    ]
    if best["policy"] == "none":  # nothing needed: show what whole-block checkpointing would cost
        family = [
            r
            for r in plan["candidates"]
            if r["micro_batch"] == plan["micro_batch"]
            and r["reduce_every"] == plan["reduce_every"]
            and (r["k"] == 0 or (r["memory"]["policy"] == "full" and not r["memory"]["offload"]))
        ]
    return sorted(family, key=lambda r: r["k"])


def _offloads(memory: MemoryConfig) -> bool:
    return memory.policy == "offload" or bool(memory.offload)


def _fits(m: ModelShape, x: PlanInputs) -> bool:
    reductions = REDUCE_CHOICES if x.reduce_every == "auto" else (x.reduce_every,)
    for mem in (MemoryConfig(policy="full"), MemoryConfig(policy="full", offload=True)):
        for reduce_every in reductions:
            if evaluate(m, dataclasses.replace(x, reduce_every=reduce_every), mem)["fits"]:
                return True
    return False


def suggestions(m: ModelShape, x: PlanInputs) -> list[str]:
    """What would fit when nothing does: shorter rows, LoRA, 8-bit optimizer states, more GPUs."""
    out = []
    seq = x.seq_len
    while seq > 128 and not _fits(m, dataclasses.replace(x, seq_len=seq)):
        seq //= 2
    if seq < x.seq_len and _fits(m, dataclasses.replace(x, seq_len=seq)):
        out.append(f"data.seq_len={seq} fits (at most; try values between {seq} and {x.seq_len})")
    if x.micro_batch > 1 and _fits(m, dataclasses.replace(x, micro_batch=1)):
        out.append(f"train.micro_batch=1 train.grad_accum={x.micro_batch * x.grad_accum} fits (same rows per step)")
    if x.chunk_size <= 0 and _fits(m, dataclasses.replace(x, chunk_size=1024)):
        out.append("loss.chunk_size=1024 fits (chunked cross-entropy)")
    # LoRA's frozen base is stored in the compute dtype (precision.cast_frozen)
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


def plan_inputs(job, hardware: HardwareConfig, spec, on_cuda: Optional[bool] = None) -> PlanInputs:
    """PlanInputs of a JobConfig on concrete hardware under a PrecisionSpec (attention backend as training
    resolves it on that device)."""
    if on_cuda is None:
        on_cuda = hardware.device == "cuda"
    import torch

    from flexengine.surgery.attention.spec import AttnBackend, resolve_backend

    # HF's fused SDPA keeps the same O(S) tensors as flex; only the dense reference adds S^2 mask terms
    resolved = resolve_backend(job.attn.backend, torch.device("cuda" if on_cuda else "cpu"))
    backend = {AttnBackend.DENSE: "dense", AttnBackend.VARLEN: "varlen"}.get(resolved, "flex")
    trainable = 1.0
    if job.model.lora.r > 0:  # only adapters have grads and optimizer states
        from flexengine.surgery.model import build_hf_config

        hf_config = build_hf_config(job.model)
        shape, family = ModelShape.from_hf_config(hf_config), resolve_family(hf_config)
        targets = family.lora_targets_of(job.model.lora.target_modules)
        trainable = shape.lora_params(job.model.lora.r, targets, family) / shape.params
    from flexengine.surgery.precision import EMBEDDING_STATE_BYTES

    per_param = spec.bytes_per_param()
    return PlanInputs(
        seq_len=job.data.seq_len,
        micro_batch=job.train.micro_batch,
        dtype_bytes=spec.act_bytes,
        hardware=hardware,
        chunk_size=job.loss.chunk_size,
        backend=backend,
        grad_accum=job.train.grad_accum,
        optimizer_state_bytes=per_param["optimizer"] / 2,
        trainable_fraction=trainable,
        weight_bytes=per_param["weights"],
        grad_bytes=per_param["grads"],
        compute_copy_bytes=per_param["compute_copy"],
        frozen_weight_bytes=per_param["frozen_weights"] if job.model.lora.r > 0 else None,
        host_bytes_per_param=per_param["host"],
        host_scratch_bytes=per_param["host_scratch"],
        embedding_state_bytes=EMBEDDING_STATE_BYTES if spec.optimizer == "adamw_8bit" else None,
        # FSDP2 gathers weights in the compute dtype under its mixed precision (CUDA only)
        fsdp_param_bytes=spec.act_bytes if on_cuda else int(per_param["weights"]),
        precision=spec.name,
        cp=job.parallel.cp,
        # DDP keeps full gradients either way: reducing per micro-batch would only add traffic
        reduce_every="window"
        if job.parallel.strategy == "ddp" and job.parallel.reduce_every == "auto"
        else job.parallel.reduce_every,
    )
