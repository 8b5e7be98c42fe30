"""GPU-only checks of the paths the CPU cannot run: flex backward, compiled flex training, offload overlap and
the planner against the allocator. Skipped without CUDA; bench/gpu_check.py runs each in its own process and
counts a skip or "no tests collected" on a GPU machine as a failure."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers import GPU_TINY_LLAMA

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TINY = GPU_TINY_LLAMA


def _llama(arch: dict, dtype: torch.dtype, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device("cuda"):
        return LlamaForCausalLM(LlamaConfig(**arch)).to(dtype).train()


def _lengths(total: int, mean: int, seed: int) -> list[int]:
    """Long-tailed document lengths filling exactly `total` tokens."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < total:
        n = int(math.exp(math.log(mean) + torch.randn(1, generator=g).item()))
        out.append(max(16, min(n, total - sum(out))))
    return out


def _packed(lengths: list[int], vocab: int, seed: int = 0) -> dict:
    from flexengine.attention import position_ids_from_document_ids
    from flexengine.data.packing import IGNORE_INDEX

    doc = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None].cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, vocab, doc.shape, device="cuda", generator=g)
    pos = position_ids_from_document_ids(doc)
    return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, IGNORE_INDEX)}


@pytest.mark.parametrize("mode", ["packed_doc", "packed_sliding"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_flex_backward_equals_dense_backward(mode, dtype, tol):
    from flexengine.attention import patch_attention
    from flexengine.loss import forward_loss_sum

    window = 64 if mode == "packed_sliding" else None
    flex = patch_attention(_llama(TINY, dtype), mode=mode, window=window, backend="flex", compile=True)
    dense = patch_attention(_llama(TINY, dtype), mode=mode, window=window, backend="dense")
    batch = _packed([300, 17, 500, 1, 150, 56], TINY["vocab_size"])
    lf, ld = forward_loss_sum(flex, batch), forward_loss_sum(dense, batch)
    lf.backward()
    ld.backward()
    assert abs(lf.item() - ld.item()) / abs(ld.item()) < tol
    for (name, a), b in zip(flex.named_parameters(), dense.parameters()):
        rel = (a.grad.float() - b.grad.float()).norm() / b.grad.float().norm().clamp(min=1e-12)
        assert rel < tol, f"{name}: {rel:.2e}"


def test_compiled_training_step_does_not_recompile_over_5_layouts():
    """Compiled blocks (inductor, fullgraph) with flex inside, under op-level SAC: new document layouts of one
    row shape are new BlockMask *inputs*, never a recompile (counted with CompileWatch, not frames.ok)."""
    from flexengine.attention import patch_attention
    from flexengine.compile import CompileWatch, apply_compile
    from flexengine.config import MemoryConfig
    from flexengine.loss import forward_loss_sum
    from flexengine.memory import apply_memory_policy

    torch._dynamo.reset()
    model = patch_attention(_llama(TINY, torch.bfloat16), mode="packed_doc", backend="flex", compile=True)
    apply_memory_policy(model, MemoryConfig(policy="selective", granularity="ops"))
    apply_compile(model, "inductor")
    watch, stats = CompileWatch(), []
    for seed in range(5):
        forward_loss_sum(model, _packed(_lengths(2048, 200, seed), TINY["vocab_size"], seed)).backward()
        stats.append(watch.stats())
        watch.start()
    assert stats[0].graphs >= 1 and stats[0].graph_breaks == 0
    assert [(s.graphs, s.recompiles) for s in stats[1:]] == [(0, 0)] * 4, [s.as_dict() for s in stats]


def _overlap_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Total time the intervals of `a` overlap any interval of `b` (both lists of (start, end))."""
    total = 0
    for s0, e0 in a:
        covered = sorted((max(s0, s1), min(e0, e1)) for s1, e1 in b if s1 < e0 and e1 > s0)
        end = s0
        for s, e in covered:
            total += max(0, e - max(s, end))
            end = max(end, e)
    return total


def test_offload_copies_overlap_compute(tmp_path):
    """memory=offload: device->host and host->device copies run on a side stream while kernels run on the
    compute stream (profiler timeline). Without the side stream the overlap is 0."""
    from flexengine.attention import patch_attention
    from flexengine.config import MemoryConfig
    from flexengine.loss import forward_loss_sum
    from flexengine.memory import apply_memory_policy

    mid = dict(TINY, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8)
    model = patch_attention(_llama(mid, torch.bfloat16), mode="packed_doc", backend="flex", compile=True)
    apply_memory_policy(model, MemoryConfig(policy="offload"))
    batch = _packed(_lengths(8192, 1200, 1), mid["vocab_size"])
    forward_loss_sum(model, batch, 2048).backward()  # warm-up: compile, pinned pools
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward_loss_sum(model, batch, 2048).backward()
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copy_streams = {e["args"].get("stream") for e in copies}
    assert copies and kernels

    def spans(evts):
        return [(int(e["ts"] * 1000), int((e["ts"] + e["dur"]) * 1000)) for e in evts]

    overlap = _overlap_ns(spans(copies), spans([k for k in kernels if k["args"].get("stream") not in copy_streams]))
    copy_ns = sum(e - s for s, e in spans(copies))
    print(json.dumps({"copies": len(copies), "copy_ms": copy_ns / 1e6, "overlapped_fraction": overlap / copy_ns}))
    assert overlap / copy_ns > 0.25, f"only {overlap / copy_ns:.0%} of copy time overlaps compute"


@pytest.mark.parametrize("memory", ["none", "full"])
def test_planner_matches_max_memory_allocated_on_a_full_width_7b(memory, tmp_path):
    """The planner's bytes (minus its CUDA context reserve, which the allocator does not see) against
    torch.cuda.max_memory_allocated over real training steps: llama2_7b at full width, 2 layers, 4K rows."""
    from flexengine.config import MemoryConfig
    from flexengine.doctor import compose_job
    from flexengine.memory.planner import CUDA_RESERVE_BYTES, ModelShape, evaluate, plan_inputs
    from flexengine.run import build_trainer

    job = compose_job(
        [
            "model=llama2_7b",
            "model.init=random",
            "++model.arch.num_hidden_layers=2",
            "attn=packed_doc",
            "data.seq_len=4096",
            "data.demo_max_files=200",
            "train.micro_batch=1",
            "train.grad_accum=1",
            f"memory={memory}",
            "hardware=h100_80g",
            "loss.chunk_size=1024",
            "train.progress=false",
            "train.save_final=false",
        ]
    )
    torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(job, tmp_path)
    for _ in range(2):  # optimizer states exist from the first step on
        trainer.train_step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    inputs = plan_inputs(trainer.job, trainer.plan.hardware, trainer.plan.precision, on_cuda=True)
    planned = (
        evaluate(
            ModelShape.from_hf_config(trainer.model.config),
            inputs,
            MemoryConfig(**trainer.memory_report["memory_policy"]),
        )["total_bytes"]
        - CUDA_RESERVE_BYTES
    )
    print(json.dumps({"memory": memory, "planned_gib": planned / 2**30, "measured_gib": measured / 2**30}))
    assert abs(planned - measured) / measured < 0.10, f"planned {planned / 2**30:.2f} vs {measured / 2**30:.2f} GiB"
