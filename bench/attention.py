"""Attention benchmark (CPU): BlockMask build time, block sparsity, and packed vs padded useful tokens/s.

    python bench/attention.py [--quick]

Writes bench/results/attention.json, .md and .png.
1. Build time of the per-batch BlockMask vs sequence length and document count: flexengine's block-level builder
   vs torch's `create_block_mask` (eager on CPU; it evaluates the mask per element, so it is only run where it
   finishes in reasonable time).
2. Block sparsity (fraction of a causal mask's blocks computed) vs document length mix.
3. Where a packed micro-batch's attention time goes at 1K/4K/8K (mask build, per-chunk SDPA, cat, host sync of
   the dense reference; the varlen backend; one row with a boolean mask vs is_causal; the padded batch).
4. Useful tokens/s of `attn=packed_doc` (bfd packing; varlen and the dense reference on CPU) vs the padded
   baseline `attn=causal` (one document per row, HF SDPA) on the demo corpus at 1K/4K/8K: same model, steps
   interleaved in one process so a shared machine's load falls on all alike.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from flexengine.surgery.attention.block_mask import _create_block_mask, build_batch_mask, canonical_document_ids
from flexengine.surgery.attention.mask_mode import get_mask_mod
from flexengine.surgery.attention.masks import MODES
from flexengine.surgery.attention.spec import AttnBackend

RESULTS = Path(__file__).parent / "results"
TORCH_BUILDER_MAX_S = 32768  # eager create_block_mask on CPU: ~1 s at 8K, ~40 s at 32K, minutes beyond


def _doc_layout(seq_len: int, mean_len: int, rng: np.random.Generator) -> torch.Tensor:
    lengths, total = [], 0
    while total < seq_len:
        n = int(min(max(1, rng.lognormal(np.log(mean_len), 0.8)), seq_len - total))
        lengths.append(n)
        total += n
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _timed(fn, repeats: int = 3, clock=time.perf_counter) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = clock()
        fn()
        times.append(clock() - t)
    return float(np.median(times))


def bench_mask_build(seq_lens: list[int], mean_lens: list[int]) -> list[dict]:
    """Median build time (s) of one row's packed_doc BlockMask, both builders."""
    rng = np.random.default_rng(0)
    rows = []
    for seq_len in seq_lens:
        for mean_len in mean_lens:
            doc = canonical_document_ids(_doc_layout(seq_len, mean_len, rng)[None])
            ours = _timed(lambda doc=doc: build_batch_mask(doc, documents=True, window=None, backend=AttnBackend.FLEX))
            row = {
                "seq_len": seq_len,
                "mean_doc_len": mean_len,
                "documents": int(doc.max()) + 1,
                "flexengine_s": ours,
                "torch_create_block_mask_s": None,
            }
            if seq_len <= TORCH_BUILDER_MAX_S:
                mod = get_mask_mod(doc)
                row["torch_create_block_mask_s"] = _timed(
                    lambda mod=mod, seq_len=seq_len, doc=doc: _create_block_mask(mod, 1, seq_len, doc.device, 128), 1
                )
            rows.append(row)
            theirs = row["torch_create_block_mask_s"]
            print(
                f"mask build S={seq_len:>6} docs={row['documents']:>4}: flexengine {ours * 1e3:8.1f} ms  "
                f"torch {theirs if theirs is None else round(theirs * 1e3, 1)} ms"
            )
    return rows


def bench_sparsity(seq_len: int, mean_lens: list[int], window: int) -> list[dict]:
    """Block sparsity for packed_doc and packed_sliding at several document length mixes."""
    rng = np.random.default_rng(1)
    rows = []
    for mean_len in mean_lens:
        doc = torch.stack([_doc_layout(seq_len, mean_len, rng) for _ in range(4)])
        row = {"seq_len": seq_len, "mean_doc_len": mean_len}
        for mode in ("causal", "packed_doc", "sliding_window", "packed_sliding"):
            m = MODES[mode]
            mask = build_batch_mask(
                doc, documents=m.documents, window=window if m.windowed else None, backend=AttnBackend.FLEX
            )
            row[mode] = float(mask.block_density)
        rows.append(row)
        print(
            f"sparsity S={seq_len} mean doc {mean_len:>5}: "
            + " ".join(f"{m}={row[m]:.3f}" for m in ("packed_doc", "packed_sliding"))
        )
    return rows


def _compose(overrides: list[str]):
    from flexengine.cli.common import compose_job

    return compose_job(overrides)


def demo_batches(seq_len: int, micro_batch: int, packed: bool, n: int) -> list[torch.Tensor]:
    """Document ids [micro_batch, width] of the first n micro-batches the default run would read at this
    seq_len: bfd-packed rows (packed) or one document per row trimmed to the batch's longest (padded)."""
    from flexengine.data.corpus import build_corpus
    from flexengine.data.loader import RowLoader
    from flexengine.data.packing import plan_packing
    from flexengine.surgery.model import load_tokenizer

    job = _compose([f"attn={'packed_doc' if packed else 'causal'}", f"data.seq_len={seq_len}"])
    corpus = build_corpus(job.data, load_tokenizer(job.model))
    plan = plan_packing(corpus.lengths, seq_len, job.data.packing, job.data.long_docs)
    loader = RowLoader(
        corpus, plan, seq_len=seq_len, micro_batch=micro_batch, pad_id=0, seed=job.train.seed, trim_padding=not packed
    )
    return [loader.next_batch()["document_ids"] for _ in range(n)]


def _fwd_bwd(attend, q, k, v) -> float:
    """CPU seconds of one attention forward + backward (median of 3 after a warm-up)."""

    def step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = attend(qq, kk, vv)
        out.backward(torch.ones_like(out))

    return _timed(step, clock=time.process_time)


HEADS = 8, 4, 32  # conf/model/tiny.yaml: 8 query heads, 4 key/value heads, head dim 256 / 8


def _masks(mode: str, backend: str, doc: torch.Tensor, window: int | None = None):
    """One batch's LayerMasks for a single-layer model (what the attention function receives)."""
    from flexengine.surgery.attention.patch import LayerMasks
    from flexengine.surgery.attention.spec import AttentionSpec, AttnBackend

    m = MODES[mode]
    window = window if m.windowed else None
    mask = build_batch_mask(doc, documents=m.documents, window=window, backend=AttnBackend(backend))
    return LayerMasks(AttentionSpec(mode, AttnBackend(backend), (window,), (None,), "bench"), {None: mask})


def _add(acc: dict, values: dict) -> None:
    for key, value in values.items():
        acc[key] = acc.get(key, 0.0) + value


def _qkv(B: int, S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    Hq, Hkv, D = HEADS
    return torch.randn(B, Hq, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)


def _packed_breakdown(doc: torch.Tensor) -> dict:
    """One packed batch: mask/plan build, the dense reference's parts, varlen, and one row bool vs is_causal."""
    import torch.nn.functional as F

    from flexengine.surgery.attention.patch import flexengine_attention
    from flexengine.surgery.attention.varlen import document_runs

    B, S = doc.shape
    q, k, v = _qkv(B, S)
    dense = _masks("packed_doc", "dense", doc)
    varlen = _masks("packed_doc", "varlen", doc)
    chunks = dense.by_hf_window[None].dense_chunks
    starts = torch.arange(0, S, 512)
    outs = [torch.randn(B, HEADS[0], ch.q_end - ch.q_start, HEADS[2]) for ch in chunks]
    causal_bool = torch.ones(S, S, dtype=torch.bool).tril()

    def chunk_sdpa(ch):
        return lambda a, b, c: F.scaled_dot_product_attention(
            a[:, :, ch.q_start : ch.q_end],
            b[:, :, ch.kv_start : ch.q_end],
            c[:, :, ch.kv_start : ch.q_end],
            attn_mask=ch.mask_B1QK,
            enable_gqa=True,
        )

    cpu = time.process_time
    return {
        "tokens": B * S,
        "documents": sum(len(r) for r in document_runs(doc)),
        "chunks": len(chunks),
        "mask_dense_s": _timed(lambda: _masks("packed_doc", "dense", doc), clock=cpu),
        "mask_varlen_s": _timed(lambda: _masks("packed_doc", "varlen", doc), clock=cpu),
        "host_sync_s": _timed(starts.tolist, clock=cpu),
        "dense_attn_s": _fwd_bwd(
            lambda a, b, c: flexengine_attention(None, a, b, c, None, flexengine_mask=dense)[0], q, k, v
        ),
        "dense_sdpa_s": sum(_fwd_bwd(chunk_sdpa(ch), q, k, v) for ch in chunks),
        "cat_s": _timed(lambda: torch.cat(outs, dim=2), clock=cpu) if len(outs) > 1 else 0.0,
        "varlen_attn_s": _fwd_bwd(
            lambda a, b, c: flexengine_attention(None, a, b, c, None, flexengine_mask=varlen)[0], q, k, v
        ),
        "row_bool_mask_s": _fwd_bwd(
            lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=causal_bool, enable_gqa=True), q, k, v
        ),
        "row_is_causal_s": _fwd_bwd(
            lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True), q, k, v
        ),
    }


def _padded_breakdown(doc: torch.Tensor) -> dict:
    """One padded batch (one document per row, as wide as its longest): HF's causal SDPA call."""
    import torch.nn.functional as F

    B, W = doc.shape
    q, k, v = _qkv(B, W)
    return {
        "padded_tokens": B * W,
        "padded_attn_s": _fwd_bwd(
            lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True), q, k, v
        ),
    }


def bench_breakdown(seq_lens: list[int], micro_batch: int, n_batches: int) -> list[dict]:
    """Where one micro-batch's attention time goes (one layer, tiny LLaMA heads), packed vs padded.

    CPU time of one thread (process_time): on a machine shared with other jobs, wall time measures the
    neighbours; one thread's CPU time measures the work."""
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for seq_len in seq_lens:
        acc: dict = {}
        for doc in demo_batches(seq_len, micro_batch, True, n_batches):
            _add(acc, _packed_breakdown(doc))
        for doc in demo_batches(seq_len, micro_batch, False, n_batches):
            _add(acc, _padded_breakdown(doc))
        row = {"seq_len": seq_len, "micro_batch": micro_batch, "batches": n_batches, "kernels": _kernel_names(seq_len)}
        row.update({key: value / n_batches for key, value in acc.items()})
        rows.append(row)
        print(
            f"breakdown S={seq_len}: "
            + " ".join(f"{key}={value:.4g}" for key, value in row.items() if isinstance(value, float))
        )
    torch.set_num_threads(threads)
    return rows


def bench_other_options(seq_len: int, micro_batch: int) -> dict:
    """The other candidates for packed rows: nested (jagged) tensors in SDPA, and compiled FlexAttention's forward (an
    inference-only path, FlexAttention has no CPU backward) against varlen's forward on one demo batch."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from flexengine.surgery.attention.patch import flexengine_attention

    result: dict = {"seq_len": seq_len}
    docs = [torch.randn(n, 8, 32) for n in (600, 424, 1024)]
    try:
        nested = torch.nested.nested_tensor(docs, layout=torch.jagged).transpose(1, 2)
        F.scaled_dot_product_attention(nested, nested, nested, is_causal=True)
        result["nested_causal"] = "runs"
    except RuntimeError as e:
        result["nested_causal"] = f"refused: {str(e).splitlines()[0]}"
    doc = demo_batches(seq_len, micro_batch, True, 1)[0]
    B, S = doc.shape
    q, k, v = torch.randn(B, 8, S, 32), torch.randn(B, 4, S, 32), torch.randn(B, 4, S, 32)
    varlen = _masks("packed_doc", "varlen", doc)
    flex = _masks("packed_doc", "flex", doc).by_hf_window[None]
    compiled = torch.compile(flex_attention, dynamic=False)
    t = time.perf_counter()
    with torch.no_grad():
        compiled(q, k, v, block_mask=flex.block_mask, enable_gqa=True)
    result["flex_compile_s"] = time.perf_counter() - t
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.no_grad():
        result["flex_forward_s"] = _timed(
            lambda: compiled(q, k, v, block_mask=flex.block_mask, enable_gqa=True), clock=time.process_time
        )
        result["varlen_forward_s"] = _timed(
            lambda: flexengine_attention(None, q, k, v, None, flexengine_mask=varlen), clock=time.process_time
        )
    windowed = {}
    for window in (256, 1024):
        for backend in ("dense", "varlen"):
            mask = _masks("packed_sliding", backend, doc, window)
            windowed[f"{backend}_{window}"] = _fwd_bwd(
                lambda a, b, c, m=mask: flexengine_attention(None, a, b, c, None, flexengine_mask=m)[0], q, k, v
            )
    result["windowed_fwd_bwd_s"] = windowed
    torch.set_num_threads(threads)
    print(f"other options S={seq_len}: {result}")
    return result


def _kernel_names(seq_len: int) -> dict:
    """The aten kernel SDPA dispatches to on this CPU, with a boolean mask and with is_causal."""
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(1, 8, min(seq_len, 512), 32)
    picked = {}
    for name, kwargs in (
        ("bool_mask", {"attn_mask": torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()}),
        ("is_causal", {"is_causal": True}),
    ):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            F.scaled_dot_product_attention(q, q, q, **kwargs)
        picked[name] = sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot")})
    return picked


def bench_throughput(steps: int, seq_lens: list[int], micro_batch: int) -> list[dict]:
    """Useful tokens/s of the padded baseline and packed_doc (varlen, and the dense reference), the trainers'
    steps interleaved so that a shared machine's load falls on all of them alike."""
    from flexengine.run import build_trainer

    results = []
    for seq_len in seq_lens:
        runs = {
            "causal (padded, HF SDPA)": ["attn=causal"],
            "packed_doc (varlen)": ["attn=packed_doc", "attn.backend=varlen"],
            "packed_doc (dense reference)": ["attn=packed_doc", "attn.backend=dense"],
        }
        trainers, totals = {}, {}
        with tempfile.TemporaryDirectory() as out:
            for name, overrides in runs.items():
                job = _compose(
                    overrides
                    + [
                        f"data.seq_len={seq_len}",
                        f"train.micro_batch={micro_batch}",
                        "train.grad_accum=1",
                        "train.save_final=false",
                        "train.progress=false",
                        f"train.output_dir={out}/{len(trainers)}",
                    ]
                )
                trainers[name] = build_trainer(job, Path(out) / str(len(trainers)))
                totals[name] = {"wall_s": 0.0, "cpu_s": 0.0, "tokens": 0, "useful_tokens": 0}
            for step in range(steps + 1):  # step 0 warms up (allocator, first-call costs) and is not counted
                for name, trainer in trainers.items():
                    t, c = time.perf_counter(), time.process_time()
                    m = trainer.train_step()
                    if step:
                        totals[name]["wall_s"] += time.perf_counter() - t
                        totals[name]["cpu_s"] += time.process_time() - c
                        totals[name]["tokens"] += m["tokens"]
                        totals[name]["useful_tokens"] += m["useful_tokens"]
        row = {"seq_len": seq_len, "micro_batch": micro_batch, "steps": steps}
        for name, tot in totals.items():
            row[name] = {
                "useful_tokens_per_s": tot["useful_tokens"] / tot["wall_s"],
                "tokens_per_s": tot["tokens"] / tot["wall_s"],
                "useful_token_fraction": tot["useful_tokens"] / tot["tokens"],
                "wall_s": tot["wall_s"],
                "useful_tokens_per_cpu_s": tot["useful_tokens"] / tot["cpu_s"],
                "cpu_s": tot["cpu_s"],
            }
        padded = row["causal (padded, HF SDPA)"]
        for name in ("packed_doc (varlen)", "packed_doc (dense reference)"):
            packed = row[name]
            packed["gain"] = packed["useful_tokens_per_s"] / padded["useful_tokens_per_s"]
            packed["ideal_gain"] = packed["useful_token_fraction"] / padded["useful_token_fraction"]
            packed["realised"] = packed["gain"] / packed["ideal_gain"]  # = per-token cost, padded / packed
            packed["realised_cpu"] = (
                packed["useful_tokens_per_cpu_s"] / padded["useful_tokens_per_cpu_s"] / packed["ideal_gain"]
            )
        results.append(row)
        print(
            f"S={seq_len}: "
            + "; ".join(
                f"{name} {r['useful_tokens_per_s']:.0f} useful tok/s (fraction {r['useful_token_fraction']:.3f})"
                + (
                    f", gain {r['gain']:.2f}x of ideal {r['ideal_gain']:.2f}x = {r['realised']:.0%}"
                    if "gain" in r
                    else ""
                )
                for name, r in row.items()
                if isinstance(r, dict)
            )
        )
    return results


def _breakdown_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    r0 = rows[0]
    title = (
        f"## Where a packed micro-batch's attention time goes (one layer, fwd+bwd, demo corpus, micro_batch "
        f"{r0['micro_batch']}, mean of {r0['batches']} batches; tiny LLaMA heads 8q/4kv x 32, fp32; CPU ms of "
        "one thread, so that a shared machine's load does not count)"
    )
    kernels = (
        f"SDPA's kernel on this CPU: boolean mask -> {', '.join(r0['kernels']['bool_mask'])}; is_causal -> "
        f"{', '.join(r0['kernels']['is_causal'])}. Same flash kernel: with a mask it visits every key block "
        "of a call, with is_causal it skips the blocks above the diagonal."
    )
    header = (
        "| seq_len | docs / batch | dense: mask build (ms) | dense: chunks | dense: per-chunk SDPA (ms) | "
        "dense: cat (ms) | dense: host sync (ms) | dense attention (ms) | varlen: plan (ms) | "
        "varlen attention (ms) | one row, bool causal mask (ms) | one row, is_causal (ms) | "
        "padded batch, is_causal (ms) | dense / varlen per token | varlen / padded per token |"
    )
    out = ["", title, "", kernels, "", header, "|" + "---|" * 15]
    for r in rows:
        varlen_per_token = r["varlen_attn_s"] / r["tokens"]
        out.append(
            f"| {r['seq_len']} | {r['documents']:.1f} | {r['mask_dense_s'] * 1e3:.1f} | {r['chunks']:.0f} | "
            f"{r['dense_sdpa_s'] * 1e3:.1f} | {r['cat_s'] * 1e3:.2f} | {r['host_sync_s'] * 1e3:.3f} | "
            f"{r['dense_attn_s'] * 1e3:.1f} | {r['mask_varlen_s'] * 1e3:.2f} | {r['varlen_attn_s'] * 1e3:.1f} | "
            f"{r['row_bool_mask_s'] * 1e3:.1f} | {r['row_is_causal_s'] * 1e3:.1f} | {r['padded_attn_s'] * 1e3:.1f} | "
            f"{r['dense_attn_s'] / r['tokens'] / varlen_per_token:.2f} | "
            f"{varlen_per_token / (r['padded_attn_s'] / r['padded_tokens']):.2f} |"
        )
    return out


def _options_lines(r: dict | None) -> list[str]:
    if not r:
        return []
    windowed = ", ".join(
        f"window {w}: dense {r['windowed_fwd_bwd_s'][f'dense_{w}'] * 1e3:.0f} ms, varlen "
        f"{r['windowed_fwd_bwd_s'][f'varlen_{w}'] * 1e3:.0f} ms"
        for w in (256, 1024)
    )
    flex = (
        f"- compiled FlexAttention forward (eval/inference only; no CPU backward): "
        f"{r['flex_forward_s'] * 1e3:.1f} ms per call after a {r['flex_compile_s']:.0f} s compile, vs varlen "
        f"{r['varlen_forward_s'] * 1e3:.1f} ms ({r['flex_forward_s'] / r['varlen_forward_s']:.2f}x)."
    )
    return [
        "",
        f"## The other candidates (S={r['seq_len']}, one demo batch, CPU ms of one thread)",
        "",
        f"- nested (jagged) tensors, SDPA with is_causal: {r['nested_causal']}.",
        flex,
        f"- sliding windows (packed_sliding, same batch, fwd+bwd): {windowed}.",
    ]


def _throughput_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    r0 = rows[0]
    title = (
        f"## Useful tokens/s on the demo corpus (tiny LLaMA, micro_batch {r0['micro_batch']}, {r0['steps']} "
        "steps each after one warm-up step, the three trainers' steps interleaved in one process)"
    )
    legend = (
        "causal = one document per row padded to the batch's longest, HF SDPA. Gain = useful tok/s over "
        "causal; ideal = useful-fraction ratio (a packed token costing what a padded one costs); realised = "
        "gain / ideal. Realised (CPU) is the same ratio from each trainer's CPU seconds (process time, all "
        "its threads) instead of wall seconds."
    )
    header = (
        "| seq_len | attn | useful tok/s | tok/s | useful fraction | gain | ideal | realised | "
        "useful tok/CPU-s | realised (CPU) |"
    )
    out = ["", title, "", legend, "", header, "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for name, r in row.items():
            if not isinstance(r, dict):
                continue
            packed = "gain" in r
            extra = f"{r['gain']:.2f}x | {r['ideal_gain']:.2f}x | **{r['realised']:.0%}**" if packed else "1.00x | | "
            cpu = f"{r['realised_cpu']:.0%}" if packed else ""
            out.append(
                f"| {row['seq_len']} | {name} | {r['useful_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | "
                f"{r['useful_token_fraction']:.3f} | {extra} | {r['useful_tokens_per_cpu_s']:.0f} | {cpu} |"
            )
    return out


def write_outputs(report: dict) -> None:
    """JSON + Markdown + PNG under bench/results/."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "attention.json").write_text(json.dumps(report, indent=2))
    load = f"; 1-min load average {report['load_avg_start']:.1f} at the start" if "load_avg_start" in report else ""
    load += f", {report['load_avg_end']:.1f} at the end" if "load_avg_end" in report else ""
    machine = (
        f"torch {torch.__version__}, {report['cpu_threads']} CPU threads (torch.get_num_threads()), "
        f"{os.cpu_count()} cores{load}"
    )
    lines = [
        "# Attention benchmark (CPU)",
        "",
        machine,
        "",
        "## BlockMask build time (one row, packed_doc)",
        "",
        "| seq_len | documents | flexengine block-level (ms) | torch create_block_mask eager (ms) |",
        "|---|---|---|---|",
    ]
    for r in report["mask_build"]:
        theirs = r["torch_create_block_mask_s"]
        torch_ms = "not run (too slow on CPU)" if theirs is None else f"{theirs * 1e3:.1f}"
        lines.append(f"| {r['seq_len']} | {r['documents']} | {r['flexengine_s'] * 1e3:.1f} | {torch_ms} |")
    lines += [
        "",
        f"## Block sparsity (fraction of causal blocks computed, window {report['window']})",
        "",
        "| seq_len | mean doc len | causal | packed_doc | sliding_window | packed_sliding |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["sparsity"]:
        lines.append(
            f"| {r['seq_len']} | {r['mean_doc_len']} | {r['causal']:.3f} | {r['packed_doc']:.3f} | "
            f"{r['sliding_window']:.3f} | {r['packed_sliding']:.3f} |"
        )
    lines += _breakdown_lines(report.get("breakdown", []))
    lines += _options_lines(report.get("other_options"))
    lines += _throughput_lines(report.get("throughput", []))
    (RESULTS / "attention.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    by_len: dict = {}
    for r in report["mask_build"]:
        by_len.setdefault(r["seq_len"], []).append(r)
    xs = sorted(by_len)
    ax[0].plot(xs, [np.median([r["flexengine_s"] for r in by_len[x]]) * 1e3 for x in xs], "o-", label="flexengine")
    tx = [x for x in xs if all(r["torch_create_block_mask_s"] is not None for r in by_len[x])]
    ax[0].plot(
        tx,
        [np.median([r["torch_create_block_mask_s"] for r in by_len[x]]) * 1e3 for x in tx],
        "s-",
        label="torch create_block_mask (eager)",
    )
    ax[0].set(
        xscale="log",
        yscale="log",
        xlabel="sequence length",
        ylabel="build time per row (ms)",
        title="BlockMask build (CPU)",
    )
    ax[0].legend()
    sp = report["sparsity"]
    for mode in ("packed_doc", "packed_sliding", "sliding_window"):
        ax[1].plot([r["mean_doc_len"] for r in sp], [r[mode] for r in sp], "o-", label=mode)
    ax[1].set(
        xscale="log",
        xlabel="mean document length",
        ylabel="blocks computed / causal blocks",
        title=f"Block sparsity at S={sp[0]['seq_len']}",
    )
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "attention.png", dpi=110)


def main() -> None:
    """Run all parts and write the results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller grid, no throughput run")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--micro-batch", type=int, default=2)  # the default run's
    parser.add_argument("--breakdown-batches", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0 = torch's default); 1 keeps a shared machine's oversubscribed "
        "OpenMP barriers out of the comparison",
    )
    parser.add_argument(
        "--keep-mask-results",
        action="store_true",
        help="reuse parts 1-2 (BlockMask build, sparsity) from the last attention.json",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    seq_lens = [8192, 32768] if args.quick else [8192, 32768, 131072]
    report = {"cpu_threads": torch.get_num_threads(), "window": 1024, "load_avg_start": os.getloadavg()[0]}
    if args.keep_mask_results:
        last = json.loads((RESULTS / "attention.json").read_text())
        report.update(mask_build=last["mask_build"], sparsity=last["sparsity"])
    else:
        report.update(
            mask_build=bench_mask_build(seq_lens, [512, 2048, 8192]),
            sparsity=bench_sparsity(32768, [256, 1024, 4096, 16384], window=1024),
        )
    # the throughput first: it is the headline, and results are written after every part
    if not args.quick:
        report["throughput"] = []
        for seq_len in args.seq_lens:
            report["throughput"] += bench_throughput(args.steps, [seq_len], args.micro_batch)
            write_outputs(report)
    report["breakdown"] = bench_breakdown(args.seq_lens, args.micro_batch, 1 if args.quick else args.breakdown_batches)
    write_outputs(report)
    if not args.quick:
        report["other_options"] = bench_other_options(4096, args.micro_batch)
    report["load_avg_end"] = os.getloadavg()[0]
    write_outputs(report)


if __name__ == "__main__":
    main()
