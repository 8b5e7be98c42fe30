"""plan.max_seq_len's per-mode table: every (LoRA rank, mode) row, and per rank the longest a mode that trains
correctly reaches, with its policy and what the host holds (the search itself: tests/planning/test_max_seq_len.py)."""

from __future__ import annotations

import re

import pytest

from flexengine.cli.common import compose_job
from flexengine.cli.plan_max_seq_len import (
    build_max_seq_len,
    format_longest_over_modes,
    format_max_seq_len,
    step_time_footer,
)
from flexengine.core.units import GiB
from flexengine.planning.costs import ASSUMED, MEASURED, NO_SPEED, UNKNOWN


def _row(r: int, mode: str, n: int, ok: bool = True, host: float = 10.0, offloaded: float = 4.0) -> dict:
    return {
        "lora_r": r,
        "precision": mode,
        "trains_correctly": ok,
        "max_seq_len": n,
        "total_bytes": 70 * GiB,
        "host_bytes": host * GiB,
        "offloaded_bytes": offloaded * GiB,
        "step_s": 100.0,
        "policy": "full + offload",
    }


def test_the_longest_per_rank_skips_modes_that_do_not_train_correctly():
    rows = [_row(0, "bf16_sr", 50_000), _row(0, "bf16_pure", 90_000, ok=False), _row(0, "bf16_cpu_master", 80_000)]
    rows += [_row(16, "bf16_mixed", 0), _row(16, "bf16_cpu_master", 300_000, host=80.0, offloaded=79.5)]
    text = format_longest_over_modes(rows)
    assert "longest, full fine-tune: 80,000 tokens with precision=bf16_cpu_master and full + offload" in text
    assert "the host holds 10.0 GiB (6.0 GiB of optimizer state and masters, 4.0 GiB of offloaded" in text
    assert "longest, LoRA r=16: 300,000 tokens" in text and "(not even 128 tokens fit)" in text
    assert "fails the long-horizon numerics check" in text  # bf16_pure shown, not taken


def test_an_unknown_device_speed_prints_no_seconds_and_names_the_options():
    """On CPU with no measured speed (FLEXENGINE_DEVICE_SPEED=off, as in every test) the step and tokens/s are n/a
    and the footer names how to get a speed, not 'the planner's FLOPs at 40% MFU'."""
    job = compose_job(["hardware.device=cpu", "data.seq_len=1024"])
    report = build_max_seq_len(job, None)
    assert {r["time_source"] for r in report["policies"] + report["modes"] if r["max_seq_len"]} == {UNKNOWN}
    text = format_max_seq_len(report)
    assert re.search(r"\d+(\.\d+)?s\b", text) is None, text  # no seconds anywhere
    assert "n/a" in text and f"step time n/a: {NO_SPEED}" in text and "MFU plus" not in text


def test_the_footer_names_each_source_the_rows_were_timed_from():
    rows = [{**_row(0, "fp32", 1000), "time_source": MEASURED}, {**_row(0, "bf16_sr", 2000), "time_source": ASSUMED}]
    footer = "\n".join(step_time_footer(rows))
    assert "at this device's measured speed" in footer and "at 40% MFU" in footer and "n/a" not in footer
    assert step_time_footer(rows[:1]) == [step_time_footer(rows)[1]]  # measured alone: no assumed MFU named
    assert "100s" in format_longest_over_modes(rows) and "n/a" not in format_longest_over_modes(rows)
    assert "n/a" in format_longest_over_modes([{**rows[0], "time_source": UNKNOWN}])


def test_the_default_picture_without_matplotlib_is_left_out_with_a_note_and_a_given_path_stops_before_searching(
    monkeypatch, capsys, tmp_path
):
    from flexengine.cli.plan_max_seq_len import DEFAULT_PNG, max_seq_len_png
    from flexengine.core.errors import UserError
    from tests.helpers import hide_package

    assert max_seq_len_png(None) is None and max_seq_len_png("") is None  # plan.png=null: no picture
    assert max_seq_len_png(str(tmp_path / "m.png")) == tmp_path / "m.png"
    hide_package(monkeypatch, "matplotlib")
    assert max_seq_len_png(DEFAULT_PNG) is None
    assert "pip install 'flexengine[plots]'" in capsys.readouterr().err  # stderr: plan.format=json stays JSON
    with pytest.raises(UserError, match=r"plan\.png=.*m\.png .*flexengine\[plots\].*plan\.png=null"):
        max_seq_len_png(str(tmp_path / "m.png"))


def test_plan_png_null_composes():
    from omegaconf import OmegaConf

    from flexengine.cli.plan import PlanOptions

    # the schema Hydra merges overrides into: a non-Optional field refuses null ("field 'plan.png' is not Optional")
    merged = OmegaConf.merge(OmegaConf.structured(PlanOptions), OmegaConf.from_dotlist(["png=null"]))
    assert merged.png is None
