"""data/build.py: the held-out set (data.eval_path / data.eval_split, no overlap with training), mixtures of formats,
the data log lines a user reads, and the padding id."""

from __future__ import annotations

import json
import logging

import pytest

from flexengine.cli.common import compose_job
from flexengine.core.errors import UserError
from flexengine.data.build import pad_token_id
from flexengine.surgery.model import load_tokenizer
from tests.helpers import job_data

# distinct documents long enough to fill rows of 64 tokens
DOCS = [f"def f{i}(x):\n    return x * {i} + {i * i} - {i % 7}  # function number {i}\n" * 3 for i in range(60)]


def _build(tmp_path, *overrides: str):
    job = compose_job(
        [
            "debug=fast",
            "data.seq_len=64",
            "data.num_workers=0",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"train.output_dir={tmp_path / 'run'}",
            *overrides,
        ]
    )
    return job_data(job, load_tokenizer(job.model))


def _dataset_dict(path, **splits):
    import datasets

    parts = {name: datasets.Dataset.from_dict({"text": docs}) for name, docs in splits.items()}
    datasets.DatasetDict(parts).save_to_disk(str(path))
    return path


def test_data_log_lines_are_readable_sentences(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="flexengine")
    _build(tmp_path, "data.eval_fraction=0.2")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("data:", "eval data:"))]
    packing = [line for line in lines if "rows of 64 tokens" in line]
    assert len(packing) == 2, lines  # training and held-out
    assert not any("{" in line or "': " in line for line in lines), lines  # no raw dicts


@pytest.mark.parametrize(
    ("splits", "eval_split", "expected"),
    [
        ({"train": 40, "validation": 8, "test": 12}, None, "validation"),
        ({"train": 40, "test": 12}, None, "test"),
        ({"train": 40, "validation": 8, "test": 12}, "test", "test"),
    ],
)
def test_eval_path_dataset_dict_evaluates_its_held_out_split(tmp_path, caplog, splits, eval_split, expected):
    """data.eval_path=<DatasetDict> (here the training dict itself) evaluates on validation / test / the named
    split, never on data.hf_split=train, and the log says which."""
    caplog.set_level(logging.INFO, logger="flexengine")
    start, parts = 0, {}
    for name, n in splits.items():
        parts[name], start = DOCS[start : start + n], start + n
    dd = _dataset_dict(tmp_path / "dd", **parts)
    extra = [f"data.eval_split={eval_split}"] if eval_split else []
    _, _, report = _build(tmp_path, "data=hf", f"data.path={dd}", f"data.eval_path={dd}", *extra)
    assert report["documents"] == splits["train"]
    assert report["eval"]["documents"] == splits[expected]
    assert f"split '{expected}'" in report["eval"]["source"]
    assert any(f"split '{expected}'" in r.getMessage() for r in caplog.records if "eval data" in r.getMessage())


def test_eval_path_dataset_dict_without_a_held_out_split_is_refused(tmp_path):
    dd = _dataset_dict(tmp_path / "dd", train=DOCS[:40], extra=DOCS[40:])
    with pytest.raises(UserError, match="no validation or test split.*data.eval_split"):
        _build(tmp_path, "data=hf", f"data.path={dd}", f"data.eval_path={dd}")
    with pytest.raises(UserError, match="data.eval_split=dev.*train, extra"):
        _build(tmp_path, "data=hf", f"data.path={dd}", f"data.eval_path={dd}", "data.eval_split=dev")


def test_eval_set_sharing_documents_with_training_is_refused(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:40]))
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[36:48]))  # 4 shared
    with pytest.raises(UserError, match=r"data.eval_path.*4 of its 12 documents are also training documents"):
        _build(tmp_path, "data=jsonl", f"data.path={train}", f"data.eval_path={held_out}")
    held_out.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[40:52]))  # disjoint: fine
    _, batches, report = _build(tmp_path, "data=jsonl", f"data.path={train}", f"data.eval_path={held_out}")
    assert batches is not None and report["eval"]["documents"] == 12


def test_a_text_file_and_a_chat_file_mix(tmp_path, chat_tokenizer):
    """data.mix of a plain-text file and a chat file: each source is read in its own format (format: chat on the
    chat one); text documents are trained whole, chat prompts are masked. Without it, the error says what to set."""
    tok_dir = tmp_path / "tokenizer"
    chat_tokenizer.save_pretrained(tok_dir)
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:30]))
    chats = tmp_path / "chats.jsonl"
    conversation = [{"role": "user", "content": "what is {i} + 1?"}, {"role": "assistant", "content": "{i}"}]
    chats.write_text(
        "".join(
            json.dumps({"messages": [{**t, "content": t["content"].format(i=i)} for t in conversation]}) + "\n"
            for i in range(30)
        )
    )
    common = ["data=mix", f"model.tokenizer={tok_dir}", "model.arch.vocab_size=2064"]
    loader, _, report = _build(tmp_path, *common, f"data.mix=[{{path: {text}}}, {{path: {chats}, format: chat}}]")
    assert [r["documents"] for r in report["mix"]] == [30, 30]
    assert all(r["tokens_used"] > 0 for r in report["mix"])
    corpus = loader.corpus
    text_part = corpus.loss_mask[: corpus.offsets[30]]
    chat_part = corpus.loss_mask[corpus.offsets[30] :]
    assert text_part.all() and 0 < chat_part.sum() < len(chat_part)
    with pytest.raises(UserError, match="it has 'messages': a chat record.*format: chat on that source"):
        _build(tmp_path, *common, f"data.mix=[{{path: {text}}}, {{path: {chats}}}]")


def test_an_unused_validation_split_is_pointed_out(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="flexengine")
    dd = _dataset_dict(tmp_path / "dd", train=DOCS[:40], validation=DOCS[40:48])
    _, held_out, _ = _build(tmp_path, "data=hf", f"data.path={dd}")
    assert held_out is None and f"has a 'validation' split, not evaluated on: add data.eval_path={dd}" in caplog.text


HEADING = " = = Reception = = \n"  # wikitext repeats heading records like this in train and validation
EVAL_DOCS = [f"class C{i}:\n    value = {i * 3} + {i % 5}  # held-out record {i}\n" * 2 for i in range(99)]


def _jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _overlap_build(tmp_path, eval_docs, *overrides):
    train = _jsonl(tmp_path / "train.jsonl", [*DOCS[:40], HEADING])
    held_out = _jsonl(tmp_path / "eval.jsonl", eval_docs)
    return _build(tmp_path, "data=jsonl", f"data.path={train}", f"data.eval_path={held_out}", *overrides)


def test_one_shared_short_record_is_dropped_from_the_eval_set_with_a_warning(tmp_path, caplog):
    """Before: any shared document refused the run, so a standard held-out split sharing one heading
    line with training (1 of 100 documents, <= 1 %) could not be trained on at all."""
    caplog.set_level(logging.WARNING, logger="flexengine")
    _, batches, report = _overlap_build(tmp_path, [*EVAL_DOCS, HEADING])
    assert batches is not None and report["eval"]["documents"] == 99
    warned = [r.getMessage() for r in caplog.records if "also training documents" in r.getMessage()]
    assert len(warned) == 1 and "1 of its 100 documents" in warned[0] and "dropped" in warned[0], warned
    with pytest.raises(UserError, match="data.eval_overlap=refuse"):
        _overlap_build(tmp_path, [*EVAL_DOCS, HEADING], "data.eval_overlap=refuse")


def test_half_the_eval_set_shared_is_refused_naming_the_switch_and_allow_or_drop_obey(tmp_path, caplog):
    half = [*DOCS[:20], *EVAL_DOCS[:20]]  # 20 of 40 are training documents
    with pytest.raises(UserError, match=r"20 of its 40 documents.*data.eval_overlap=drop.*data.eval_overlap=allow"):
        _overlap_build(tmp_path, half)
    caplog.set_level(logging.WARNING, logger="flexengine")
    _, _, kept = _overlap_build(tmp_path, half, "data.eval_overlap=allow")
    assert kept["eval"]["documents"] == 40 and "kept (data.eval_overlap=allow)" in caplog.text
    _, _, dropped = _overlap_build(tmp_path, half, "data.eval_overlap=drop")
    assert dropped["eval"]["documents"] == 20
    with pytest.raises(UserError, match="nothing is left to evaluate"):
        _overlap_build(tmp_path, DOCS[:10], "data.eval_overlap=drop")


@pytest.mark.parametrize("mode, packing", [("causal", "none"), ("packed_doc", "bfd")])
def test_a_hand_built_job_packs_once_its_attention_rules_are_resolved(tmp_path, mode, packing):
    """A JobConfig built in Python (no composition) keeps data.packing=auto until the attention rules resolve it
    from attn.mode (surgery/attention/job_rules.py, beside the mode table; run.build_trainer calls them): the data
    layer refuses to guess, naming the call, and packs as the mode says once it is made."""
    from flexengine.core.config import AttnConfig, DataConfig, JobConfig, TrainConfig
    from flexengine.surgery.attention.job_rules import resolve_attention_rules

    job = JobConfig(
        attn=AttnConfig(mode=mode, backend="dense"),
        data=DataConfig(seq_len=64, num_workers=0, demo_max_files=24, cache_dir=str(tmp_path / "cache")),
        train=TrainConfig(output_dir=str(tmp_path / "run")),
    )
    tokenizer = load_tokenizer(job.model)
    with pytest.raises(UserError, match=r"data.packing=auto .*resolve_attention_rules\(job.attn, job.data"):
        job_data(job, tokenizer)
    resolve_attention_rules(job.attn, job.data, job.model)
    loader, _, _ = job_data(job, tokenizer)
    assert job.data.packing == packing and loader.batches_per_epoch > 0


def test_the_loader_is_built_pinned_when_asked(tmp_path):
    """run.py asks for pinned batches on CUDA at construction (no attribute set on a built loader afterwards)."""
    job = compose_job(["debug=fast", "data.seq_len=64", "data.num_workers=0", f"data.cache_dir={tmp_path / 'c'}"])
    tokenizer = load_tokenizer(job.model)
    assert job_data(job, tokenizer, pin_memory=True)[0].pin_memory is True
    assert job_data(job, tokenizer)[0].pin_memory is False


class _Tokenizer:
    def __init__(self, pad: int | None, eos: int | None):
        self.pad_token_id, self.eos_token_id = pad, eos


def test_padding_slots_take_the_pad_token_else_eos_else_0():
    assert pad_token_id(_Tokenizer(3, 7)) == 3
    assert pad_token_id(_Tokenizer(None, 7)) == 7
    assert pad_token_id(_Tokenizer(None, None)) == 0
