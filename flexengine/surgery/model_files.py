"""model.path's files checked before transformers reads them: a damaged one stops with one paragraph naming it.

A truncated shard, a garbled header, an index that points at a missing file or at tensors a shard does not hold,
and weights of another architecture than config.json's each ended in a long traceback from deep inside
safetensors or transformers (rc 1, the file often unnamed). Each weight file is opened with safetensors' own
reader, which reads only the header and validates it (its length, its JSON, each tensor's byte range against its
dtype and shape, the data exactly covered), so what passes here is what transformers will load, and the check is
cheap enough to run before any tokenizing. safetensors' refusals name neither the tensor nor the sizes: for a refused
file the header is read again to say which (the layout: https://huggingface.co/docs/safetensors). A flexengine
checkpoint used as model.path is also checked against its manifest's sizes and checksums. config.json and the
tokenizer's files get the same treatment (read_config_json, tokenizer_problem).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from safetensors import SafetensorError, safe_open

from flexengine.core.errors import UserError
from flexengine.core.storage import MANIFEST, inside_directory, read_manifest, sha256_file

SAFE_WEIGHTS = "model.safetensors"  # what transformers reads first; the index only when it is absent
SAFE_INDEX = "model.safetensors.index.json"
# bytes per element of each safetensors dtype name (a header's "dtype"): the one table of them
DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}  # fmt: skip
COPY_AGAIN = "copy or download it again"


@dataclass(frozen=True)
class StoredTensor:
    """Where a checkpoint tensor lives and what its header says it is."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def safetensors_tensors(file: Path) -> dict[str, StoredTensor]:
    """Every tensor of one safetensors file, as safetensors' own reader lists them once it has validated the file."""
    try:
        with safe_open(str(file), framework="numpy") as f:  # numpy: opening with "pt" would import torch
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
            return {name: StoredTensor(file, s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}
    except SafetensorError as e:
        reason = str(e).removeprefix("Error while deserializing header: ")
        raise UserError(f"{file} {_damage(file, reason)}: {COPY_AGAIN}.") from None


def _damage(file: Path, reason: str) -> str:
    """What is wrong with a file safetensors refused for `reason`, with the sizes that show it (its messages name
    neither the tensor nor the bytes)."""
    size = file.stat().st_size
    if size < 8:
        return f"is {size} bytes, too short for a safetensors file (an empty or interrupted copy)"
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > size - 8:
            return (f"is damaged: its header says the table of tensors is {length:,} bytes, but the whole file has "
                    f"{size:,} (the file is truncated or its first 8 bytes are garbled)")  # fmt: skip
        raw = f.read(length)
    if "JSON" in reason or "UTF-8" in reason:
        return f"is damaged: its header is not a JSON table of tensors ({reason})"
    try:
        header = json.loads(raw)
    except ValueError:  # a header too large for safetensors to read, unreadable here too
        return f"is damaged: safetensors refuses it ({reason})"
    try:  # safetensors' older releases say only "InvalidHeaderDeserialization": a malformed entry lands here too
        return _sizes_damage({name: e for name, e in header.items() if name != "__metadata__"}, size, length, reason)
    except (KeyError, TypeError, AttributeError, ValueError):  # not a table of {dtype, shape, data_offsets}
        return f"is damaged: its header is not a JSON table of tensors ({reason})"


def _sizes_damage(entries: dict, size: int, length: int, reason: str) -> str:
    """Which tensor's bytes disagree with its shape, or whether the data after the header is cut short or overlong."""
    for name, e in entries.items():
        width, (begin, end) = DTYPE_BYTES.get(e["dtype"]), e["data_offsets"]
        if width is not None and end - begin != math.prod(e["shape"]) * width:
            return (f"is damaged: tensor {name!r} ({e['dtype']}, shape {e['shape']}) needs "
                    f"{math.prod(e['shape']) * width:,} bytes, its header gives it {end - begin:,}")  # fmt: skip
    end_of_data, data_bytes = max((e["data_offsets"][1] for e in entries.values()), default=0), size - 8 - length
    if end_of_data > data_bytes:
        return (f"is truncated: its tensors need {end_of_data:,} bytes after the header, the file holds "
                f"{data_bytes:,} (an interrupted download or copy)")  # fmt: skip
    if end_of_data < data_bytes:
        return (f"is damaged: {data_bytes - end_of_data:,} bytes follow its last tensor, which safetensors refuses "
                "(the file was appended to or its header is garbled)")  # fmt: skip
    return f"is damaged: safetensors refuses it ({reason})"


def _index_shards(directory: Path) -> dict[str, list[str]]:
    """model.safetensors.index.json as {shard file: [tensor names]}, checked for shape; UserError naming it."""
    index = directory / SAFE_INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to shard file names")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise UserError(
            f"{index} is damaged: it must be JSON with a weight_map of tensor name -> shard file "
            f"({type(e).__name__}: {e}); {COPY_AGAIN} with the shards it belongs to."
        ) from None
    outside = sorted({shard for shard in weight_map.values() if not inside_directory(shard)})
    if outside:  # transformers joins the name to the directory: `../x` or an absolute path reads from anywhere
        raise UserError(
            f"{index} names shard files outside {directory} ({', '.join(map(repr, outside[:3]))}): an index lists "
            "the model directory's own files by relative name only. Put the shards beside the index and name them "
            f"there, or {COPY_AGAIN}."
        )
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    return shards


def stored_tensors(directory: Path) -> Optional[dict[str, StoredTensor]]:
    """The tensors transformers would load from a model directory (model.safetensors, else the index's shards),
    every file checked; None when the directory has no safetensors weights (*.bin: torch's format, unchecked)."""
    single = directory / SAFE_WEIGHTS
    if single.is_file():
        return safetensors_tensors(single)
    if not (directory / SAFE_INDEX).is_file():
        return None
    tensors: dict[str, StoredTensor] = {}
    for shard, names in _index_shards(directory).items():
        file = directory / shard
        if not file.is_file():
            raise UserError(
                f"{directory / SAFE_INDEX} lists {shard} (for {len(names)} tensors, e.g. {names[0]!r}), but "
                f"{file} does not exist: the shard is missing; copy every model-*.safetensors file the index names."
            )
        held = safetensors_tensors(file)
        absent = [n for n in names if n not in held]
        if absent:
            raise UserError(
                f"{directory / SAFE_INDEX} says {len(absent)} tensors (e.g. {absent[0]!r}) are in {shard}, but "
                f"{file} does not hold them: the index and the shards come from different saves; {COPY_AGAIN}."
            )
        tensors.update({n: held[n] for n in names})
    return tensors


def check_against_manifest(directory: Path, files: set[Path]) -> None:
    """A flexengine checkpoint used as model.path: each weight file's size and sha256 as its manifest recorded them
    (a flipped byte inside the data leaves every header intact)."""
    if not (directory / MANIFEST).is_file():
        return
    recorded = read_manifest(directory)["files"]
    for file in sorted(files):
        expected = recorded.get(file.name)
        if expected is None:
            continue
        if file.stat().st_size != expected["bytes"] or sha256_file(file) != expected["sha256"]:
            raise UserError(
                f"{file} does not match the checksum its checkpoint's {MANIFEST} recorded: the file changed or was "
                "damaged after it was saved; use another checkpoint (e.g. an earlier step_<N>) as model.path."
            )


def check_shapes(stored: dict[str, StoredTensor], expected: dict[str, tuple[int, ...]], config_file: Path) -> None:
    """Each stored tensor the model has must have the model's shape: weights of another size than config.json's
    architecture are refused naming the tensor, its file and both shapes (transformers would re-initialise them)."""
    wrong = [(name, t) for name, t in stored.items() if name in expected and t.shape != expected[name]]
    if wrong:
        name, t = wrong[0]
        raise UserError(
            f"{t.file} holds {name} with shape {list(t.shape)}, but {config_file} describes a model whose "
            f"{name} is {list(expected[name])} ({len(wrong)} tensors differ): the weights and config.json come "
            "from different models; put the config.json that was saved with these weights back."
        )


def read_config_json(directory: Path) -> dict:
    """directory/config.json parsed, or a UserError naming it and where the JSON breaks."""
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(
            f"{path} is not valid JSON ({e}): it must be the model's Hugging Face config; put back the config.json "
            "that came with these weights."
        ) from None
    return config


def check_model_dir(model_path: str, loads_weights: bool) -> Path:
    """model.path as a Hugging Face model directory: it exists, holds a config.json that parses and (loads_weights)
    weight files whose headers, index and sizes hold together; a UserError naming what is wrong. Torch-free and
    cheap: the entry point runs it before the heavy imports, build_hf_config again where the files are read."""
    path = Path(model_path)
    if not path.is_dir():
        raise UserError(f"model.path={model_path!r} is not a directory. Point it at a local HF model directory.")
    if not (path / "config.json").is_file():
        raise UserError(
            f"model.path={model_path!r} has no config.json, so it is not a Hugging Face model directory "
            "(expected config.json, tokenizer files and *.safetensors)."
        )
    read_config_json(path)
    if loads_weights:
        stored_tensors(path)
    return path


# config.json keys that describe the file rather than the network: transformers' bookkeeping, the storage dtype
# (precision.* decides the training one), the cache switch (training turns it off), classification labels
NOT_ARCHITECTURE: tuple[str, ...] = ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype")
NOT_ARCHITECTURE += ("use_cache", "id2label", "label2id")


def architecture_of(directory: Path) -> dict:
    """The architecture fields of directory/config.json (what trains when model.path is set, in place of
    model.arch): every key but NOT_ARCHITECTURE, as the file gives it."""
    return {k: v for k, v in read_config_json(Path(directory)).items() if k not in NOT_ARCHITECTURE}


# A tokenizer's vocabulary: fast (tokenizers' tokenizer.json) or one of the slow formats transformers converts
VOCAB_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
)


def tokenizer_problem(source: str, error: BaseException) -> str:
    """Why AutoTokenizer could not load `source`, in one paragraph naming the file at fault where one is."""
    directory = Path(source)
    if not directory.is_dir():
        return f"{source!r} is not a directory (model.tokenizer / model.path must be a local tokenizer directory)"
    fast = directory / "tokenizer.json"
    if fast.is_file():
        try:
            json.loads(fast.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            return f"{fast} is not valid JSON ({e}): the file is damaged; {COPY_AGAIN}"
    if not any((directory / name).is_file() for name in VOCAB_FILES):
        present = sorted(p.name for p in directory.glob("tokenizer*")) or ["no tokenizer files"]
        return (
            f"{directory} has no tokenizer vocabulary ({', '.join(VOCAB_FILES[:2])}, or vocab.json + merges.txt; it "
            f"holds {', '.join(present)}): copy the tokenizer files that came with the model next to it, or point "
            "model.tokenizer at a directory that has them"
        )
    return f"cannot load a tokenizer from {directory}: " + " ".join(str(error).split())
