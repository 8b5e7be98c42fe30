"""The worker of bench/gpu_check.py: runs the named checks in one process (compiles shared), in the order given,
appending one JSON line per check to --jsonl as it ends and printing `@@start NAME` / `@@done NAME: ...` lines the
driver follows. With --dry-run every check runs its CPU part (bench/gpu_check_list.py says what that is).

  python bench/gpu_check_scripts.py --jsonl OUT.jsonl [--dry-run [--fast]] NAME [NAME ...]

Checks here: env, flex_vs_dense, flex_vs_sdpa, recompiles, cp_grads, doctor, fsdp_smoke, precision_proof; the
7B-width ones (train_<mode>, planner_vs_allocator, offload_overlap) are in bench/gpu_check_width.py, the README's
plan at the A100's budget (readme_a100) in bench/gpu_check_readme.py. A check says how far it got with
`@@progress ...` lines (gpu_check_width.progress): the driver keeps them for a check it has to kill.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
from gpu_check_list import DEAD_DEVICE_EXIT  # noqa: E402
from gpu_check_width import CHECK_STARTED, FAST_DRY, FIRST_STEPS, PROGRESS  # noqa: E402

from tests.helpers import GPU_TINY_LLAMA  # noqa: E402

TINY = GPU_TINY_LLAMA
WIDTH_7B = dict(  # llama2_7b's blocks (conf/model/llama2_7b.yaml), 4 of them: the flex kernels of train_<mode>
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=32768,
    use_cache=False,
    tie_word_embeddings=False,
)
FLEX_TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2}  # logits and per-parameter gradients, relative


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_llama(arch: dict, dtype: torch.dtype, seed: int = 0):
    """A random-init LLaMA on this machine's device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with device():
        model = LlamaForCausalLM(LlamaConfig(**arch)).to(dtype)
    return model.train()


def doc_lengths(total: int, mean: int, cap: int, seed: int) -> list[int]:
    """Long-tailed document lengths (lognormal around `mean`, at most `cap`) filling exactly `total` tokens."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < total:
        n = int(math.exp(math.log(mean) + torch.randn(1, generator=g).item()))
        out.append(max(16, min(cap, n, total - sum(out))))
    return out


def packed_batch(lengths: list[int], vocab: int, seed: int = 0) -> dict:
    """One packed row [1, S]: ids, positions restarting per document, labels with document starts ignored."""
    from flexengine.data.packing import IGNORE_INDEX
    from flexengine.surgery.attention import position_ids_from_document_ids

    dev = device()
    doc = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None].to(dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randint(0, vocab, doc.shape, device=dev, generator=g)
    pos = position_ids_from_document_ids(doc)
    return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, IGNORE_INDEX)}


def padded_batches(lengths: list[int], vocab: int, per_batch: int, seed: int = 0) -> list[dict]:
    """The same documents one per row, `per_batch` rows per batch, right-padded to the batch's longest."""
    from flexengine.data.packing import IGNORE_INDEX

    dev = device()
    g = torch.Generator(device=dev).manual_seed(seed)
    out = []
    for i in range(0, len(lengths), per_batch):
        chunk = lengths[i : i + per_batch]
        L = max(chunk)
        ids = torch.randint(0, vocab, (len(chunk), L), device=dev, generator=g)
        real = torch.arange(L, device=dev)[None] < torch.tensor(chunk, device=dev)[:, None]
        # right padding + causal attention: real tokens never see the pads, so no attention mask is needed
        positions = torch.arange(L, device=dev)[None].expand(len(chunk), L)
        out.append({"input_ids": ids, "position_ids": positions, "labels": ids.masked_fill(~real, IGNORE_INDEX)})
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable, repeats: int) -> float:
    """Median seconds of fn() after synchronising."""
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# -- env ------------------------------------------------------------------------------------------------------
ENV_MODULES = (  # everything the checks import: a missing carried wheel fails here, first, with its name
    "hydra",
    "omegaconf",
    "antlr4",
    "yaml",
    "torchao.optim",
    "transformers",
    "safetensors",
    "tensorboard",
    "peft",
    "pyarrow",
    "flexengine.cli.common",
    "flexengine.run",
    "flexengine.doctor",
    "flexengine.planning.fit",
    "flexengine.surgery.memory.meter",
    "flexengine.planning.planner",
    "flexengine.surgery.compile",
    "flexengine.loop.optim",
    "flexengine.surgery.loss",
    "flexengine.train",
    "torch.nn.attention.flex_attention",
    "torch.distributed.fsdp",
    "gpu_check_width",
    "gpu_check_readme",
    "gpu_overlap",
)
# needed only by checks after the decisive ones (LoRA, parquet sources, FSDP, the overlap trace): a missing one is
# a warning in env's record, and the check that needs it fails on its own
ENV_OPTIONAL = ("peft", "pyarrow", "torch.distributed.fsdp", "gpu_overlap")
# what the checks' compiles and allocations run under (bench/gpu_check.py sets them for the whole call)
CALL_ENV = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_FX_GRAPH_CACHE",
)


def check_env(dry: bool) -> dict:
    """Import everything, report versions, the device and the host's memory."""
    import gpu_check_width as width

    errors, versions = {}, {}
    for name in ENV_MODULES:
        try:
            module = importlib.import_module(name)
            top = sys.modules[name.split(".")[0]]
            versions[name.split(".")[0]] = getattr(top, "__version__", getattr(module, "__version__", "?"))
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": props.name if props else None,
        "gpu_memory_gib": props.total_memory / 2**30 if props else None,
        # held outside the allocator before any allocation: the CUDA context (the planner's context term)
        "cuda_context_gib": _context_gib() if props else None,
        "transformers": versions.get("transformers"),
        "versions": versions,
        "call_env": {k: os.environ.get(k) for k in CALL_ENV},
    }
    env["host_memory_gib"] = width.host_memory_gib()
    warnings = {k: v for k, v in errors.items() if k in ENV_OPTIONAL}
    errors = {k: v for k, v in errors.items() if k not in ENV_OPTIONAL}
    ok = not errors and (dry or props is not None)
    record = {"ok": ok, "env": env, "import_errors": errors, "import_warnings": warnings}
    record["headline"] = {"torch": torch.__version__, **({"warnings": sorted(warnings)} if warnings else {})}
    if errors:
        record["error"] = f"a decisive check's import failed: {', '.join(sorted(errors))}"
    if props is None and not dry:
        record["error"] = "no CUDA device visible: nothing else can be checked"
    return record


def _context_gib() -> float:
    """Device memory in use that the caching allocator does not hold (the CUDA context, other processes)."""
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**30


# -- flex vs dense --------------------------------------------------------------------------------------------
def flex_dense_agreement(mode: str, dtype: torch.dtype, flex_mode: str | None = None, backward: bool = True) -> dict:
    """Loss (and gradients) of flex vs the dense-mask reference on one packed row; `flex_mode` gives flex another
    mask (the broken variant). Without `backward` (CPU: flex has no backward there) flex runs eager."""
    from flexengine.surgery.attention import patch_attention
    from flexengine.surgery.loss import forward_loss_sum

    window = 64 if mode == "packed_sliding" else None
    flex_window = 64 if (flex_mode or mode) == "packed_sliding" else None
    compiled = torch.cuda.is_available() and backward  # flex's backward needs the compiled kernels
    flex = patch_attention(
        make_llama(TINY, dtype), mode=flex_mode or mode, window=flex_window, backend="flex", compile=compiled
    )
    dense = patch_attention(make_llama(TINY, dtype), mode=mode, window=window, backend="dense")
    batch = packed_batch([300, 17, 500, 1, 150, 56], TINY["vocab_size"])
    # Logits, not the loss: at random init attention is near uniform and the summed loss barely feels the mask
    # (a causal-only flex moves it by 6e-4 of 1, inside the fp32 tolerance); the logits move by 0.8 of their norm.
    with torch.no_grad():  # (torch 2.11's CPU flex also refuses inputs that require grad)
        logits = [
            m(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.float() for m in (flex, dense)
        ]
    out = {"logits_rel": float((logits[0] - logits[1]).norm() / logits[1].norm())}
    if backward:
        forward_loss_sum(flex, batch).backward()
        forward_loss_sum(dense, batch).backward()
        rel = {
            name: float((a.grad.float() - b.grad.float()).norm() / b.grad.float().norm().clamp(min=1e-12))
            for (name, a), b in zip(flex.named_parameters(), dense.parameters())
        }
        worst = max(rel, key=rel.get)
        out.update(worst_grad_rel=rel[worst], worst_param=worst)
    tol = FLEX_TOL[dtype]
    out["ok"] = out["logits_rel"] < tol and out.get("worst_grad_rel", 0.0) < tol
    return out


def check_flex_vs_dense(dry: bool) -> dict:
    """Flex == dense (forward + backward) for both packed masks and both dtypes; the wrong mask must fail."""
    cases = {}
    grid = (
        [("packed_doc", torch.float32)] if dry else [(m, d) for m in ("packed_doc", "packed_sliding") for d in FLEX_TOL]
    )
    for mode, dtype in grid:
        cases[f"{mode}/{str(dtype)[6:]}"] = flex_dense_agreement(mode, dtype, backward=not dry)
    broken = flex_dense_agreement("packed_doc", torch.float32, flex_mode="causal", backward=False)
    cases["broken: flex causal-only vs dense packed_doc"] = broken
    ok = all(c["ok"] for k, c in cases.items() if not k.startswith("broken")) and not broken["ok"]
    worst = max(
        max(c["logits_rel"], c.get("worst_grad_rel", 0.0)) for k, c in cases.items() if not k.startswith("broken")
    )
    return {"ok": ok, "cases": cases, "headline": {"worst_rel": worst, "wrong_mask_logits_rel": broken["logits_rel"]}}


# -- flex vs SDPA ---------------------------------------------------------------------------------------------
def check_flex_vs_sdpa(dry: bool) -> dict:
    """Useful tokens/s of one fwd+bwd: flex on a packed row vs HF SDPA on the same documents padded 4 per batch,
    every block recomputed on both sides (dry: S=512 on a tiny model, varlen standing in for flex)."""
    from flexengine.core.config import MemoryConfig
    from flexengine.surgery.attention import patch_attention
    from flexengine.surgery.loss import forward_loss_sum
    from flexengine.surgery.memory import apply_memory_policy, block_memory_specs

    # 2 layers: every layer is alike, so the speed ratio is per layer (half the GPU seconds of 4)
    arch, dtype = (TINY, torch.float32) if dry else (dict(WIDTH_7B, num_hidden_layers=2), torch.bfloat16)
    out = {}
    for S in (512,) if dry else (8192, 32768):
        lengths = doc_lengths(S, 1200, min(S, 8192), seed=S)
        row = {"documents": len(lengths), "useful_tokens": S}
        for name in ("flex_packed", "sdpa_padded"):
            model = make_llama(arch, dtype)
            if name == "flex_packed":
                patch_attention(model, mode="packed_doc", backend="varlen" if dry else "flex", compile=True)
                batches = [packed_batch(lengths, arch["vocab_size"])]
            else:
                model.set_attn_implementation("sdpa")
                batches = padded_batches(lengths, arch["vocab_size"], per_batch=4)
            apply_memory_policy(
                model, block_memory_specs(MemoryConfig(policy="full"), model.config.num_hidden_layers)
            )  # both sides recompute every block

            def step(model=model, batches=batches):
                for b in batches:
                    with torch.autocast(device().type, dtype=torch.bfloat16, enabled=not dry):
                        loss = forward_loss_sum(model, b, 4096)
                    loss.backward()
                model.zero_grad(set_to_none=True)

            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            first = timed(step, 1)  # flex compile on the flex side
            FIRST_STEPS.append(first)
            seconds = timed(step, 1 if dry else 2)
            row[name] = {
                "step_s": seconds,
                "first_step_s": first,
                "useful_tokens_per_s": S / seconds,
                "token_slots": sum(b["input_ids"].numel() for b in batches),
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            }
            del model, batches, step  # step's defaults hold the model too
            _free_device()
        row["speedup_flex_vs_sdpa_padded"] = row["sdpa_padded"]["step_s"] / row["flex_packed"]["step_s"]
        out[f"S={S}"] = row
    ok = True if dry else all(r["speedup_flex_vs_sdpa_padded"] > 1 for r in out.values())
    return {"ok": ok, **out, "headline": {k: r["speedup_flex_vs_sdpa_padded"] for k, r in out.items()}}


# -- recompiles -----------------------------------------------------------------------------------------------
def recompile_overrides(dry: bool, seq_len: int) -> list[str]:
    """train.compile=true with flex (CPU: dense, aot_eager) under op-level SAC, a tiny model."""
    device_keys = (
        ["hardware=cpu", "attn.backend=dense", "train.compile_backend=aot_eager"] if dry else ["hardware=h200_141g"]
    )
    return [
        "model=tiny",
        "attn=packed_doc",
        f"data.seq_len={seq_len}",
        "data.demo_max_files=40",
        "train.micro_batch=1",
        "train.grad_accum=1",
        "memory=selective",
        "memory.granularity=ops",
        "train.compile=true",
        "precision.mode=fp32" if dry else "precision.mode=bf16_mixed",
        "train.progress=false",
        "train.save_final=false",
        *device_keys,
    ]


def _compiles_over_steps(overrides: list[str], warmup: int, steps: int) -> dict:
    """CompileWatch over `steps` train steps after `warmup` ones; the block densities show the layouts differ."""
    from flexengine.cli.common import compose_job
    from flexengine.run import build_trainer
    from flexengine.surgery.compile import CompileWatch

    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(compose_job(overrides), Path(out))
        t0 = time.perf_counter()
        for _ in range(warmup):
            trainer.train_step()
        if warmup:
            FIRST_STEPS.append(time.perf_counter() - t0)
        watch = CompileWatch()
        densities = [trainer.train_step()["block_density"] for _ in range(steps)]
        stats = watch.stats().as_dict()
        trainer.metrics.close()
    return {**stats, "layouts": len({round(d, 6) for d in densities if d is not None}), "densities": densities}


def check_recompiles(dry: bool) -> dict:
    """0 recompiles over new layouts after warm-up; then a row of another length must count as a recompile."""
    seq = 512 if dry else 2048
    steady = _compiles_over_steps(recompile_overrides(dry, seq), warmup=1, steps=3 if dry else 5)
    clean = steady["graphs"] == steady["recompiles"] == steady["graph_breaks"] == 0
    layouts_ok = dry or steady["layouts"] >= 3  # dense on the CPU has no block density: layouts not counted
    record = {
        "ok": clean and layouts_ok,
        "steady": steady,
        "headline": {"recompiles": steady["recompiles"], "graphs": steady["graphs"]},
    }
    if dry:  # the broken variant, same process: a row of another length fails a shape guard of the same blocks
        # (not on the GPU: there it costs a second cold inductor compile to show what the CPU shows)
        broken = _compiles_over_steps(recompile_overrides(dry, seq // 2), warmup=0, steps=1)
        record["broken_other_length"] = broken
        record["headline"]["other_length_recompiles"] = broken["recompiles"]
        record["ok"] = record["ok"] and broken["recompiles"] >= 1
    return record


# -- context parallel -----------------------------------------------------------------------------------------
CP_API = {
    "torch.distributed.tensor.experimental._context_parallel": (
        "_ContextParallel",
        "_PTRRLoadBalancer",
        "_context_parallel_shard",
    ),
    "torch.distributed.tensor.experimental._context_parallel._attention": ("_create_cp_block_mask",),
}


def cp_api_missing() -> list[str]:
    """The private torch names flexengine.surgery.context_parallel and this check use that this torch lacks."""
    missing = []
    for module, names in CP_API.items():
        try:
            m = importlib.import_module(module)
        except ImportError:
            missing.append(module)
            continue
        missing += [f"{module}.{n}" for n in names if not hasattr(m, n)]
    return missing


class _VirtualCPRank:
    """What torch's _create_cp_block_mask reads of a DeviceMesh (its size, this rank, the device type), for one
    rank of a context-parallel group simulated inside one process."""

    def __init__(self, rank: int, size: int, device_type: str):
        self.rank, self.world, self.device_type = rank, size, device_type

    def size(self) -> int:
        return self.world

    def get_local_rank(self) -> int:
        return self.rank


def cp_virtual_ranks(cp: int = 2, seq_len: int = 8192, backward: bool = True, restore: bool = True) -> dict:
    """torch's CP flex math in one process: q of each virtual rank (PTRR order) against the whole reordered K/V
    under torch's CP BlockMask; summing the ranks' dK/dV is what flex_cp_allgather's backward reduce-scatter does.
    Without `backward` (CPU) the ranks' outputs are compared instead; restore=False skips undoing the PTRR order
    (the broken variant)."""
    from torch.distributed.tensor.experimental._context_parallel import _PTRRLoadBalancer
    from torch.distributed.tensor.experimental._context_parallel._attention import _create_cp_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    from flexengine.surgery.attention.block_mask import build_block_mask
    from flexengine.surgery.attention.mask_mode import band_mode, canonical_document_ids

    dev = device()
    flex = torch.compile(flex_attention, dynamic=False) if dev.type == "cuda" else flex_attention
    lengths = doc_lengths(seq_len, 900, 4000, seed=3)
    doc = canonical_document_ids(
        torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None].to(dev)
    )
    mask = build_block_mask(band_mode(True, None), doc, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    heads, dim = (32, 8, 8), 128 if dev.type == "cuda" else 32
    q, k, v = (torch.randn(1, h, seq_len, dim, device=dev, generator=g, requires_grad=backward) for h in heads)
    out = flex(q, k, v, block_mask=mask, enable_gqa=True)
    grad_out = torch.randn(out.shape, device=dev, generator=g)
    ref = torch.autograd.grad(out, (q, k, v), grad_out) if backward else (out.detach(),)

    balancer = _PTRRLoadBalancer(mask, cp)
    order = balancer._generate_indices()[0]  # reordered position -> original position
    qr, kr, vr = (t.detach()[:, :, order].requires_grad_(backward) for t in (q, k, v))
    results = [torch.zeros_like(t) for t in ((qr, kr, vr) if backward else (qr[..., :0].new_zeros(out.shape),))]
    work, shard = [], seq_len // cp
    for rank in range(cp):
        local = slice(rank * shard, (rank + 1) * shard)
        cp_mask = _create_cp_block_mask(
            mask.mask_mod, 1, 1, seq_len, seq_len, _VirtualCPRank(rank, cp, dev.type), balancer
        )
        work.append(int(cp_mask.kv_num_blocks.sum() + cp_mask.full_kv_num_blocks.sum()))
        out_r = flex(qr[:, :, local], kr, vr, block_mask=cp_mask, enable_gqa=True)
        if backward:
            for acc, grad in zip(results, torch.autograd.grad(out_r, (qr, kr, vr), grad_out[:, :, order][:, :, local])):
                acc += grad  # dK/dV: the reduce-scatter's sum over ranks
        else:
            results[0][:, :, local] = out_r.detach()
    undo = torch.argsort(order) if restore else torch.arange(seq_len, device=dev)
    names = ("dq", "dk", "dv") if backward else ("out",)
    errors = {n: float((r[:, :, undo] - t).norm() / t.norm()) for n, r, t in zip(names, results, ref)}
    blocks = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    return {
        "ok": max(errors.values()) < 1e-4 and sum(work) == blocks,
        "relative_errors": errors,
        "documents": len(lengths),
        "blocks_per_rank": work,
        "blocks_total": blocks,
    }


def cp_two_ranks() -> dict:
    """One training step with parallel.cp=2 on 2 GPUs vs the same rows in one process: gradients per tensor."""
    run = [
        "model=tiny",
        "attn=packed_doc",
        "hardware=h200_141g",
        "data.seq_len=2048",
        "data.demo_max_files=80",
        "train.micro_batch=2",
        "precision.mode=fp32",
        "parallel.mixed_precision=false",
        "optim.grad_clip=0",
    ]

    def grads(out: Path, ranks: int, *extra: str) -> dict:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        cmd = [
            *(launcher if ranks else [sys.executable]),
            str(REPO / "tests" / "support" / "parallel_grads.py"),
            str(out),
            *run,
            *extra,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"parallel_grads.py ({ranks} ranks) failed:\n{proc.stderr[-3000:]}")
        return torch.load(out / "grads.pt")["grads"]

    with tempfile.TemporaryDirectory() as d:
        ref, got = grads(Path(d) / "one", 0), grads(Path(d) / "cp2", 2, "parallel.cp=2")
    errors = {n: float((got[n] - ref[n]).norm() / ref[n].norm().clamp(min=1e-30)) for n in ref}
    worst = max(errors, key=errors.get)
    return {
        "ok": got.keys() == ref.keys() and errors[worst] < 1e-4,
        "max_relative_error": errors[worst],
        "worst_tensor": worst,
    }


def check_cp_grads(dry: bool) -> dict:
    """Virtual-rank CP flex math (and the 2-GPU training step where 2 GPUs exist), or the API this torch lacks."""
    missing = cp_api_missing()
    if missing:
        return {
            "ok": None,
            "status": "skipped",
            "skipped": f"skipped: torch {torch.__version__} lacks {', '.join(missing)}",
        }
    importlib.import_module("flexengine.surgery.context_parallel")
    seq = 1024 if dry else 4096  # 32 blocks of 128, 16 per rank: the PTRR order and the reduce are the same at 8K
    virtual = cp_virtual_ranks(seq_len=seq, backward=not dry)
    broken = cp_virtual_ranks(seq_len=seq, backward=not dry, restore=False)
    record = {"virtual_ranks": virtual, "broken_order_not_restored": broken}
    ok = virtual["ok"] and not broken["ok"]
    if torch.cuda.device_count() >= 2:
        record["two_ranks"] = cp_two_ranks()
        ok = ok and record["two_ranks"]["ok"]
    else:
        record["two_ranks"] = f"skipped: {torch.cuda.device_count()} GPU visible, the NCCL training step needs 2"
    worst = max(virtual["relative_errors"].values())
    return {
        "ok": ok,
        **record,
        "headline": {"worst_rel": worst, "unrestored_rel": max(broken["relative_errors"].values())},
    }


# -- doctor ---------------------------------------------------------------------------------------------------
def doctor_overrides(dry: bool) -> list[str]:
    """The doctor's job: a tiny packed run (CPU: varlen)."""
    keys = (
        ["hardware=cpu", "attn.backend=varlen", "data.seq_len=512", "data.demo_max_files=24"]
        if dry
        else [
            "hardware=h200_141g",
            "data.seq_len=2048",
            "data.demo_max_files=80",
        ]
    )
    return ["model=tiny", "attn=packed_doc", "train.micro_batch=2", "train.grad_accum=1", *keys]


def check_doctor(dry: bool) -> dict:
    """The doctor on this device with the tiny model: what it says about a healthy packed run."""
    from flexengine.cli.common import compose_job
    from flexengine.cli.doctor import diagnose

    with tempfile.TemporaryDirectory() as d:
        report = diagnose(compose_job(doctor_overrides(dry)), Path(d), steps=1 if dry else 3)
    n = report["numbers"]
    backend_ok = n["attn_backend"] == ("varlen" if dry else "flex")
    keys = (
        "attn_backend",
        "graphs_compiled_warmup",
        "recompiles_after_warmup",
        "graph_breaks",
        "useful_tokens_per_s",
        "mfu",
        "memory",
    )
    return {
        "ok": backend_ok and n["recompiles_after_warmup"] == 0 and n["graph_breaks"] == 0,
        "numbers": {k: n.get(k) for k in keys},
        "suggestions": report["suggestions"],
        "headline": {k: n.get(k) for k in ("attn_backend", "recompiles_after_warmup", "useful_tokens_per_s")},
    }


# -- FSDP smoke -----------------------------------------------------------------------------------------------
FSDP_TIMEOUT_S = 900  # only for a worker run by hand: under bench/gpu_check.py the check's cap kills torchrun first


def fsdp_smoke_command(dry: bool, run_dir: Path) -> list[str]:
    """torchrun with one process: FSDP2 on one rank (gloo on the CPU)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        "-m",
        "flexengine.train",
        "debug=fast",
        "hardware=cpu" if dry else "hardware=h200_141g",
        f"hydra.run.dir={run_dir}",
    ]


def check_fsdp_smoke(dry: bool) -> dict:
    """FSDP2 under torchrun on one process: exit 0, a finite loss, summary.json and a safetensors checkpoint."""
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "fsdp_smoke"
        proc = subprocess.run(
            fsdp_smoke_command(dry, run_dir),
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=FSDP_TIMEOUT_S,
        )
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        weights = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.safetensors"))
    final = summary.get("final_loss")
    ok = proc.returncode == 0 and final is not None and math.isfinite(final) and bool(weights)
    record = {
        "ok": ok,
        "returncode": proc.returncode,
        "steps": summary.get("steps"),
        "initial_loss": summary.get("initial_loss"),
        "final_loss": final,
        "useful_tokens_per_s": summary.get("useful_tokens_per_s"),
        "safetensors": weights,
        "headline": {"exit": proc.returncode, "final_loss": final, "safetensors": len(weights)},
    }
    if not ok:
        record["tail"] = (proc.stdout + proc.stderr).splitlines()[-30:]
    return record


# -- precision proof ------------------------------------------------------------------------------------------
def check_precision_proof(dry: bool) -> dict:
    """tests/gpu/test_gpu_precision.py's proof, in this process (its JSON line becomes the record)."""
    if dry:
        return {
            "ok": None,
            "status": "skipped",
            "skipped": "CUDA only (tests/surgery/test_precision.py is its CPU twin in CI)",
        }
    from tests.gpu.test_gpu_precision import test_bf16_mixed_follows_fp32_and_bf16_pure_does_not as proof

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            proof()
            error = None
        except AssertionError as e:
            error = f"AssertionError: {e}"
    lines = [json.loads(x) for x in printed.getvalue().splitlines() if x.startswith("{")]
    summary = lines[-1] if lines else {}
    record = {"ok": error is None, "summary": summary}
    if error:
        record["error"] = error
    mixed = summary.get("bf16_mixed", {})
    record["headline"] = {"bf16_mixed_mean_slope": mixed.get("mean_step_slope"), "bf16_mixed_gain": mixed.get("gain")}
    return record


# -- the worker -----------------------------------------------------------------------------------------------
def _free_device() -> float:
    """GiB left allocated once a check's objects are gone (gpu_check_width.release_device_memory)."""
    from gpu_check_width import release_device_memory

    return release_device_memory()


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far: dynamo's frame compiles (inductor's forward
    included) and the backward graphs compiled lazily at their first backward."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(k, ())) for k in ("_compile.compile_inner", "backward._backward_impl"))


def checks() -> dict[str, Callable[[bool], dict]]:
    """Check name -> function(dry) -> record, in bench/gpu_check_list.py's order."""
    import gpu_check_width as width
    from gpu_check_list import CHECKS
    from gpu_check_readme import check_readme_a100

    modes = {f"train_{m}": functools.partial(width.check_train_mode, m) for m in width.MODES}
    table = {
        "env": check_env,
        "readme_a100": check_readme_a100,
        **modes,
        "flex_vs_dense": check_flex_vs_dense,
        "flex_vs_sdpa": check_flex_vs_sdpa,
        "recompiles": check_recompiles,
        "planner_vs_allocator": width.check_planner_vs_allocator,
        "offload_overlap": width.check_offload_overlap,
        "cp_grads": check_cp_grads,
        "doctor": check_doctor,
        "fsdp_smoke": check_fsdp_smoke,
        "precision_proof": check_precision_proof,
    }
    return {c.name: table[c.name] for c in CHECKS}


def append_line(path: Path, record: dict) -> None:
    """One JSON line, flushed to disk before the next check starts (a kill cannot take it back)."""
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _headline(record: dict) -> str:
    return ", ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.get("headline", {}).items()
    )


def is_oom(record: dict) -> bool:
    """The failure was an out-of-memory (the device is fine; the next check can run in this process)."""
    return "OutOfMemoryError" in str(record.get("error")) or "out of memory" in str(record.get("error")).lower()


def device_alive() -> bool:
    """A failed check may leave the CUDA context dead (an illegal address, a device-side assert): every later
    call would then fail in seconds. True when the device still synchronises and computes (or there is none)."""
    if not torch.cuda.is_available():
        return True
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception as e:
        print(f"@@progress device probe failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return False


def after_failure(record: dict) -> bool:
    """Clean up after a failed check: dynamo's caches dropped (a frame skip it remembers for a block's code would
    fail the next check too); after a failure that is not an OOM, the device probed. False: exit this worker."""
    torch._dynamo.reset()
    return is_oom(record) or device_alive()


def run_one(table: dict, name: str, dry: bool, jsonl: Path) -> dict:
    """Run check `name`, append its record to `jsonl` (before anything else can fail) and return it."""
    print(f"@@start {name}", flush=True)
    t0, compiled0 = time.perf_counter(), compile_seconds()
    FIRST_STEPS.clear()
    PROGRESS.clear()
    CHECK_STARTED[0] = t0
    try:
        record = table[name](dry)
    except Exception as e:
        record = {"ok": False, "error": f"{type(e).__name__}: {e}"[:3000], "traceback": traceback.format_exc()[-4000:]}
    record.setdefault("status", "pass" if record.get("ok") else "fail")
    seconds = time.perf_counter() - t0
    # where the seconds went, to re-order the next run by (bench/README.md): compiles in this process, and the
    # first (warm-up) steps of the trainers and models this check ran
    record["compile_s"] = round(compile_seconds() - compiled0, 2)
    if FIRST_STEPS:
        record["first_step_s"] = [round(x, 2) for x in FIRST_STEPS]
    record["progress"] = list(PROGRESS)
    try:
        record["left_allocated_gib"] = _free_device()  # > 1: this check leaked device memory (dynamo was reset)
    except Exception as e:  # a dead context fails here too; the record still goes out
        record["left_allocated_gib"] = f"{type(e).__name__}: {str(e)[:200]}"
    append_line(jsonl, {"check": name, "seconds": round(seconds, 2), "dry_run": dry, **record})
    print(f"@@done {name}: {record['status']} ({seconds:.0f} s) {_headline(record)}", flush=True)
    if record["status"] == "fail" and record.get("error"):
        print(record.get("traceback", record["error"]), flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--fast", action="store_true", help="with --dry-run: the CPU parts without training steps")
    parser.add_argument("names", nargs="+")
    args = parser.parse_args()
    FAST_DRY[0] = args.fast and args.dry_run
    # One process trains many shapes and dtypes through the same compiled code (the decoder block, flex): more
    # cache entries than dynamo's default limit of 8, past which flex would fall back to eager (scores
    # materialised). The recompiles check counts its own compiles with CompileWatch, which this does not change.
    for key in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(256, getattr(torch._dynamo.config, key)))
    # the run's own log lines (its plan, warnings) go to the driver's log next to the @@ lines
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")
    table = checks()
    for name in args.names:
        record = run_one(table, name, args.dry_run, args.jsonl)
        if name == "env" and record["status"] != "pass":
            return  # nothing else can run (no GPU, a missing wheel): the driver records the rest as not run
        if record["status"] == "fail" and not after_failure(record):
            sys.exit(DEAD_DEVICE_EXIT)  # the driver starts a fresh worker (a new CUDA context) for the next check


if __name__ == "__main__":
    main()
