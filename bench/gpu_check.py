"""Every GPU check of flexengine in one process, within a time budget; one JSON with each check's numbers or error.

Checks (each in try/except, results written after every check so a timeout still leaves a file):
  grads        flex backward grads == dense grads (packed_doc, packed_sliding; fp32 and bf16), tiny LLaMA
  recompiles   compiled flex over 5 document layouts of one shape: frames compiled after the first layout
  step_time    compiled flex (packed rows) vs HF SDPA (the same documents, padded) at 8K and 32K, ~0.9B LLaMA
  memory       peak CUDA memory of one step per memory policy (none / full / selective / offload), vs planner
  doctor       `flexengine.doctor` on the GPU (tiny model): verdicts and suggestions
  pytest_gpu   the test suite's `-m gpu` tests
Run through bench/gpu_check.sh. Usage: python bench/gpu_check.py --out bench/results/gpu_check.json [--budget-s 450]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
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

DEV = torch.device("cuda")
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=65536, use_cache=False, tie_word_embeddings=False)
ONE_B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=8, max_position_embeddings=65536, use_cache=False, tie_word_embeddings=False,
             rope_theta=500000.0)
MID = dict(ONE_B, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
           num_key_value_heads=4)


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
        chunk = lengths[i:i + per_batch]
        L = max(chunk)
        ids = torch.randint(0, vocab, (len(chunk), L), device=DEV, generator=g)
        real = torch.arange(L, device=DEV)[None] < torch.tensor(chunk, device=DEV)[:, None]
        labels = ids.masked_fill(~real, IGNORE_INDEX)
        # right padding + causal attention: real tokens never see the pads, so no attention mask is needed
        out.append({"input_ids": ids, "position_ids": torch.arange(L, device=DEV)[None].expand(len(chunk), L),
                    "labels": labels})
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
def check_grads() -> dict:
    """Flex (compiled) and dense masks give the same loss and grads on CUDA."""
    out, ok = {}, True
    lengths = [300, 17, 500, 1, 150, 56]  # 1024 tokens, one single-token document
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 3e-2)):
        for mode in ("packed_doc", "packed_sliding"):
            flex, dense = make_llama(TINY, dtype), make_llama(TINY, dtype)
            patch_attention(flex, mode=mode, window=64, backend="flex", compile=True)
            patch_attention(dense, mode=mode, window=64, backend="dense")
            batch = packed_batch(lengths, TINY["vocab_size"])
            lf, ld = forward_loss_sum(flex, batch), forward_loss_sum(dense, batch)
            lf.backward()
            ld.backward()
            rel = max(((a.grad.float() - b.grad.float()).norm() / b.grad.float().norm().clamp(min=1e-12)).item()
                      for a, b in zip(flex.parameters(), dense.parameters()))
            key = f"{mode}/{str(dtype).replace('torch.', '')}"
            out[key] = {"loss_flex": lf.item(), "loss_dense": ld.item(), "max_rel_grad_err": rel, "tol": tol}
            ok &= rel < tol and abs(lf.item() - ld.item()) / abs(ld.item()) < tol
    return {"ok": ok, **out}


def check_recompiles() -> dict:
    """5 document layouts of one row shape: only the first compiles (BlockMasks are inputs, not constants)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = make_llama(TINY, torch.bfloat16)
    patch_attention(model, mode="packed_doc", backend="flex", compile=True)
    frames = []
    for seed in range(5):
        fwd_bwd(model, packed_batch(doc_lengths(2048, 200, 2048, seed), TINY["vocab_size"], seed))
        frames.append(int(counters["frames"]["ok"]))
    return {"ok": frames[-1] == frames[0], "frames_compiled_after_each_layout": frames,
            "recompiles_after_first": frames[-1] - frames[0],
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def check_step_time(seq_lens=(8192, 32768)) -> dict:
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
            row[name] = {"step_s": seconds, "first_step_s": t_first, "useful_tokens_per_s": S / seconds,
                         "token_slots": sum(b["input_ids"].numel() for b in batches),
                         "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
            del model, batches
            torch.cuda.empty_cache()
        row["speedup_flex_vs_sdpa_padded"] = row["sdpa_padded"]["step_s"] / row["flex_packed"]["step_s"]
        out[f"S={S}"] = row
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**ONE_B)).parameters())
    return {"ok": all(r["speedup_flex_vs_sdpa_padded"] > 1 for r in out.values()), "params": params, **out}


def check_memory(S: int = 8192) -> dict:
    """Peak CUDA bytes of one fwd+bwd per memory policy (packed_doc, flex); full must be below none."""
    policies = {"none": MemoryConfig(), "full": MemoryConfig(policy="full"),
                "selective_ops": MemoryConfig(policy="selective", granularity="ops"),
                "offload": MemoryConfig(policy="offload")}
    batch = packed_batch(doc_lengths(S, 1200, S, seed=1), MID["vocab_size"])
    out = {}
    for name, memory in policies.items():
        try:
            model = make_llama(MID, torch.bfloat16)
            patch_attention(model, mode="packed_doc", backend="flex", compile=True)
            apply_memory_policy(model, memory)
            fwd_bwd(model, batch, chunk=2048)  # warm-up: compile, allocator
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fwd_bwd(model, batch, chunk=2048)
            torch.cuda.synchronize()
            out[name] = {"peak_above_weights_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}
            out[name]["planner_activation_gib"] = _planner_activation_gib(model, memory, S)
            del model
            torch.cuda.empty_cache()
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    none, full = out.get("none", {}), out.get("full", {})
    ok = "peak_above_weights_gib" in none and "peak_above_weights_gib" in full and \
        full["peak_above_weights_gib"] < none["peak_above_weights_gib"]
    return {"ok": ok, "seq_len": S, **out}


def _planner_activation_gib(model, memory: MemoryConfig, S: int):
    try:
        from flexengine.memory import planner

        shape = planner.ModelShape.from_hf_config(model.config)
        w = planner.Workload(1, S, 2, "flex", 2048)
        return planner.estimate_activations(shape, w, memory).total_bytes / 2**30
    except Exception as e:  # planner absent or changed: the measurement still stands
        return f"unavailable: {type(e).__name__}: {e}"


def check_doctor() -> dict:
    """The doctor on the GPU with the tiny model: what it says about a healthy packed run."""
    import tempfile

    from flexengine.doctor import compose_job, diagnose

    job = compose_job(["model=tiny", "attn=packed_doc", "hardware=h100_80g", "data.seq_len=2048",
                       "data.demo_max_files=80", "train.micro_batch=2", "train.grad_accum=1"])
    with tempfile.TemporaryDirectory() as d:
        report = diagnose(job, Path(d), steps=3)
    n = report["numbers"]
    return {"ok": n["attn_backend"] == "flex" and n["recompiles_after_warmup"] == 0,
            "numbers": {k: n[k] for k in ("attn_backend", "mask_backends_seen", "recompiles_after_warmup",
                                           "graph_breaks", "useful_tokens_per_s", "mfu", "time_split",
                                           "block_sparsity")},
            "suggestions": report["suggestions"]}


def check_pytest_gpu(timeout_s: float) -> dict:
    """The suite's GPU-marked tests."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-x", "-p", "no:cacheprovider"],
                          cwd=REPO, capture_output=True, text=True, timeout=max(10, timeout_s))
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"ok": proc.returncode in (0, 5), "returncode": proc.returncode, "tail": tail}  # 5 = none collected


CHECKS = (("grads", check_grads, 30), ("recompiles", check_recompiles, 20), ("step_time", check_step_time, 150),
          ("memory", check_memory, 60), ("doctor", check_doctor, 40), ("pytest_gpu", None, 30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu_check.json")
    parser.add_argument("--budget-s", type=float, default=450.0, help="skip checks that would start after this")
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks")
    args = parser.parse_args()
    start = time.perf_counter()
    result = {"env": {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}, "checks": {}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result["env"].update(gpu=props.name, memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, fn, min_left in CHECKS:
        if args.only and name not in args.only:
            continue
        left = args.budget_s - (time.perf_counter() - start)
        if not torch.cuda.is_available():
            result["checks"][name] = {"ok": False, "skipped": "no CUDA device"}
        elif left < min_left:
            result["checks"][name] = {"ok": False, "skipped": f"time budget: {left:.0f} s left, needs ~{min_left} s"}
        else:
            t0 = time.perf_counter()
            try:
                record = fn() if fn is not None else check_pytest_gpu(left - 5)
            except Exception as e:
                record = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            record["seconds"] = time.perf_counter() - t0
            result["checks"][name] = record
            torch.cuda.empty_cache()
        print(f"{name:>12}: {json.dumps(result['checks'][name], default=str)[:400]}", flush=True)
        result["total_s"] = time.perf_counter() - start
        args.out.write_text(json.dumps(result, indent=2, default=str))
    result["all_ok"] = all(c.get("ok") for c in result["checks"].values())
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"all_ok={result['all_ok']} total {result.get('total_s', 0):.0f} s -> {args.out}")
    sys.exit(0 if result["all_ok"] else 1)


if __name__ == "__main__":
    main()
