"""build_corpus end to end: tokens equal direct tokenizer calls, chat labels, skip counts in summary.json."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flexengine.core.config import AttnConfig, DataConfig, JobConfig, ModelConfig, TrainConfig
from flexengine.data.corpus import build_corpus
from flexengine.data.packing import IGNORE_INDEX, materialise_rows, plan_packing

TEXTS = [f"class C{i}:\n    value = {i * 7}\n" * (1 + i % 5) for i in range(12)]


def test_text_corpus_equals_direct_tokenization(tmp_path, write_jsonl, demo_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": t} for t in TEXTS])
    data = DataConfig(source="jsonl", path=str(path), text_field="body", cache_dir=str(tmp_path / "c"))
    corpus = build_corpus(data, demo_tokenizer)
    eos = demo_tokenizer.eos_token_id
    expected = [demo_tokenizer(t)["input_ids"] + [eos] for t in TEXTS]
    assert [corpus.tokens[a:b].tolist() for a, b in zip(corpus.offsets[:-1], corpus.offsets[1:])] == expected
    assert corpus.loss_mask is None and corpus.skipped == {}


def test_parquet_matches_jsonl(tmp_path, write_jsonl, demo_tokenizer):
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "d.parquet")
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    cache = str(tmp_path / "c")
    a = build_corpus(DataConfig(source="parquet", path=str(tmp_path / "d.parquet"), cache_dir=cache), demo_tokenizer)
    b = build_corpus(DataConfig(source="jsonl", path=str(tmp_path / "d.jsonl"), cache_dir=cache), demo_tokenizer)
    assert a.cache_path != b.cache_path
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_chat_rows_mask_prompts_and_document_starts(tmp_path, write_jsonl, chat_tokenizer):
    chats = [
        [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]
        for i in range(6)
    ]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in chats])
    data = DataConfig(source="jsonl", path=str(path), format="chat", cache_dir=str(tmp_path / "c"), seq_len=128)
    corpus = build_corpus(data, chat_tokenizer)
    assert build_corpus(data, chat_tokenizer).loss_mask is not None  # the mask survives the cache
    plan = plan_packing(corpus.lengths, data.seq_len, "bfd")
    batch = materialise_rows(plan.rows, corpus.tokens, corpus.offsets, data.seq_len, 0, corpus.loss_mask)
    labels, inputs = batch["labels"], batch["input_ids"]
    trained = chat_tokenizer.decode(inputs[labels != IGNORE_INDEX].tolist())
    # every label left is an assistant reply or its end marker; no prompt token and no document start
    assert sorted(trained.split("<|im_end|>")[:-1]) == sorted(f"answer {i}." for i in range(6))
    starts = batch["position_ids"] == 0
    assert (labels[starts] == IGNORE_INDEX).all()


def test_pretokenized_corpus_keeps_ids_and_labels(tmp_path, write_jsonl, demo_tokenizer):
    records = [{"input_ids": [3, 4, 5], "labels": [-100, 4, 5]}, {"input_ids": [6, 7]}]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    data = DataConfig(source="jsonl", path=str(path), format="pretokenized", cache_dir=str(tmp_path / "c"))
    corpus = build_corpus(data, demo_tokenizer)
    assert corpus.tokens.tolist() == [3, 4, 5, 6, 7] and corpus.offsets.tolist() == [0, 3, 5]
    assert corpus.loss_mask.tolist() == [False, True, True, True, True]


def test_demo_corpus_is_cached(tmp_path, demo_tokenizer):
    data = DataConfig(demo_max_files=5, cache_dir=str(tmp_path))
    first, second = build_corpus(data, demo_tokenizer), build_corpus(data, demo_tokenizer)
    assert not first.cache_hit and second.cache_hit and len(second) == 5


def test_skip_counts_reach_summary_json(tmp_path, write_lines):
    good = [json.dumps({"text": t}) for t in TEXTS]
    path = write_lines(tmp_path / "d.jsonl", good[:6] + ["{oops", json.dumps({"text": 3})] + good[6:] + ["{again"])
    job = JobConfig(
        model=ModelConfig(
            init="random",
            arch=dict(
                model_type="llama",
                vocab_size=2048,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=256,
            ),
        ),
        attn=AttnConfig(mode="packed_doc"),
        data=DataConfig(source="jsonl", path=str(path), on_error="skip", seq_len=64, cache_dir=str(tmp_path / "c")),
        train=TrainConfig(max_steps=1, micro_batch=1, grad_accum=1, progress=False, save_final=False),
    )
    from flexengine.run import run_training

    summary = run_training(job, tmp_path / "run")
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"]["documents_skipped"] == {"malformed_json": 2, "not_a_string": 1}
    assert written["data"]["documents_skipped"] == {"malformed_json": 2, "not_a_string": 1}
    assert written["data"]["documents"] == len(TEXTS)
