"""The scripted GPU checks of bench/gpu_check.py, one per process: `python bench/gpu_check_scripts.py NAME OUT`.

step_time  compiled flex (packed rows) vs HF SDPA (the same documents, padded) at 8K, ~0.9B LLaMA
doctor     `flexengine.doctor` on the GPU (tiny model, flex): verdicts and recompiles
cp_grads   context parallelism's gradients: 2 GPUs -> a real training step under torchrun with parallel.cp=2
           (NCCL, FSDP2 on the (dp, cp) mesh, compiled flex) vs one process, per-tensor gradients before the
           optimizer; 1 GPU -> that part is recorded as skipped (it needs 2), and torch's CP attention math runs
           in one process instead: each virtual rank's queries against the gathered K/V under torch's CP
           BlockMask (PTRR-balanced), flex backward, gradients summed over the ranks vs unsharded flex
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flexengine.attention import patch_attention, position_ids_from_document_ids  # noqa: E402
from flexengine.config import MemoryConfig  # noqa: E402
from flexengine.data.packing import IGNORE_INDEX  # noqa: E402
from flexengine.loss import forward_loss_sum  # noqa: E402
from flexengine.memory import apply_memory_policy  # noqa: E402
from tests.helpers import GPU_TINY_LLAMA  # noqa: E402

DEV = torch.device("cuda")
TINY = GPU_TINY_LLAMA
ONE_B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=65536,
    use_cache=False,
    tie_word_embeddings=False,
    rope_theta=500000.0,
)
MID = dict(
    ONE_B, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4
)


def make_llama(arch: dict, dtype: torch.dtype, seed: int = 0):
    """A random-init LLaMA on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with DEV:
        model = LlamaForCausalLM(LlamaConfig(**arch)).to(dtype)
    return model.train()


def doc_lengths(total: int, mean: int, cap: int, seed: int) -> list[int]:
    """Long-tailed document lengths (lognormal around `mean`, at most `cap`) filling exactly `total` tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while sum(out) < total:
        n = int(math.exp(math.log(mean) + torch.randn(1, generator=g).item()))
        out.append(max(16, min(cap, n, total - sum(out))))
    return out


def packed_batch(lengths: list[int], vocab: int, seed: int = 0) -> dict:
    """One packed row [1, S]: ids, positions restarting per document, labels with document starts ignored."""
    doc = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None].to(DEV)
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.randint(0, vocab, doc.shape, device=DEV, generator=g)
    pos = position_ids_from_document_ids(doc)
    return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, IGNORE_INDEX)}


def padded_batches(lengths: list[int], vocab: int, per_batch: int, seed: int = 0) -> list[dict]:
    """The same documents one per row, `per_batch` rows per batch, right-padded to the batch's longest."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    out = []
    for i in range(0, len(lengths), per_batch):
        chunk = lengths[i : i + per_batch]
        L = max(chunk)
        ids = torch.randint(0, vocab, (len(chunk), L), device=DEV, generator=g)
        real = torch.arange(L, device=DEV)[None] < torch.tensor(chunk, device=DEV)[:, None]
        labels = ids.masked_fill(~real, IGNORE_INDEX)
        # right padding + causal attention: real tokens never see the pads, so no attention mask is needed
        out.append(
            {
                "input_ids": ids,
                "position_ids": torch.arange(L, device=DEV)[None].expand(len(chunk), L),
                "labels": labels,
            }
        )
    return out


def fwd_bwd(model, batch: dict, chunk: int = 0) -> float:
    """One forward + backward under bf16 autocast; returns the summed loss."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = forward_loss_sum(model, batch, chunk)
    loss.backward()
    return float(loss)


def timed(fn: Callable, repeats: int) -> float:
    """Median seconds of fn() after synchronising."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# -- checks ---------------------------------------------------------------------------------------------------
def check_step_time(seq_lens=(8192,)) -> dict:
    """Useful tokens/s of one fwd+bwd: flex on a packed row vs SDPA on the same documents padded 4 per batch."""
    out = {}
    for S in seq_lens:
        lengths = doc_lengths(S, 1200, min(S, 8192), seed=S)
        row = {"documents": len(lengths), "useful_tokens": S}
        for name in ("flex_packed", "sdpa_padded"):
            model = make_llama(ONE_B, torch.bfloat16)
            if name == "flex_packed":
                patch_attention(model, mode="packed_doc", backend="flex", compile=True)
                batches = [packed_batch(lengths, ONE_B["vocab_size"])]
            else:
                model.set_attn_implementation("sdpa")
                batches = padded_batches(lengths, ONE_B["vocab_size"], per_batch=4)
            apply_memory_policy(model, MemoryConfig(policy="full"))  # both sides recompute every block

            def step(model=model, batches=batches):
                for b in batches:
                    fwd_bwd(model, b, chunk=4096)
                model.zero_grad(set_to_none=True)

            torch.cuda.reset_peak_memory_stats()
            t_first = timed(step, 1)  # compile + autotune on the flex side
            seconds = timed(step, 3)
            row[name] = {
                "step_s": seconds,
                "first_step_s": t_first,
                "useful_tokens_per_s": S / seconds,
                "token_slots": sum(b["input_ids"].numel() for b in batches),
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            }
            del model, batches
            torch.cuda.empty_cache()
        row["speedup_flex_vs_sdpa_padded"] = row["sdpa_padded"]["step_s"] / row["flex_packed"]["step_s"]
        out[f"S={S}"] = row
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**ONE_B)).parameters())
    return {"ok": all(r["speedup_flex_vs_sdpa_padded"] > 1 for r in out.values()), "params": params, **out}


def check_doctor() -> dict:
    """The doctor on the GPU with the tiny model: what it says about a healthy packed run."""
    import tempfile

    from flexengine.doctor import compose_job, diagnose

    job = compose_job(
        [
            "model=tiny",
            "attn=packed_doc",
            "hardware=h100_80g",
            "data.seq_len=2048",
            "data.demo_max_files=80",
            "train.micro_batch=2",
            "train.grad_accum=1",
        ]
    )
    with tempfile.TemporaryDirectory() as d:
        report = diagnose(job, Path(d), steps=3)
    n = report["numbers"]
    return {
        "ok": n["attn_backend"] == "flex" and n["recompiles_after_warmup"] == 0 and n["graph_breaks"] == 0,
        "numbers": {
            k: n[k]
            for k in (
                "attn_backend",
                "graphs_compiled_warmup",
                "recompiles_after_warmup",
                "graph_breaks",
                "useful_tokens_per_s",
                "mfu",
                "time_split",
                "block_density",
                "memory",
            )
        },
        "suggestions": report["suggestions"],
    }


CP_RUN = [
    "model=tiny",
    "attn=packed_doc",
    "hardware=h100_80g",
    "data.seq_len=2048",
    "data.demo_max_files=80",
    "train.micro_batch=2",
    "precision.mode=fp32",
    "parallel.mixed_precision=false",
    "optim.grad_clip=0",
]


def _grads_run(out: Path, ranks: int, *overrides: str) -> dict:
    """tests/parallel_grads.py: the first step's gradients (full tensors, rank 0), alone or under torchrun."""
    import os
    import subprocess

    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", "29613"]
        if ranks
        else [sys.executable]
    )
    proc = subprocess.run(
        [*launcher, str(REPO / "tests" / "parallel_grads.py"), str(out), *CP_RUN, *overrides],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(launcher[-3:])} parallel_grads.py failed:\n{proc.stderr[-3000:]}")
    return torch.load(out / "grads.pt")["grads"]


def _relative_errors(got: dict, ref: dict) -> dict:
    return {name: float((got[name] - ref[name]).norm() / ref[name].norm().clamp(min=1e-30)) for name in ref}


def cp_two_ranks() -> dict:
    """One training step with parallel.cp=2 on 2 GPUs vs the same rows in one process: gradients per tensor."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        ref = _grads_run(Path(d) / "one", 0)
        got = _grads_run(Path(d) / "cp2", 2, "parallel.cp=2")
    errors = _relative_errors(got, ref)
    worst = max(errors, key=errors.get)
    return {
        "ok": got.keys() == ref.keys() and errors[worst] < 1e-4,
        "tensors": len(errors),
        "max_relative_error": errors[worst],
        "worst_tensor": worst,
    }


class _VirtualCPRank:
    """What torch's _create_cp_block_mask reads of a DeviceMesh (its size, this rank, the device type), for one
    rank of a context-parallel group simulated inside one process."""

    def __init__(self, rank: int, size: int):
        self.rank, self.world, self.device_type = rank, size, "cuda"

    def size(self) -> int:
        return self.world

    def get_local_rank(self) -> int:
        return self.rank


def cp_virtual_ranks(cp: int = 2, seq_len: int = 8192) -> dict:
    """torch's CP flex math on one GPU: q of each virtual rank (PTRR order) against the whole reordered K/V under
    torch's CP BlockMask; summing the ranks' dK/dV is what flex_cp_allgather's backward reduce-scatter does.
    Proves flex's backward under CP masks (Q_LEN = S/cp, KV_LEN = S); not the collectives, FSDP or the trainer."""
    from torch.distributed.tensor.experimental._context_parallel import _PTRRLoadBalancer
    from torch.distributed.tensor.experimental._context_parallel._attention import _create_cp_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    from flexengine.attention.block_mask import canonical_document_ids, document_block_mask

    flex = torch.compile(flex_attention, dynamic=False)
    lengths = doc_lengths(seq_len, 900, 4000, seed=3)
    doc = canonical_document_ids(
        torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None].to(DEV)
    )
    mask = document_block_mask(True, doc, None, 128)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, seq_len, 128, device=DEV, generator=g, requires_grad=True) for h in (32, 8, 8))
    out = flex(q, k, v, block_mask=mask, enable_gqa=True)
    grad_out = torch.randn(out.shape, device=DEV, generator=g)
    ref = torch.autograd.grad(out, (q, k, v), grad_out)

    balancer = _PTRRLoadBalancer(mask, cp)
    order = balancer._generate_indices()[0]  # reordered position -> original position
    qr, kr, vr = (t.detach()[:, :, order].requires_grad_() for t in (q, k, v))
    grads = [torch.zeros_like(t) for t in (qr, kr, vr)]
    work, shard = [], seq_len // cp
    for rank in range(cp):
        local = slice(rank * shard, (rank + 1) * shard)
        cp_mask = _create_cp_block_mask(mask.mask_mod, 1, 1, seq_len, seq_len, _VirtualCPRank(rank, cp), balancer)
        work.append(int(cp_mask.kv_num_blocks.sum() + cp_mask.full_kv_num_blocks.sum()))
        out_r = flex(qr[:, :, local], kr, vr, block_mask=cp_mask, enable_gqa=True)
        dq, dk, dv = torch.autograd.grad(out_r, (qr, kr, vr), grad_out[:, :, order][:, :, local])
        grads[0] += dq
        grads[1] += dk  # the reduce-scatter's sum over ranks
        grads[2] += dv
    restore = torch.argsort(order)
    errors = {
        name: float((g_[:, :, restore] - r).norm() / r.norm()) for name, g_, r in zip(("dq", "dk", "dv"), grads, ref)
    }
    blocks = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    return {
        "ok": max(errors.values()) < 1e-4 and sum(work) == blocks,
        "relative_errors": errors,
        "documents": len(lengths),
        "blocks_per_rank": work,
        "blocks_total": blocks,
    }


def check_cp_grads() -> dict:
    """cp_two_ranks where 2 GPUs are visible (else recorded as skipped), cp_virtual_ranks always."""
    virtual = cp_virtual_ranks()
    if torch.cuda.device_count() < 2:
        return {
            "ok": virtual["ok"],
            "virtual_ranks": virtual,
            "two_ranks": f"skipped: {torch.cuda.device_count()} GPU visible, the NCCL training step needs 2",
        }
    two = cp_two_ranks()
    return {"ok": virtual["ok"] and two["ok"], "virtual_ranks": virtual, "two_ranks": two}


def main(name: str, out: Path) -> None:
    """Run one check and write its record (also when it raises)."""
    try:
        record = {"step_time": check_step_time, "doctor": check_doctor, "cp_grads": check_cp_grads}[name]()
    except Exception as e:
        record = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    out.write_text(json.dumps(record, indent=2, default=str))
    sys.exit(0 if record.get("ok") else 1)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
