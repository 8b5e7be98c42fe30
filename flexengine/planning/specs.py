"""What a plan reads besides the model and the precision mode, resolved once: `PlanSpecs` (the resolved
AttentionSpec and ParallelSpec, the row shape, LoRA's trainable share, the attended-pair count), and `plan_inputs`,
which turns them and a PrecisionSpec into the PlanInputs every cost reads.

`fit.plan_specs` is the one place a JobConfig becomes these specs; flexengine/resolve.py resolves the AttentionSpec
once and hands it in, and with a known corpus the pair count of its packed rows (`packed_pairs`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from flexengine.core.config import CP_BLOCK_SIZE, AttnConfig, HardwareConfig
from flexengine.core.parallel_spec import ParallelSpec, Strategy
from flexengine.planning.shapes import NO_CORPUS, AttendedPairs, PlanInputs
from flexengine.surgery.attention.mask_mode import MaskMode
from flexengine.surgery.attention.masks import Causal
from flexengine.surgery.attention.spec import AttentionSpec, AttnBackend, resolve_attention_spec
from flexengine.surgery.precision import PrecisionSpec
from flexengine.surgery.rope import context_limits


@dataclass(frozen=True)
class PlanSpecs:
    """A job's plan-relevant choices, resolved (`plan_specs`); the precision mode is the search's (fit.py)."""

    seq_len: int
    micro_batch: int
    grad_accum: int
    chunk_size: int  # loss.chunk_size
    attention: AttentionSpec
    parallel: ParallelSpec
    lora_fraction: Optional[float] = None  # LoRA: the adapters' share of the parameters; None = full fine-tune
    pairs: AttendedPairs = field(default_factory=AttendedPairs)
    compiled: bool = False  # train.compile
    fused_loss: bool = False  # loss.fused


def planned_attention(attn: AttnConfig, hf_config, hardware: HardwareConfig) -> AttentionSpec:
    """attn.* resolved as training resolves it on `hardware`'s device type (a plan runs on another machine)."""
    import torch

    return resolve_attention_spec(attn, hf_config, device=torch.device("cuda" if hardware.on_cuda else "cpu"))


def whole_row_pairs(attention: AttentionSpec, seq_len: int) -> AttendedPairs:
    """Per layer, the pairs its mask allows over one document filling the whole row, as a fraction of seq_len^2:
    the count when the corpus is unknown (a window charges its band, not a causal half)."""
    fractions = tuple(_whole_row_fraction(mask, seq_len) for mask in attention.layer_masks)
    return AttendedPairs(fractions, f"{NO_CORPUS}, {counted(attention, seq_len)}")


def _whole_row_fraction(mask: MaskMode, seq_len: int) -> float:
    pairs = mask.attended_pairs([seq_len])
    # a mask that allows causal's pairs keeps the plan's causal half, S^2 / 2: the diagonal's S / 2 more is noise
    # next to it, and plans of causal models stay what they have always been
    return 0.5 if pairs == Causal().pairs(seq_len) else pairs / seq_len**2


def counted(attention: AttentionSpec, seq_len: int) -> str:
    """Which masks a pair count counted, and for which row length (the plan's source names them)."""
    return f"counted for {attention.describe()}, seq_len={seq_len}"


def packed_pairs(attention: AttentionSpec, rows: Sequence[Sequence[int]], seq_len: int, source: str) -> AttendedPairs:
    """Per layer, the mean (query, key) pairs its mask mode allows in these packed rows (each a list of its
    document pieces' lengths), as a fraction of seq_len^2. A row's padding is laid out as one more document
    (data/packing.materialise_rows), whose causal square the kernel computes too; a mode without documents
    masks the whole row as one. No rows: `whole_row_pairs`."""
    if not rows:
        return whole_row_pairs(attention, seq_len)
    layouts = Counter(_row_documents(row, seq_len, attention.documents) for row in rows)
    per_mask = {  # each distinct mask counted once (many layers share one)
        mask: sum(n * mask.attended_pairs(list(layout)) for layout, n in layouts.items()) / len(rows) / seq_len**2
        for mask in dict.fromkeys(attention.layer_masks)
    }
    return AttendedPairs(
        tuple(per_mask[mask] for mask in attention.layer_masks), f"{source}, {counted(attention, seq_len)}"
    )


def _row_documents(pieces: Sequence[int], seq_len: int, documents: bool) -> tuple[int, ...]:
    """The documents a row's mask separates: its pieces and the padding after them, or the whole row."""
    if not documents:
        return (seq_len,)
    padding = seq_len - sum(pieces)
    return (*pieces, padding) if padding > 0 else tuple(pieces)


def plan_inputs(
    specs: PlanSpecs, hardware: HardwareConfig, precision: PrecisionSpec, on_cuda: Optional[bool] = None
) -> PlanInputs:
    """PlanInputs of resolved specs on concrete hardware under a PrecisionSpec."""
    on_cuda = hardware.on_cuda if on_cuda is None else on_cuda
    # HF's fused SDPA keeps the same O(S) tensors as flex; only the dense reference adds S^2 mask terms
    resolved = specs.attention.backend
    backend = resolved if resolved in (AttnBackend.DENSE, AttnBackend.VARLEN) else AttnBackend.FLEX
    parallel = specs.parallel
    given = precision.bytes_per_param()  # None only for embedding_optimizer: like every other parameter
    per_param = {key: value for key, value in given.items() if value is not None}
    gather, reduce = precision.fsdp_dtypes(on_cuda, parallel.mixed_precision)
    # sharded over several ranks, FSDP2 casts under the mode's policy (apply_fsdp) and the trainer runs no autocast
    # (its compute_context asks the record): no autocast weight copy then
    fsdp_casts = (
        parallel.strategy is Strategy.FSDP
        and hardware.world_size > 1
        and precision.fsdp_casts(on_cuda, parallel.mixed_precision)
    )
    lora = specs.lora_fraction is not None
    return PlanInputs(
        seq_len=specs.seq_len,
        micro_batch=specs.micro_batch,
        dtype_bytes=precision.act_bytes,
        hardware=hardware,
        chunk_size=specs.chunk_size,
        backend=backend,
        grad_accum=specs.grad_accum,
        optimizer_state_bytes=per_param["optimizer"] / 2,
        trainable_fraction=specs.lora_fraction if specs.lora_fraction is not None else 1.0,
        weight_bytes=per_param["weights"],
        grad_bytes=per_param["grads"],
        compute_copy_bytes=0.0 if fsdp_casts else per_param["compute_copy"],
        frozen_weight_bytes=per_param["frozen_weights"] if lora else None,
        host_bytes_per_param=per_param["host"],
        host_scratch_bytes=per_param["host_scratch"],
        embedding_state_bytes=given["embedding_optimizer"],
        # FSDP2 gathers weights in the compute dtype and reduces gradients in fp32 under the mode's policy (CUDA,
        # parallel.mixed_precision), else both in the stored dtype
        fsdp_param_bytes=gather.itemsize,
        fsdp_reduce_bytes=reduce.itemsize,
        precision=precision.name,
        cp=parallel.cp,
        autocast=precision.autocast and not fsdp_casts,
        reduce_every=parallel.reduce_every,  # DDP's auto is already window (resolve_parallel)
        pairs=specs.pairs,
        compiled=specs.compiled,
        fused_loss=specs.fused_loss,
    )


def context_rows(hf_config, cp: int = 1) -> int:
    """Rows of the model's supported context (a multiple of cp x 128): what data.seq_len=auto plans where no
    document lengths are known."""
    block = CP_BLOCK_SIZE * cp
    return max(block, context_limits(hf_config).supported // block * block)
