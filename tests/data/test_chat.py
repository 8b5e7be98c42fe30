"""Chat SFT end to end on a real chat template the test writes itself: a tiny tokenizer saved to disk with a
ChatML template (with {% generation %} markers), loaded through model.tokenizer like an instruct model's."""

from __future__ import annotations

import json
import logging

import pytest

from flexengine.cli.common import compose_job
from flexengine.core.errors import UserError
from flexengine.data.packing import IGNORE_INDEX
from flexengine.run import run_training
from flexengine.surgery.model import load_tokenizer
from tests.helpers import job_data


def _conversation(i: int, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "Answer in one word."}]
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"question {i}.{t}: what is {t} plus {i}?"},
            {"role": "assistant", "content": f"answer{i + t}"},
        ]
    return messages


@pytest.fixture
def chat_dir(tmp_path, chat_tokenizer):
    """A saved instruct-style tokenizer + a JSONL of conversations (two much longer than seq_len)."""
    tok_dir = tmp_path / "tokenizer"
    chat_tokenizer.save_pretrained(tok_dir)
    rows = [{"messages": _conversation(i, 2)} for i in range(40)]
    rows += [{"messages": _conversation(100 + i, 30)} for i in range(2)]  # ~30 turns: far beyond 128 tokens
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path, tok_dir, path


def _job(tmp_path, tok_dir, path, *overrides):
    return compose_job(
        [
            "debug=fast",
            "data=jsonl",
            f"data.path={path}",
            "data.format=chat",
            "data.seq_len=128",
            f"model.tokenizer={tok_dir}",
            "model.arch.vocab_size=2064",
            "data.num_workers=0",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.max_steps=2",
            "train.save_final=false",
            *overrides,
        ]
    )


def test_chat_sft_trains_only_assistant_replies_and_counts_long_conversations(chat_dir):
    tmp_path, tok_dir, path = chat_dir
    job = _job(tmp_path, tok_dir, path)
    tokenizer = load_tokenizer(job.model)
    assert "{% generation %}" in tokenizer.chat_template  # loaded from disk, as from an instruct model directory
    loader, _, report = job_data(job, tokenizer)
    assert report["chats_longer_than_seq_len"] == {"truncated": 2, "dropped": 0, "policy": "truncate"}
    assert report["documents_split"] == 0  # nothing split mid-turn
    trained, prompts = [], []
    for _ in range(loader.batches_per_epoch):
        batch = loader.next_batch()
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            trained.append(tokenizer.decode(ids[labels != IGNORE_INDEX].tolist()))
            prompts.append(tokenizer.decode(ids[labels == IGNORE_INDEX].tolist()))
    trained_text, prompt_text = "".join(trained), "".join(prompts)
    assert "answer" in trained_text and "question" not in trained_text and "one word" not in trained_text
    assert "question" in prompt_text
    summary = run_training(job, tmp_path / "run")
    assert summary["steps"] == 2 and summary["data"]["chats_longer_than_seq_len"]["truncated"] == 2


def test_full_sequence_loss_and_drop_policy(chat_dir):
    tmp_path, tok_dir, path = chat_dir
    job = _job(tmp_path, tok_dir, path, "data.train_on=all", "data.long_chats=drop")
    tokenizer = load_tokenizer(job.model)
    loader, _, report = job_data(job, tokenizer)
    assert report["chats_longer_than_seq_len"] == {"truncated": 0, "dropped": 2, "policy": "drop"}
    batch = loader.next_batch()
    text = tokenizer.decode(batch["input_ids"][batch["labels"] != IGNORE_INDEX].tolist())
    assert "question" in text and "answer" in text  # prompts are trained on too


def test_template_without_markers_trains_with_the_prefix_mask_and_reports_token_counts(chat_dir, caplog):
    """A stock template without {% generation %} markers trains by default (auto falls back to the prefix mask,
    saying so) and the log reports how many tokens carry loss."""
    tmp_path, tok_dir, path = chat_dir
    template_file = tok_dir / "chat_template.jinja"  # where transformers saves the template
    template_file.write_text(
        template_file.read_text().replace("{% generation %}", "").replace("{% endgeneration %}", "")
    )
    caplog.set_level(logging.INFO, logger="flexengine")
    job = _job(tmp_path, tok_dir, path)
    loader, _, _ = job_data(job, load_tokenizer(job.model))
    assert "no {% generation %} markers" in caplog.text
    mask = loader.corpus.loss_mask
    trained, total = int(mask.sum()), len(mask)
    assert 0 < trained < total
    assert f"loss on {trained:,} of {total:,} tokens" in caplog.text and f"{total - trained:,} masked" in caplog.text
    with pytest.raises(UserError, match="data.assistant_mask=prefix"):  # the markers, asked for explicitly
        run_training(_job(tmp_path, tok_dir, path, "data.assistant_mask=template"), tmp_path / "run")


@pytest.mark.parametrize("fmt", ["chat", "mixed", "mix"])
def test_auto_row_length_over_chats_is_refused_by_name(chat_dir, fmt):
    """data.seq_len=auto over conversations (data.format=chat, mixed, or a chat source in data.mix): a clear error
    naming data.seq_len and data.format and what to set, at composition, never a TypeError from the encoder."""
    tmp_path, tok_dir, path = chat_dir
    extra = (
        [f"data.format={fmt}"]
        if fmt != "mix"
        else ["data.format=text", f"data.mix=[{{path: {path}, format: chat}}]", "data.path=null"]
    )
    with pytest.raises(UserError) as e:
        run_training(_job(tmp_path, tok_dir, path, *extra, "data.seq_len=auto"))
    message = str(e.value)
    assert "data.seq_len=auto" in message and "data.format=" in message and "data.seq_len=4096" in message
    assert ("mixed" if fmt == "mixed" else "chat") in message.split(":")[0]
