"""flexengine vs the plain Hugging Face recipe a user would write, same tiny model, same data, one process.

The HF recipe: one document per row (truncated to seq_len), batches padded to their longest document, HF's own
SDPA attention, `gradient_checkpointing_enable()`, AdamW, a minimal loop. flexengine: packed rows with
per-document masks (attn=packed_doc) and memory=full (the same recompute as the recipe), or memory=none.
Each trains from the same random init until it has seen the same number of useful (document) tokens; then all
are scored on the same held-out documents. MFU counts model FLOPs (flexengine.loop.flops: useful tokens, attended
pairs, LoRA-aware) against hardware.peak_tflops of conf/hardware/cpu.yaml; `mfu_old_formula` is what the
formula the engine used before it counted attended pairs (6 x non-embedding params + a full causal square of
attention per useful token) gives for the same run. Writes bench/results/peer_hf.{json,md}.
Usage: python bench/peer_hf.py [--tokens N]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from flexengine.cli.doctor import compose_job
from flexengine.data.build import pad_token_id
from flexengine.data.corpus import build_corpus
from flexengine.data.demo import iter_demo_documents
from flexengine.data.packing import IGNORE_INDEX
from flexengine.loop.flops import TrainFlops, attended_pairs
from flexengine.run import build_trainer
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.model import build_hf_config, load_tokenizer

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
SEQ_LEN, FILES, TRAIN_DOCS, EVAL_DOCS = 512, 160, 120, 16
LR, SEED = 1e-3, 0
# constant learning rate for both sides (no warmup, min_lr_ratio=1): the comparison is per token, not per step
BASE = [
    "experiment=cpu_compare",
    f"data.seq_len={SEQ_LEN}",
    f"data.demo_max_files={FILES}",
    f"data.max_docs={TRAIN_DOCS}",
    "data.shuffle=true",
    f"optim.lr={LR}",
    "optim.warmup_steps=0",
    "optim.min_lr_ratio=1.0",
    f"train.seed={SEED}",
    "train.grad_accum=1",
]


def old_flops_per_token(model, seq_len: int) -> float:
    """The MFU numerator per useful token before attended pairs were counted: 6 x (non-embedding params) +
    attention as a full causal square (seq_len / 2 keys per query), whatever the documents."""
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 6 * n_params + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq_len * 0.5


def utilisation(flops: float, wall: float, peak_tflops: float) -> float:
    """FLOP/s as a fraction of the peak."""
    return flops / wall / (peak_tflops * 1e12)


def eval_batches(tokenizer) -> list[dict]:
    """Held-out documents (after the training ones in the demo list), one per batch, truncated to seq_len."""
    texts = [t for _, t in iter_demo_documents(FILES)][TRAIN_DOCS : TRAIN_DOCS + EVAL_DOCS]
    out = []
    for text in texts:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:SEQ_LEN])[None]
        out.append({"input_ids": ids, "position_ids": torch.arange(ids.shape[1])[None], "labels": ids.clone()})
    return out


@torch.no_grad()
def eval_loss(model, batches: list[dict]) -> float:
    """Mean next-token CE over the held-out documents (the same code for every model)."""
    model.eval()
    total = sum(forward_loss_sum(model, b).item() for b in batches)
    count = sum(b["labels"].shape[1] - 1 for b in batches)
    model.train()
    return total / count


def hf_recipe(token_budget: int, micro_batch: int, eval_set: list[dict]) -> dict:
    """The plain recipe: padded one-document-per-row batches, HF sdpa, HF gradient checkpointing."""
    from transformers import AutoModelForCausalLM

    job = compose_job(BASE)
    tokenizer = load_tokenizer(job.model)
    corpus = build_corpus(job.data, tokenizer)  # the same token ids flexengine trains on
    # a copy: the corpus is a read-only memory map
    docs = [
        torch.tensor(corpus.tokens[a:b][:SEQ_LEN], dtype=torch.long)
        for a, b in zip(corpus.offsets[:-1], corpus.offsets[1:])
    ]
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(build_hf_config(job.model), attn_implementation="sdpa")
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    pad = pad_token_id(tokenizer)
    rng = random.Random(SEED)
    flops = TrainFlops(model)  # model FLOPs only: HF's own recompute and logits are not ours to count
    useful = slots = steps = 0
    model_flops = 0.0
    t0 = time.perf_counter()
    while useful < token_budget:
        order = list(range(len(docs)))
        rng.shuffle(order)
        for i in range(0, len(order) - micro_batch + 1, micro_batch):
            batch = [docs[j] for j in order[i : i + micro_batch]]
            longest = max(len(d) for d in batch)
            ids = torch.full((len(batch), longest), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, d in enumerate(batch):
                ids[r, : len(d)], mask[r, : len(d)] = d, 1
            labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            useful, slots, steps = useful + int(mask.sum()), slots + ids.numel(), steps + 1
            lengths = [len(d) for d in batch]
            model_flops += flops.model_flops(sum(lengths), sum(n - 1 for n in lengths), attended_pairs(lengths))
            if useful >= token_budget:
                break
    wall = time.perf_counter() - t0
    peak = job.hardware.peak_tflops
    return {
        "recipe": "HF: padded rows, sdpa, gradient_checkpointing_enable()",
        "steps": steps,
        "useful_tokens": useful,
        "token_slots": slots,
        "wall_s": wall,
        "useful_tokens_per_s": useful / wall,
        "useful_token_fraction": useful / slots,
        "mfu": utilisation(model_flops, wall, peak),
        "hfu": None,
        "mfu_old_formula": utilisation(useful * old_flops_per_token(model, SEQ_LEN), wall, peak),
        "eval_loss": eval_loss(model, eval_set),
    }


def flexengine_recipe(token_budget: int, micro_batch: int, memory: str, eval_set: list[dict], work: Path) -> dict:
    """flexengine's own step (packed rows, document masks) until the same useful-token count."""
    job = compose_job(
        [
            *BASE,
            "attn=packed_doc",
            f"memory={memory}",
            f"train.micro_batch={micro_batch}",
            f"train.output_dir={work / memory}",
            "train.max_steps=100000",
        ]
    )
    trainer = build_trainer(job, work / memory)
    trainer.model.train()
    useful = slots = steps = 0
    model_flops = hardware_flops = 0.0
    t0 = time.perf_counter()
    while useful < token_budget:
        m = trainer.train_step()
        useful, slots, steps = useful + m["useful_tokens"], slots + m["tokens"], steps + 1
        model_flops, hardware_flops = model_flops + m["model_flops"], hardware_flops + m["hardware_flops"]
    wall = time.perf_counter() - t0
    trainer.metrics.close()
    peak = job.hardware.peak_tflops
    return {
        "recipe": f"flexengine: attn=packed_doc memory={memory} ({trainer.attn.backend.value})",
        "steps": steps,
        "useful_tokens": useful,
        "token_slots": slots,
        "wall_s": wall,
        "useful_tokens_per_s": useful / wall,
        "useful_token_fraction": useful / slots,
        "mfu": utilisation(model_flops, wall, peak),
        "hfu": utilisation(hardware_flops, wall, peak),
        "mfu_old_formula": utilisation(useful * old_flops_per_token(trainer.model, SEQ_LEN), wall, peak),
        "eval_loss": eval_loss(trainer.model, eval_set),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=12_000, help="useful tokens each recipe trains on")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = load_tokenizer(compose_job(BASE).model)
    eval_set = eval_batches(tokenizer)
    with tempfile.TemporaryDirectory() as work:
        rows = [hf_recipe(args.tokens, 4, eval_set)]
        for memory in ("full", "none"):
            rows.append(flexengine_recipe(args.tokens, 2, memory, eval_set, Path(work)))
    base = rows[0]["useful_tokens_per_s"]
    for r in rows:
        r["speedup_vs_hf"] = r["useful_tokens_per_s"] / base
    meta = {
        "model": "tiny LLaMA (conf/model/tiny.yaml, 4M params, random init seed 0)",
        "seq_len": SEQ_LEN,
        "train_docs": TRAIN_DOCS,
        "eval_docs": EVAL_DOCS,
        "token_budget": args.tokens,
        "lr": LR,
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "peak_tflops": compose_job(BASE).hardware.peak_tflops,
        "batches": "HF: 4 documents per batch (padded); flexengine: 2 packed rows of 512 tokens",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "peer_hf.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    cols = (
        "recipe",
        "useful_tokens_per_s",
        "speedup_vs_hf",
        "useful_token_fraction",
        "steps",
        "useful_tokens",
        "wall_s",
        "mfu",
        "hfu",
        "mfu_old_formula",
        "eval_loss",
    )
    lines = [
        f"# flexengine vs plain HF recipe (CPU, {meta['model']}, {args.tokens} useful tokens each)",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        cells = (f"{r[c]:.4g}" if isinstance(r[c], float) else "—" if r[c] is None else str(r[c]) for c in cols)
        lines.append("| " + " | ".join(cells) + " |")
    (RESULTS / "peer_hf.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
