"""`python -m flexengine.plan`: JSON fields, the chosen policy, and what to do when nothing fits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flexengine.core.errors import UserError
from tests.planning.test_plan import PLAN_KEYS

ROOT = Path(__file__).parents[2]


def _plan(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flexengine.plan", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_plan_json_for_deepseek7b_on_a100():
    proc = _plan("model=deepseek7b", "data.seq_len=6144", "hardware=a100_80g", "plan.format=json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    for key in (
        "hf_config",
        "seq_len",
        "micro_batch",
        "dtype",
        "weights_bytes",
        "grads_bytes",
        "optimizer_bytes",
        "activation_bytes",
        "activation_bytes_per_block",
        "logits_bytes",
        "total_bytes",
        "budget_bytes",
        "fits",
        "policy",
        "recompute_flops_fraction",
    ):
        assert key in plan, key
    assert plan["hf_config"]["hidden_size"] == 4096 and plan["hf_config"]["vocab_size"] == 102400
    assert plan["seq_len"] == 6144 and plan["dtype"] == "bfloat16"
    # the card as the least A100-80GB reports it, less the assumed CUDA context and the 5 % margin, all printed
    card, context, margin = plan["card_bytes"], plan["cuda_context_bytes"], plan["margin_bytes"]
    assert card == int(79.15 * 2**30) and context == int(0.8 * 2**30) and margin == int(0.05 * card)
    assert plan["budget_bytes"] == card - context - margin
    assert plan["fits"] and plan["total_bytes"] <= plan["budget_bytes"]
    parts = plan["weights_bytes"] + plan["grads_bytes"] + plan["optimizer_bytes"] + plan["activation_bytes"]
    assert parts < plan["total_bytes"]
    assert len(plan["activation_bytes_per_block"]["none"]) == 30
    assert plan["weights_bytes"] == pytest.approx(6.91e9 * 2, rel=0.01)
    assert plan["context"]["trained_context"] == 4096 and not plan["context"]["rows_within_supported"]


def test_plan_reports_documents_against_the_trained_context(tmp_path):
    """With data.path and a tokenizer, the planner tokenizes (cached) and places the lengths against the context."""
    from flexengine.cli.plan import context_report
    from flexengine.data.demo import load_demo_tokenizer
    from flexengine.surgery.model import build_hf_config
    from tests.helpers import make_job

    tokenizer_dir = tmp_path / "tok"
    load_demo_tokenizer().save_pretrained(str(tokenizer_dir))
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": "x = 1\n" * n}) + "\n" for n in (5, 20, 80, 200)))
    job = make_job(
        tmp_path,
        "data=jsonl",
        f"data.path={path}",
        "data.num_workers=0",
        f"model.tokenizer={tokenizer_dir}",
        "model.arch.max_position_embeddings=256",
        "model.rope_scaling={rope_type:linear,factor:4.0}",
    )
    report = context_report(job, build_hf_config(job.model))
    assert (report["trained_context"], report["supported_context"]) == (256, 1024)
    docs = report["documents"]
    assert docs["documents"] == 4 and docs["documents_over_trained"] == 2 and docs["documents_over_supported"] == 0


def test_plan_table_and_nothing_fits():
    proc = _plan("model=llama2_7b", "data.seq_len=8192", "hardware=a100_80g", "hardware.memory_gb=24")
    assert proc.returncode == 0, proc.stderr
    assert "NOTHING FITS" in proc.stdout and "LoRA" in proc.stdout
    assert "k (of 32)" in proc.stdout and "block k=32/32" in proc.stdout


def test_plan_counts_small_models_in_millions_and_7b_in_billions():
    """Before: the demo model's table said "(0.00B parameters)"."""
    from flexengine.cli.first_contact import format_params

    assert (format_params(4_194_304), format_params(6_738_415_616)) == ("4.2M", "6.74B")
    proc = _plan()  # the demo model
    assert proc.returncode == 0, proc.stderr
    assert "M parameters)" in proc.stdout and "0.00B" not in proc.stdout, proc.stdout[:2000]


def test_plan_rejects_bad_format():
    proc = _plan("plan.format=yaml")
    assert proc.returncode == 2 and "plan.format" in proc.stderr


def test_training_still_composes_without_plan_key():
    """The planner's schema is registered only by its CLI: training configs never gain a `plan` key."""
    from hydra import compose, initialize_config_module

    import flexengine.cli.plan  # noqa: F401  (importing must not register anything)
    from flexengine.cli.common import register_schema

    register_schema()  # what training's entry point registers
    with initialize_config_module("flexengine.conf", version_base="1.3"):
        cfg = compose("config", overrides=["memory=auto"])
    assert "plan" not in cfg and cfg.memory.policy == "auto"


@pytest.mark.slow
def test_train_with_memory_auto_reports_activation_bytes(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexengine.train",
            "debug=fast",
            "memory=auto",
            "train.max_steps=1",
            f"train.output_dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["activation_bytes"] > 0 and len(summary["activation_bytes_per_block"]) == 4
    assert summary["memory_policy"]["policy"] != "auto"
    assert "plan: precision=fp32" in proc.stderr + proc.stdout  # the one plan line names the chosen mode


def test_max_seq_len_search_takes_any_data_seq_len_under_context_parallelism():
    """plan.max_seq_len=true tries multiples of cp x 128 itself: a data.seq_len it never uses (6000, not a
    multiple of 8 x 128) is not refused; the plain plan of that seq_len still is, and the search keeps the other
    context-parallel rules."""
    from flexengine.cli.common import compose_config
    from flexengine.cli.plan import PlanJobConfig, plan_job_config

    common = [
        "model=deepseek7b",
        "model.init=random",
        "hardware=a100_80g",
        "hardware.world_size=8",
        "data.seq_len=6000",
    ]
    for cp in (["parallel.cp=8"], ["plan.cp=8"]):
        job = plan_job_config(compose_config([*common, *cp, "plan.max_seq_len=true"], PlanJobConfig))
        assert job.parallel.cp == 8 and job.data.seq_len == 6000
        with pytest.raises(UserError, match="data.seq_len=6000 must be a multiple of parallel.cp x 128 = 1024"):
            plan_job_config(compose_config([*common, *cp], PlanJobConfig))
    with pytest.raises(UserError, match="parallel.cp=8 needs attn.block_size=128"):
        plan_job_config(
            compose_config([*common, "plan.cp=8", "attn.block_size=64", "plan.max_seq_len=true"], PlanJobConfig)
        )


COMMAND_KEYS = ["params", "hardware", "precision_table", "updates_arrive_at_lr", "context", "cp", "node_of_8"]
COMMAND_KEYS += ["work_per_useful_token"]
SUMMARY_KEYS = ["fits", "precision", "policy", "memory", "micro_batch", "grad_accum", "seq_len", "hardware"]
SUMMARY_KEYS += ["world_size", "params", "total_bytes", "budget_bytes", "card_bytes", "cuda_context_bytes"]
SUMMARY_KEYS += ["margin_bytes", "host_bytes", "host_budget_bytes", "step_s", "tokens_per_step", "tokens_per_s"]
SUMMARY_KEYS += ["describe", "candidates"]
PRECISION_ROW_KEYS = ["precision", "fits", "total_bytes", "host_bytes", "policy", "step_s", "updates_exact"]
PRECISION_ROW_KEYS += ["stochastic_rounding", "trains_correctly", "missing", "why_not_fit", "verdict", "time_source"]


def test_plan_json_leads_with_a_summary_and_stays_small():
    """A script reads `summary` (the chosen precision, policy and batch shape, the peak against the budget and what
    the budget is made of, the estimated step time and tokens/s); the HF config is reduced to what the plan reads,
    and the candidate table (~390 KB at 7B) comes only with plan.candidates=true."""
    proc = _plan("experiment=deepseek7b_6k_a100", "plan.format=json")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) < 16_000  # was 392 KB
    plan = json.loads(proc.stdout)
    assert next(iter(plan)) == "summary"
    # the keys scripts read, in their order: the summary, the plan's own (planning/plan.py), the command's
    assert list(plan) == ["summary", *(k for k in PLAN_KEYS if k != "candidates"), *COMMAND_KEYS]
    assert list(plan["summary"]) == SUMMARY_KEYS
    assert all(list(row) == PRECISION_ROW_KEYS for row in plan["precision_table"])
    assert list(plan["node_of_8"]) == ["precision", "total_bytes", "budget_bytes", "fits", "policy"] + [
        "recompute_flops_fraction"
    ]
    s = plan["summary"]
    assert s["fits"] and s["precision"] == next(
        r["precision"] for r in plan["precision_table"] if r["verdict"] == "chosen"
    )
    assert (s["policy"], s["memory"], s["micro_batch"], s["grad_accum"]) == (
        plan["policy"],
        plan["memory"],
        plan["micro_batch"],
        plan["grad_accum"],
    )
    assert s["budget_bytes"] == s["card_bytes"] - s["cuda_context_bytes"] - s["margin_bytes"] == plan["budget_bytes"]
    assert s["total_bytes"] == plan["total_bytes"] <= s["budget_bytes"]
    assert s["tokens_per_step"] == 8192 * 1 * 8 and s["tokens_per_s"] == pytest.approx(65536 / plan["step_s"])
    assert "id2label" not in plan["hf_config"] and plan["hf_config"]["rope_parameters"]["rope_type"] == "yarn"
    assert "candidates" not in plan and s["candidates"].endswith("plan.candidates=true lists them")
    full = _plan("experiment=deepseek7b_6k_a100", "plan.format=json", "plan.candidates=true")
    candidates = json.loads(full.stdout)["candidates"]
    assert len(candidates) == int(s["candidates"].split()[0]) and {"label", "total_bytes", "fits"} <= set(candidates[0])


def test_how_long_for_the_seed_workload():
    """The seed question: 20,000 documents of ~6,000 tokens, one epoch, one A100-80G (and a node of eight, and
    LoRA): hours printed as estimates, and the same numbers in the JSON."""
    seed = [
        "experiment=deepseek7b_6k_a100",
        "plan.documents=20000",
        "plan.doc_tokens=6000",
        "plan.epochs=1",
        "data.seq_len=8192",
    ]
    table = _plan(*seed)
    assert table.returncode == 0, table.stderr
    assert "how long: 20,000 documents of 6,000 tokens -> 20,000 rows of 8,192" in table.stdout
    assert "estimates" in table.stdout and "LoRA r=16, 8 GPUs" in table.stdout
    plan = json.loads(_plan(*seed, "plan.format=json").stdout)
    report = plan["corpus_time"]
    assert report["corpus"]["rows"] == 20_000 and report["corpus"]["useful_tokens"] == 120_000_000
    first = report["alternatives"][0]
    assert first["label"] == "as configured" and first["steps"] == 2_500
    assert f"{first['hours']:7.1f}" in table.stdout
    # known documents: each row's mask allows the 6,000-token document's causal pairs and its padding's, not the
    # whole row's causal half, and the plan and its hours say so
    pairs = plan["attention_pairs"]
    expected = (6000 * 6001 // 2 + 2192 * 2193 // 2) / 8192**2
    assert pairs["source"].startswith("the mask of the packed rows of 20,000 documents of 6,000 tokens")
    assert "counted for mode=packed_doc backend=flex window: none on 30 layers" in pairs["source"]
    assert pairs["source"].endswith("seq_len=8192")
    assert pairs["fraction_of_row_squared"] == pytest.approx(expected)
    assert f"attention: {expected:.3f} x seq_len^2" in table.stdout and first["step_s"] == plan["step_s"]
    unknown = json.loads(_plan("experiment=deepseek7b_6k_a100", "plan.format=json").stdout)
    fallback = unknown["attention_pairs"]
    assert fallback["fraction_of_row_squared"] == 0.5 and "no corpus given" in fallback["source"]
    assert unknown["step_s"] > plan["step_s"]


def test_the_seed_workload_gets_rows_that_fit_its_documents():
    """experiment=deepseek7b_6k_a100's data.seq_len=auto over the seed's documents: 6,144-token rows chosen by
    themselves (97.7 % useful, not 8,192 at 73 %), <= 12.2 h at the assumed MFU, the MFU 9 h would need, the lengths
    weighed, and executed FLOPs per useful token <= 1.05; the same in the JSON."""
    seed = ["experiment=deepseek7b_6k_a100", "plan.documents=20000", "plan.doc_tokens=6000"]

    def _plan(*overrides: str) -> subprocess.CompletedProcess:  # a dozen row lengths planned: minutes under load
        command = [sys.executable, "-m", "flexengine.plan", *overrides]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)

    table = _plan(*seed)
    assert table.returncode == 0, table.stderr
    assert "rows: data.seq_len=auto -> 6,144 tokens" in table.stdout and "9 h needs" in table.stdout
    assert "-> 20,000 rows of 6,144 (120,000,000 tokens, 97.7% of slots useful)" in table.stdout
    plan = json.loads(_plan(*seed, "plan.format=json").stdout)
    rows = plan["row_length"]
    assert rows["seq_len"] == plan["summary"]["seq_len"] == 6144
    assert {o["seq_len"] for o in rows["options"]} >= {4096, 6144, 8192}
    assert plan["corpus_time"]["alternatives"][0]["hours"] <= 12.2
    assert plan["work_per_useful_token"]["ratio"] <= 1.05
    assert f"{plan['work_per_useful_token']['ratio']:.3f} x the model's FLOPs" in table.stdout


@pytest.mark.parametrize("measured", [False, True])
def test_plan_and_run_choose_the_same_row_length(monkeypatch, measured):
    """data.seq_len=auto: the plan prices the candidate lengths on the hardware the run prices them on (this
    machine at its measured speed, here off as the tests set it, or a fixed measured speed), so both choose the same
    length from the same documents, every option's step time the same."""
    import torch

    from flexengine import resolve as resolve_module
    from flexengine import run
    from flexengine.cli.common import compose_job
    from flexengine.cli.plan import PlanOptions, plan_documents
    from flexengine.cli.plan_corpus import document_lengths
    from flexengine.core.distributed import DistInfo
    from flexengine.resolve import resolve, resolve_target_hardware
    from flexengine.surgery.model import build_hf_config
    from tests.planning.test_costs import _speed

    if measured:
        monkeypatch.setattr(resolve_module, "measure_device_speed", lambda *a, **k: _speed(matmul_tflops=0.5))
    overrides = ["debug=fast", "hardware.device=cpu", "data.seq_len=auto", "model.arch.max_position_embeddings=512"]
    job = compose_job(overrides)
    options = PlanOptions(documents=64, doc_tokens=300)
    hf_config = build_hf_config(job.model)
    planned = resolve(job, hf_config, resolve_target_hardware(job, hf_config), documents=plan_documents(job, options))
    lengths, _ = document_lengths(job, options)
    monkeypatch.setattr(run, "training_lengths", lambda *a, **k: lengths)
    monkeypatch.setattr(run, "load_tokenizer", lambda model: None)
    device = torch.device("cpu")
    ran = run._resolve_run(job, hf_config, planned.attention, device=device, dist_info=DistInfo())
    assert bool(ran.hardware.speed) == measured
    assert planned.rows is not None and ran.rows is not None
    assert planned.seq_len == ran.seq_len == ran.rows.seq_len
    assert [(o.seq_len, o.step_s) for o in planned.rows.options] == [(o.seq_len, o.step_s) for o in ran.rows.options]


def test_the_assumed_line_names_only_what_is_assumed():
    """A plan priced with a measured speed prints the measured figures as measured, and no assumed MFU, datasheet
    peak or bandwidth beside them; a named card's plan still lists those as assumed."""
    import dataclasses

    from flexengine.cli.common import compose_job
    from flexengine.core.device_speed import DeviceSpeed
    from flexengine.core.hardware import assumed_hardware
    from flexengine.planning.costs import assumed_and_measured
    from flexengine.planning.fit import plan_job
    from flexengine.surgery.model import build_hf_config

    job = compose_job(["hardware.device=cpu", "data.seq_len=1024", "precision=fp32"])
    hf_config = build_hf_config(job.model)
    speed = DeviceSpeed(matmul_tflops=0.05, memory_gb_s=12.5, dtype_bytes=4, source="measured on cpu (test)")
    hardware = dataclasses.replace(assumed_hardware(job.hardware), speed=(speed,))
    plan = plan_job(job, hf_config, hardware).plan
    assumed, measured = assumed_and_measured(plan.assumptions, plan.chosen.time.source, plan.dtype, hardware)
    assert "assumed_mfu" not in assumed and "memory_gb_s" not in assumed and "margin=" in assumed
    assert measured == "  measured (measured on cpu (test)): matmul_tflops=0.05, memory_gb_s=12.5"

    card = compose_job(["hardware=a100_80g", "data.seq_len=1024"])
    a100 = assumed_hardware(card.hardware)
    plan = plan_job(card, hf_config, a100).plan
    (line,) = assumed_and_measured(plan.assumptions, plan.chosen.time.source, plan.dtype, a100)
    assert "assumed_mfu=0.4" in line and "peak_tflops=312" in line and "memory_gb_s=" in line
