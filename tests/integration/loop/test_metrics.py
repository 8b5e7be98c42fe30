"""TensorBoard tags and hparams read back from a real run's event files (FLOP counts: tests/loop/test_flops.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flexengine.cli.common import compose_job
from flexengine.loop import metrics, progress
from flexengine.loop.metrics import ALLOCATOR_TAGS, TAGS
from flexengine.run import run_training


def _accumulator(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return ea


def _tiny_job(out, steps: int = 3):
    return compose_job(
        [
            "debug=fast",
            "attn=packed_doc",
            f"train.max_steps={steps}",
            "hardware=cpu",
            "train.save_final=false",
            f"train.output_dir={out}",
        ]
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    summary = run_training(_tiny_job(out), out)
    return out, summary


def _train_records(out) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["type"] == "train"]


def test_every_stable_tag_is_logged_each_step(tiny_run):
    out, summary = tiny_run
    ea = _accumulator(out / "tb")
    scalars = set(ea.Tags()["scalars"])
    missing = set(TAGS.values()) - scalars
    assert not missing, f"tags not in the event files: {missing}"
    for tag in TAGS.values():
        assert [e.step for e in ea.Scalars(tag)] == [1, 2, 3], tag
    # the logged loss is the run's loss, not some other number under the same name
    logged = [e.value for e in ea.Scalars(TAGS["loss"])]
    assert logged == pytest.approx(summary["losses"], rel=1e-6)
    fractions = [e.value for e in ea.Scalars(TAGS["useful_token_fraction"])]
    assert all(0 < f <= 1 for f in fractions)


def test_hparams_are_logged_for_side_by_side_comparison(tiny_run):
    from tensorboard.plugins.hparams import plugin_data_pb2

    out, summary = tiny_run
    content = _accumulator(out / "tb").PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["attn"].string_value == "packed_doc"
    assert hparams["memory"].string_value == "none"
    assert hparams["seq_len"].number_value == 256
    ea = _accumulator(out / "tb")
    assert ea.Scalars("hparam/final_loss")[0].value == pytest.approx(summary["final_loss"], rel=1e-6)


def test_allocator_figures_are_null_on_cpu(tiny_run):
    """No caching allocator on a CPU: the keys are null in summary.json, absent from metrics.jsonl and TensorBoard
    (never a made-up number); the plan's peak and budget are in the summary beside them."""
    out, _ = tiny_run
    saved = json.loads((out / "summary.json").read_text())
    assert {k: saved[k] for k in ALLOCATOR_TAGS} == dict.fromkeys(ALLOCATOR_TAGS)
    assert all(not set(ALLOCATOR_TAGS) & set(r) for r in _train_records(out))
    assert not set(ALLOCATOR_TAGS.values()) & set(_accumulator(out / "tb").Tags()["scalars"])
    assert 0 < saved["planned_peak_bytes"] <= saved["plan_budget_bytes"]


class _FakeAllocator:
    """torch.cuda.memory_stats as a CUDA run would answer it, growing with each read."""

    def __init__(self) -> None:
        self.reads: list[dict] = []

    def __call__(self, device=None) -> dict:
        k = len(self.reads) + 1
        stats = {
            "allocated_bytes.all.peak": k * 2**30,
            "reserved_bytes.all.peak": k * 2**30 + k * 2**20,
            "num_alloc_retries": k,
            "num_ooms": k - 1,
        }
        self.reads.append(stats)
        return stats


def _expected(stats: dict) -> dict:
    allocated, reserved = stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]
    return {
        "max_memory_allocated_bytes": allocated,
        "max_memory_reserved_bytes": reserved,
        "allocator_overhead_bytes": reserved - allocated,
        "num_alloc_retries": stats["num_alloc_retries"],
        "num_ooms": stats["num_ooms"],
    }


def test_allocator_figures_reach_tensorboard_metrics_and_summary(tmp_path, monkeypatch):
    """A CPU run whose loop reads a CUDA device's allocator (torch.cuda.memory_stats faked): each logged step's
    figures reach metrics.jsonl and TensorBoard under ALLOCATOR_TAGS, and the run's last read reaches summary.json.
    Read once per logged step and once for the summary: no more host calls than that."""
    fake = _FakeAllocator()
    monkeypatch.setattr(torch.cuda, "memory_stats", fake)
    monkeypatch.setattr(progress, "allocator_stats", lambda device: metrics.allocator_stats(torch.device("cuda", 0)))
    summary = run_training(_tiny_job(tmp_path, steps=2), tmp_path)
    assert len(fake.reads) == 3  # steps 1 and 2 (log_every=1), then the summary
    records = _train_records(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    for record, stats in zip(records, fake.reads):
        assert {k: record[k] for k in ALLOCATOR_TAGS} == _expected(stats)
    ea = _accumulator(tmp_path / "tb")
    for key, tag in ALLOCATOR_TAGS.items():
        assert [e.value for e in ea.Scalars(tag)] == [float(_expected(s)[key]) for s in fake.reads[:2]], tag
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert {k: saved[k] for k in ALLOCATOR_TAGS} == {k: summary[k] for k in ALLOCATOR_TAGS} == _expected(fake.reads[2])


def test_a_resume_survives_a_torn_and_a_garbage_line_in_metrics_jsonl(tmp_path, caplog):
    """What a power cut or a full disk leaves: a cut last line, and a line of garbage. Before: every
    train.resume=auto died in truncate_after with a JSONDecodeError traceback, so a requeue loop failed forever."""
    out = tmp_path / "run"
    first = _tiny_job(out, steps=2)
    first = dataclasses.replace(first, train=dataclasses.replace(first.train, save_final=True))
    run_training(first, out)
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines()
    torn = len(lines) + 1  # the garbage line goes before the cut one
    path.write_text("\n".join(lines) + "\n\x00\x00garbage\n" + lines[-1][: len(lines[-1]) // 2])
    resumed = _tiny_job(out, steps=3)
    resumed = dataclasses.replace(resumed, train=dataclasses.replace(resumed.train, resume="auto"))
    with caplog.at_level("WARNING", logger="flexengine.loop.metrics"):
        summary = run_training(resumed, out)
    assert summary["steps"] == 3
    assert f"{path}:{torn} is not a JSON record" in caplog.text and f"{path}:{torn + 1} is not" in caplog.text
    records = [json.loads(line) for line in path.read_text().splitlines()]  # every line a record again
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3]
