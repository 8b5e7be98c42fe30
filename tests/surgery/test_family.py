"""flexengine/surgery/family.py: each supported family resolves from its HF config and names modules its tiny model has;
an unknown family is refused by name; no other module of the package spells an HF module name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import (
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import flexengine
from flexengine.core.config import LoraConfig, ModelConfig
from flexengine.core.errors import UserError
from flexengine.planning.shapes import ModelShape
from flexengine.surgery.family import (
    FAMILIES,
    LLAMA,
    MISTRAL,
    QWEN2,
    HFCausalLM,
    family_of,
    hf_causal_lm,
    resolve_family,
)
from flexengine.surgery.model import build_hf_config
from tests.helpers import QWEN_MIXED, TINY_LLAMA

PACKAGE = Path(flexengine.__file__).parent
CASES = {  # family -> a tiny model of it, built from its own HF config class
    "llama": (LLAMA, lambda: LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))),
    "mistral": (MISTRAL, lambda: MistralForCausalLM(MistralConfig(**TINY_LLAMA, sliding_window=8))),
    # layer_types (full_attention / sliding_attention per layer), the Gemma-style per-layer windows
    "qwen2": (QWEN2, lambda: Qwen2ForCausalLM(Qwen2Config(**QWEN_MIXED))),
}


def test_every_family_has_a_case():
    assert sorted(f.name for f in FAMILIES) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_family_resolves_and_names_modules_its_model_has(name):
    family, build = CASES[name]
    torch.manual_seed(0)
    model = build()
    assert family_of(model) is family and resolve_family(model.config) is family
    layers = family.decoder_layers(model)
    assert isinstance(layers, nn.ModuleList) and len(layers) == model.config.num_hidden_layers
    assert isinstance(family.final_norm_of(model), nn.Module)
    for layer in layers:
        for sub in (family.attention, family.mlp):
            assert isinstance(getattr(layer, sub.norm), nn.Module), sub.norm
            parent = getattr(layer, sub.module)
            for proj in sub.projections:
                assert isinstance(getattr(parent, proj), nn.Linear), f"{sub.module}.{proj}"
    if name == "qwen2":  # the layer_types case really mixes both kinds
        assert set(model.config.layer_types) == {"full_attention", "sliding_attention"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_default_lora_targets_every_projection_and_the_planner_sizes_them(name):
    """target_modules=null adapts every projection the family names, and the planner's adapter count (which maps
    the names to shapes by role order: q, k, v, o / gate, up, down) equals peft's, GQA's narrower k/v included."""
    from flexengine.surgery.lora import apply_lora

    family, build = CASES[name]
    r = 2
    peft_model = apply_lora(build(), LoraConfig(r=r))
    adapted = {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(family.lora_targets)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    shape = ModelShape.from_hf_config(peft_model.config)
    assert shape.lora_params(r, list(family.lora_targets), family) == trainable


# what each HFCausalLM method returns (None: returns nothing worth checking, called for its effect)
_HF_METHODS = {
    "get_decoder": nn.Module,
    "get_input_embeddings": nn.Embedding,
    "get_output_embeddings": nn.Module,
    "set_attn_implementation": None,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_family_and_its_peft_wrapper_have_what_hf_causal_lm_types(name):
    """`hf_causal_lm` is a static view only: the members it declares exist, with the declared types, on every
    family's model and on peft's wrapper of it (which forwards them)."""
    from flexengine.surgery.lora import apply_lora

    members = {n for n in vars(HFCausalLM) if not n.startswith("_")} | set(HFCausalLM.__annotations__)
    assert members == {"config", *_HF_METHODS}
    _, build = CASES[name]
    for model in (build(), apply_lora(build(), LoraConfig(r=2))):
        lm = hf_causal_lm(model)
        assert isinstance(lm.config, PretrainedConfig)
        for method, returns in _HF_METHODS.items():
            assert callable(getattr(lm, method)), method
            if returns is not None:
                assert isinstance(getattr(lm, method)(), returns), method


def test_unknown_family_is_refused_naming_model_type_and_the_supported_list():
    with pytest.raises(UserError, match=r"model_type='gpt2'.*llama, mistral, qwen2.*flexengine/surgery/family\.py"):
        resolve_family(GPT2Config())
    # every entry point builds its HF config through build_hf_config: the refusal comes before any work
    with pytest.raises(UserError, match="model_type='gpt2'"):
        build_hf_config(ModelConfig(init="random", arch={"model_type": "gpt2", "n_layer": 1}))


# -- nothing but family.py names an HF module ----------------------------------------------------------------------

# Names that are also flexengine's own words (memory.granularity=mlp, memory.layers, the planner's "norm1"): a
# literal of these is not a module lookup, so the scan leaves them to review.
_GENERIC = {"mlp", "layers", "norm"}


def _hf_names() -> set[str]:
    names = set()
    for f in FAMILIES:
        for sub in (f.attention, f.mlp):
            names |= {sub.norm, sub.module, *sub.projections}
        names |= {f.layers, f.final_norm}
    return names - _GENERIC


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def hf_names_in(source: str) -> list[str]:
    """HF module names (as whole words) in the string literals of `source`, f-string parts included; docstrings
    and comments are prose and are not scanned."""
    pattern = re.compile(r"(?<!\w)(" + "|".join(sorted(map(re.escape, _hf_names()))) + r")(?!\w)")
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found += pattern.findall(node.value)
    return found


def test_the_scan_finds_a_module_name_and_ignores_prose():
    assert hf_names_in('sub = getattr(layer, "self_attn")') == ["self_attn"]
    assert hf_names_in('msg = f"{x}: no q_proj here"') == ["q_proj"]
    assert hf_names_in('"""A docstring about q_proj."""\nx = 1  # o_proj\ny = "o_proj_input"') == []


def test_no_module_but_family_names_an_hf_module():
    offenders = {
        str(path.relative_to(PACKAGE)): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "family.py" and (names := hf_names_in(path.read_text()))
    }
    assert offenders == {}, f"read these names from flexengine.surgery.family instead: {offenders}"


# -- the walkthrough of docs/architecture.md, "A new model family": one FAMILIES entry, really added ---------------

# Kyutai's Helium: LLaMA's module names, its own HF classes. Its config defaults head_dim to 128 while its o_proj is
# hidden x hidden, so only head_dim = hidden / heads builds a model that runs; the planner's count caught it.
HELIUM_ARCH = dict(
    TINY_LLAMA, model_type="helium", head_dim=TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
)


@pytest.fixture
def helium(monkeypatch):
    """Helium added as one entry of FAMILIES and nothing else (the family table is the only list of families)."""
    import flexengine.surgery.family as family_table

    entry = family_table._llama_named("helium")
    monkeypatch.setattr(family_table, "FAMILIES", (*family_table.FAMILIES, entry))
    return entry


def _tiny_helium(seed: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = build_hf_config(ModelConfig(init="random", arch=HELIUM_ARCH))
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def test_a_family_missing_from_the_table_is_refused():
    with pytest.raises(UserError, match="model_type='helium'"):
        build_hf_config(ModelConfig(init="random", arch=HELIUM_ARCH))


def test_new_family_entry_names_its_modules_and_the_planner_counts_its_parameters(helium):
    model = _tiny_helium()
    assert type(model).__name__ == "HeliumForCausalLM" and family_of(model) is helium
    assert len(helium.decoder_layers(model)) == model.config.num_hidden_layers
    assert ModelShape.from_hf_config(model.config).params == sum(p.numel() for p in model.parameters())


def test_new_family_packed_documents_equal_each_document_alone(helium):
    """The patched Helium on packed rows == each document through the unpatched HF Helium (eager)."""
    from flexengine import pack_documents, patch_attention
    from tests.helpers import clone_model

    reference = _tiny_helium()
    patched = patch_attention(clone_model(reference), mode="packed_doc", backend="dense")
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (37, 5, 60, 20)]
    batch = pack_documents(docs, seq_len=128, strategy="greedy")  # greedy keeps the order: documents back to back
    with torch.no_grad():
        packed = patched(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        starts = (batch["position_ids"] == 0).nonzero().tolist()
        for doc, (row, start) in zip(docs, starts):
            alone = reference(input_ids=torch.tensor([doc])).logits[0]
            assert (packed[row, start : start + len(doc)] - alone).abs().max().item() <= 1e-5


def test_new_family_plans_and_trains_through_the_loop(helium, tmp_path):
    """`python -m flexengine.train debug=fast model.arch.model_type=helium +model.arch.head_dim=32` once the entry
    exists: planned, surgery applied, two steps that move the loss."""
    import math

    from flexengine.cli.common import compose_job
    from flexengine.run import run_training

    overrides = ["model.arch.model_type=helium", "+model.arch.head_dim=32"]  # tiny.yaml: 256 hidden / 8 heads
    job = compose_job(["debug=fast", *overrides, "train.max_steps=2", f"train.output_dir={tmp_path}"])
    summary = run_training(job, tmp_path)
    assert summary["steps"] == 2 and all(math.isfinite(loss) for loss in summary["losses"])
    assert summary["losses"][0] != summary["losses"][1]
