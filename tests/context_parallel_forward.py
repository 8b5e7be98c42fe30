"""Context parallelism on CPU (gloo): under torchrun, each rank computes its share of a packed multi-document
batch through torch's context parallel + FSDP2 on the (dp, cp) mesh, blocks compiled (aot_eager, fullgraph);
rank 0 saves the whole-row logits (ContextParallel.logits), the loss sum and the eval loss next to a single-process
reference on the same weights (flex without CP, and the dense reference backend). Forward only (gradients:
tests/context_parallel_trainer.py; flex's own backward: bench/gpu_check.py cp_grads). Driven by
tests/test_context_parallel.py.

usage: torchrun --nproc_per_node 2 tests/context_parallel_forward.py OUT_FILE
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from flexengine.attention import patch_attention
from flexengine.compile import apply_compile
from flexengine.config import ParallelConfig
from flexengine.context_parallel import build_context_parallel
from flexengine.data.packing import pack_documents
from flexengine.evaluate import evaluate_loss
from flexengine.loss import forward_loss_sum
from flexengine.parallel import apply_parallel, init_distributed
from tests.helpers import clone_model, make_llama

SEQ_LEN = 1024  # 8 blocks of 128: PTRR balances whole blocks, 4 per rank
LAYERS = 4


def packed_batch(lengths: tuple = (700, 3, 190, 131, 600, 250, 90, 61, 17), seed: int = 1) -> dict:
    """Two rows of unequal documents (by default: one crosses blocks, one is 3 tokens, padding at a row end)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, 256, (n,), generator=g) for n in lengths]
    batch = pack_documents(docs, SEQ_LEN, strategy="greedy")
    assert batch["input_ids"].shape == (2, SEQ_LEN), batch["input_ids"].shape
    return batch


def main(out: str) -> None:
    """Reference on every rank (same seed, same weights), then the CP forward; rank 0 saves both."""
    info = init_distributed(ParallelConfig(cp=2, backend="gloo"), torch.device("cpu"))
    model = make_llama(num_hidden_layers=LAYERS)  # GQA: 4 query heads, 2 KV heads
    dense = patch_attention(clone_model(model), backend="dense")
    reference = patch_attention(clone_model(model), backend="flex", compile=False)
    patch_attention(model, backend="flex", compile=False)
    batch = packed_batch()
    other = packed_batch((300, 700, 24, 1000), seed=2)  # another layout of the same shape (eval's second batch)
    with torch.no_grad():
        ref = {"logits": reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits,
               "loss_sum": forward_loss_sum(reference, batch), "other_loss_sum": forward_loss_sum(reference, other),
               "dense_logits": dense(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits}

    cp = build_context_parallel(info, torch.device("cpu"))
    cp.apply(model)
    apply_compile(model, "aot_eager")  # fullgraph per block, as training compiles: the CP hook must trace
    root = apply_parallel(model, ParallelConfig(cp=2), info, torch.device("cpu"), chunk_size=100,
                          fsdp_mesh=cp.fsdp_mesh)
    sharded = {n: p.to_local().shape[0] for n, p in model.named_parameters()}  # each rank's first-dim shard
    with torch.no_grad():
        share, mask_kwargs = cp.shard(model, batch)
        loss_sum = root(share, **mask_kwargs).detach()
        logits = cp.logits(root, model, batch)  # whole rows, put together from both ranks' shares
        graphs = counters["stats"]["unique_graphs"]  # compiled blocks + torch's compiled CP mask builder
        evaluation = evaluate_loss(root, [batch, other], torch.device("cpu"), lambda b: cp.shard(model, b),
                                   contextlib.nullcontext)
        new_graphs = counters["stats"]["unique_graphs"] - graphs  # a new document layout must not recompile
    local = {"logits": logits, "token_index": share["token_index"], "targets": share["targets"],
             "blocks": mask_kwargs["flexengine_mask"].by_hf_window[None].computed_blocks}
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, {**local, "loss_sum": loss_sum, "seq_len_local": share["input_ids"].shape[1]})
    if info.is_main:
        torch.save({"ref": ref, "ranks": gathered, "eval": evaluation, "batch": batch, "other": other,
                    "fsdp_shards": sharded, "graphs": graphs, "new_graphs": new_graphs}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
