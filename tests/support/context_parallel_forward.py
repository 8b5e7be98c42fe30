"""Context parallelism on CPU (gloo): under torchrun, each rank computes its share of a packed multi-document
batch through torch's context parallel + FSDP2 on the (dp, cp) mesh, for a model with full-attention and
sliding-window layers (two masks per batch, the window not a multiple of 128); rank 0 saves the whole-row logits
(ContextParallel.logits), the loss sum and the eval loss next to a single-process reference on the same weights
(flex without CP, and the dense reference backend). Forward only (gradients: tests/support/context_parallel_trainer.py;
flex's own backward: bench/gpu_check.py cp_grads). Driven by tests/surgery/test_context_parallel.py.

2 ranks (dp 1 x cp 2): blocks compiled (aot_eager, fullgraph), no recompile for a new layout, greedy samples of
prompts of different lengths. 4 ranks (dp 2 x cp 2): each data-parallel group takes its own row (rows by
rank // cp, cp groups of consecutive ranks on the mesh), uncompiled and with torch's mask builder run eagerly
(4 processes on 2 cores; the 2-rank run covers compilation).

usage: torchrun --nproc_per_node {2,4} tests/support/context_parallel_forward.py OUT_FILE
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask

from flexengine.core.config import LossConfig, ParallelConfig
from flexengine.core.distributed import init_distributed
from flexengine.core.parallel_spec import ParallelSpec
from flexengine.data.packing import pack_documents
from flexengine.loop.evaluator import evaluate_loss, greedy_continue
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.compile import apply_compile
from flexengine.surgery.context_parallel import build_context_parallel
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.parallel import apply_parallel
from tests.helpers import CharTokenizer, clone_model, make_qwen_mixed

SEQ_LEN = 1024  # 8 blocks of 128: PTRR balances whole blocks, 4 per rank
CP = 2
WINDOW = 200  # HF sliding_window of layers 2 and 3 (layers 0 and 1: full attention); not a multiple of 128
PROMPTS = ["a", "b" * 300]  # one padded width per sample call: 512 for both (not 256 and 512)


def packed_batch(lengths: tuple = (700, 3, 190, 131, 600, 250, 90, 61, 17), seed: int = 1) -> dict:
    """Two rows of unequal documents (by default: one crosses blocks, one is 3 tokens, padding at a row end)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, 256, (n,), generator=g) for n in lengths]
    batch = pack_documents(docs, SEQ_LEN, strategy="greedy")
    assert batch["input_ids"].shape == (2, SEQ_LEN), batch["input_ids"].shape
    return batch


def mask_builder_variants() -> int:
    """Compiled variants of create_block_mask (torch's CP mask builder compiles it once per shape and mask)."""
    return len(_debug_get_cache_entry_list(create_block_mask.__code__))


def main(out: str) -> None:
    """Reference on every rank (same seed, same weights), then the CP forward; rank 0 saves both."""
    info = init_distributed(ParallelConfig(cp=CP, backend="gloo"), torch.device("cpu"))
    dp = info.data_world_size
    if dp > 1:  # torch's compiled mask builder is an optimisation of this same function
        import torch.distributed.tensor.experimental._context_parallel._attention as cp_attention

        cp_attention._compiled_create_block_mask = create_block_mask
    model = make_qwen_mixed(sliding_window=WINDOW)  # GQA: 4 query heads, 2 KV heads; 4 layers
    dense = patch_attention(clone_model(model), mode="packed_sliding", backend="dense")
    reference = patch_attention(clone_model(model), mode="packed_sliding", backend="flex", compile=False)
    patch_attention(model, mode="packed_sliding", backend="flex", compile=False)
    batch = packed_batch()
    other = packed_batch((300, 700, 24, 1000), seed=2)  # another layout of the same shape (eval's second batch)
    with torch.no_grad():
        ref = {
            "logits": reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits,
            "loss_sum": forward_loss_sum(reference, batch),
            "other_loss_sum": forward_loss_sum(reference, other),
            "dense_logits": dense(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits,
        }

    def rows_of_group(b: dict) -> dict:  # this data-parallel group's rows (all of them when dp = 1)
        return {k: v[info.data_rank :: dp] for k, v in b.items() if isinstance(v, torch.Tensor)}

    cp = build_context_parallel(info, torch.device("cpu"))
    cp.apply(model)
    if dp == 1:
        apply_compile(model, "aot_eager")  # fullgraph per block, as training compiles: the CP hook must trace
    root = apply_parallel(
        model, ParallelSpec(cp=CP), info, torch.device("cpu"), LossConfig(chunk_size=100), fsdp_mesh=cp.fsdp_mesh
    )
    sharded = {n: p.to_local().shape[0] for n, p in model.named_parameters()}  # each rank's first-dim shard
    results = {}
    with torch.no_grad():
        mine = rows_of_group(batch)
        share, mask_kwargs = cp.shard(model, mine)
        loss_sum = root(share, **mask_kwargs).detach()
        logits = cp.logits(root, model, mine)  # whole rows, put together from the cp ranks' shares
        graphs = counters["stats"]["unique_graphs"]  # compiled blocks + torch's compiled CP mask builder
        evaluation = evaluate_loss(
            root,
            [mine, rows_of_group(other)],
            torch.device("cpu"),
            lambda b: cp.shard(model, b),
            contextlib.nullcontext,
        )
        if dp == 1:
            results["new_graphs"] = counters["stats"]["unique_graphs"] - graphs  # a new layout: no recompile
            variants = mask_builder_variants()

            def split_logits(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
                return cp.logits(root, model, {"input_ids": input_ids, "position_ids": position_ids})

            def reference_logits(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
                return reference(input_ids=input_ids, position_ids=position_ids).logits

            sample = dict(
                tokenizer=CharTokenizer(), prompts=PROMPTS, new_tokens=2, device=torch.device("cpu"), pad_to=CP * 128
            )
            results["samples"] = greedy_continue(split_logits, **sample)
            results["sample_mask_variants"] = mask_builder_variants() - variants
            results["ref_samples"] = greedy_continue(reference_logits, **sample)
    masks = mask_kwargs["flexengine_mask"].by_hf_window
    local = {
        "logits": logits,
        "token_index": share["token_index"],
        "targets": share["targets"],
        "blocks": masks[None].computed_blocks,
        "mask_kinds": len({id(m) for m in masks.values()}),
        "data_rank": info.data_rank,
        "loss_sum": loss_sum,
        "seq_len_local": share["input_ids"].shape[1],
    }
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, local)
    if info.is_main:
        torch.save(
            {
                "ref": ref,
                "ranks": gathered,
                "eval": evaluation,
                "batch": batch,
                "other": other,
                "fsdp_shards": sharded,
                "graphs": graphs,
                **results,
            },
            out,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
