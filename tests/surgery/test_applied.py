"""`model.flexengine`, the record of what surgery did (flexengine/surgery/applied.py): one record per model, made on
first use, kept outside the module tree, and read back by `attention_spec`."""

from __future__ import annotations

import copy

import torch

from flexengine import patch_attention
from flexengine.surgery.applied import ATTRIBUTE, Applied, applied, attention_spec
from tests.helpers import clone_model, make_llama


def test_the_record_is_made_once_and_empty():
    model = torch.nn.Linear(2, 2)
    assert ATTRIBUTE not in model.__dict__  # nothing until a step records something
    record = applied(model)
    assert record == Applied() and applied(model) is record
    assert record.memory == () and record.attention is None and record.compile_backend is None


def test_the_record_is_no_submodule_parameter_or_buffer():
    model = torch.nn.Linear(2, 2)
    before = set(model.state_dict())
    applied(model).compile_backend = "aot_eager"
    assert set(model.state_dict()) == before and [n for n, _ in model.named_modules()] == [""]
    assert getattr(model, ATTRIBUTE).compile_backend == "aot_eager"  # a plain attribute, readable as model.flexengine
    assert applied(copy.deepcopy(model)).compile_backend == "aot_eager"  # a copy carries what was done to it


def test_attention_spec_is_none_until_attention_is_patched():
    model = make_llama()
    assert attention_spec(model) is None
    applied(model)  # a record without an attention step still answers None
    assert attention_spec(model) is None
    patched = patch_attention(clone_model(model), mode="packed_doc", backend="dense")
    spec = attention_spec(patched)
    assert spec is applied(patched).attention and spec.mode == "packed_doc" and spec.backend.value == "dense"
