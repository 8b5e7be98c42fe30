"""What the bytes model reads: the model's dimensions (ModelShape), one micro-batch (Workload), and everything a
plan depends on besides the model (PlanInputs, built from resolved specs by `planning/specs.plan_inputs`), among it
how many (query, key) pairs a row's attention mask allows (AttendedPairs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from flexengine.core.config import HardwareConfig
from flexengine.core.parallel_spec import ReduceEvery
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.family import Family, resolve_family


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
    # projections reading each sub-layer's normalised input (Family.attention/mlp.inputs): under autocast each
    # casts that input to bf16 on its own and keeps its copy for backward
    attention_inputs: int = 3  # q, k, v
    mlp_inputs: int = 2  # gate, up

    @property
    def embedding_params(self) -> int:
        """Input embedding plus lm_head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def norm_params(self) -> int:
        """Norm weights: two per block and the final norm (the 1-D parameters `precision.apply_precision` keeps)."""
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
        family = resolve_family(cfg)
        per_layer = h * (a * d + 2 * k * d) + a * d * h + 3 * h * f + 2 * h
        if getattr(cfg, "attention_bias", False):  # q, k, v and o
            per_layer += a * d + 2 * k * d + h
        elif family.input_biases:  # q, k and v only
            per_layer += a * d + 2 * k * d
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        embeddings = V * h * (1 if tied else 2)
        inputs = len(family.attention.inputs), len(family.mlp.inputs)
        return cls(h, a, k, d, f, L, V, L * per_layer + embeddings + h, tied, *inputs)

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
    backend: AttnBackend = AttnBackend.FLEX  # FLEX | VARLEN (CPU per-document SDPA) | DENSE (the CPU reference;
    # adds S^2 mask terms). HF's own SDPA keeps flex's O(S) tensors: planned as FLEX (`specs.plan_inputs`)
    chunk_size: int = 0  # loss.chunk_size
    mlp_tile: int = 0  # memory.tiled_mlp: tokens per MLP tile (0 = untiled)
    doc_len: int = 0  # dense backend: documents of this many tokens back to back (0 = one per row, the worst case)
    dense_chunk: int = 512  # dense backend: attn.dense_chunk, queries per SDPA call
    cp: int = 1  # context parallelism: seq_len is this rank's share of a row of cp x seq_len tokens, whose K and V
    # attention gathers whole (torch's flex CP path) and holds for its backward
    autocast: bool = False  # forward under autocast over fp32 weights (bf16_mixed on one device): the residual
    # stream stays fp32 and every projection casts its own input (PlanInputs.autocast)
    fused_loss: bool = False  # loss.fused: the chunks' gradients are computed in the loss's forward (no re-run)
    head_trains: bool = True  # lm_head's weight gets a gradient: full fine-tuning (LoRA freezes it; an adapted
    # lm_head is refused by loss.fused)

    @property
    def tokens(self) -> int:
        """T = B x S."""
        return self.micro_batch * self.seq_len

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the residual stream, the norms' outputs and the loss inputs: the fp32 masters'
        dtype under autocast (the embedding's output and every residual add stay fp32; apply_precision keeps them
        so under LoRA too), else the activation dtype."""
        return 4 if self.autocast else self.act_bytes

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
    def loss_chunked(self) -> bool:
        """Whether the loss really runs in more than one chunk (one chunk or fewer rows: in one piece)."""
        return 0 < self.chunk_size < self.micro_batch * (self.seq_len - 1)

    @property
    def mlp_tiled(self) -> bool:
        """Whether the MLP really runs in more than one tile (tiled_mlp_forward skips a single tile)."""
        return 0 < self.mlp_tile < self.tokens


NO_CORPUS = (
    "one document per row (no corpus given; plan.documents=N plan.doc_tokens=T, or plan.epochs with the job's data, "
    "gives the packed rows' own count)"
)


@dataclass(frozen=True)
class AttendedPairs:
    """How many (query, key) pairs a row's attention allows, per decoder layer, as a fraction of seq_len^2: the
    attention core's FLOPs and time follow it. The planner always hands per-layer fractions
    (`planning/specs.plan_specs`); `None` serves inputs built by hand: a causal half on every layer."""

    fractions: Optional[tuple[float, ...]] = None  # per layer: mean allowed pairs per row / seq_len^2; None = 1/2
    source: str = "a causal half on every layer (inputs built without specs)"  # where the count comes from (the
    # plan's JSON and table say it)

    def of_rank(self, cp: int) -> float | tuple[float, ...]:
        """The fraction of one rank's (seq_len / cp)^2 its queries attend: under context parallelism local queries
        see all seq_len keys, (S / cp)^2 x cp x the row's fraction (one number for every layer when unknown)."""
        if self.fractions is None:
            return 0.5 * cp
        return tuple(f * cp for f in self.fractions)

    def as_dict(self) -> dict:
        """JSON-ready: the source, and the mean fraction of seq_len^2 over the layers (0.5: causal)."""
        mean = 0.5 if self.fractions is None else sum(self.fractions) / len(self.fractions)
        per_layer = None if self.fractions is None else list(self.fractions)
        return {"source": self.source, "fraction_of_row_squared": mean, "per_layer": per_layer}


@dataclass
class PlanInputs:
    """Everything a plan depends on besides the model shape (bytes per parameter from the precision mode)."""

    seq_len: int
    micro_batch: int
    dtype_bytes: int  # activation bytes per element (and parameter bytes unless weight_bytes is given)
    hardware: HardwareConfig
    chunk_size: int = 0
    backend: AttnBackend = AttnBackend.FLEX  # as Workload.backend
    grad_accum: int = 1
    optimizer_state_bytes: Optional[float] = None  # bytes per AdamW state element (x2 states); None = param dtype
    trainable_fraction: float = 1.0  # LoRA-style: fraction of parameters with grads and optimizer state
    embedding_state_bytes: Optional[float] = None  # per input-embedding element when its optimizer states differ
    # from the rest (adamw_8bit keeps them in fp32: OptimizerSpec.embedding_state_bytes); None = like every parameter
    fsdp_param_bytes: Optional[int] = None  # bytes per element FSDP gathers weights in (bf16 under its mixed
    # precision on CUDA); None = dtype_bytes. Used only when hardware.world_size > 1.
    fsdp_reduce_bytes: int = 4  # bytes per gradient element FSDP reduce-scatters in (fp32 under bf16_mixed's policy,
    # bf16 for bf16-stored modes: PrecisionSpec.fsdp_dtypes)
    weight_bytes: Optional[float] = None  # bytes per stored parameter; None = dtype_bytes
    grad_bytes: Optional[float] = None  # bytes per gradient element; None = weight bytes
    compute_copy_bytes: float = 0.0  # per parameter: autocast's bf16 weight copies (bf16_mixed unless FSDP casts)
    frozen_weight_bytes: Optional[float] = None  # per frozen matrix element when trainable_fraction < 1 (LoRA's
    # base weights, stored in the compute dtype with no autocast copy: precision.apply_precision); None = weight bytes
    host_bytes_per_param: float = 0.0  # per trainable parameter in host memory (CPU-offloaded masters/states)
    host_scratch_bytes: float = 0.0  # per element of the largest trainable tensor: the host step's fp32 scratch
    precision: str = ""  # the precision mode these bytes come from (for reports)
    cp: int = 1  # context-parallel degree: each of cp ranks holds seq_len / cp tokens of every row (torchtitan's
    # layout: FSDP shards over all hardware.world_size ranks, cp of which share a row)
    reduce_every: ReduceEvery = ReduceEvery.WINDOW  # FSDP gradient reduce-scatter: WINDOW (once per step; every
    # block's unsharded gradient lives through the accumulation window) | MICRO_BATCH (each backward) | AUTO
    # (plan_memory weighs both)
    autocast: bool = False  # the forward runs under autocast over fp32 weights (PrecisionSpec.compute_context:
    # bf16_mixed unless FSDP2 casts): activations follow it (Workload.autocast)
    pairs: AttendedPairs = AttendedPairs()  # the attention core's share of seq_len^2 per layer, and its source
    compiled: bool = True  # train.compile: the blocks' pointwise ops are fused (eager ones cost their bytes twice
    # more: costs.eager_pointwise_s, priced where the device's speed is measured)
    fused_loss: bool = False  # loss.fused (Workload.fused_loss)


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
        autocast=x.autocast,
        fused_loss=x.fused_loss,
        head_trains=x.trainable_fraction >= 1.0,  # LoRA: only the adapters train
    )
