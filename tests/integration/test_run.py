"""The record of the effective config (resolved_config.yaml, summary.json's config, TensorBoard) is what trained:
checked value by value against what the trainer used, for a model.path run whose first-contact defaults and planner
choices both change the composed config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from flexengine.cli.common import compose_job_record
from flexengine.core.config import MemoryConfig
from flexengine.run import build_trainer, run_training
from flexengine.surgery.applied import applied
from flexengine.surgery.memory.spec import block_memory_specs
from tests.helpers import save_pretrained_llama

REPO = Path(__file__).resolve().parents[2]
# debug=fast on a pretrained directory; a 30 MiB "device" makes the planner halve the micro-batch typed
OVERRIDES = ("debug=fast", "train.micro_batch=4", "hardware.device=cpu", "hardware.memory_gb=0.03")


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return save_pretrained_llama(tmp_path / "my-small-llama")


def _steps_accumulation(trainer) -> int:
    """How many micro-batches the trainer draws for one optimizer step, counted while it takes one."""
    drawn = []
    next_batch = trainer.loader.next_batch
    trainer.loader.next_batch = lambda: drawn.append(1) or next_batch()
    try:
        trainer.train_step()
    finally:
        del trainer.loader.next_batch
    return len(drawn)


def _used(trainer, recorded_arch: dict) -> dict:
    """What the built trainer really runs with, read from the objects that do the work (never from the job the
    record is built from): the model's HF config, the optimizer's groups, the loader, one step."""
    built = trainer.model.config.to_dict()
    groups = trainer.optimizer.param_groups
    return {
        "model.arch": {key: built.get(key, "absent from the built model's config") for key in recorded_arch},
        "optim.lr": groups[0]["initial_lr"],  # the peak the schedule scales (each group's lr = it x the schedule)
        "optim.weight_decay": groups[0]["weight_decay"],  # the matrices' group
        "optim.name": type(trainer.optimizer).__name__.lower(),
        "precision.mode": trainer.precision.name,
        "train.micro_batch": trainer.loader.micro_batch,
        "attn.backend": trainer.attn.backend.value,
        "train.grad_accum": _steps_accumulation(trainer),  # last: it takes a step
    }


def test_the_record_is_what_the_trainer_used(checkpoint, tmp_path):
    job, record = compose_job_record([f"model.path={checkpoint}", *OVERRIDES])
    trainer = build_trainer(job, tmp_path / "run", record)
    used = _used(trainer, record.values["model.arch"])
    assert {key: record.values[key] for key in used} == used
    assert len({group["initial_lr"] for group in trainer.optimizer.param_groups}) == 1
    # the architecture is the checkpoint's config.json (2 layers of 64), not conf/model/tiny.yaml's (4 of 256)
    on_disk = json.loads((checkpoint / "config.json").read_text())
    arch = record.values["model.arch"]
    assert (arch["hidden_size"], arch["num_hidden_layers"]) == (on_disk["hidden_size"], on_disk["num_hidden_layers"])
    assert (arch["hidden_size"], arch["num_hidden_layers"]) != (job.model.arch["hidden_size"], 4)
    assert record.sources["model.arch"] == "model.path: config.json" and "transformers_version" not in arch
    # the memory policy: the specs on the model's blocks are the ones the recorded memory.* values make
    memory = MemoryConfig(**{k.split(".")[1]: v for k, v in record.values.items() if k.startswith("memory.")})
    assert applied(trainer.model).memory == block_memory_specs(memory, len(applied(trainer.model).memory))
    # and these are the run's values, not the composed ones: first-contact's lr, weight decay and name, the
    # planner's micro-batch (4 typed, 2 planned) and precision
    assert (used["optim.lr"], used["optim.weight_decay"], record.values["model.name"]) == (2e-5, 0.0, "my-small-llama")
    assert (used["train.micro_batch"], used["train.grad_accum"]) == (2, 2)
    kinds = record.kinds()
    assert kinds["optim.lr"] == kinds["optim.weight_decay"] == kinds["model.name"] == "first-contact"
    assert kinds["train.micro_batch"] == kinds["precision.mode"] == kinds["memory.policy"] == "auto"
    assert (
        kinds["attn.backend"] == "auto" and kinds["train.max_steps"] == "config" and kinds["hardware.device"] == "yours"
    )
    assert "replaces 4, yours: command line" in record.sources["train.micro_batch"]
    assert "replaces 0.001, config: conf/optim/adamw.yaml" in record.sources["optim.lr"]
    assert record.sources["optim.warmup_steps"] == "config: conf/debug/fast.yaml"  # so no warmup ratio is taken


def _tensorboard(run_dir: Path) -> tuple[dict, dict]:
    """(the HParams a run logged, its text entries by tag), read back from the event files."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    hparams, texts = {}, {}
    for path in (run_dir / "tb").rglob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                plugin = value.metadata.plugin_data.plugin_name
                if plugin == "hparams":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    if data.HasField("session_start_info"):
                        for k, v in data.session_start_info.hparams.items():
                            hparams[k] = getattr(v, v.WhichOneof("kind"))
                elif plugin == "text":
                    texts[value.tag] = value.tensor.string_val[0].decode()
    return hparams, texts


def _cli(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_files_tensorboard_and_the_plan_show_the_same_record(checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"model.path={checkpoint}", *OVERRIDES, "train.max_steps=2"]
    proc = _cli("flexengine.train", *overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["config"] == resolved
    assert resolved["optim"]["lr"] == 2e-5 and resolved["train"]["micro_batch"] == 2
    assert summary["config_sources"]["optim.lr"].startswith("first-contact: from flexengine's generic")
    # what trained: 2 steps of micro_batch 2 x grad_accum 2 rows of 256 tokens
    assert summary["tokens_seen"] == 2 * 2 * 2 * 256
    hydra_cfg = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert hydra_cfg["optim"]["lr"] == 1e-3  # Hydra's composition, as composed (the record says what changed it)
    hparams, texts = _tensorboard(run_dir)
    shown = {"lr": "optim.lr", "weight_decay": "optim.weight_decay", "model": "model.name", "memory": "memory.policy"}
    shown |= {"precision": "precision.mode", "micro_batch": "train.micro_batch", "grad_accum": "train.grad_accum"}
    flat = {f"{g}.{k}": v for g, values in resolved.items() for k, v in values.items()}
    assert {name: hparams[name] for name in shown} == pytest.approx({name: flat[key] for name, key in shown.items()})
    assert hparams["backend"] == flat["attn.backend"]
    assert yaml.safe_load(texts["config/resolved/text_summary"]) == resolved
    # without training: the plan's resolved config is the run's (host memory is measured again, so it moves)
    plan = _cli("flexengine.plan", *overrides, "plan.format=resolved", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    planned = yaml.safe_load(plan.stdout)
    for group in (planned, resolved):
        group["hardware"].pop("host_memory_gb")
    assert planned == resolved


def test_cfg_job_says_it_is_the_composition_and_where_the_effective_config_is(tmp_path):
    proc = _cli("flexengine.train", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["optim"]["lr"] == 1e-3
    assert "plan.format=resolved" in proc.stderr and "resolved_config.yaml" in proc.stderr


def _hashes(directory: Path) -> dict[str, str]:
    import hashlib

    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in directory.rglob("*")
        if p.is_file()
    }


def test_a_refused_resume_leaves_the_runs_files_byte_identical(tmp_path):
    """A train.resume=auto onto another data stream is refused (rc 2). Before: resolved_config.yaml (and a new
    TensorBoard event file) were written before the resume compared the data, so the run's record described the
    refused launch. Every file of the run dir is hashed before and after; the refused launch may add only its own
    Hydra folder (.hydra/, train.log, error.json), and .lock names the last holder."""
    out = tmp_path / "run"
    fast = ("debug=fast", "train.progress=false", f"train.output_dir={out}", "data.demo_max_files=24")
    first = subprocess.run(
        [sys.executable, "-m", "flexengine.train", *fast, "train.max_steps=2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    before = _hashes(out)
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexengine.train",
            *fast,
            "data.demo_max_files=12",
            "optim.lr=0.05",
            "train.max_steps=4",
            "train.resume=auto",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert refused.returncode == 2 and "another data stream" in refused.stderr, refused.stderr[-3000:]
    after = _hashes(out)
    changed = sorted(name for name in before if name != ".lock" and after.get(name) != before[name])
    assert not changed, changed
    launches = {Path(name).parts[:2] for name in before if Path(name).parts[0][:2] == "20"}
    added = sorted(name for name in after if name not in before and Path(name).parts[:2] not in launches)
    assert added and all(Path(name).parts[0][:2] == "20" for name in added), added  # only the launch's own folder
    assert "tb" not in {Path(n).parts[0] for n in added}


def test_data_seq_len_auto_is_chosen_before_the_fit_and_recorded_as_it_runs(tmp_path):
    """data.seq_len=auto through the real loop: the length is chosen from the demo corpus's training documents
    (within the 512 positions the model is given), the fit and the rows use it, and resolved_config.yaml and
    summary.json record that number with its source, beside every length weighed."""
    overrides = ["debug=fast", "hardware.device=cpu", "train.max_steps=2", "data.seq_len=auto"]
    job, record = compose_job_record([*overrides, "model.arch.max_position_embeddings=512"])
    summary = run_training(job, tmp_path / "run", record)
    recorded = yaml.safe_load((tmp_path / "run" / "resolved_config.yaml").read_text())["data"]["seq_len"]
    assert recorded == summary["data"]["seq_len"] == summary["data"]["row_length"]["seq_len"] == 512
    assert summary["config"]["data"]["seq_len"] == recorded and summary["steps"] == 2
    assert summary["config_sources"]["data.seq_len"].startswith("auto: row length")
    weighed = {o["seq_len"]: o for o in summary["data"]["row_length"]["options"]}
    assert all(not o["within_context"] for n, o in weighed.items() if n > 512) and len(weighed) > 3
    # the run's work per useful token: its hardware FLOPs against its model FLOPs, the parts named
    work = summary["work_per_useful_token"]
    assert work["model_flops"] * summary["useful_tokens_seen"] == pytest.approx(summary["model_flops"])
    assert work["ratio"] == pytest.approx(summary["hardware_flops"] / summary["model_flops"]) and work["ratio"] > 1
    assert work["recompute_flops"] == 0 and work["loss_recompute_flops"] == 0  # no checkpoint; one loss chunk
    assert work["padding_and_attention_flops"] == pytest.approx(work["executed_flops"] - work["model_flops"])


def _rank_hardware(rank: int, init_file: str, out: str) -> None:
    """Each rank 'measures' a speed of its own (rank + 1 TFLOP/s, as noise would differ) and writes what it plans
    with."""
    import dataclasses
    import datetime

    import torch.distributed as dist

    from flexengine import resolve, run
    from flexengine.core.distributed import DistInfo
    from flexengine.surgery.model import build_hf_config
    from tests.planning.test_costs import _speed

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    resolve.with_measured_speed = lambda hw, *a: dataclasses.replace(hw, speed=(_speed(matmul_tflops=rank + 1.0),))
    job = compose_job_record(["debug=fast", "hardware.device=cpu", "data.seq_len=auto"])[0]
    hardware = run._run_hardware(job, torch.device("cpu"), DistInfo(rank, 2), build_hf_config(job.model))
    result = {"tflops": [s.matmul_tflops for s in hardware.speed], "world_size": hardware.world_size}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_plans_with_rank_0s_measured_hardware(tmp_path):
    """Under a process group rank 0 resolves the hardware and measures its speed, and every rank plans with that:
    ranks measuring their own could choose different row lengths, policies or micro-batches (a hang)."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_hardware, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 == {"tflops": [1.0], "world_size": 2}
