"""The doctor on CPU with planted problems: a padded baseline, checkpoint-all where nothing is needed, a card
too small for no checkpointing, and tokenisation inside the loop; a healthy run gets no suggestions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexengine.doctor import compose_job, diagnose, format_report, main
from flexengine.run import build_trainer

FAST = ["debug=fast", "train.grad_accum=1"]
STEPS = 1


def check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    out = tmp_path_factory.mktemp("healthy")
    return diagnose(compose_job([*FAST, "attn=packed_doc", "memory=none"]), out, steps=STEPS), out


def test_healthy_run_has_no_suggestions_and_writes_doctor_json(healthy):
    report, out = healthy
    assert report["suggestions"] == [], format_report(report)
    assert json.loads((out / "doctor.json").read_text())["checks"] == report["checks"]
    n = report["numbers"]
    assert n["attn_backend"] == "dense" and n["mask_backends_seen"] == {"dense": STEPS + 1}
    assert n["useful_token_fraction"] > 0.9 and n["tokenizer_calls_in_loop"] == 0
    assert n["recompiles_after_warmup"] == 0 and n["graph_breaks"] == 0
    assert 0 < n["block_sparsity"] <= 1
    split = n["time_split"]
    assert split["forward"] > 0 and split["backward"] > 0 and split["optimizer"] > 0 and split["data"] > 0
    assert sum(split.values()) == pytest.approx(1.0, abs=1e-6)
    mem = n["memory"]
    # the doctor's one-block measurement without checkpointing = what each block of the (unchanged) model holds
    assert mem["checkpointed"] == [] and mem["measured_bytes_per_block"] == [mem["activation_bytes_per_block"]] * 4


def test_padded_baseline_is_told_to_pack(tmp_path, capsys):
    report = main([*FAST, "attn=causal", "--steps", str(STEPS), "--out", str(tmp_path)])
    n = report["numbers"]
    assert n["attn_backend"] == "sdpa" and n["mask_backends_seen"] == {"hf:sdpa": STEPS + 1}
    assert n["useful_token_fraction"] < 0.9 and n["block_sparsity"] is None
    assert check(report, "useful tokens")["verdict"] in ("warn", "bad")
    assert any("attn=packed_doc" in s for s in report["suggestions"])
    printed = capsys.readouterr().out
    assert "attn=packed_doc" in printed and "doctor.json" in printed


def test_checkpointing_everything_when_nothing_is_needed(tmp_path, healthy):
    report = diagnose(compose_job([*FAST, "attn=packed_doc", "memory=full"]), tmp_path, steps=STEPS)
    mem = report["numbers"]["memory"]
    assert mem["checkpointed"] == [0, 1, 2, 3] and mem["must_checkpoint"] == 0
    # checkpointed blocks keep only their input; the no-checkpoint estimate matches the healthy run's blocks
    assert all(b < mem["activation_bytes_per_block"] / 5 for b in mem["measured_bytes_per_block"])
    assert mem["activation_bytes_per_block"] == healthy[0]["numbers"]["memory"]["measured_bytes_per_block"][0]
    assert check(report, "memory")["verdict"] == "warn"
    assert any("checkpointing 4 of 4" in s and "memory=none" in s for s in report["suggestions"])


def test_too_small_a_card_asks_for_checkpointing(tmp_path):
    # weights + grads + AdamW moments of the 4M-parameter model take ~60 MiB: 0.07 GB leaves no room
    report = diagnose(compose_job([*FAST, "memory=none", "hardware.memory_gb=0.07"]), tmp_path, steps=1)
    assert check(report, "memory")["verdict"] == "bad"
    assert any("memory=full" in s for s in report["suggestions"])


def test_tokenizer_inside_the_loop_is_caught(tmp_path):
    job = compose_job([*FAST, "attn=packed_doc"])
    trainer = build_trainer(job, tmp_path)
    next_batch = trainer.loader.next_batch

    def tokenizing_next_batch():  # the planted mistake: tokenise while training
        trainer.tokenizer("def f(x):\n    return x\n")
        return next_batch()

    trainer.loader.next_batch = tokenizing_next_batch
    report = diagnose(job, tmp_path, steps=STEPS, trainer=trainer)
    assert report["numbers"]["tokenizer_calls_in_loop"] == STEPS  # warm-up step not counted
    assert check(report, "tokenization in loop")["verdict"] == "bad"
    # the probe is removed afterwards: calling the tokenizer no longer counts
    assert "__call__" not in vars(type(trainer.tokenizer))


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "flexengine"
                                                              / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_composes(experiment):
    job = compose_job([f"experiment={experiment}", "model.path=/models/any", "data.path=/data/any.jsonl"])
    assert job.data.seq_len > 0 and job.train.max_steps > 0
