"""Dress rehearsal of every shipped experiment/* and 7B model/* config, composed exactly as shipped.

(a) The full-size model on the meta device through the planner: it fits its own hardware with its own defaults,
    and the precision chosen updates weights at its learning rate.
(b) Two optimizer steps on CPU at full depth and full layer structure with only the width shrunk (hidden 64,
    the GQA ratio, window/seq_len ratio, precision, memory policy, micro-batch and compile setting as planned
    for the real hardware); only `model.init=random` and `hardware=cpu` are added (plus a data file where the
    config reads one, and aot_eager as the compile backend: the graphs are the same, inductor's codegen is not).
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import yaml

from flexengine.cli.common import compose_job
from flexengine.core.config import conf_dir
from flexengine.core.hardware import assumed_hardware
from flexengine.planning.fit import plan_job
from flexengine.planning.shapes import ModelShape
from flexengine.planning.specs import context_rows
from flexengine.resolve import with_seq_len
from flexengine.surgery.memory import decoder_layers
from flexengine.surgery.model import build_hf_config, build_meta_model

CONF = conf_dir()
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
MODELS_7B = sorted(
    p.stem
    for p in (CONF / "model").glob("*.yaml")
    if yaml.safe_load(p.read_text()).get("model", {}).get("arch", {}).get("hidden_size", 0) >= 4096
)
# A model config alone has no hardware of its own: it is rehearsed on the smallest shipped GPU config.
MODEL_HARDWARE = "hardware=a100_80g"
CONFIGS = [f"experiment={e}" for e in EXPERIMENTS] + [f"model={m}" for m in MODELS_7B]
SHRUNK_HIDDEN, SHRUNK_HEADS, REHEARSAL_SEQ = 64, 4, 256


def test_every_shipped_config_is_rehearsed():
    assert len(EXPERIMENTS) >= 4 and set(MODELS_7B) == {"deepseek7b", "llama2_7b", "mistral7b"}


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    """Text documents (standard-library sources) for the configs that read data=jsonl."""
    import json
    import os

    path = tmp_path_factory.mktemp("rehearsal") / "train.jsonl"
    sources = sorted(Path(os.__file__).parent.glob("*.py"))[:60]
    path.write_text("".join(json.dumps({"text": p.read_text(errors="replace")[:6000]}) + "\n" for p in sources))
    return path


def _shipped(config: str, jsonl: Path) -> list[str]:
    """The config as shipped, plus what a weightless, data-less composition needs to exist at all."""
    extra = [MODEL_HARDWARE] if config.startswith("model=") else []
    return [config, *extra, "model.init=random", f"data.path={jsonl}"]


@lru_cache(maxsize=None)
def _plan(config: str, jsonl: Path):
    job = compose_job(_shipped(config, jsonl))
    hf_config = build_hf_config(job.model)
    if job.data.fixed_seq_len is None:  # data.seq_len=auto: the plan with no documents takes the supported context
        job = with_seq_len(job, context_rows(hf_config, job.parallel.cp))
    return job, hf_config, plan_job(job, hf_config, assumed_hardware(job.hardware))


@pytest.mark.parametrize("config", CONFIGS)
def test_a_full_size_plan_fits_and_updates_weights(config, jsonl):
    job, hf_config, fit = _plan(config, jsonl)
    best = fit.plan.chosen
    usage = best.usage
    peak_gib, budget_gib = usage.terms.total_bytes / 2**30, usage.budget.usable_bytes / 2**30
    assert usage.fits, f"{config}: {peak_gib:.1f} GiB of {budget_gib:.1f}"
    assert fit.precision.name != "bf16_pure" and fit.precision.updates_arrive(job.optim.lr)
    if fit.hardware.device == "cuda":  # the peak leaves the CUDA context and >= 5 % of the card (planning/budget)
        card = usage.budget.card_bytes
        assert card <= fit.hardware.memory_gb * 2**30 and usage.budget.context_bytes > 0
        assert usage.terms.total_bytes <= card - usage.budget.context_bytes - 0.05 * card
    if job.model.arch.get("hidden_size", 0) >= 4096:
        assert job.optim.lr <= 5e-5, "a 7B fine-tune at a pretraining learning rate"
    # The meta model has exactly the planner's parameters and bytes: nothing allocated, nothing guessed.
    meta = build_meta_model(hf_config, fit.precision.param_dtype)
    params = list(meta.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == ModelShape.from_hf_config(hf_config).params
    assert sum(p.numel() * p.element_size() for p in params) == usage.terms.weights_bytes
    print(
        f"{config}: {peak_gib:.1f} / {budget_gib:.1f} GiB on {fit.hardware.name}, precision {fit.precision.name}, "
        f"{best.label}, micro_batch {best.micro_batch} x {best.grad_accum}"
    )


def _shrunk(job, fit) -> list[str]:
    """Overrides that shrink only the width (and the row length, with the window in proportion) and pin the
    full-size plan's choices."""
    arch = job.model.arch
    heads, kv = arch["num_attention_heads"], arch.get("num_key_value_heads", arch["num_attention_heads"])
    ratio = SHRUNK_HIDDEN / arch["hidden_size"]
    seq = min(job.data.seq_len, REHEARSAL_SEQ)
    scale = seq / job.data.seq_len
    out = [
        f"model.arch.hidden_size={SHRUNK_HIDDEN}",
        f"model.arch.intermediate_size={round(arch['intermediate_size'] * ratio)}",
        f"model.arch.num_attention_heads={SHRUNK_HEADS}",
        f"model.arch.num_key_value_heads={max(1, SHRUNK_HEADS * kv // heads)}",
        f"data.seq_len={seq}",
        f"precision={fit.precision.name}",
        f"memory={fit.plan.chosen.memory.policy}",
        f"train.micro_batch={fit.plan.chosen.micro_batch}",
        f"train.grad_accum={fit.plan.chosen.grad_accum}",
        "train.max_steps=2",
        "train.save_final=false",
        "train.save_every=0",
        "train.progress=false",
        "optim.warmup_steps=1",
        "train.compile_backend=aot_eager",
        "data.num_workers=0",
    ]
    if fit.plan.chosen.memory.policy != "none":
        out += [
            f"memory.layers={fit.plan.chosen.memory.layers}",
            f"memory.granularity={fit.plan.chosen.memory.granularity}",
            f"memory.offload={str(fit.plan.chosen.memory.offload).lower()}",
        ]
    if fit.plan.chosen.memory.tiled_mlp:  # the plan's tile, in tokens (a shrunk row may be shorter than one tile)
        out.append(f"memory.tiled_mlp={fit.plan.chosen.memory.tiled_mlp}")
    if arch.get("sliding_window"):
        out.append(f"model.arch.sliding_window={max(16, int(arch['sliding_window'] * scale))}")
    if job.attn.window:
        out.append(f"attn.window={max(16, int(job.attn.window * scale))}")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_b_two_steps_at_full_depth_on_cpu(config, jsonl, tmp_path):
    from flexengine.run import build_planned_trainer

    job, _, fit = _plan(config, jsonl)
    overrides = [*_shipped(config, jsonl), "hardware=cpu", *_shrunk(job, fit), f"train.output_dir={tmp_path}"]
    run_job = compose_job(overrides)
    trainer, run = build_planned_trainer(run_job, tmp_path)
    layers = decoder_layers(trainer.model)
    assert len(layers) == job.model.arch["num_hidden_layers"]  # full depth
    assert run.job.precision.mode == fit.precision.name and run.job.memory == fit.plan.chosen.memory
    assert {p.dtype for p in trainer.model.parameters()} == {fit.precision.param_dtype}
    assert trainer.setup.train.compile == job.train.compile
    before = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
    summary = trainer.train()
    assert summary["steps"] == 2 and all(math.isfinite(x) for x in summary["losses"]), summary["losses"]
    moved = sum(int(not torch.equal(before[n], p.detach().float())) for n, p in trainer.model.named_parameters())
    assert moved > 0
    print(f"{config}: 2 steps at {len(layers)} layers, losses {summary['losses']}, {moved} tensors moved")


def test_rehearsal_covers_every_shipped_config():
    # the parametrised rehearsals above would pass vacuously if the config directory moved and the glob found nothing
    assert len(EXPERIMENTS) >= 4 and len(MODELS_7B) >= 3, (EXPERIMENTS, MODELS_7B)
