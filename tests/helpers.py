"""Shared test helpers, imported by tests (`from tests.helpers import make_llama`); fixtures stay in conftest.

Tiny HF models built in-process (no downloads), fp32, deterministic.
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

TINY_LLAMA = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, use_cache=False, tie_word_embeddings=False,
)


def make_llama(seed: int = 0, attn_implementation: str = "eager", **overrides) -> LlamaForCausalLM:
    """A tiny GQA LLaMA with its own config object (set_attn_implementation mutates the config)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def make_mistral(seed: int = 0, sliding_window: int = 8, attn_implementation: str = "eager") -> MistralForCausalLM:
    """A tiny GQA Mistral with a native sliding window."""
    torch.manual_seed(seed)
    config = MistralConfig(**{**TINY_LLAMA, "sliding_window": sliding_window})
    model = MistralForCausalLM(config).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def clone_model(model: torch.nn.Module, attn_implementation: str = "eager") -> torch.nn.Module:
    """Same weights, independent config (so patching one never changes the other)."""
    twin = copy.deepcopy(model)
    twin.config = copy.deepcopy(model.config)
    for module in twin.modules():
        if hasattr(module, "config"):
            module.config = twin.config
    twin.set_attn_implementation(attn_implementation)
    return twin


def assert_same_loss_gradients(model, reference, batch) -> None:
    """Run both patched models' decoder + summed LM loss on batch; outputs and every parameter gradient must match."""
    from flexengine.loss import causal_lm_loss_sum

    outs = []
    for m in (model, reference):
        out = m.get_decoder()(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        causal_lm_loss_sum(out.last_hidden_state, batch["labels"], m.lm_head).backward()
        outs.append(out.last_hidden_state.detach())
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
