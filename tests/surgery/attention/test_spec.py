"""AttentionSpec: windows come from the model (per layer), are logged with their source, and really apply."""

import logging

import pytest
import torch
from transformers import MistralConfig, Qwen2Config

from flexengine.core.config import AttnConfig
from flexengine.core.errors import UserError
from flexengine.surgery.applied import attention_spec
from flexengine.surgery.attention import (
    MASK_KWARG,
    apply_attention,
    mask_kwargs,
    patch_attention,
    resolve_attention_spec,
)
from flexengine.surgery.attention.mask_mode import mask_mode
from flexengine.surgery.attention.masks import MODES
from flexengine.surgery.attention.spec import AttnBackend
from tests.helpers import QWEN_MIXED, TINY_LLAMA, clone_model, make_llama
from tests.helpers import make_qwen_mixed as _qwen_mixed


def test_window_defaults_to_the_mistral_config_not_a_yaml_value():
    config = MistralConfig(**{**TINY_LLAMA, "sliding_window": 4096})
    spec = resolve_attention_spec(AttnConfig(mode="packed_sliding", backend="dense"), config)
    assert spec.layer_windows == (4096, 4096)
    assert "sliding_window=4096" in spec.window_source


def test_per_layer_windows_follow_layer_types():
    config = Qwen2Config(**QWEN_MIXED)
    assert config.layer_types == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    spec = resolve_attention_spec(AttnConfig(mode="packed_sliding", backend="dense"), config)
    assert spec.layer_windows == (None, None, 6, 6)
    assert "layer_types" in spec.window_source
    # attn.window overrides the window on the model's windowed layers only
    spec = resolve_attention_spec(AttnConfig(mode="packed_sliding", backend="dense", window=3), config)
    assert spec.layer_windows == (None, None, 3, 3)
    assert "attn.window=3" in spec.window_source


def test_per_layer_windows_equal_hf_eager_qwen2():
    """Independent reference: HF's own eager attention with its per-layer sliding masks."""
    reference = _qwen_mixed()
    patched = patch_attention(clone_model(reference), mode="sliding_window", backend="dense")
    assert attention_spec(patched).layer_windows == (None, None, 6, 6)
    ids = torch.randint(0, 256, (2, 30))  # 5x the window
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        got = patched(input_ids=ids).logits
        everywhere = patch_attention(clone_model(reference), mode="sliding_window", window=6, backend="dense")
        # a window on every layer would differ: proves the full-attention layers stayed full
        windows_everywhere = apply_attention(everywhere, _every_layer(attention_spec(everywhere), 6))
        wrong = windows_everywhere(input_ids=ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert (wrong - want).abs().max().item() > 1e-3


def _every_layer(spec, window):
    from dataclasses import replace

    return replace(spec, layer_windows=(window,) * len(spec.layer_windows))


def test_one_mask_per_distinct_window_per_batch():
    model = patch_attention(_qwen_mixed(), mode="packed_sliding", backend="dense")
    masks = mask_kwargs(model, torch.zeros(1, 16, dtype=torch.int32))[MASK_KWARG]
    assert set(masks.by_hf_window) == {None, 6}
    assert masks.for_layer(None).mode == mask_mode("packed_doc") and masks.for_layer(6).mode == mask_mode(
        "packed_sliding", 6
    )
    assert len({id(masks.for_layer(w)) for w in (None, 6)}) == 2
    with pytest.raises(RuntimeError, match="sliding_window=5"):
        masks.for_layer(5)


def test_the_log_names_the_window_and_where_it_came_from(caplog):
    with caplog.at_level(logging.INFO, logger="flexengine.surgery.attention.patch"):
        patch_attention(_qwen_mixed(), mode="packed_sliding", backend="dense")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("attention:"))
    assert "none on 2 layers, 6 on 2 layers" in line and "layer_types" in line


def test_a_sliding_mode_without_any_window_is_a_clear_error():
    with pytest.raises(UserError, match="attn.window"):
        resolve_attention_spec(AttnConfig(mode="packed_sliding", backend="dense"), make_llama().config)


def test_a_window_with_a_mode_that_has_none_is_refused(tmp_path):
    from tests.helpers import make_job

    with pytest.raises(UserError, match="attn.window=64"):
        make_job(tmp_path, "attn=packed_doc", "attn.window=64")  # at composition
    with pytest.raises(UserError, match="attn.window=64"):  # and by the resolver itself (a hand-built config)
        resolve_attention_spec(AttnConfig(mode="packed_doc", window=64), make_llama().config)


def test_whole_document_mode_on_a_windowed_model_warns_and_records_it(caplog):
    config = MistralConfig(**{**TINY_LLAMA, "sliding_window": 8})
    with caplog.at_level(logging.WARNING):
        spec = resolve_attention_spec(AttnConfig(mode="packed_doc", backend="dense"), config)
    assert spec.layer_windows == (None, None)
    assert "not used" in spec.window_source and "packed_sliding" in caplog.text


def test_modes_compose_masks_without_mode_strings():
    for name, entry in MODES.items():
        spec = resolve_attention_spec(
            AttnConfig(mode=name, backend="dense", window=4 if entry.windowed else None), make_llama().config
        )
        assert spec.documents == entry.documents
        assert (spec.layer_windows[0] is not None) == entry.windowed
        assert spec.backend is AttnBackend.DENSE


def test_no_shipped_attn_yaml_hard_codes_a_window():
    from pathlib import Path

    import yaml

    import flexengine.conf

    conf = Path(flexengine.conf.__file__).parent
    for path in sorted(conf.rglob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        attn = data if path.parent.name == "attn" else (data.get("attn") or {})
        assert "window" not in attn, f"{path.relative_to(conf)} hard-codes attn.window={attn.get('window')}"


def test_no_attention_mode_string_is_compared_outside_the_spec():
    """attn.mode is parsed once (the MODES table, attention/spec.py, job_rules.py); the rest dispatches on the spec."""
    import ast
    from pathlib import Path

    import flexengine

    package = Path(flexengine.__file__).parent
    attention = package / "surgery" / "attention"
    allowed = {attention / "masks.py", attention / "spec.py", attention / "job_rules.py"}
    found = []
    for path in sorted(package.rglob("*.py")):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in MODES]
                found += [f"{path.relative_to(package)}:{c.lineno} {c.value!r}" for c in constants]
    assert not found, found


def test_each_layer_counts_the_pairs_of_its_own_mask():
    """MFU's attended pairs come from each layer's MaskMode: windowed layers count the band, full layers the
    triangle; HF's own attention (backend sdpa) keeps the model's window on its windowed layers. Reference: a
    query at position i of a document sees min(i + 1, window) keys, counted one query at a time."""

    def band(lengths: list[int], window) -> int:
        return sum(min(i + 1, window or n) for n in lengths for i in range(n))

    lengths = [5, 30, 12]
    spec = resolve_attention_spec(AttnConfig(mode="packed_sliding", backend="dense"), _qwen_mixed().config)
    assert spec.attended_pairs(lengths) == [band(lengths, w) for w in spec.layer_windows]
    assert spec.attended_pairs(lengths)[0] != spec.attended_pairs(lengths)[-1]  # the layers differ
    hf_own = resolve_attention_spec(AttnConfig(mode="causal", backend="sdpa"), _qwen_mixed().config)
    assert hf_own.attended_pairs(lengths) == [band(lengths, w) for w in hf_own.layer_windows]
