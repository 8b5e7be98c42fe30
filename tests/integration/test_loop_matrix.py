"""Every option through the real loop: an all-pairs covering design over the config options that change what the
loop does, each run through the train entry point for 2 steps on CPU.

The options are read from conf/ (every yaml of a group) and from the schema's choice lists (flexengine.core.config), so
a new precision mode, optimizer, memory policy, attention backend or data format is covered without editing this
file. Crossing everything would be thousands of runs; an all-pairs design (every value of every dimension meets
every value of every other dimension in at least one run) finds the faults of one option or of two options
together, which is where the faults of modes "tested in isolation" live, in a few dozen runs.

Each run calls `flexengine.cli.train.main()` the way `python -m flexengine.train` does (in this process, to keep the
start-up cost to one import) and must either work (finite losses, summary, metrics and a checkpoint written) or
refuse with a UserError (exit 2, one paragraph, no traceback). A run that refuses covers its pairs only as a
refusal, so a second round re-covers, in runs that can work, the pairs whose only runs refused (except with the
values that refused in every run they were in: those are reported as refused on this machine). Only the values in
MAY_REFUSE_ALONE (attn.backend=flex: no CPU backward) may refuse on their own; any other is a failure.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

import pytest
import yaml

from flexengine.core.config import ATTN_BACKENDS, DATA_FORMATS, OPTIM_NAMES, conf_dir
from flexengine.data.demo import DEMO_VOCAB_SIZE
from tests.helpers import run_entry_point

CONF = conf_dir()
SHRUNK_HIDDEN, SHRUNK_INTERMEDIATE, SHRUNK_HEADS, SEQ_LEN, WINDOW = 32, 64, 2, 256, 64
LOSS_CHUNK = 64  # a row's 255 predicting positions in four chunks: the chunked (or fused) loss, not one piece


def _group_options(group: str) -> List[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# dimension -> its values, each value one Hydra override (`<dimension>=<value>`)
DIMENSIONS: Dict[str, List[str]] = {
    "precision": _group_options("precision"),
    "optim.name": list(OPTIM_NAMES),
    "memory": _group_options("memory"),
    "attn": _group_options("attn"),
    "attn.backend": list(ATTN_BACKENDS),
    "data.format": list(DATA_FORMATS),
    "model": _group_options("model"),
    "loss.fused": ["false", "true"],  # with every row's loss in chunks (LOSS_CHUNK): fused or re-run in backward
}

Pair = Tuple[Tuple[str, str], Tuple[str, str]]


def _pairs_of(row: Dict[str, str]) -> Set[Pair]:
    items = sorted(row.items())
    return {(a, b) for a, b in combinations(items, 2)}


def all_pairs(
    dims: Dict[str, List[str]], wanted: Optional[Set[Pair]] = None, avoid: Iterable[Pair] = ()
) -> List[Dict[str, str]]:
    """Rows (dimension -> value) covering every pair in `wanted` (default: every pair of values of two different
    dimensions), built greedily: each row starts from an uncovered pair and takes, dimension by dimension, the
    value that covers the most still-uncovered pairs with the values already chosen, never one that forms a pair
    in `avoid` with them if another value does not (deterministic: ties go to the first value)."""
    names = sorted(dims)
    if wanted is None:
        wanted = {((a, va), (b, vb)) for a, b in combinations(names, 2) for va in dims[a] for vb in dims[b]}
    avoid, uncovered = set(avoid), set(wanted)
    rows = []
    while uncovered:
        (a, va), (b, vb) = min(uncovered)
        row = {a: va, b: vb}
        for name in names:
            if name not in row:
                row[name] = max(dims[name], key=lambda v, n=name, r=dict(row): _score((n, v), r, uncovered, avoid))
        rows.append(row)
        uncovered -= _pairs_of(row)
    return rows


def _score(item: Tuple[str, str], row: Dict[str, str], uncovered: Set[Pair], avoid: Set[Pair]) -> Tuple[int, int]:
    """(minus the avoided pairs, the uncovered pairs) that adding item to row makes."""
    pairs = [_pair(item, other) for other in row.items()]
    return (-sum(p in avoid for p in pairs), sum(p in uncovered for p in pairs))


def _pair(x: Tuple[str, str], y: Tuple[str, str]) -> Pair:
    return (x, y) if x < y else (y, x)


def test_all_pairs_covers_every_pair_of_the_real_dimensions():
    rows = all_pairs(DIMENSIONS)
    covered = set().union(*map(_pairs_of, rows))
    names = sorted(DIMENSIONS)
    for a, b in combinations(names, 2):
        for va in DIMENSIONS[a]:
            for vb in DIMENSIONS[b]:
                assert ((a, va), (b, vb)) in covered, (a, va, b, vb)
    assert all(set(row) == set(names) for row in rows)
    sizes = sorted(len(v) for v in DIMENSIONS.values())
    # far fewer runs than the full cross, never fewer than the two largest dimensions crossed
    assert sizes[-1] * sizes[-2] <= len(rows) < math.prod(sizes) // 10


def test_dimensions_come_from_conf_and_the_schema():
    # the shipped options a new user is shown: each of them must be in the matrix
    assert {"auto", "fp32", "bf16_mixed", "bf16_sr", "bf16_cpu_master", "bf16_pure"} <= set(DIMENSIONS["precision"])
    assert {"none", "full", "selective", "offload", "auto"} <= set(DIMENSIONS["memory"])
    assert {"deepseek7b", "tiny"} <= set(DIMENSIONS["model"]) and "varlen" in DIMENSIONS["attn.backend"]
    assert DIMENSIONS["loss.fused"] == ["false", "true"]


# --- the runs -----------------------------------------------------------------------------------------------


@dataclass
class Result:
    row: Dict[str, str]
    status: str  # ok | refused | crashed
    detail: str  # final loss, the refusal's paragraph, or the crash's last lines
    seconds: float


def _arch_overrides(model: str) -> List[str]:
    """Full depth and layer structure of the shipped model config, width and vocabulary shrunk."""
    raw = yaml.safe_load((CONF / "model" / f"{model}.yaml").read_text())
    arch = raw.get("model", raw)["arch"]
    heads, kv = arch["num_attention_heads"], arch.get("num_key_value_heads", arch["num_attention_heads"])
    out = [
        f"model.arch.hidden_size={SHRUNK_HIDDEN}",
        # one MLP width for every model: torchao's optimizers compile their step per parameter shape, so shared
        # shapes compile once per process instead of once per model (a run costs seconds, not a minute)
        f"model.arch.intermediate_size={SHRUNK_INTERMEDIATE}",
        f"model.arch.num_attention_heads={SHRUNK_HEADS}",
        f"model.arch.num_key_value_heads={max(1, SHRUNK_HEADS * kv // heads)}",
        f"model.arch.vocab_size={DEMO_VOCAB_SIZE}",  # the demo tokenizer's
    ]
    out += [f"model.arch.{k}=null" for k in ("bos_token_id", "eos_token_id") if k in arch]  # ids past the vocab
    if arch.get("sliding_window"):
        out.append(f"model.arch.sliding_window={WINDOW}")
    return out


def _overrides(row: Dict[str, str], data: Path, tokenizer: Path, run_dir: Path) -> List[str]:
    out = [f"{k}={v}" for k, v in sorted(row.items())]
    out += _arch_overrides(row["model"])
    if "sliding" in row["attn"]:
        out.append(f"attn.window={WINDOW}")  # the tiny models have no window of their own
    return [
        *out,
        "hardware=cpu",
        "model.init=random",
        f"model.tokenizer={tokenizer}",
        "data=jsonl",
        f"data.path={data}",
        f"data.format={row['data.format']}",  # after data=jsonl, which would reset it
        "data.num_workers=0",
        f"data.seq_len={SEQ_LEN}",
        f"loss.chunk_size={LOSS_CHUNK}",
        "train.max_steps=2",
        "train.micro_batch=1",
        "train.grad_accum=2",  # accumulation exercised: two micro-batches per step
        "train.progress=false",
        "train.compile_backend=aot_eager",  # same graphs as inductor, no C++ codegen on the CI machine
        "optim.warmup_steps=1",
        f"hydra.run.dir={run_dir}",
    ]


def _judge(row: Dict[str, str], run_dir: Path, code: int, stderr: str, seconds: float) -> Result:
    if code == 2 and "Traceback" not in stderr and "flexengine: error:" in stderr:
        paragraph = stderr.split("flexengine: error:", 1)[1].strip()
        return Result(row, "refused", paragraph, seconds)
    if code != 0:
        return Result(row, "crashed", f"exit {code}: " + stderr[-3000:], seconds)
    summary_path = run_dir / "summary.json"
    problems = []
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    losses = summary.get("losses", [])
    if len(losses) != 2 or not all(math.isfinite(x) for x in losses):
        problems.append(f"losses {losses}")
    if not list((run_dir / "checkpoints").glob("step_2/*.safetensors")):
        problems.append("no checkpoint step_2")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() or len(metrics.read_text().splitlines()) < 2:
        problems.append("no metrics.jsonl lines")
    if problems:
        return Result(row, "crashed", "exit 0 but " + "; ".join(problems), seconds)
    return Result(row, "ok", f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", seconds)


def _records(tokenizer, n: int = 48) -> Iterable[dict]:
    """Records every data.format can read: text, messages, input_ids, and the format of a mixed corpus."""
    import os

    sources = sorted(Path(os.__file__).parent.glob("*.py"))[:n]
    for i, path in enumerate(sources):
        text = path.read_text(errors="replace")[: 300 + 97 * (i % 9)]
        messages = [
            {"role": "user", "content": f"what does {path.stem} do?"},
            {"role": "assistant", "content": text[:200]},
        ]
        ids = tokenizer(text)["input_ids"]
        yield {"text": text, "messages": messages, "input_ids": ids, "format": ("text", "chat")[i % 2]}


# a minimal chat template with HF's {% generation %} markers (assistant replies are the trained tokens)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Tuple[Path, Path]:
    """(jsonl path, tokenizer directory with a chat template), shared by every run of the matrix."""
    from flexengine.data.demo import load_demo_tokenizer

    root = tmp_path_factory.mktemp("matrix")
    tokenizer = load_demo_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(root / "tokenizer")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records(tokenizer)))
    return data, root / "tokenizer"


def _run_rows(rows: List[Dict[str, str]], corpus: Tuple[Path, Path], root: Path, first: int) -> List[Result]:
    results = []
    for i, row in enumerate(rows, start=first):
        run_dir = root / f"run_{i:03d}"
        start = time.perf_counter()
        code, stderr = run_entry_point(_overrides(row, *corpus, run_dir))
        results.append(_judge(row, run_dir, code, stderr, time.perf_counter() - start))
        r = results[-1]
        print(f"[{i:3d}] {r.status:8s} {r.seconds:5.1f}s {' '.join(f'{k}={v}' for k, v in sorted(row.items()))}")
    return results


def culprits(result: Result) -> frozenset:
    """The row's values a refusal names (`key=value`: every UserError names what to change), or the whole row when
    it names none of them."""
    named = {
        (k, v)
        for k, v in result.row.items()
        if re.search(rf"(?<![\w.]){re.escape(k)}={re.escape(v)}(?![\w])", result.detail)
    }
    return frozenset(named or result.row.items())


def still_wanted(results: List[Result], every: Set[Pair]) -> Tuple[Set[Pair], Set[Tuple[str, str]], Set[Pair]]:
    """(pairs neither trained together in a working run nor explained by a refusal, values refused on their own,
    pairs refused together). A refusal naming one value explains every pair of that value; naming two or more,
    the pairs among them. The rest of a refused row's pairs were not tried: they are wanted again."""
    covered = set().union(*(_pairs_of(r.row) for r in results if r.status == "ok"))
    alone: Set[Tuple[str, str]] = set()
    together: Set[Pair] = set()
    for r in results:
        if r.status == "refused":
            named = sorted(culprits(r))
            if len(named) == 1:
                alone.add(named[0])
            together |= {_pair(x, y) for x, y in combinations(named, 2)}
    explained = {p for p in every if set(p) & alone} | together
    return every - covered - explained, alone, together


# the values that may refuse on their own on this CPU machine, whatever they are paired with: FlexAttention has no
# CPU backward. Any other value refused alone is a whole option lost (e.g. a precision mode that stopped building
# here with a tidy UserError): the matrix would count its pairs as explained and pass, so it fails instead.
MAY_REFUSE_ALONE: Set[Tuple[str, str]] = {("attn.backend", "flex")}


def matrix_failures(
    results: List[Result], every: Set[Pair], may_refuse_alone: Set[Tuple[str, str]] = MAY_REFUSE_ALONE
) -> List[str]:
    """What makes the matrix fail: crashes, a refusal longer than one paragraph, a value refused alone that is not
    in may_refuse_alone, pairs neither trained nor refused, and too few working runs."""
    failures = [f"crashed {r.row}: {r.detail}" for r in results if r.status == "crashed"]
    failures += [
        f"not one paragraph: {r.detail}" for r in results if r.status == "refused" and "\n\n" in r.detail.strip()
    ]
    wanted, alone, _ = still_wanted(results, every)
    for key, value in sorted(alone - may_refuse_alone):
        why = next(r.detail for r in results if r.status == "refused" and culprits(r) == {(key, value)})
        failures.append(f"{key}={value} refused on its own (only {sorted(may_refuse_alone)} may): {why}")
    if wanted:
        failures.append(f"pairs neither trained nor refused: {sorted(wanted)}")
    if sum(r.status == "ok" for r in results) < len(results) // 3:
        failures.append("most options must train somewhere")
    return failures


def format_matrix(results: List[Result]) -> str:
    """The results as Markdown: one line per run, then what refused and why."""
    names = sorted(results[0].row)
    lines = ["| # | " + " | ".join(names) + " | result | s |", "|" + "---|" * (len(names) + 3)]
    for i, r in enumerate(results):
        status = r.detail if r.status == "ok" else r.status
        lines.append(f"| {i} | " + " | ".join(r.row[n] for n in names) + f" | {status} | {r.seconds:.1f} |")
    reasons: Dict[frozenset, Tuple[List[int], str]] = {}
    for i, r in enumerate(results):
        if r.status == "refused":
            reasons.setdefault(culprits(r), ([], r.detail))[0].append(i)
    lines += ["", "Refused (the values the message names -> runs: the message):"]
    for named, (ids, message) in sorted(reasons.items(), key=lambda kv: sorted(kv[0])):
        lines.append(f"- {' + '.join(f'{k}={v}' for k, v in sorted(named))} -> runs {ids}: {message}")
    return "\n".join(lines)


@pytest.fixture
def fast_cpu():
    """One intra-op thread: at width 32 a thread hand-off costs more than the matmul it splits (measured 10x slower
    per step with 2 threads on a loaded 2-core machine). And torch.compile runs eagerly ("force_eager" stance):
    torchao's optimizers compile their per-parameter step with inductor, whose C++ builds took 30-77 s per run
    here (per dtype and shape); eager they run the same code (the compiled bf16_sr step is compared with the eager
    one in tests/loop/test_optim_numerics.py). The matrix checks how the options compose in the
    loop, not inductor's codegen (nothing else here compiles: train.compile is off, and flex, which forces it,
    cannot train on CPU)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.compiler.set_stance("force_eager"):
        yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_every_option_runs_through_the_loop_or_refuses_clearly(corpus, tmp_path, fast_cpu):
    every = _pairs_of_design(DIMENSIONS)
    results = _run_rows(all_pairs(DIMENSIONS), corpus, tmp_path, 0)
    for _ in range(3):  # pairs whose runs refused for another value: again, away from what refused
        wanted, alone, together = still_wanted(results, every)
        if not wanted:
            break
        dims = {k: [v for v in vals if (k, v) not in alone] for k, vals in DIMENSIONS.items()}
        results += _run_rows(all_pairs(dims, wanted, avoid=together), corpus, tmp_path, len(results))
    report = format_matrix(results)
    print(report)
    (tmp_path / "matrix.md").write_text(report)
    failures = matrix_failures(results, every)
    assert not failures, "\n\n".join(failures)


def test_a_refusal_explains_the_pairs_it_names_and_leaves_the_others_wanted():
    dims = {"a": ["1", "2"], "b": ["x", "y"], "c": ["p", "q"]}
    every = _pairs_of_design(dims)
    row = {"a": "1", "b": "x", "c": "p"}
    pair = Result(row, "refused", "a=1 needs b=y, not b=x (use one of ...).", 0.0)
    wanted, alone, together = still_wanted([pair], every)
    assert together == {(("a", "1"), ("b", "x"))} and not alone
    assert (("a", "1"), ("c", "p")) in wanted and (("a", "1"), ("b", "x")) not in wanted
    single = Result(row, "refused", "c=p cannot train here; use c=q.", 0.0)  # "c=q" is not the row's value
    wanted, alone, _ = still_wanted([single], every)
    assert alone == {("c", "p")} and not any(("c", "p") in p for p in wanted)
    ok = Result({"a": "2", "b": "y", "c": "q"}, "ok", "", 0.0)
    wanted, _, _ = still_wanted([ok, pair], every)
    assert (("a", "2"), ("b", "y")) not in wanted
    # the next round's rows cover what is wanted without the refused pair
    rows = all_pairs(dims, wanted, avoid=together)
    assert not any(r["a"] == "1" and r["b"] == "x" for r in rows)
    assert wanted <= set().union(*map(_pairs_of, rows))


def test_only_the_allowed_values_may_refuse_on_their_own():
    """A whole option refusing on CPU with a tidy UserError (naming only itself) explained all its
    pairs, so the matrix passed with that option never trained; only MAY_REFUSE_ALONE may do that."""
    dims = {"attn.backend": ["flex", "varlen"], "precision": ["fp32", "bf16_cpu_master"], "c": ["p", "q"]}
    every = _pairs_of_design(dims)
    rows = all_pairs({**dims, "attn.backend": ["varlen"], "precision": ["fp32"]})
    results = [Result(row, "ok", "", 0.0) for row in rows]
    flex = Result({"attn.backend": "flex", "precision": "fp32", "c": "p"}, "refused", "attn.backend=flex: no.", 0.0)
    assert matrix_failures([*results, flex], every, {("attn.backend", "flex")}) == [
        f"pairs neither trained nor refused: {sorted(still_wanted([*results, flex], every)[0])}"
    ]  # flex is excused; bf16_cpu_master never ran, so its pairs are still wanted
    mode = Result(
        {"attn.backend": "varlen", "precision": "bf16_cpu_master", "c": "q"},
        "refused",
        "precision=bf16_cpu_master cannot build its optimizer here.",
        0.0,
    )
    failures = matrix_failures([*results, flex, mode], every, {("attn.backend", "flex")})
    # every pair is explained (the old checks passed); the lone refusal alone fails it, quoting the message
    assert len(failures) == 1 and failures[0].startswith("precision=bf16_cpu_master refused on its own")
    assert failures[0].endswith(mode.detail)
    assert not matrix_failures(
        [*results, flex, mode], every, {("attn.backend", "flex"), ("precision", "bf16_cpu_master")}
    )


def _pairs_of_design(dims: Dict[str, List[str]]) -> Set[Pair]:
    names = sorted(dims)
    return {((a, va), (b, vb)) for a, b in combinations(names, 2) for va in dims[a] for vb in dims[b]}
