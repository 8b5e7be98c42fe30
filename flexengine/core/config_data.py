"""The data.* schema (one `DataConfig`, and `MixSource` per entry of data.mix); re-exported by `config.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from flexengine.core.config_checks import (
    DATA_SOURCES,
    EVAL_OVERLAP,
    LONG_DOC_POLICIES,
    PACKING_STRATEGIES,
    check_choice,
)
from flexengine.core.data_formats import FORMATS, DataFormat
from flexengine.core.errors import UserError

SEQ_LEN_AUTO = "auto"  # data.seq_len=auto: the row length is chosen from the corpus (planning/row_length.py)


def check_seq_len(seq_len: Any) -> None:
    """data.seq_len is a positive whole number of tokens or auto (UserError naming the key otherwise)."""
    if seq_len == SEQ_LEN_AUTO:
        return
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise UserError(
            f"data.seq_len={seq_len!r} must be a positive number of tokens, e.g. data.seq_len=4096, or auto (the "
            "length with the least estimated epoch time over the corpus's documents)."
        )


@dataclass
class MixSource:
    """One source of a data mixture (data.mix): read with data.*'s fields, and its format unless it names one."""

    path: str = ""  # file, directory or glob, like data.path
    weight: float = 1.0  # share of the training tokens (weights are normalised); a source is repeated or
    # subsampled (whole documents) to reach it
    source: Optional[str] = None  # jsonl | parquet | hf; None = data.source
    format: Optional[str] = None  # text | chat | pretokenized | mixed; None = data.format (a text file and a
    # chat file mix as [{path: code.jsonl}, {path: chats.jsonl, format: chat}])
    name: Optional[str] = None  # label in the packing report; None = the path


@dataclass
class DataConfig:
    """Where documents come from and how they are packed into rows."""

    source: str = "demo"  # demo (Python stdlib sources, offline) | jsonl | parquet | hf (HF `datasets`: local
    # JSON/Parquet/Arrow files via load_dataset, or a save_to_disk directory via load_from_disk; never the hub)
    path: Optional[str] = None  # file, directory or glob (several separated by commas) for jsonl/parquet/hf
    hf_split: str = "train"  # source=hf: the split of a saved DatasetDict
    mix: List[MixSource] = field(default_factory=list)  # several sources with weights instead of data.path, e.g.
    # data.mix='[{path: /d/code.jsonl, weight: 3}, {path: /d/chat.jsonl, weight: 1}]'; shares per source reported
    format: str = "text"  # text | chat | pretokenized | mixed (text and chat records, by data.format_field): a
    # format of core/data_formats.FORMATS, which says what each reads and how it is encoded
    text_field: str = "text"  # record field holding the document text (format=text)
    messages_field: str = "messages"  # record field holding the chat turns (format=chat)
    format_field: str = "format"  # format=mixed: the record field saying "text" or "chat" for that record
    train_on: str = "assistant"  # chat: assistant (completion-only loss: the replies and their end-of-turn
    # markers) | all (full-sequence loss)
    assistant_mask: str = "auto"  # chat: where replies are found. template: the chat template's
    # {% generation %} markers (transformers' return_assistant_tokens_mask) | prefix: render turn by turn |
    # auto: template when it has the markers, else prefix (the log says which)
    long_chats: str = "truncate"  # chat longer than seq_len: truncate (after the last assistant turn that fits)
    # | drop | split (mid-turn, by data.long_docs: an explicit choice); truncated and dropped ones are counted
    max_docs: Optional[int] = None  # use only the first N documents (None = all)
    on_error: str = "raise"  # raise: stop at the first bad record with file:line | skip: skip and count
    max_record_bytes: int = 64 << 20  # a JSONL line (one record) longer than this is a bad record (data.on_error),
    # read no further than this: a runaway single-line file would otherwise be held and tokenized whole
    seq_len: Any = 1024  # tokens per packed row | auto: the length with the least estimated epoch time over this
    # corpus's documents, within the memory budget and the model's context (flexengine/planning/row_length.py;
    # resolved before the fit, recorded in resolved_config.yaml)
    packing: str = "auto"  # auto (bfd for packed attn modes, none otherwise) | bfd (best-fit decreasing) | greedy
    # (data order) | none (one document per row, padded to the batch's longest)
    long_docs: str = "split"  # documents longer than seq_len: split | truncate | drop (always counted)
    bucket: bool = False  # packing=none: group documents of similar length into batches (less padding)
    add_eos: bool = True  # format=text: append the document separator (data.separator) to every document (chat:
    # the template decides)
    separator: Optional[str] = None  # format=text: the token that ends each document, as its text in the
    # vocabulary (e.g. '<|endoftext|>') | eos: the tokenizer's EOS | null: the base model's end-of-text
    # (<|endoftext|>, <|end_of_text|> or </s>) where the vocabulary has one and the EOS is another token (an instruct
    # tokenizer's EOS ends chat turns: <|im_end|>, <|eot_id|>), else the EOS. The log says which token it is
    cache_dir: Optional[str] = None  # tokenized-corpus cache; None = $FLEXENGINE_CACHE or ~/.cache/flexengine
    num_workers: int = 2  # tokenization processes; 0 or 1 = in this process (the Rust tokenizer's own threads)
    shuffle: bool = True  # shuffle packed rows each epoch (seeded by train.seed, resumable)
    demo_max_files: int = 400  # demo corpus: number of stdlib source files read
    eval_path: Optional[str] = None  # held-out documents (same source and format as data.path); None = split
    eval_split: Optional[str] = None  # data.eval_path as a saved HF DatasetDict: the split evaluated on;
    # None = "validation", else "test" (the log says which)
    eval_overlap: str = "auto"  # data.eval_path documents that are also training documents (identical tokens):
    # auto = drop them from the eval set (a WARNING gives the count) when they are <= 1 % of it (short repeated
    # records, e.g. wikitext's heading lines), refuse the run above that | drop (any number) | refuse (any) |
    # allow (keep them, with a warning: the eval loss then partly measures training data)
    eval_fraction: float = 0.0  # with no eval_path: this fraction of the documents is held out for evaluation
    # (whole documents, chosen by a hash of their tokens: stable across runs and seeds); 0 = no held-out set

    def __post_init__(self) -> None:
        check_choice("data.source", self.source, DATA_SOURCES)
        check_choice("data.format", self.format, tuple(FORMATS))  # read now: a test may add one
        check_choice("data.packing", self.packing, PACKING_STRATEGIES)
        check_choice("data.long_docs", self.long_docs, LONG_DOC_POLICIES)
        check_choice("data.on_error", self.on_error, ("raise", "skip"))
        if self.max_record_bytes <= 0:
            raise UserError(f"data.max_record_bytes={self.max_record_bytes} must be a positive number of bytes.")
        check_choice("data.train_on", self.train_on, ("assistant", "all"))
        check_choice("data.assistant_mask", self.assistant_mask, ("auto", "template", "prefix"))
        check_choice("data.long_chats", self.long_chats, ("truncate", "drop", "split"))
        check_seq_len(self.seq_len)
        if self.mix:
            if self.path:
                raise UserError("data.path and data.mix are both set: a mixture names its files in data.mix[*].path.")
            for i, part in enumerate(self.mix):
                part.source = part.source or self.source
                check_choice(f"data.mix[{i}].source", part.source, DATA_SOURCES[1:])
                part.format = part.format or self.format
                check_choice(f"data.mix[{i}].format", part.format, tuple(FORMATS))
                if not part.path:
                    raise UserError(f"data.mix[{i}] has no path.")
                if not part.weight > 0:
                    raise UserError(f"data.mix[{i}].weight={part.weight} must be positive.")
        elif self.source != "demo" and not self.path:
            raise UserError(
                f"data={self.source} needs data.path, e.g. data={self.source} data.path=/data/train.{self.source}"
            )
        self._check_auto_rows()
        if self.max_docs is not None and self.max_docs <= 0:
            raise UserError(f"data.max_docs={self.max_docs} must be positive (or null for all documents).")
        # the demo corpus is one text per file: a format reads it if all it needs is the text field
        if self.source == "demo" and FORMATS[self.format].needs != "data.text_field" and not self.mix:
            raise UserError(f"data=demo is plain text; data.format={self.format} needs data=jsonl or data=parquet.")
        if self.num_workers < 0:
            raise UserError(f"data.num_workers={self.num_workers} must be >= 0 (0 = tokenize in this process).")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise UserError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1) (0 = no held-out split).")
        if self.eval_path and self.eval_fraction:
            raise UserError(
                f"data.eval_path and data.eval_fraction={self.eval_fraction} both set: use one (the "
                "held-out set comes from a file, or from splitting data.path), e.g. data.eval_fraction=0."
            )
        check_choice("data.eval_overlap", self.eval_overlap, EVAL_OVERLAP)
        if self.eval_split and not self.eval_path:
            raise UserError(
                f"data.eval_split={self.eval_split} names a split of data.eval_path, which is not set: set "
                "data.eval_path=<the saved DatasetDict> (it may be data.path itself)."
            )
        if self.eval_path and self.source == "demo":
            raise UserError(
                "data.eval_path needs a file source (data=jsonl or data=parquet); the demo corpus "
                "splits itself with data.eval_fraction."
            )

    def _check_auto_rows(self) -> None:
        """data.seq_len=auto chooses from the documents' token lengths, and a chat's tokens depend on the row length
        (data.long_chats truncates, drops or splits conversations at data.seq_len): refused there, by name."""
        chats = sorted(name for name in self.formats if FORMATS[name].chats)
        if self.seq_len == SEQ_LEN_AUTO and chats:
            raise UserError(
                f"data.seq_len=auto with data.format={'/'.join(chats)}: a conversation is encoded to fit the row "
                "length (data.long_chats), so its length is not known before the row length is. Set data.seq_len "
                "to a number of tokens (a multiple of 128, e.g. data.seq_len=4096), e.g. from "
                "`python -m flexengine.plan data.seq_len=auto plan.documents=N plan.doc_tokens=T` with your "
                "conversations' count and typical length."
            )

    @property
    def fixed_seq_len(self) -> Optional[int]:
        """data.seq_len as a number of tokens; None while it is auto (not yet resolved)."""
        return None if self.seq_len == SEQ_LEN_AUTO else int(self.seq_len)

    @property
    def formats(self) -> set:
        """The record formats read: data.format, or each mixture source's."""
        return {m.format or self.format for m in self.mix} or {self.format}

    @property
    def format_specs(self) -> list[DataFormat]:
        """The DataFormat (core/data_formats.py) of each format read."""
        return [FORMATS[name] for name in sorted(self.formats)]

    @property
    def has_eval(self) -> bool:
        """Whether a held-out set is configured."""
        return bool(self.eval_path) or self.eval_fraction > 0
