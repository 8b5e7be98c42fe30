"""RoPE scaling into the HF config and config.json, the trained-context check, and a scaled model's round trip."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from flexengine.cli.train import to_job_config
from flexengine.core.config import ModelConfig, RopeScalingConfig
from flexengine.core.errors import UserError
from flexengine.run import build_trainer
from flexengine.surgery.model import build_hf_config
from flexengine.surgery.rope import ContextLimits, apply_rope_scaling, check_context, context_limits
from tests.helpers import make_job

SMALL = ["model.arch.max_position_embeddings=128", "data.seq_len=256"]  # demo documents run past 128 tokens


def _llama(**kw) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, **kw)


def test_context_limits_of_published_configs():
    assert context_limits(_llama(max_position_embeddings=4096)) == ContextLimits(4096, 4096)
    llama31 = _llama(
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
    )
    assert context_limits(llama31) == ContextLimits(8192, 131072, "llama3", 8.0)
    longchat = _llama(max_position_embeddings=16384, rope_parameters={"rope_type": "linear", "factor": 8.0})
    assert context_limits(longchat) == ContextLimits(2048, 16384, "linear", 8.0)
    qwen_yarn = _llama(
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    )
    assert context_limits(qwen_yarn).supported == 131072


@pytest.mark.parametrize(
    "scaling,max_pos",
    [
        ({"rope_type": "yarn", "factor": 2.0}, 8192),
        ({"rope_type": "linear", "factor": 2}, 8192),
        ({"rope_type": "dynamic", "factor": 2.0}, 4096),  # NTK reads max_position_embeddings as the trained length
        ({"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, 8192),
    ],
)
def test_model_rope_scaling_goes_into_the_hf_config(scaling, max_pos):
    cfg = build_hf_config(
        ModelConfig(
            init="random",
            arch={"model_type": "llama", "max_position_embeddings": 4096, "hidden_size": 64, "num_attention_heads": 4},
            rope_scaling=RopeScalingConfig(**scaling),
        )
    )
    assert cfg.rope_parameters["rope_type"] == scaling["rope_type"]
    assert cfg.rope_parameters["factor"] == 2.0 and cfg.max_position_embeddings == max_pos
    assert context_limits(cfg) == ContextLimits(4096, 8192, cfg.rope_parameters["rope_type"], 2.0)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.rope_scaling.rope_type=ntk", "model.rope_scaling.rope_type='ntk' is not valid"),
        ("model.rope_scaling={rope_type:yarn,factor:0.5}", "model.rope_scaling.factor=0.5 must be >= 1"),
        ("model.rope_scaling.scale=2", "scale"),  # a typo'd key fails at composition
    ],
)
def test_bad_rope_scaling_is_refused_by_key(tmp_path, override, needle):
    with pytest.raises(Exception, match=re.escape(needle)):
        make_job(tmp_path, override)


def test_missing_type_keys_and_stacked_scaling_are_refused():
    with pytest.raises(UserError, match="low_freq_factor"):
        apply_rope_scaling(_llama(max_position_embeddings=4096), {"rope_type": "llama3", "factor": 2.0})
    cfg = _llama(max_position_embeddings=4096)
    apply_rope_scaling(cfg, {"rope_type": "yarn", "factor": 2.0})
    apply_rope_scaling(cfg, {"rope_type": "yarn", "factor": 2.0})  # a checkpoint saved with it: no-op
    assert context_limits(cfg) == ContextLimits(4096, 8192, "yarn", 2.0)
    with pytest.raises(UserError, match="would stack"):
        apply_rope_scaling(cfg, {"rope_type": "linear", "factor": 4.0})


def test_check_context_names_both_lengths_and_every_option(caplog):
    limits = ContextLimits(4096, 4096)
    check_context(4096, limits, 8192, "split", False)  # at the limit: fine
    with pytest.raises(UserError) as e:
        check_context(6000, limits, 8192, "split", False)
    msg = str(e.value)
    for needle in (
        "6000 tokens",
        "trained on 4096 positions",
        "model.rope_scaling={rope_type:yarn,factor:2}",
        "data.seq_len=4096",
        "model.allow_long_context=true",
    ):
        assert needle in msg, needle
    check_context(6000, limits, 8192, "split", True)
    assert "training anyway" in caplog.text


def test_packed_rows_count_by_longest_document_not_row(tmp_path):
    """Rows of 256 tokens full of documents of <= 100 tokens fit a 128-position model; one 200-token one does not."""
    path = tmp_path / "docs.jsonl"
    short = [{"text": " ".join(["word"] * 60)} for _ in range(12)]
    path.write_text("\n".join(json.dumps(d) for d in short) + "\n")
    common = [*SMALL, "data=jsonl", f"data.path={path}", "data.num_workers=0", "train.max_steps=1"]
    trainer = build_trainer(make_job(tmp_path / "a", *common), tmp_path / "a")
    assert trainer.data_report["longest_piece"] <= 128 < 256
    path.write_text("\n".join(json.dumps(d) for d in [*short, {"text": " ".join(["word"] * 400)}]) + "\n")
    with pytest.raises(UserError, match=r"longest document in the packed rows is 256 tokens .* trained on 128"):
        build_trainer(make_job(tmp_path / "b", *common), tmp_path / "b")


@pytest.mark.slow
def test_scaled_model_saved_by_flexengine_reloads_with_the_same_logits_past_the_old_limit(tmp_path):
    trainer = build_trainer(
        make_job(tmp_path, *SMALL, "train.max_steps=2", "model.rope_scaling={rope_type:yarn,factor:2.0}"), tmp_path
    )
    assert trainer.data_report["longest_piece"] == 256  # documents do reach past position 128
    trainer.train()
    path = tmp_path / "checkpoints" / "step_2"
    saved = json.loads((path / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == "yarn" and saved["max_position_embeddings"] == 256
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 2048, (1, 256), generator=torch.Generator().manual_seed(0))
    ours = trainer.model.eval()
    unscaled = AutoModelForCausalLM.from_config(
        LlamaConfig(**{**saved, "rope_parameters": None, "max_position_embeddings": 128})
    ).eval()
    unscaled.load_state_dict(hf.state_dict())
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=torch.arange(256)[None]).logits[:, 128:]
        want = hf(input_ids=ids).logits[:, 128:]
        plain = unscaled(input_ids=ids).logits[:, 128:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (plain - want).abs().max() > 1e-2  # the scaling is what makes them equal, not an unused setting


@pytest.mark.parametrize("experiment", ["deepseek7b_6k_a100", "mistral7b_32k_h100"])
def test_shipped_7b_experiments_keep_rows_within_the_supported_context(tmp_path, experiment):
    """deepseek7b_6k_a100's rows of ~6,000-token documents need its YaRN x2 (trained on 4,096; its data.seq_len=auto
    keeps every document piece within what the model supports); Mistral's 32K is native."""
    with initialize_config_module(version_base="1.3", config_module="flexengine.conf"):
        cfg = compose("config", overrides=[f"experiment={experiment}", "model.init=random", "data.path=unused.jsonl"])
    job = to_job_config(cfg)
    limits = context_limits(build_hf_config(job.model))
    if experiment == "deepseek7b_6k_a100":
        assert job.data.seq_len == "auto" and limits == ContextLimits(4096, 8192, "yarn", 2.0)
    else:
        assert 4096 < job.data.seq_len <= limits.supported


@pytest.mark.parametrize("attn", ["packed_doc", "packed_sliding", "causal"])
def test_position_dependent_rope_is_refused_past_the_trained_context_in_every_mode(attn):
    """Dynamic NTK frequencies follow the batch's largest position once it passes the trained context: a packed
    document would rotate by its neighbours, and attn=causal is no remedy (its rows share the batch's largest
    position; at micro_batch=1 an earlier, longer batch's grown frequencies stay cached), so it is refused too, and
    the message offers only the fixed scalings or rows within the trained context."""
    scaling = "model.rope_scaling={rope_type:dynamic,factor:2.0}"
    window = ["attn.window=64"] if attn == "packed_sliding" else []
    short = "model.arch.max_position_embeddings=128"  # the demo's rows are 256 tokens
    with pytest.raises(UserError) as e:
        make_job(Path("unused"), f"attn={attn}", *window, scaling, short)
    msg = str(e.value)
    assert f"attn={attn} cannot train" in msg and "rope_type=dynamic" in msg and "\n" not in msg
    assert "pass the trained context of 128 positions" in msg
    assert all(fixed in msg for fixed in ("yarn", "linear", "llama3"))
    assert ("packed document" in msg) == (attn != "causal") and ("one document per row" in msg) == (attn == "causal")
    # within the trained context the scaling is inert, in every mode: accepted
    assert make_job(Path("unused"), f"attn={attn}", *window, scaling).model.rope_scaling.rope_type == "dynamic"


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_position_dependent_rope_within_the_trained_context_is_batch_independent(rope_type):
    """Why rows within the trained context are accepted: transformers rescales dynamic NTK and switches longrope to
    its long factors only past it, so a sequence's logits are the same alone, after a longer batch and beside a
    longer row (and dynamic NTK's are the unscaled model's)."""
    from tests.helpers import TINY_LLAMA

    rope = {"rope_theta": 10000.0, "rope_type": rope_type, "factor": 2.0}
    if rope_type == "longrope":
        half = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"] // 2
        rope.update(original_max_position_embeddings=64, short_factor=[1.0] * half, long_factor=[2.0] * half)
    torch.manual_seed(0)
    arch = {**TINY_LLAMA, "max_position_embeddings": 64}
    plain = LlamaForCausalLM(LlamaConfig(**arch)).eval()
    scaled = LlamaForCausalLM(LlamaConfig(**arch, rope_parameters=rope)).eval()
    scaled.load_state_dict(plain.state_dict())
    short, long = (torch.randint(0, TINY_LLAMA["vocab_size"], (1, n)) for n in (16, 64))
    with torch.no_grad():
        alone = scaled(input_ids=short).logits
        scaled(input_ids=long)  # an earlier batch as long as the trained context
        torch.testing.assert_close(scaled(input_ids=short).logits, alone)
        beside = scaled(input_ids=torch.cat([torch.cat([short, long[:, 16:]], 1), long])).logits[:1, :16]
        torch.testing.assert_close(beside, alone)  # causal: the row's first 16 positions see only themselves
        if rope_type == "dynamic":
            torch.testing.assert_close(alone, plain(input_ids=short).logits)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_checkpoint_with_position_dependent_rope_is_refused_under_packing(tmp_path, rope_type):
    """The same refusal when the scaling comes from model.path's config.json (no model.rope_scaling given), for rows
    past its trained context: packed, or one padded document per row."""
    from tests.helpers import TINY_LLAMA

    rope = {"rope_theta": 10000.0, "rope_type": rope_type, "factor": 2.0}
    if rope_type == "longrope":  # one factor per rotated frequency
        half = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"] // 2
        rope.update(original_max_position_embeddings=512, short_factor=[1.0] * half, long_factor=[2.0] * half)
    LlamaConfig(**TINY_LLAMA, rope_parameters=rope).save_pretrained(tmp_path / "model")
    model = [f"model.path={tmp_path / 'model'}", "model.init=random", "data.seq_len=2048"]
    for attn in ("packed_doc", "causal"):
        job = make_job(tmp_path / "out", f"attn={attn}", *model)
        with pytest.raises(UserError, match=rf"attn={attn} cannot .* config.json has rope_type={rope_type}.*llama3"):
            build_trainer(job, tmp_path / "out")
