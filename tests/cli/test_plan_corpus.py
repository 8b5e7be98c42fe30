"""flexengine-plan's corpus for "how long": documents of one length packed as training packs them, a bare token
count in full rows, or the job's own documents."""

from __future__ import annotations

import math

import pytest

from flexengine.cli.common import compose_job
from flexengine.cli.plan import PlanOptions
from flexengine.cli.plan_corpus import NODE, corpus_hours, corpus_rows, wants_corpus_time
from flexengine.core.errors import UserError
from flexengine.core.hardware import assumed_hardware
from flexengine.data.packing import plan_packing
from flexengine.planning.corpus_time import Corpus, format_corpus_hours
from flexengine.surgery.model import build_hf_config


def test_documents_of_one_length_are_packed_with_their_padding():
    """The seed workload: 20,000 documents of ~6,000 tokens in 8K rows hold one each (two do not fit): 73 % of
    each row is useful, which the hours must count."""
    job = compose_job(["experiment=deepseek7b_6k_a100", "model.init=random", "data.source=demo", "data.seq_len=8192"])
    corpus = corpus_rows(job, PlanOptions(documents=20_000, doc_tokens=6_000, epochs=1))[0]
    assert (corpus.rows, corpus.useful_tokens, corpus.epochs) == (20_000, 120_000_000, 1)
    assert "73.2% of slots useful" in corpus.describe
    shorter = compose_job(
        ["experiment=deepseek7b_6k_a100", "model.init=random", "data.source=demo", "data.seq_len=6144"]
    )
    assert corpus_rows(shorter, PlanOptions(documents=20_000, doc_tokens=6_000))[0].rows == 20_000  # 97.7 % useful


def test_a_token_count_fills_rows_and_the_data_is_counted_otherwise():
    job = compose_job(["debug=fast"])
    corpus = corpus_rows(job, PlanOptions(tokens=1e6, epochs=3))[0]
    assert corpus.rows == math.ceil(1e6 / 256) and corpus.epochs == 3 and "optimistic" in corpus.describe
    demo = corpus_rows(job, PlanOptions(epochs=1))[0]  # the run's own data: the demo corpus, tokenized and packed
    from flexengine.data.corpus import build_corpus
    from flexengine.surgery.model import load_tokenizer

    lengths = build_corpus(job.data, load_tokenizer(job.model)).lengths
    assert demo.rows == plan_packing(lengths, 256, job.data.packing, job.data.long_docs).stats.rows
    assert not wants_corpus_time(PlanOptions()) and wants_corpus_time(PlanOptions(epochs=1))


def test_bad_corpus_options_name_the_key():
    job = compose_job(["debug=fast"])
    with pytest.raises(UserError, match="plan.documents needs plan.doc_tokens"):
        corpus_rows(job, PlanOptions(documents=10))
    with pytest.raises(UserError, match="plan.epochs=0"):
        corpus_rows(job, PlanOptions(epochs=0, tokens=10))
    with pytest.raises(UserError, match="give model.path .* plan.tokens=N"):
        corpus_rows(compose_job(["data=jsonl", "data.path=/nowhere.jsonl"]), PlanOptions(epochs=1))


def _seed_job(*overrides: str):
    job = compose_job(
        ["experiment=deepseek7b_6k_a100", "model.init=random", "data.source=demo", "data.seq_len=8192", *overrides]
    )
    return job, build_hf_config(job.model), assumed_hardware(job.hardware)


def test_the_alternatives_weigh_lora_and_a_node_at_the_same_rows_per_step():
    job, hf_config, hardware = _seed_job()
    rows = corpus_hours(job, hf_config, hardware, Corpus(rows=20_000, useful_tokens=120_000_000))
    by = {(r["lora_r"], r["world_size"]): r for r in rows}
    assert set(by) == {(0, 1), (0, NODE), (16, 1), (16, NODE)}
    assert all(r["rows_per_step"] == 8 and r["steps"] == 2_500 for r in rows)  # the same optimization, faster
    assert by[0, NODE]["hours"] < by[0, 1]["hours"] / 4  # eight cards
    assert by[16, 1]["hours"] < by[0, 1]["hours"]  # no weight gradients for the frozen base
    text = format_corpus_hours(rows, Corpus(20_000, 120_000_000, 1.0, "the seed corpus"), "a100_80g")
    assert "estimates" in text and "LoRA r=16, 8 GPUs" in text and text.count("\n") == len(rows) + 1


def test_on_cpu_only_the_job_and_its_lora_twin():
    job = compose_job(["debug=fast", "hardware=cpu"])
    rows = corpus_hours(job, build_hf_config(job.model), assumed_hardware(job.hardware), Corpus(100, 20_000))
    assert [(r["lora_r"], r["world_size"]) for r in rows] == [(0, 1), (16, 1)]
    assert rows[1]["label"] == "LoRA r=16, 1 CPU"  # before: "1 GPU" on a CPU


def test_no_hours_without_a_known_speed_and_the_options_named():
    job = compose_job(["debug=fast", "hardware=auto"])  # this CPU, its speed unmeasured (tests turn it off)
    hardware = assumed_hardware(job.hardware)
    assert hardware.speed == () and hardware.peak_tflops is None
    rows = corpus_hours(job, build_hf_config(job.model), hardware, Corpus(100, 20_000))
    assert all(r["hours"] is None and r["step_s"] is None and r["useful_tokens_per_s"] is None for r in rows)
    assert {r["time_source"] for r in rows} == {"unknown device speed"}
    text = format_corpus_hours(rows, Corpus(100, 20_000, 1.0, "the demo"), "cpu")
    assert "0.0" not in text.split("\n")[2] and "n/a" in text
    assert "no hours" in text and "hardware=a100_80g" in text and "flexengine-doctor" in text


def test_a_measured_speed_gives_hours_and_says_so(monkeypatch, tmp_path):
    from flexengine.resolve import resolve_target_hardware

    monkeypatch.delenv("FLEXENGINE_DEVICE_SPEED")
    monkeypatch.setenv("FLEXENGINE_SPEED_CACHE", str(tmp_path / "speed.json"))
    job = compose_job(["debug=fast", "hardware=auto"])
    hf_config = build_hf_config(job.model)
    hardware = resolve_target_hardware(job, hf_config)
    assert len(hardware.speed) == 1 and hardware.speed[0].dtype_bytes == 4  # CPU: the mode auto takes, fp32
    rows = corpus_hours(job, hf_config, hardware, Corpus(100, 20_000))
    assert rows[0]["hours"] > 0 and rows[0]["time_source"] == "measured device speed"
    text = format_corpus_hours(rows, Corpus(100, 20_000, 1.0, "the demo"), "cpu")
    assert "from measured device speed" in text and "no hours" not in text


def test_a_named_card_keeps_its_datasheet_wherever_it_is_planned():
    from flexengine.resolve import resolve_target_hardware

    job, hf_config, _ = _seed_job()
    hardware = resolve_target_hardware(job, hf_config)
    assert hardware.speed == () and hardware.peak_tflops == 312.0
    rows = corpus_hours(job, hf_config, hardware, Corpus(rows=20_000, useful_tokens=120_000_000))
    assert {r["time_source"] for r in rows} == {"assumed MFU x datasheet peak"}
