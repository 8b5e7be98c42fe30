"""LoRA through peft: frozen base, adapter checkpoints, exact resume, and a merged HF directory."""

from __future__ import annotations

import pytest
import torch

from flexengine.core.config import LoraConfig
from flexengine.core.errors import UserError
from flexengine.run import build_trainer
from flexengine.surgery.lora import adapter_to_model_keys, apply_lora, merge_lora_state_dict
from tests.helpers import DEBUG_FAST, make_job

LORA = (*DEBUG_FAST, "optim.lr=1e-2", "model.lora.r=4", "model.lora.alpha=8")


def _base_state(peft_model) -> dict:
    """The frozen base weights of a peft model under plain HF names."""
    merged = merge_lora_state_dict(
        {k: v for k, v in peft_model.state_dict().items() if ".lora_" not in k}, LoraConfig(r=1)
    )
    return {k: v.clone() for k, v in merged.items()}


def test_merged_directory_equals_base_plus_adapter(tmp_path):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    trainer = build_trainer(make_job(tmp_path, *LORA, "train.max_steps=2", "train.merge_lora_on_save=true"), tmp_path)
    base_before = _base_state(trainer.model)
    trainer.train()
    step = tmp_path / "checkpoints" / "step_2"
    assert (step / "adapter_model.safetensors").is_file() and not (step / "model.safetensors").exists()
    base_after = _base_state(trainer.model)
    for key in base_before:  # the base stays frozen
        assert torch.equal(base_before[key], base_after[key]), key

    # reference: peft's own (unmerged) forward of the saved adapter on top of the base weights
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(step / "merged"))
    missing, unexpected = base.load_state_dict(base_after, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    reference = PeftModel.from_pretrained(base, step).eval()
    merged = AutoModelForCausalLM.from_pretrained(step / "merged").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 32))
    with torch.no_grad():
        want, got = reference(input_ids=ids).logits, merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the adapters trained (B starts at zero): the merged weights differ from the base
    merged_q = merged.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert (merged_q - base_after["model.layers.0.self_attn.q_proj.weight"]).abs().max() > 1e-4


def test_lora_resume_continues_the_same_trajectory(tmp_path):
    full = build_trainer(
        make_job(tmp_path / "a", *LORA, "train.max_steps=4", "train.save_every=2", "model.lora.dropout=0.1"),
        tmp_path / "a",
    )
    losses = full.train()["losses"]
    resumed = build_trainer(
        make_job(tmp_path / "b", *LORA, "train.max_steps=4", "model.lora.dropout=0.1"), tmp_path / "b"
    )
    resumed.resume(str(tmp_path / "a" / "checkpoints" / "step_2"))
    assert resumed.train()["losses"] == pytest.approx(losses, rel=1e-6)


def test_merge_formula_matches_peft_merge_and_unload(tiny_llama):
    config = LoraConfig(r=2, alpha=6.0, target_modules=["q_proj", "down_proj"])
    peft_model = apply_lora(tiny_llama, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # B starts at zero; give the merge something to add
    mine = merge_lora_state_dict(peft_model.state_dict(), config)
    theirs = peft_model.merge_and_unload().state_dict()
    assert mine.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], atol=1e-6, rtol=1e-6)


def test_merge_of_a_bf16_frozen_base_keeps_the_update_in_the_adapters_dtype(tiny_llama):
    """bf16 modes store the frozen base in bf16: the merged export is W + dW in fp32 (the adapters' dtype), not
    rounded back to bf16, where most of a small LoRA update would vanish."""
    config = LoraConfig(r=2, alpha=4.0, target_modules=["q_proj"])
    peft_model = apply_lora(tiny_llama, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=1e-4)  # an update ~1e-3 of the weights
            elif not p.requires_grad and p.ndim >= 2:
                p.data = p.data.bfloat16()
    state = peft_model.state_dict()
    merged = merge_lora_state_dict(state, config)
    key = "model.layers.0.self_attn.q_proj"
    a, b = (
        state[f"base_model.model.{key}.lora_A.default.weight"],
        state[f"base_model.model.{key}.lora_B.default.weight"],
    )
    expected = state[f"base_model.model.{key}.base_layer.weight"].float() + (b @ a) * (config.alpha / config.r)
    assert merged[f"{key}.weight"].dtype == torch.float32
    torch.testing.assert_close(merged[f"{key}.weight"], expected, atol=1e-7, rtol=1e-6)
    assert {v.dtype for v in merged.values() if v.is_floating_point()} == {torch.float32}


def test_adapter_keys_round_trip_to_model_keys(tiny_llama):
    from peft import get_peft_model_state_dict

    peft_model = apply_lora(tiny_llama, LoraConfig(r=2, target_modules=["v_proj"]))
    saved = get_peft_model_state_dict(peft_model)
    assert set(adapter_to_model_keys(saved)) == {k for k in peft_model.state_dict() if ".lora_" in k}


def test_bad_lora_settings_name_the_key(tiny_llama):
    with pytest.raises(UserError, match="model.lora.r"):
        LoraConfig(r=-1)
    with pytest.raises(UserError, match="model.lora.target_modules"):
        apply_lora(tiny_llama, LoraConfig(r=2, target_modules=["no_such_proj"]))
    assert apply_lora(tiny_llama, LoraConfig(r=0)) is tiny_llama


def test_embedding_adapters_and_unknown_adapter_tensors_are_refused(tiny_llama):
    """The merge knows Linear LoRA only: an embedding adapter (or DoRA magnitude) must not pass silently."""
    with pytest.raises(UserError, match=r"embed_tokens.*not Linear layers"):
        apply_lora(tiny_llama, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    state = {
        "base_model.model.model.embed_tokens.lora_embedding_A.default": torch.zeros(4, 8),
        "base_model.model.model.embed_tokens.base_layer.weight": torch.zeros(8, 8),
    }
    with pytest.raises(ValueError, match="lora_embedding_A"):
        merge_lora_state_dict(state, LoraConfig(r=4))
    dora = {"base_model.model.q_proj.lora_magnitude_vector.default.weight": torch.ones(8)}
    with pytest.raises(ValueError, match="lora_magnitude_vector"):
        merge_lora_state_dict(dora, LoraConfig(r=4))


def test_merged_export_from_an_fp32_checkpoint_in_a_bf16_mode_keeps_the_base_exact(tmp_path):
    """Before: bf16 modes hold the frozen base in bf16 and merged/ was built on that copy, so every base weight of
    an fp32 checkpoint moved by its bf16 rounding (up to 2.4e-4, 16 % of the LoRA update). Now merged/ is the
    checkpoint's own fp32 base + (alpha / r) B A, exactly."""
    from safetensors.torch import load_file

    from flexengine.data.demo import load_demo_tokenizer
    from tests.helpers import make_llama

    model_dir = tmp_path / "base"
    make_llama(vocab_size=2048, num_hidden_layers=2).save_pretrained(model_dir)
    load_demo_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "run"
    job = make_job(
        out,
        *LORA,
        f"model.path={model_dir}",
        "model.init=pretrained",
        "precision=bf16_mixed",
        "train.max_steps=2",
        "train.merge_lora_on_save=true",
        "model.lora.target_modules=[q_proj]",
    )
    trainer = build_trainer(job, out)
    assert next(p for n, p in trainer.model.named_parameters() if "base_layer" in n).dtype == torch.bfloat16
    trainer.train()
    base = load_file(str(model_dir / "model.safetensors"))
    step = out / "checkpoints" / "step_2"
    merged = load_file(str(step / "merged" / "model.safetensors"))
    adapter = load_file(str(step / "adapter_model.safetensors"))
    scaling = job.model.lora.alpha / job.model.lora.r
    adapted = 0
    for key, weight in base.items():
        module = key.removesuffix(".weight")
        a_key = f"base_model.model.{module}.lora_A.weight"
        if a_key in adapter:
            b = adapter[f"base_model.model.{module}.lora_B.weight"]
            expected = weight + (b.float() @ adapter[a_key].float()) * scaling
            torch.testing.assert_close(merged[key], expected, atol=0, rtol=1e-6, msg=key)
            adapted += 1
        else:  # untouched by LoRA: bit-identical to the checkpoint (was: rounded to bf16 and back)
            assert torch.equal(merged[key], weight), key
    assert adapted == 2  # q_proj of both layers
