"""Turn checked records into token ids (+ which tokens are trained on): text, chat, pretokenized or mixed.

- text: the tokenizer's own special tokens (e.g. LLaMA's BOS) + the document separator appended when
  data.add_eos: data.separator, else the base model's end-of-text (document_separator: an instruct tokenizer's
  EOS is its chat end-of-turn, which raw text must not teach after every document), else the tokenizer's EOS.
- chat: the conversation through the tokenizer's own chat template (`apply_chat_template`). With
  data.train_on=assistant only the assistant replies (and their end-of-turn markers) are trained on: found by
  the template's {% generation %} markers (transformers' `return_assistant_tokens_mask`), or, for a template
  without them (data.assistant_mask=auto falls back, saying so) or with data.assistant_mask=prefix, by rendering
  the conversation turn by turn. Either way the text a template adds after the end-of-turn token (ChatML's newline
  after <|im_end|>) is not trained on: the model never generates it. A conversation longer than
  data.seq_len is cut after the last assistant turn that fits, or dropped (data.long_chats), and counted.
- pretokenized: input_ids as given; labels of -100 mark tokens not trained on.
- mixed: each record is text or chat, as its data.format_field says.
Each format names its encoding below in core/data_formats.py's FORMATS. An `Encoder` holds what they share; it is
picklable and stateless per call, so worker processes can each hold one.
"""

from __future__ import annotations

import logging
import re
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from flexengine.core.config import DataConfig
from flexengine.core.data_formats import data_format, function_named
from flexengine.core.errors import UserError
from flexengine.data.sources import RawDoc

log = logging.getLogger(__name__)

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

TOKEN_DTYPE = np.int32  # every real vocabulary fits; halves the cache and the page cache it occupies


# What base models end a document with, in order of preference. An instruct tokenizer's EOS is its chat
# end-of-turn instead (Qwen2.5- and SmolLM2-Instruct: <|im_end|>; Llama-3-Instruct: <|eot_id|>): appended to raw
# text, continued pre-training would teach the model to end its turn after every document
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>")
TOKENIZER_EOS = "eos"  # data.separator=eos: the tokenizer's EOS, whatever it is


class Separator(NamedTuple):
    """The token appended to every text document (data.add_eos), and why it is that one (for the log)."""

    id: Optional[int]  # None: the tokenizer has no EOS and none was named: nothing is appended
    token: Optional[str]
    why: str


def document_separator(tokenizer, separator: Optional[str] = None) -> Separator:
    """The token that ends each text document: data.separator (a token of the vocabulary, or `eos`), else the base
    model's end-of-text (END_OF_TEXT_TOKENS) where the vocabulary has one and the EOS is something else (a chat
    end-of-turn), else the tokenizer's EOS."""
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    if separator == TOKENIZER_EOS:
        return Separator(eos_id, eos, "the tokenizer's eos (data.separator=eos)")
    vocab = tokenizer.get_vocab()
    if separator is not None:
        if separator not in vocab:
            near = [t for t in END_OF_TEXT_TOKENS if t in vocab] + ([eos] if eos else [])
            raise UserError(
                f"data.separator={separator!r} is not a token of this tokenizer's vocabulary; give one token's "
                f"text ({', '.join(dict.fromkeys(near)) or 'e.g. its end-of-text'}), `eos` for the tokenizer's EOS, "
                "or null for the base model's end-of-text."
            )
        return Separator(vocab[separator], separator, "data.separator")
    if eos in END_OF_TEXT_TOKENS:
        return Separator(eos_id, eos, "the tokenizer's eos, an end-of-text")
    found = next((t for t in END_OF_TEXT_TOKENS if t in vocab), None)
    if found is not None and eos_id is not None:
        why = f"the base model's end-of-text; the tokenizer's eos {eos} ends chat turns (data.separator chooses)"
        return Separator(vocab[found], found, why)
    if found is not None:
        return Separator(vocab[found], found, "the base model's end-of-text (the tokenizer names no eos)")
    return Separator(
        eos_id, eos, "the tokenizer's eos (no end-of-text token in its vocabulary; data.separator chooses)"
    )


def describe_separator(tokenizer, data: DataConfig) -> Optional[str]:
    """Which token separates text documents, for the log; None where none is appended (chat or pretokenized data,
    or data.add_eos=false)."""
    if not data.add_eos or not any(f.texts for f in data.format_specs):
        return None
    sep = document_separator(tokenizer, data.separator)
    if sep.id is None:
        return "text documents end with no separator token: the tokenizer has no eos (set data.separator)"
    return f"text documents end with {sep.token} (id {sep.id}: {sep.why})"


class Encoded(NamedTuple):
    """One tokenized document; loss_mask None means every token is trained on."""

    ids: np.ndarray  # [tokens] int32
    loss_mask: Optional[np.ndarray]  # [tokens] bool or None
    truncated: bool = False  # a conversation cut at a turn boundary to fit data.seq_len


class Dropped(NamedTuple):
    """A record left out by a configured policy (not an error): counted, never raised."""

    reason: str
    message: str  # starts with the record's location


class Rejected(NamedTuple):
    """A record that failed during encoding (e.g. the chat template raised), reported by the caller."""

    reason: str
    message: str  # starts with the record's location


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template.get("default", "") if isinstance(template, dict) else template


class Encoder:
    """Encodes batches of RawDoc for one format with one tokenizer."""

    def __init__(
        self,
        tokenizer,
        fmt: str,
        add_eos: bool = True,
        *,
        train_on: str = "assistant",
        assistant_mask: str = "auto",
        max_len: Optional[int] = None,
        long_chats: str = "split",
        separator: Optional[str] = None,
    ):
        spec = data_format(fmt)
        self.tokenizer, self.format, self.add_eos = tokenizer, fmt, add_eos
        self.encode_docs = function_named(spec.encode)  # (encoder, docs) -> one result per doc
        self.separator_id = document_separator(tokenizer, separator).id if spec.texts else None
        self.train_on, self.max_len, self.long_chats = train_on, max_len, long_chats
        self.mask_source = assistant_mask
        if spec.chats:
            template = _template_text(tokenizer)
            if not template:
                raise UserError(
                    f"data.format={fmt} needs a tokenizer with a chat template; this one has none. Use the model's "
                    "instruct tokenizer (model.tokenizer=...) or data.format=text."
                )
            has_markers = bool(_GENERATION_TAG.search(template))
            if assistant_mask == "auto":
                self.mask_source = "template" if has_markers else "prefix"
                if not has_markers and train_on == "assistant":
                    log.info(
                        "data: the chat template has no {% generation %} markers: assistant replies are found by "
                        "rendering each conversation turn by turn (data.assistant_mask=prefix)"
                    )
            elif assistant_mask == "template" and not has_markers:
                if train_on == "assistant":
                    raise UserError(
                        "data.train_on=assistant: this tokenizer's chat template has no {% generation %} markers, so "
                        "it cannot say which tokens are the assistant's (transformers' return_assistant_tokens_mask). "
                        "Use data.assistant_mask=prefix (finds each reply by rendering the conversation turn by "
                        "turn; needs a template that renders earlier turns unchanged), or data.train_on=all "
                        "(full-sequence loss), or a tokenizer whose template marks {% generation %}."
                    )
                self.mask_source = "prefix"  # train_on=all: turn boundaries (for truncation) only
            if self.mask_source == "prefix" and not getattr(tokenizer, "is_fast", False):
                raise UserError(
                    "data.assistant_mask=prefix (what a chat template without {% generation %} markers needs) "
                    "needs a fast (Rust) tokenizer for token offsets; this one is slow. Use the model's fast "
                    "tokenizer, a template with {% generation %} markers, or data.train_on=all."
                )
            self.special_tokens = _special_token_texts(tokenizer)
        self.vocab_size = len(tokenizer)

    @classmethod
    def from_config(cls, tokenizer, data: DataConfig) -> "Encoder":
        """The encoder data.* describes."""
        return cls(
            tokenizer,
            data.format,
            data.add_eos,
            train_on=data.train_on,
            assistant_mask=data.assistant_mask,
            max_len=data.seq_len,
            long_chats=data.long_chats,
            separator=data.separator,
        )

    def encode_batch(self, docs: Sequence[RawDoc]) -> list[Any]:
        """Encoded, Rejected or Dropped per document, in order (the format's own encoding)."""
        return self.encode_docs(self, docs)

    def describe_mask(self) -> str:
        """How assistant tokens are found, for the log."""
        if self.mask_source == "template":
            return "the chat template's {% generation %} markers"
        return "rendering each conversation turn by turn (data.assistant_mask=prefix)"

    def _render(self, messages: list, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def assistant_char_spans(self, messages: list) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the [start, end) character spans of its assistant turns.

        A turn's span runs from the end of the prompt rendered up to it (with the generation prompt, e.g.
        "<|im_start|>assistant\\n") to the end of the conversation rendered through it, so it covers the reply
        and its end-of-turn marker, which the model must learn to emit; whitespace the template puts after that
        marker (ChatML's "\\n" after <|im_end|>) is left out, as a {% generation %} block closed at the marker does.
        """
        text = self._render(messages, add_generation_prompt=False)
        spans = []
        for i, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            before = self._render(messages[:i], add_generation_prompt=True) if i else ""
            through = self._render(messages[: i + 1], add_generation_prompt=False)
            if not text.startswith(before) or not text.startswith(through) or len(through) < len(before):
                raise ValueError(
                    "the chat template does not render earlier turns as a prefix of the whole conversation "
                    "(it rewrites history), so assistant tokens cannot be located"
                )
            spans.append((len(before), self._end_of_turn(through, len(before))))
        return text, spans

    def _end_of_turn(self, text: str, start: int) -> int:
        """Where the assistant turn text[start:] really ends: after its last special token when only whitespace
        follows it (the template's trailer), else at the end."""
        tail_start = len(text.rstrip())
        for token in self.special_tokens:
            if text.endswith(token, start, tail_start):
                return tail_start
        return len(text)

    def _chat_ids_and_mask(self, messages: list) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the rendered conversation and its assistant-token mask."""
        if self.mask_source == "template":
            enc = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return np.asarray(enc["input_ids"], dtype=TOKEN_DTYPE), np.asarray(enc["assistant_masks"], dtype=bool)
        text, spans = self.assistant_char_spans(messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = np.fromiter((s for s, _ in enc["offset_mapping"]), dtype=np.int64)
        mask = np.zeros(len(starts), dtype=bool)
        for a, b in spans:
            mask |= (starts >= a) & (starts < b)
        return np.asarray(enc["input_ids"], dtype=TOKEN_DTYPE), mask

    def encode_chat(self, doc: RawDoc) -> Any:
        """One conversation: Encoded (its assistant mask), Rejected (the template failed) or Dropped (too long)."""
        try:
            ids, mask = self._chat_ids_and_mask(doc.payload)
        except Exception as e:  # jinja raises TemplateError / exceptions the template itself raises
            return Rejected("chat_template_error", f"{doc.where}: chat template failed: {e}")
        if not mask.any():
            return Rejected("no_assistant_turn", f"{doc.where}: the chat template rendered no assistant tokens")
        truncated = False
        if self.max_len is not None and len(ids) > self.max_len and self.long_chats != "split":
            # turn boundaries: where an assistant reply (with its end-of-turn marker) ends
            ends = np.flatnonzero(mask & ~np.append(mask[1:], False)) + 1
            fitting = ends[ends <= self.max_len]
            if self.long_chats == "drop" or not len(fitting):
                return Dropped(
                    "chat_too_long",
                    f"{doc.where}: {len(ids)} tokens > data.seq_len={self.max_len}"
                    + ("" if self.long_chats == "drop" else " and its first assistant turn ends beyond it"),
                )
            ids, mask, truncated = ids[: fitting[-1]], mask[: fitting[-1]], True
        return Encoded(ids, mask if self.train_on == "assistant" else None, truncated)


def encode_texts(encoder: Encoder, docs: Sequence[RawDoc]) -> list[Any]:
    """format=text: the texts through the tokenizer in one batch, each ended by the document separator."""
    eos = encoder.separator_id
    texts = [d.payload for d in docs]
    backend = getattr(encoder.tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        # same ids as tokenizer(texts) (special tokens come from the backend's post-processor), ~30 % faster
        # because it skips the character offsets nobody reads here
        batch = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=True)]
    else:
        batch = encoder.tokenizer(texts)["input_ids"]
    out = []
    for ids in batch:
        if encoder.add_eos and eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]  # some tokenizers already end with it; never two
        out.append(Encoded(np.asarray(ids, dtype=TOKEN_DTYPE), None))
    return out


def encode_chats(encoder: Encoder, docs: Sequence[RawDoc]) -> list[Any]:
    """format=chat: each conversation through the chat template, its assistant tokens masked in."""
    return [encoder.encode_chat(doc) for doc in docs]


def encode_pretokenized(encoder: Encoder, docs: Sequence[RawDoc]) -> list[Any]:
    """format=pretokenized: the ids as given (each inside the vocabulary), trained where labels are not -100."""
    return [_token_ids(doc, encoder.vocab_size) for doc in docs]


def _token_ids(doc: RawDoc, vocab_size: int) -> Any:
    ids, labels = np.asarray(doc.payload[0], dtype=np.int64), doc.payload[1]
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if len(bad):
        i = int(bad[0])
        problem = f"input_ids[{i}]={int(ids[i])} is outside the tokenizer's vocabulary (0..{vocab_size - 1})"
        return Rejected("token_id_out_of_range", f"{doc.where}: {problem}")
    mask = None if labels is None else np.asarray(labels, dtype=np.int64) != -100
    return Encoded(ids.astype(TOKEN_DTYPE), mask)


def encode_mixed(encoder: Encoder, docs: Sequence[RawDoc]) -> list[Any]:
    """format=mixed: payload (kind, value), its kind a format (text or chat) whose encoding takes all its documents."""
    out: list[Any] = [None] * len(docs)
    for kind in dict.fromkeys(doc.payload[0] for doc in docs):
        picked = [i for i, doc in enumerate(docs) if doc.payload[0] == kind]
        encode = function_named(data_format(kind).encode)
        for i, result in zip(picked, encode(encoder, [RawDoc(docs[i].where, docs[i].payload[1]) for i in picked])):
            out[i] = result
    return out


def _special_token_texts(tokenizer) -> tuple[str, ...]:
    """The tokenizer's special tokens as text (end-of-turn markers are among them), longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(added, "special", False):
            texts.add(str(added.content))
    return tuple(sorted((t for t in texts if t), key=len, reverse=True))


# Worker-process side: fork copies the parent's Encoder into each worker once (initializer), not per batch.
_WORKER_ENCODER: Optional[Encoder] = None


def init_worker(encoder: Encoder) -> None:
    """Pool initializer: keep the encoder (the parent forks with TOKENIZERS_PARALLELISM=false, so each worker
    runs one tokenizer thread: the processes are the parallelism)."""
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def encode_in_worker(docs: Sequence[RawDoc]) -> list[Any]:
    """Pool task: encode one batch with the worker's encoder."""
    assert _WORKER_ENCODER is not None, "init_worker was not run"
    return _WORKER_ENCODER.encode_batch(docs)
