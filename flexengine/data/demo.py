"""The offline demo: the running interpreter's own standard-library sources and a tokenizer trained on them.

Real text with long-tailed lengths (a few hundred to tens of thousands of tokens), no download needed.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

DEMO_TOKENIZER_VERSION = "v1"
DEMO_VOCAB_SIZE = 2048
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def default_cache_dir() -> Path:
    """~/.cache/flexengine (or $FLEXENGINE_CACHE)."""
    return Path(os.environ.get("FLEXENGINE_CACHE", Path.home() / ".cache" / "flexengine"))


def demo_source_files(max_files: int) -> list[Path]:
    """Up to `max_files` stdlib .py files, spread evenly over the sorted list so sizes stay long-tailed."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size > 0)
    if not files:
        raise FileNotFoundError(f"no Python sources under {root} for the demo corpus")
    stride = max(1, len(files) // max_files)
    return files[::stride][:max_files]


def iter_demo_documents(max_files: int) -> Iterator[tuple[str, str]]:
    """(file name, text) of each demo document."""
    for path in demo_source_files(max_files):
        yield str(path), path.read_text(encoding="utf-8", errors="replace")


def load_demo_tokenizer(cache_dir: Optional[Path] = None):
    """A byte-level BPE tokenizer trained once on the demo corpus and cached (a HF PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    directory = (cache_dir or default_cache_dir()) / f"demo_tokenizer_{DEMO_TOKENIZER_VERSION}"
    if (directory / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_VOCAB_SIZE,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((text for _, text in iter_demo_documents(400)), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    wrapped.save_pretrained(str(tmp))
    try:
        os.replace(tmp, directory)  # atomic: concurrent runs never see a half-written tokenizer
    except OSError:
        pass  # another process won the race; its copy is identical
    return PreTrainedTokenizerFast.from_pretrained(str(directory))
