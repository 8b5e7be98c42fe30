"""data.mix: each source's weight becomes its share of the training tokens (whole documents, repeats when a
source is small), reported per source; the held-out split happens before mixing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flexengine.cli.common import compose_job
from flexengine.core.config import MixSource
from flexengine.core.errors import UserError
from flexengine.data.mix import mix_documents
from flexengine.surgery.model import load_tokenizer
from tests.helpers import job_data


def test_weights_become_token_shares_by_whole_documents():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(50, 150, 400), rng.integers(500, 1500, 20)])  # big short-doc source
    source_of = np.array([0] * 400 + [1] * 20)
    mix = [MixSource(path="a", weight=1.0), MixSource(path="b", weight=1.0)]
    docs, report = mix_documents(lengths, source_of, np.arange(420), mix, seed=0)
    shares = [lengths[docs][source_of[docs] == i].sum() / lengths[docs].sum() for i in (0, 1)]
    assert shares == pytest.approx([0.5, 0.5], abs=0.02)
    assert [r["share"] for r in report] == pytest.approx(shares)
    assert report[1]["repeats"] > 1.5 and report[0]["repeats"] < 1.0  # small source repeated, big one subsampled
    counts = np.bincount(docs, minlength=420)
    assert counts[400:].min() >= 1  # every document of the repeated source at least once
    again, _ = mix_documents(lengths, source_of, np.arange(420), mix, seed=0)
    assert np.array_equal(docs, again)


def test_mix_excludes_held_out_documents_and_refuses_an_empty_source():
    lengths = np.full(10, 100)
    source_of = np.array([0] * 5 + [1] * 5)
    docs, _ = mix_documents(lengths, source_of, np.arange(8), [MixSource("a"), MixSource("b")], seed=1)
    assert not set(docs.tolist()) & {8, 9}
    with pytest.raises(UserError, match=r"data.mix\[1\]"):
        mix_documents(lengths, source_of, np.arange(5), [MixSource("a"), MixSource("b")], seed=1)


def test_mixture_through_the_data_path_reports_each_source(tmp_path):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": f"alpha {i} " * 30}) + "\n" for i in range(40)))
    b.write_text("".join(json.dumps({"text": f"beta {i} " * 30}) + "\n" for i in range(8)))
    mix = f"data.mix=[{{path: {a}, weight: 3}}, {{path: {b}, weight: 1, name: b}}]"
    job = compose_job(
        [
            "debug=fast",
            "data=mix",
            mix,
            "data.seq_len=256",
            "data.num_workers=0",
            f"data.cache_dir={tmp_path / 'cache'}",
        ]
    )
    _, _, report = job_data(job, load_tokenizer(job.model))
    mix = report["mix"]
    assert [m["source"] for m in mix] == [str(a), "b"]
    assert [m["share"] for m in mix] == pytest.approx([0.75, 0.25], abs=0.03)
    assert report["documents"] == sum(m["documents_used"] for m in mix)
    with pytest.raises(UserError, match="data.path and data.mix"):
        compose_job(["data=jsonl", f"data.path={a}", f"data.mix=[{{path: {b}}}]"])
