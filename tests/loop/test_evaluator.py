"""loop/evaluator.py: greedy samples (greedy_continue) use one padded row width per call; the Evaluator says when
evaluations and samples are due and what the evaluations still due cost."""

from __future__ import annotations

import pytest
import torch

from flexengine.loop.evaluator import greedy_continue
from tests.helpers import CharTokenizer, make_llama


def test_prompts_of_different_lengths_share_one_row_width():
    """Every forward of one call has the same width: the longest prompt plus the new tokens, in whole pad_to
    blocks (under CP each new width is a new variant of torch's compiled mask builder, and dynamo stops the run
    after 8). Greedy tokens are read at each prompt's own last position, not at the padding."""
    widths = []

    def next_char(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # a causal "model": the logits at position t favour the character after input_ids[t]
        widths.append(input_ids.shape[1])
        assert torch.equal(position_ids[0], torch.arange(input_ids.shape[1]))
        return torch.nn.functional.one_hot((input_ids + 1) % 256, 256).float()

    prompts = ["a", "b" * 130, "c" * 300]
    texts = greedy_continue(next_char, CharTokenizer(), prompts, new_tokens=3, device=torch.device("cpu"), pad_to=256)
    assert texts == ["bcd", "cde", "def"]
    assert widths == [512] * 9  # 300 + 3 tokens -> 2 blocks of 256 for every prompt (before: 256, 256, 512)


def test_evaluation_progress_lines_and_the_budget_advice(caplog, monkeypatch):
    """A long evaluation logs where it is (batches done/total, elapsed, left); one costing more than ~10 % of the
    training between two evaluations is told which train.eval_batches would fit."""
    import logging

    import flexengine.loop.evaluator as ev

    caplog.set_level(logging.INFO, logger="flexengine")
    ticks = iter([0.0, 10.0, 20.0, 25.0, 40.0])
    monkeypatch.setattr(ev.time, "perf_counter", lambda: next(ticks))
    progress = ev.EvalProgress(step=20, total=8, every_s=15.0)  # starts at t=0
    for done in (1, 2, 3, 4):  # at t = 10, 20, 25, 40
        progress(done)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "eval step 20: 8 batches",
        "eval step 20: batch 2/8, 20 s elapsed, ~60 s left",
        "eval step 20: batch 4/8, 40 s elapsed, ~40 s left",
    ]
    # 60 s for 120 batches between 20 steps of 10 s (200 s): 30 %, so 40 batches (20 s, 10 %) fit
    advice = ev.eval_budget_warning(eval_s=60.0, batches=120, eval_every=20, step_s=10.0, eval_batches=0)
    assert "the whole held-out set, 120 batches" in advice and "30%" in advice
    assert "train.eval_batches=40" in advice
    assert ev.eval_budget_warning(eval_s=15.0, batches=120, eval_every=20, step_s=10.0, eval_batches=0) is None


class _HeldOut:
    num_batches = 6


def _evaluator(tmp_path, train, held_out):
    """A hand-built run's Evaluator (loop/components.py) around a tiny model, with `held_out` as its set."""
    from flexengine.core.config import JobConfig
    from flexengine.data.demo import load_demo_tokenizer
    from tests.helpers import job_components, job_forward

    job = JobConfig(train=train)
    tokenizer = load_demo_tokenizer()  # train.sample_prompts needs one
    _, components = job_components(
        job, job_forward(job, make_llama()), None, tmp_path, tokenizer=tokenizer, held_out=held_out
    )
    return components.evaluator


def test_the_evaluator_says_when_evaluations_and_samples_are_due(tmp_path):
    from flexengine.core.config import TrainConfig

    train = TrainConfig(max_steps=7, eval_every=2, grad_accum=2, sample_prompts=["def "])
    evaluator = _evaluator(tmp_path / "a", train, _HeldOut())
    assert [s for s in range(1, 8) if evaluator.should_evaluate(s)] == [2, 4, 6]
    evaluator.state.evals.append({"step": 6})  # the history lives in the run's shared TrainState
    assert evaluator.due_at_end(7) and not evaluator.due_at_end(6)
    evaluator.state.evals.append({"step": 4})
    assert evaluator.should_sample(4) and not evaluator.should_sample(5)  # with evaluations
    bare = _evaluator(tmp_path / "b", train, None)
    assert not bare.should_evaluate(2) and not bare.due_at_end(7) and bare.evaluate() is None
    # before any evaluation: a third of a micro-batch step per held-out batch, for each one still due (2, 4, 6, 7)
    assert evaluator.seconds_left(1, step_s=3.0) == 4 * (6 * 3.0 / 2 / 3)
    evaluator.eval_seconds = [10.0, 20.0]  # then the mean of those measured
    assert evaluator.seconds_left(4, step_s=3.0) == 3 * 15.0  # 4 (its line comes before it), 6 and the end
    evaluator.cut_short = True  # a signal cut one short: no more samples
    assert not evaluator.should_sample(4) and not evaluator.samples_at_end(7)


def _instruct_run(tmp_path, fmt: str, *overrides: str):
    """A tiny instruct model (SmolLM2-Instruct's tokenizer shape: eos <|im_end|>, <|endoftext|> in the vocabulary)
    trained for one step on text or chat records through the real loop; returns the job and its tokenizer."""
    import json

    from transformers import AutoTokenizer

    from tests.helpers import make_job, save_pretrained_instruct

    model = save_pretrained_instruct(tmp_path / "instruct")
    if fmt == "chat":
        rows = [
            {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(40)
        ]
    else:
        rows = [{"text": f"def f{i}(x):\n    return x + {i}\n"} for i in range(40)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = make_job(
        tmp_path / "run",
        f"model.path={model}",
        "data=jsonl",
        f"data.path={data}",
        f"data.format={fmt}",
        "data.seq_len=128",
        "data.num_workers=0",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.max_steps=1",
        "train.save_final=false",
        *overrides,
    )
    return job, AutoTokenizer.from_pretrained(model)


def test_a_chat_run_samples_its_prompts_through_the_chat_template(tmp_path, monkeypatch):
    """Before: train.sample_prompts were tokenized as raw text in a chat run, a form it never trains on."""
    from flexengine.loop import evaluator as evaluator_module
    from flexengine.run import run_training

    rendered = []
    real = evaluator_module.prompt_ids

    def spy(tokenizer, prompt, chat):
        ids = real(tokenizer, prompt, chat)
        rendered.append(tokenizer.decode(ids))
        return ids

    monkeypatch.setattr(evaluator_module, "prompt_ids", spy)
    job, tokenizer = _instruct_run(tmp_path, "chat", "train.sample_prompts=[hello]", "train.sample_tokens=2")
    assert run_training(job, tmp_path / "run")["steps"] == 1
    assert rendered == ["<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"]
    assert evaluator_module.sample_end_ids(tokenizer, job.data) == {tokenizer.eos_token_id}  # <|im_end|>


@pytest.mark.parametrize(
    ("typed", "separator", "why"),
    [([], "<|endoftext|>", "the base model's end-of-text"), (["data.separator=eos"], "<|im_end|>", "the tokenizer's")],
)
def test_a_text_run_on_an_instruct_tokenizer_ends_documents_and_samples_at_end_of_text(
    tmp_path, caplog, typed, separator, why
):
    """Before: every document ended with the instruct tokenizer's eos, the chat end-of-turn <|im_end|>; the log
    now names the separator, the corpus ends each document with <|endoftext|> (or what data.separator names), and
    samples stop there too."""
    import logging

    from flexengine.data.corpus import build_corpus
    from flexengine.loop.evaluator import sample_end_ids
    from flexengine.run import run_training

    job, tokenizer = _instruct_run(tmp_path, "text", *typed)
    with caplog.at_level(logging.INFO, logger="flexengine.data.build"):
        assert run_training(job, tmp_path / "run")["steps"] == 1
    end_of_text, end_of_turn = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    sep = tokenizer.convert_tokens_to_ids(separator)
    assert f"data: text documents end with {separator} (id {sep}: {why}" in caplog.text
    corpus = build_corpus(job.data, tokenizer)  # the run's cache entry
    assert (corpus.tokens[corpus.offsets[1:] - 1] == sep).all()
    assert ({end_of_text, end_of_turn} - {sep}).isdisjoint(corpus.tokens.tolist())
    assert sample_end_ids(tokenizer, job.data) == {sep, end_of_turn}
