"""What the bytes model reads (flexengine/planning/shapes.py): ModelShape's analytic parameter counts against the
models HF builds (on the meta device: no bytes), LoRA's adapter count against peft's, and one micro-batch's sizes."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from flexengine.core.config import HardwareConfig
from flexengine.planning.shapes import ModelShape, PlanInputs, Workload, rank_workload
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.family import resolve_family
from flexengine.surgery.model import build_meta_model

SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, vocab_size=300)
CONFIGS = {
    "llama": LlamaConfig(**SMALL),
    "llama_gqa_tied": LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=True),
    "llama_head_dim": LlamaConfig(**SMALL, head_dim=32),  # heads x head_dim != hidden
    "mistral": MistralConfig(**SMALL, num_key_value_heads=1),
    "qwen2_bias": Qwen2Config(**SMALL, num_key_value_heads=2),  # q, k, v carry biases
    "deepseek7b": LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=30,
        num_attention_heads=32,
        vocab_size=102400,
    ),
}


def _hf(cfg):
    return build_meta_model(cfg, torch.float32)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_counts_equal_the_model_hf_builds(name):
    cfg = CONFIGS[name]
    m, model = ModelShape.from_hf_config(cfg), _hf(cfg)
    assert m.params == sum(p.numel() for p in model.parameters())  # tied: the shared matrix counted once
    assert m.block_params == sum(p.numel() for p in model.model.layers[0].parameters())
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert m.norm_params == sum(p.numel() for p in norms)
    embeddings = model.model.embed_tokens.weight.numel() + (0 if m.tied else model.lm_head.weight.numel())
    assert m.embedding_params == embeddings
    largest = max(p.numel() for p in model.parameters())
    assert m.largest_matrix == largest


def test_the_shape_reads_gqa_and_an_explicit_head_dim():
    gqa = ModelShape.from_hf_config(CONFIGS["llama_gqa_tied"])
    assert (gqa.heads, gqa.kv_heads, gqa.head_dim, gqa.tied) == (4, 2, 16, True)
    wide = ModelShape.from_hf_config(CONFIGS["llama_head_dim"])
    assert (wide.head_dim, wide.heads * wide.head_dim) == (32, 128)  # 128 != hidden 64
    assert ModelShape.from_hf_config(CONFIGS["deepseek7b"]).params == pytest.approx(6.91e9, rel=0.01)


@pytest.mark.parametrize("name", ["llama", "llama_gqa_tied", "qwen2_bias"])
@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"], ["down_proj"]])
def test_lora_adapter_count_equals_peft(name, targets):
    from peft import LoraConfig, get_peft_model

    cfg = CONFIGS[name]
    family = resolve_family(cfg)
    chosen = family.lora_targets_of(targets)
    model = get_peft_model(_hf(cfg), LoraConfig(r=4, target_modules=chosen))
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert ModelShape.from_hf_config(cfg).lora_params(4, chosen, family) == adapters


def test_a_workload_counts_tokens_residual_bytes_and_tiles():
    w = Workload(micro_batch=2, seq_len=1000, act_bytes=2, mlp_tile=512)
    assert w.tokens == 2000 and w.residual_bytes == 2 and w.mlp_tiled
    assert Workload(2, 1000, 2, autocast=True).residual_bytes == 4  # fp32 residual stream under autocast
    assert not Workload(1, 512, 2, mlp_tile=512).mlp_tiled  # one tile: not tiled
    assert not Workload(1, 512, 2).mlp_tiled


@pytest.mark.parametrize("doc_len", [0, 300, 1024])
def test_dense_mask_elements_equal_the_chunks_the_dense_backend_builds(doc_len):
    """The dense backend's own chunks (DenseMask.executed_pairs, from the mode's key ranges) for documents of doc_len
    tokens back to back: the count the planner derives without building them."""
    from flexengine.surgery.attention.block_mask import build_batch_mask
    from flexengine.surgery.attention.mask_mode import mask_mode

    S, B = 1024, 2
    ids = torch.arange(S) // doc_len if doc_len else torch.zeros(S, dtype=torch.long)
    mask = build_batch_mask(ids.expand(B, S), backend=AttnBackend.DENSE, mode=mask_mode("packed_doc"), dense_chunk=512)
    w = Workload(B, S, 4, AttnBackend.DENSE, doc_len=doc_len if doc_len < S else 0, dense_chunk=512)
    assert w.dense_mask_elements == mask.executed_pairs
    if doc_len == 300:  # by hand: 512 x 512, then queries 512..1023 from the document starting at 300
        assert w.dense_mask_elements == B * (512 * 512 + 512 * (1024 - 300))


@pytest.mark.parametrize(("seq_len", "cp", "share"), [(1000, 1, 1000), (1000, 2, 500), (1000, 3, 334)])
def test_a_ranks_workload_is_its_share_of_the_row(seq_len, cp, share):
    hardware = HardwareConfig(name="x", device="cuda", memory_gb=80)
    x = PlanInputs(seq_len=seq_len, micro_batch=2, dtype_bytes=2, hardware=hardware, cp=cp, chunk_size=64)
    w = rank_workload(x, mlp_tile=256)
    assert (w.seq_len, w.cp, w.micro_batch, w.mlp_tile, w.chunk_size) == (share, cp, 2, 256, 64)
    assert rank_workload(x, micro_batch=5).micro_batch == 5  # the search tries other micro-batches
