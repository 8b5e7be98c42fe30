"""Damaged, truncated or mismatched files in model.path stop with one paragraph naming the file and what is wrong
(exit 2 through the real entry point), before transformers or safetensors raise from deep inside."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexengine.core.config import ModelConfig
from flexengine.core.errors import UserError
from flexengine.core.storage import write_manifest
from flexengine.surgery.model import build_hf_config, load_model, load_tokenizer
from flexengine.surgery.model_files import (
    DTYPE_BYTES,
    NOT_ARCHITECTURE,
    architecture_of,
    safetensors_tensors,
    stored_tensors,
)
from tests.helpers import FAST, flip_one_byte, make_llama

CPU = torch.device("cpu")


def _save_model(directory: Path, shard_size: str = "5GB") -> Path:
    from flexengine.data.demo import load_demo_tokenizer

    make_llama(vocab_size=2048).save_pretrained(directory, max_shard_size=shard_size)
    load_demo_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"single": _save_model(root / "single"), "sharded": _save_model(root / "sharded", "100KB")}


@pytest.fixture
def copy_of(saved, tmp_path):
    def copy(kind: str) -> Path:
        return Path(shutil.copytree(saved[kind], tmp_path / kind))

    return copy


def _shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("model-*.safetensors"))


# -- each damage, and what it is called ---------------------------------------------------------------------------


def truncate(d: Path) -> Path:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f


def garble_header_length(d: Path) -> Path:
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", 10**12)
    f.write_bytes(bytes(data))
    return f


def garble_header_json(d: Path) -> Path:
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe@@"
    f.write_bytes(bytes(data))
    return f


def _rewrite_header(f: Path, change) -> None:
    data = f.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    change(header)
    raw = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def widen_a_tensor(d: Path) -> Path:
    f = d / "model.safetensors"
    _rewrite_header(f, lambda h: h["model.norm.weight"]["shape"].__setitem__(0, 65))  # 64 -> 65: 4 bytes short
    return f


def drop_a_dtype(d: Path) -> Path:
    f = d / "model.safetensors"
    _rewrite_header(f, lambda h: h["model.norm.weight"].pop("dtype"))
    return f


def append_bytes(d: Path) -> Path:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes() + b"\0" * 16)
    return f


def empty_file(d: Path) -> Path:
    f = d / "model.safetensors"
    f.write_bytes(b"")
    return f


def remove_a_shard(d: Path) -> Path:
    f = _shards(d)[1]
    f.unlink()
    return f


def index_names_a_tensor_the_shard_lacks(d: Path) -> Path:
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = next(iter(data["weight_map"]))
    others = [s.name for s in _shards(d) if s.name != data["weight_map"][name]]
    data["weight_map"][name] = others[0]
    index.write_text(json.dumps(data))
    return index


def index_not_json(d: Path) -> Path:
    index = d / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    return index


DAMAGE = [
    ("single", truncate, "is truncated: its tensors need"),
    ("single", garble_header_length, "is damaged: its header says the table of tensors is 1,000,000,000,000 bytes"),
    ("single", garble_header_json, "is damaged: its header is not a JSON table of tensors"),
    ("single", append_bytes, "is damaged: 16 bytes follow its last tensor"),
    (
        "single",
        widen_a_tensor,
        "is damaged: tensor 'model.norm.weight' (F32, shape [65]) needs 260 bytes, its header gives it 256",
    ),
    (
        "single",
        drop_a_dtype,
        "is damaged: its header is not a JSON table of tensors (",  # with safetensors' reason
    ),
    ("single", empty_file, "is 0 bytes, too short for a safetensors file"),
    ("sharded", remove_a_shard, "does not exist: the shard is missing"),
    ("sharded", index_names_a_tensor_the_shard_lacks, "does not hold them: the index and the shards come from"),
    ("sharded", index_not_json, "is damaged: it must be JSON with a weight_map"),
]


@pytest.mark.parametrize("kind, damage, said", DAMAGE, ids=[d.__name__ for _, d, _ in DAMAGE])
def test_damaged_weights_are_named_before_any_tokenizing(copy_of, kind, damage, said):
    directory = copy_of(kind)
    assert stored_tensors(directory) is not None  # intact, it reads
    damage_file = damage(directory)
    with pytest.raises(UserError) as e:
        build_hf_config(ModelConfig(path=str(directory)))
    text = str(e.value)
    assert said in text and str(damage_file if damage is not remove_a_shard else directory) in text, text
    assert "\n" not in text
    build_hf_config(ModelConfig(path=str(directory), init="random"))  # random weights: the files are not read


def test_intact_directories_list_every_tensor(saved):
    expected = set(make_llama(vocab_size=2048).state_dict())
    for kind in ("single", "sharded"):
        stored = stored_tensors(saved[kind])
        assert set(stored) == expected
        assert {t.file.name for t in stored.values()} == (
            {"model.safetensors"} if kind == "single" else {f.name for f in _shards(saved[kind])}
        )


def test_weights_of_another_shape_than_config_json(copy_of):
    directory = copy_of("single")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(UserError, match=r"holds model\.layers\.0\.mlp\.\w+_proj\.weight with shape \[.*config\.json"):
        load_model(ModelConfig(path=str(directory)), CPU)


def test_checkpoint_used_as_model_path_is_checked_against_its_manifest(copy_of):
    directory = copy_of("single")
    write_manifest(directory, step=1)  # as a flexengine checkpoint is saved: manifest.json with sizes and sha256
    load_model(ModelConfig(path=str(directory)), CPU)
    flip_one_byte(directory / "model.safetensors")  # inside the tensor data: every header still parses
    with pytest.raises(UserError, match=r"model\.safetensors does not match the checksum .*manifest\.json"):
        load_model(ModelConfig(path=str(directory)), CPU)


def test_the_architecture_of_a_model_path_is_its_config_json_without_bookkeeping(saved):
    on_disk = json.loads((saved["single"] / "config.json").read_text())
    arch = architecture_of(saved["single"])
    assert arch == {k: v for k, v in on_disk.items() if k not in NOT_ARCHITECTURE}
    assert arch["hidden_size"] == build_hf_config(ModelConfig(path=str(saved["single"]))).hidden_size
    assert "transformers_version" in on_disk and "transformers_version" not in arch


def test_the_dtype_width_table_agrees_with_what_safetensors_writes(tmp_path):
    """DTYPE_BYTES (the one table: header checks here, the LoRA merge's wider-base test in loop/checkpoint/save.py)
    against the header safetensors writes for each torch dtype."""
    from safetensors.torch import save_file

    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8]
    dtypes += [torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
    save_file({str(d): torch.zeros(3, dtype=d) for d in dtypes}, str(tmp_path / "all.safetensors"))
    for name, tensor in safetensors_tensors(tmp_path / "all.safetensors").items():
        assert DTYPE_BYTES[tensor.dtype] == getattr(torch, name.removeprefix("torch.")).itemsize, name


def test_config_json_that_is_not_json(copy_of):
    directory = copy_of("single")
    (directory / "config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"config\.json is not valid JSON \(Expecting property name"):
        build_hf_config(ModelConfig(path=str(directory)))


def test_the_model_dir_check_names_each_problem_and_passes_an_intact_one(copy_of, tmp_path):
    """check_model_dir (torch-free: the entry point runs it before the heavy imports) refuses what build_hf_config
    refuses: no directory, no config.json, a config.json that is not JSON, damaged weights."""
    from flexengine.surgery.model_files import check_model_dir

    directory = copy_of("single")
    assert check_model_dir(str(directory), loads_weights=True) == directory
    with pytest.raises(UserError, match="is not a directory"):
        check_model_dir(str(tmp_path / "absent"), loads_weights=True)
    (directory / "model.safetensors").write_bytes(b"\x10")
    check_model_dir(str(directory), loads_weights=False)  # model.init=random reads no weights
    with pytest.raises(UserError, match="too short for a safetensors file"):
        check_model_dir(str(directory), loads_weights=True)
    (directory / "config.json").unlink()
    with pytest.raises(UserError, match="has no config.json"):
        check_model_dir(str(directory), loads_weights=True)


def test_tokenizer_files_missing_or_broken(copy_of):
    directory = copy_of("single")
    (directory / "tokenizer.json").write_text("{garbage")
    with pytest.raises(UserError, match=r"tokenizer\.json is not valid JSON"):
        load_tokenizer(ModelConfig(path=str(directory)))
    (directory / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=r"has no tokenizer vocabulary .* it holds tokenizer_config\.json"):
        load_tokenizer(ModelConfig(path=str(directory)))


# -- through the real entry point ---------------------------------------------------------------------------------


def _remove_tokenizer_json(d: Path) -> Path:
    (d / "tokenizer.json").unlink()
    return d


def _break_config_json(d: Path) -> Path:
    (d / "config.json").write_text("{not json")
    return d / "config.json"


ENTRY_POINT = [
    ("single", truncate, "is truncated"),
    ("single", garble_header_length, "its first 8 bytes are garbled"),
    ("sharded", remove_a_shard, "the shard is missing"),
    ("single", _break_config_json, "is not valid JSON"),
    ("single", _remove_tokenizer_json, "has no tokenizer vocabulary"),
]


@pytest.mark.parametrize("kind, damage, said", ENTRY_POINT, ids=[d.__name__ for _, d, _ in ENTRY_POINT])
def test_train_stops_with_one_paragraph_and_exit_2(copy_of, tmp_path, kind, damage, said):
    directory = copy_of(kind)
    named = damage(directory)
    proc = subprocess.run(
        [sys.executable, "-m", "flexengine.train", f"model.path={directory}", *FAST, "train.max_steps=1",
         f"train.output_dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    error = proc.stderr[proc.stderr.index("flexengine: error: ") :].strip()
    assert said in error and str(named) in error and "\n" not in error, error


@pytest.mark.parametrize("outside", ["../elsewhere/model-00001.safetensors", "ABSOLUTE"])
def test_an_index_naming_shards_outside_the_model_directory_is_refused(copy_of, outside):
    """Before: `../../x.safetensors` or an absolute path in the weight_map loaded silently from wherever it was."""
    d = copy_of("sharded")
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = _shards(d)[0]
    target = d.parent / "elsewhere" / "model-00001.safetensors"
    target.parent.mkdir()
    shutil.copy(first, target)
    name = str(target) if outside == "ABSOLUTE" else outside
    data["weight_map"] = {k: (name if v == first.name else v) for k, v in data["weight_map"].items()}
    index.write_text(json.dumps(data))
    with pytest.raises(UserError, match=rf"{index} names shard files outside {d} \({name!r}"):
        stored_tensors(d)


def header_is_a_list(d: Path) -> Path:
    f = d / "model.safetensors"
    raw = b'["not", "a", "table"]'
    f.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return f


@pytest.mark.parametrize("damage", [drop_a_dtype, header_is_a_list])
def test_an_older_safetensors_that_only_says_invalid_header_still_gets_one_clear_message(copy_of, damage, monkeypatch):
    """safetensors 0.4's refusal names no JSON: the header's own shape must not raise KeyError or AttributeError."""
    from flexengine.surgery import model_files

    def old_safe_open(*args, **kwargs):
        raise model_files.SafetensorError("Error while deserializing header: InvalidHeaderDeserialization")

    directory = copy_of("single")
    damage(directory)
    monkeypatch.setattr(model_files, "safe_open", old_safe_open)
    with pytest.raises(UserError, match="is damaged: its header is not a JSON table of tensors"):
        stored_tensors(directory)
