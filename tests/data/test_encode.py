"""Encoding: chat prompt masking against transformers' own assistant mask, text EOS, pretokenized labels."""

from __future__ import annotations

import logging

import pytest

from flexengine.core.errors import UserError
from flexengine.data.encode import Dropped, Encoded, Encoder, Rejected
from flexengine.data.sources import RawDoc

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What does def f(x): return x do?"},
    {"role": "assistant", "content": "It returns its argument."},
    {"role": "user", "content": "And 2 + 2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.mark.parametrize("assistant_mask", ["template", "prefix"])
def test_chat_mask_matches_transformers_generation_mask(chat_tokenizer, assistant_mask):
    encoder = Encoder(chat_tokenizer, "chat", assistant_mask=assistant_mask)
    result = encoder.encode_batch([RawDoc("f.jsonl:1", CONVERSATION)])[0]
    reference = chat_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert result.ids.tolist() == reference["input_ids"]
    assert result.loss_mask.tolist() == [bool(m) for m in reference["assistant_masks"]]


def test_chat_trains_only_on_assistant_replies_and_their_end_marker(chat_tokenizer):
    result = Encoder(chat_tokenizer, "chat").encode_batch([RawDoc("f.jsonl:1", CONVERSATION)])[0]
    trained = chat_tokenizer.decode(result.ids[result.loss_mask].tolist())
    assert trained == "It returns its argument.<|im_end|>4<|im_end|>"  # not the "\n" trailer after <|im_end|>
    prompt = chat_tokenizer.decode(result.ids[~result.loss_mask].tolist())
    assert "What does def f(x)" in prompt and "terse" in prompt and "It returns" not in prompt


def test_chat_template_that_rewrites_history_is_rejected_with_location(chat_tokenizer):
    # Drops earlier assistant turns when more follow (like reasoning templates): prefixes no longer match.
    chat_tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    encoder = Encoder(chat_tokenizer, "chat", assistant_mask="prefix")
    result = encoder.encode_batch([RawDoc("chat.jsonl:7", CONVERSATION)])[0]
    assert isinstance(result, Rejected) and result.reason == "chat_template_error"
    assert result.message.startswith("chat.jsonl:7: ")


def test_chat_needs_a_template(demo_tokenizer):
    with pytest.raises(UserError, match="chat template"):
        Encoder(demo_tokenizer, "chat")


def test_text_gets_exactly_one_eos(demo_tokenizer):
    eos = demo_tokenizer.eos_token_id
    docs = [RawDoc("a:1", "x = 1\n"), RawDoc("a:2", "y = 2" + demo_tokenizer.eos_token)]
    with_eos = Encoder(demo_tokenizer, "text", add_eos=True).encode_batch(docs)
    without = Encoder(demo_tokenizer, "text", add_eos=False).encode_batch(docs)
    assert with_eos[0].ids.tolist() == demo_tokenizer("x = 1\n")["input_ids"] + [eos]
    assert with_eos[1].ids.tolist().count(eos) == 1 and with_eos[1].ids[-1] == eos
    assert without[0].ids.tolist() == demo_tokenizer("x = 1\n")["input_ids"]
    assert all(r.loss_mask is None for r in with_eos)


def test_pretokenized_labels_become_the_loss_mask(demo_tokenizer):
    enc = Encoder(demo_tokenizer, "pretokenized")
    out = enc.encode_batch([RawDoc("p:1", ([5, 6, 7, 8], [-100, -100, 7, 8])), RawDoc("p:2", ([9, 10], None))])
    assert isinstance(out[0], Encoded)
    assert out[0].ids.tolist() == [5, 6, 7, 8] and out[0].loss_mask.tolist() == [False, False, True, True]
    assert out[1].loss_mask is None


def test_pretokenized_id_outside_vocab_is_rejected(demo_tokenizer):
    out = Encoder(demo_tokenizer, "pretokenized").encode_batch([RawDoc("p.jsonl:3", ([1, len(demo_tokenizer)], None))])
    assert isinstance(out[0], Rejected) and out[0].reason == "token_id_out_of_range"
    assert out[0].message.startswith("p.jsonl:3: input_ids[1]=")


def test_text_keeps_the_tokenizers_own_special_tokens(demo_tokenizer):
    from tokenizers.processors import TemplateProcessing

    bos = demo_tokenizer.convert_tokens_to_ids("<|pad|>")  # stand-in for LLaMA's <s>
    demo_tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|pad|> $A", special_tokens=[("<|pad|>", bos)]
    )
    result = Encoder(demo_tokenizer, "text").encode_batch([RawDoc("a:1", "import os")])[0]
    assert result.ids.tolist() == demo_tokenizer("import os")["input_ids"] + [demo_tokenizer.eos_token_id]
    assert result.ids[0] == bos


def test_template_without_generation_markers_names_the_alternatives(chat_tokenizer):
    chat_tokenizer.chat_template = chat_tokenizer.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    with pytest.raises(UserError, match=r"no \{% generation %\} markers.*data.assistant_mask=prefix.*train_on=all"):
        Encoder(chat_tokenizer, "chat", assistant_mask="template")  # asked for explicitly
    # the alternatives it names both work
    prefix = Encoder(chat_tokenizer, "chat", assistant_mask="prefix").encode_batch([RawDoc("f:1", CONVERSATION)])[0]
    full = Encoder(chat_tokenizer, "chat", train_on="all").encode_batch([RawDoc("f:1", CONVERSATION)])[0]
    assert prefix.loss_mask.any() and not prefix.loss_mask.all()
    assert full.loss_mask is None and full.ids.tolist() == prefix.ids.tolist()


def test_full_sequence_loss_trains_every_token(chat_tokenizer):
    result = Encoder(chat_tokenizer, "chat", train_on="all").encode_batch([RawDoc("f:1", CONVERSATION)])[0]
    assert result.loss_mask is None


@pytest.mark.parametrize("assistant_mask", ["template", "prefix"])
def test_long_conversation_is_cut_after_the_last_assistant_turn_that_fits(chat_tokenizer, assistant_mask):
    whole = Encoder(chat_tokenizer, "chat").encode_batch([RawDoc("f:1", CONVERSATION)])[0]
    n = len(whole.ids)
    # n - 2: the last reply's <|im_end|> no longer fits (n - 1 would only lose the trailer after it)
    short = Encoder(chat_tokenizer, "chat", assistant_mask=assistant_mask, max_len=n - 2, long_chats="truncate")
    cut = short.encode_batch([RawDoc("f:1", CONVERSATION)])[0]
    assert isinstance(cut, Encoded) and cut.truncated
    assert chat_tokenizer.decode(cut.ids.tolist()).endswith("It returns its argument.<|im_end|>")  # turn 1 whole
    assert cut.ids.tolist() == whole.ids[: len(cut.ids)].tolist()
    # nothing fits -> dropped (counted by the corpus), as with long_chats=drop
    tiny = Encoder(chat_tokenizer, "chat", assistant_mask=assistant_mask, max_len=5, long_chats="truncate")
    assert isinstance(tiny.encode_batch([RawDoc("f:9", CONVERSATION)])[0], Dropped)
    drop = Encoder(chat_tokenizer, "chat", max_len=n - 1, long_chats="drop").encode_batch([RawDoc("f:1", CONVERSATION)])
    drop = drop[0]
    assert isinstance(drop, Dropped) and drop.message.startswith("f:1: ")
    # split leaves it whole: the packer splits it mid-turn, as the user asked
    split = Encoder(chat_tokenizer, "chat", max_len=n - 1, long_chats="split")
    split = split.encode_batch([RawDoc("f:1", CONVERSATION)])[0]
    assert len(split.ids) == n and not split.truncated


def test_mixed_records_encode_by_kind(chat_tokenizer):
    enc = Encoder(chat_tokenizer, "mixed")
    text, chat = enc.encode_batch([RawDoc("m:1", ("text", "def f(): pass")), RawDoc("m:2", ("chat", CONVERSATION))])
    assert text.loss_mask is None and text.ids[-1] == chat_tokenizer.eos_token_id
    assert chat.loss_mask.any() and not chat.loss_mask.all()


def test_template_without_markers_falls_back_to_the_prefix_mask_and_says_so(chat_tokenizer, caplog):
    """The default (auto) trains a stock template without {% generation %} markers by rendering turn by turn, and
    its mask (trailer after <|im_end|> excluded) equals transformers' mask of the same template with markers."""
    reference = chat_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    chat_tokenizer.chat_template = chat_tokenizer.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    caplog.set_level(logging.INFO, logger="flexengine")
    encoder = Encoder(chat_tokenizer, "chat")
    assert "no {% generation %} markers" in caplog.text and "data.assistant_mask=prefix" in caplog.text
    result = encoder.encode_batch([RawDoc("f:1", CONVERSATION)])[0]
    assert result.ids.tolist() == reference["input_ids"]
    assert result.loss_mask.tolist() == [bool(m) for m in reference["assistant_masks"]]


def _text_ids(tokenizer, **kwargs) -> list[int]:
    (enc,) = Encoder(tokenizer, "text", **kwargs).encode_batch([RawDoc("doc", "def f(x): return x")])
    return enc.ids.tolist()


def test_text_documents_end_with_the_base_models_end_of_text_not_the_chat_end_of_turn(instruct_tokenizer):
    """Before: every document ended with tokenizer.eos_token_id, for an instruct tokenizer the chat end-of-turn
    <|im_end|>: continued pre-training on raw text taught the model to end its turn after every document."""
    from flexengine.data.encode import document_separator

    vocab = instruct_tokenizer.get_vocab()
    end_of_text, end_of_turn = vocab["<|endoftext|>"], vocab["<|im_end|>"]
    assert instruct_tokenizer.eos_token_id == end_of_turn != end_of_text
    ids = _text_ids(instruct_tokenizer)
    assert ids[-1] == end_of_text and end_of_turn not in ids
    assert document_separator(instruct_tokenizer).why.startswith("the base model's end-of-text")
    # named: a token of the vocabulary, or `eos` for the tokenizer's own
    assert _text_ids(instruct_tokenizer, separator="<|im_end|>")[-1] == end_of_turn
    assert _text_ids(instruct_tokenizer, separator="eos")[-1] == end_of_turn
    assert _text_ids(instruct_tokenizer, separator="<|endoftext|>", add_eos=False)[-1] not in (end_of_text, end_of_turn)
    with pytest.raises(UserError, match=r"data.separator='<\|end\|>' is not a token .*<\|endoftext\|>, <\|im_end\|>"):
        Encoder(instruct_tokenizer, "text", separator="<|end|>")


def test_a_base_tokenizer_keeps_its_eos_as_the_separator(demo_tokenizer):
    """A base tokenizer's eos is its end-of-text: what every document ended with before, unchanged."""
    from flexengine.data.encode import document_separator

    assert _text_ids(demo_tokenizer)[-1] == demo_tokenizer.eos_token_id
    assert document_separator(demo_tokenizer).why == "the tokenizer's eos, an end-of-text"
