"""data.seq_len=auto: candidate lengths on the grid, the seed corpus's 6,144-token rows, long rows kept where
packing fills them, the keep-whole rule against a faster split, the context guard, and nothing that fits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flexengine.cli.common import compose_job
from flexengine.core.errors import UserError
from flexengine.core.hardware import assumed_hardware
from flexengine.data.packing import packer
from flexengine.planning.costs import NO_SPEED
from flexengine.planning.fit import plan_job
from flexengine.planning.row_length import (
    KEEP_WHOLE,
    TIE_BAND,
    Documents,
    RowOption,
    candidate_lengths,
    choose_row_length,
    fastest,
    format_row_length,
    keep_whole_length,
    mfu_for_hours,
    mfu_ladder,
    on_grid,
)
from flexengine.planning.specs import context_rows, planned_attention
from flexengine.resolve import with_seq_len
from flexengine.surgery.model import build_hf_config
from flexengine.surgery.rope import context_limits


def _choose(job, lengths):
    hf_config, hardware = build_hf_config(job.model), assumed_hardware(job.hardware)
    attention = planned_attention(job.attn, hf_config, hardware)
    pack = packer(lengths, job.data.packing, job.data.long_docs)

    def plan_at(seq_len, pairs):  # the composition root's: the job at that length (flexengine/resolve.py)
        return plan_job(with_seq_len(job, seq_len), hf_config, hardware, attention=attention, pairs=pairs)

    documents = Documents(lengths, pack, "test documents")
    limits, cp, long_context = context_limits(hf_config), job.parallel.cp, job.model.allow_long_context
    return choose_row_length(plan_at, documents, hardware, attention, limits, cp=cp, long_context=long_context)


@pytest.mark.parametrize("n", [1, 127, 128, 129, 1000, 4097, 6000, 8192, 100_000, 333_333])
@pytest.mark.parametrize("block", [128, 256, 384])
def test_a_length_rounds_up_to_whole_blocks_and_at_most_a_sixteenth_past_its_power_of_two(n, block):
    got = on_grid(n, block)
    assert got >= n and got % block == 0
    # the grid's step is 1/16 of the power of two below n (a whole number of blocks): never a step past n
    assert got - n < math.lcm(block, max(block, 2 ** (max(n, block).bit_length() - 1) // 16))
    if block == 128 and n >= 2048:
        assert got - n < n / 16  # at most 6.25 % more slots than the length asked for


def test_candidates_span_the_corpus_and_include_the_context():
    lengths = np.array([300] * 50 + [2000] * 45 + [9000] * 5)
    limits = context_limits(build_hf_config(compose_job(["model=deepseek7b", "model.init=random"]).model))
    got = candidate_lengths(lengths, 128, limits)
    assert got == sorted(got) and all(n % 128 == 0 for n in got)
    whole = keep_whole_length(lengths, 128)
    assert whole >= np.quantile(lengths, KEEP_WHOLE) and whole in got
    assert limits.trained in got and any(n < whole for n in got) and max(got) >= 4 * whole - 4096


def test_the_seed_corpus_gets_rows_of_6144_not_8192():
    """20,000 documents of 6,000 tokens on one A100-80G: 6,144-token rows (97.7 % useful), not 8,192 (73 %),
    <= 12.2 h at the assumed MFU; rows of 4,096 plan faster but split every document, so they are not taken."""
    job = compose_job(["experiment=deepseek7b_6k_a100", "model.init=random", "data.source=demo"])
    choice = _choose(job, np.full(20_000, 6000))
    by_length = {o.seq_len: o for o in choice.options}
    assert choice.seq_len == 6144
    assert choice.chosen.useful_fraction == pytest.approx(6000 / 6144) and choice.chosen.hours <= 12.2
    assert by_length[8192].useful_fraction == pytest.approx(6000 / 8192)
    assert by_length[8192].hours > 1.25 * choice.chosen.hours
    assert by_length[4096].hours < choice.chosen.hours and not by_length[4096].keeps_whole
    assert by_length[4096].documents_split == 20_000
    nine = mfu_for_hours(choice.chosen, 9.0, 0.4)
    assert nine is not None and 0.45 < nine < 0.65  # more MFU than assumed, less than a full card
    assert mfu_for_hours(choice.chosen, choice.chosen.hours, 0.4) == pytest.approx(0.4)
    assert "9 h needs" in mfu_ladder(choice.chosen) and "<- chosen" in format_row_length(choice)


def test_a_corpus_of_varied_lengths_keeps_long_rows_where_packing_fills_them():
    """Mostly short documents and a tail to 3,000 tokens: rows that hold the tail whole, far longer than the typical
    document, packed full; and where the shortest such row packs poorly (documents of 3,000 and 5,000 tokens: one
    per 5,120-token row), the longer row that packs one of each (8,000 of 8,192 slots) is taken."""
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(np.log(100), np.log(3000), 2000)).astype(int)
    job = compose_job(["hardware=a100_80g", "attn=packed_doc", "data.seq_len=auto"])
    choice = _choose(job, lengths)
    assert choice.seq_len >= np.quantile(lengths, KEEP_WHOLE) > 5 * np.median(lengths)
    assert choice.chosen.useful_fraction > 0.99 and choice.chosen.keeps_whole
    least = min(o.hours for o in choice.options if o.eligible and o.keeps_whole)
    assert least <= choice.chosen.hours <= least * (1 + TIE_BAND)

    pairs = np.array([3000, 5000] * 500)
    choice = _choose(job, pairs)
    shortest_whole = next(o for o in choice.options if o.keeps_whole)
    assert shortest_whole.seq_len == 5120 and shortest_whole.useful_fraction < 0.8
    assert choice.seq_len >= 8192 and choice.chosen.useful_fraction > 0.97
    assert choice.chosen.hours < 0.85 * shortest_whole.hours


def _option(seq_len: int, hours: float) -> RowOption:
    return RowOption(seq_len, 1, 1.0, 0, seq_len, True, True, True, 1, hours * 3600, hours, "bf16", "none", fit=None)


@pytest.mark.parametrize(
    ("hours", "chosen"),
    [
        ({6144: 12.06, 8192: 12.9, 12288: 12.08}, 6144),  # a near-tie: the shorter, however the noise falls
        ({6144: 12.08, 8192: 12.9, 12288: 12.06}, 6144),
        ({6144: 12.5, 8192: 12.9, 12288: 12.0}, 12288),  # 4 % faster: past the band, the faster
        ({6144: 12.5, 8192: 12.0, 12288: 12.1}, 8192),
    ],
)
def test_lengths_within_the_tie_band_of_the_fastest_take_the_shortest(hours, chosen):
    assert fastest([_option(n, h) for n, h in hours.items()]).seq_len == chosen


def test_rows_stay_within_the_supported_context_unless_allowed():
    """Documents of 3,000 tokens and a model of 1,024 positions: every length holding them passes the context,
    so the longest within it is taken; model.allow_long_context=true lets the rows hold them."""
    common = ["hardware=a100_80g", "attn=packed_doc", "model.arch.max_position_embeddings=1024"]
    choice = _choose(compose_job(common), np.full(200, 3000))
    assert choice.seq_len == 1024 and not choice.chosen.keeps_whole
    assert all(not o.within_context for o in choice.options if o.seq_len > 1024)
    allowed = _choose(compose_job([*common, "model.allow_long_context=true"]), np.full(200, 3000))
    assert allowed.chosen.keeps_whole and allowed.seq_len >= 3072


def test_nothing_fits_names_the_way_out():
    job = compose_job(["hardware.device=cpu", "hardware.memory_gb=0.005", "data.seq_len=auto"])
    with pytest.raises(UserError, match="data.seq_len=auto: no row length .* Set data.seq_len"):
        _choose(job, np.full(100, 4000))


def test_without_documents_the_rows_are_the_supported_context():
    assert (
        context_rows(
            build_hf_config(
                compose_job(["experiment=deepseek7b_6k_a100", "model.init=random", "data.source=demo"]).model
            )
        )
        == 8192
    )
    with pytest.raises(UserError, match="no documents"):
        _choose(compose_job(["data.seq_len=auto"]), np.array([], dtype=int))


def test_an_unknown_device_speed_prints_no_hours():
    """On CPU with no measured speed the lengths are still ranked, but the table prints n/a, names the options
    once, and the ladder scales no hours; a named card's assumed MFU still prints both."""
    lengths = np.full(200, 1000)
    choice = _choose(compose_job(["hardware.device=cpu", "data.seq_len=auto"]), lengths)
    assert not any(o.timed for o in choice.options)
    table, ladder = format_row_length(choice), mfu_ladder(choice.chosen)
    assert "n/a     n/a" in table and table.count(NO_SPEED) == 1 and "<- chosen" in table
    assert "no MFU ladder" in ladder and " h " not in ladder
    assumed = _choose(compose_job(["hardware=a100_80g", "data.seq_len=auto"]), lengths)
    assert all(o.timed for o in assumed.options) and NO_SPEED not in format_row_length(assumed)
    assert "at the assumed 40% MFU" in mfu_ladder(assumed.chosen)
