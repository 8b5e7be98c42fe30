"""TensorBoard tags and hparams read back from a real run's event files (FLOP counts: tests/loop/test_flops.py)."""

from __future__ import annotations

import pytest

from flexengine.cli.common import compose_job
from flexengine.loop.metrics import TAGS
from flexengine.run import run_training


def _accumulator(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return ea


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    job = compose_job(
        [
            "debug=fast",
            "attn=packed_doc",
            "train.max_steps=3",
            "hardware=cpu",
            "train.save_final=false",
            f"train.output_dir={out}",
        ]
    )
    summary = run_training(job, out)
    return out, summary


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
