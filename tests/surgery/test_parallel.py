"""FSDP2/DDP over `torchrun --nproc_per_node 2` (gloo, CPU) against a single process on the same global batch; and
two torchrun agents ("nodes") meeting through a c10d rendezvous, as a multi-node launch does."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexengine.core.config import LossConfig, ParallelConfig
from flexengine.core.distributed import DistInfo
from flexengine.core.parallel_spec import ParallelSpec, Strategy
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.parallel import LossForward, apply_parallel
from tests.helpers import free_port, python_launcher, run_grads_script, trainer_for

# eps=1e-6: with AdamW's default 1e-8, float-rounding noise on near-zero gradients (rare-token embedding rows)
# is amplified to a full lr-sized step, which says nothing about the parallel engine
RUN = [
    "debug=fast",
    "train.max_steps=4",
    "optim.lr=1e-3",
    "optim.eps=1e-6",
    "data.shuffle=true",
    'train.sample_prompts=["def main(", "import "]',
    "train.sample_tokens=4",
]


def _train(out: Path, *overrides: str, ranks: int = 0) -> dict:
    """One training run (torchrun with `ranks` processes; 0 = a plain process); returns summary.json."""
    cmd = [
        *python_launcher(ranks),
        "-m",
        "flexengine.train",
        *RUN,
        f"train.output_dir={out}",
        f"hydra.run.dir={out}",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "summary.json").read_text())


def _samples(out: Path) -> list:
    """The greedy samples a run wrote (metrics.jsonl: rank 0 only)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["prompt"], r["text"]) for r in records if r["type"] == "sample"]


def _weights(step_dir: Path) -> dict:
    return load_file(str(step_dir / "model.safetensors"))


def _assert_same_weights(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The reference: one process, micro_batch 4 = 2 ranks x micro_batch 2 (the same rows per step)."""
    out = tmp_path_factory.mktemp("single") / "run"
    out.parent.mkdir(exist_ok=True)
    _train(out, "train.micro_batch=4")
    return out


@pytest.mark.slow
def test_fsdp_under_torchrun_with_one_process_shards_and_matches_plain(single, tmp_path):
    """The 1-GPU smoke path of bench/gpu_check.sh: one torchrun process is still FSDP-sharded."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "fsdp1"
    summary = _train(out, "train.micro_batch=4", "parallel=fsdp", ranks=1)
    reference = json.loads((single / "summary.json").read_text())
    assert summary["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert "fsdp: 4 decoder blocks + root sharded over 1 ranks" in (out / "train.log").read_text()
    AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_4")  # the gathered checkpoint loads


@pytest.mark.slow
def test_fsdp_two_ranks_match_one_process_then_resume_on_two_ranks(single, tmp_path):
    from transformers import AutoModelForCausalLM

    fsdp = tmp_path / "fsdp"
    summary = _train(fsdp, "train.micro_batch=2", "train.save_every=2", "parallel=fsdp", ranks=2)
    reference = json.loads((single / "summary.json").read_text())
    torch.testing.assert_close(summary["losses"], reference["losses"], rtol=1e-5, atol=0)
    # greedy samples: every rank runs the sharded forward in lockstep, and they equal one process's
    assert len(_samples(fsdp)) == 2 and _samples(fsdp) == _samples(single)
    final = fsdp / "checkpoints" / "step_4"
    _assert_same_weights(_weights(final), _weights(single / "checkpoints" / "step_4"))
    assert (final / "trainer_state.rank1.pt").is_file()  # rank 1's optimizer shard travels with the step

    # the gathered checkpoint is a plain HF model
    hf = AutoModelForCausalLM.from_pretrained(final)
    for name, value in hf.state_dict().items():
        torch.testing.assert_close(value, _weights(final)[name], atol=0, rtol=0)

    # resume from step 2 on two ranks: the same trajectory and the same final weights
    resumed = tmp_path / "resumed"
    again = _train(resumed, "train.micro_batch=2", f"train.resume={fsdp / 'checkpoints' / 'step_2'}", ranks=2)
    torch.testing.assert_close(again["losses"], summary["losses"], rtol=1e-6, atol=0)
    _assert_same_weights(_weights(resumed / "checkpoints" / "step_4"), _weights(final), atol=1e-6)


def _two_nodes(out: Path, *overrides: str) -> tuple[dict, list[str]]:
    """One training run as two torchrun agents of one process each (two "nodes" on this host) that meet through a
    c10d rendezvous, as the README's multi-node launch; returns summary.json and each agent's console output."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out.parent.mkdir(parents=True, exist_ok=True)
    procs, logs = [], [out.parent / f"node{node}.log" for node in (0, 1)]
    for node, log_file in enumerate(logs):
        agent = [
            *("--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"),
            f"--rdzv_id=flexengine-test-{os.getpid()}",
            f"--rdzv_conf=is_host={int(node == 0)}",  # one agent serves the rendezvous store, the other joins it
            "--local_addr=127.0.0.1",  # the workers' process group: this host's loopback, not its hostname
        ]
        train = ["-m", "flexengine.train", *RUN, f"train.output_dir={out}", f"hydra.run.dir={out}", *overrides]
        with open(log_file, "w") as sink:  # a file, not a pipe: a full pipe would stall one node and hang both
            cmd = [sys.executable, "-m", "torch.distributed.run", *agent, *train]
            procs.append(subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=out.parent))
    try:
        for proc in procs:
            proc.wait(timeout=600)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    texts = [log_file.read_text() for log_file in logs]
    for proc, text in zip(procs, texts):
        assert proc.returncode == 0, text[-4000:]
    return json.loads((out / "summary.json").read_text()), texts


@pytest.mark.slow
def test_two_nodes_through_a_c10d_rendezvous_train_what_one_process_trains(single, tmp_path):
    """`torchrun --nnodes=2 --rdzv_backend=c10d` on one host, one process per node, FSDP over both: the same losses
    and final weights as one process on the same rows per step; each node ran one worker (local rank 0) of a world
    of 2, and rank 1's optimizer shard joined rank 0's checkpoint in the shared output directory."""
    out = tmp_path / "nodes" / "run"
    summary, texts = _two_nodes(out, "train.micro_batch=2", "parallel=fsdp")
    ranks = sorted(m.group(1) for text in texts for m in re.finditer(r"distributed: rank (\d)/2 \(local 0\)", text))
    assert ranks == ["0", "1"]
    reference = json.loads((single / "summary.json").read_text())
    torch.testing.assert_close(summary["losses"], reference["losses"], rtol=1e-5, atol=0)
    final = out / "checkpoints" / "step_4"
    _assert_same_weights(_weights(final), _weights(single / "checkpoints" / "step_4"))
    assert (final / "trainer_state.rank1.pt").is_file()


@pytest.mark.slow
def test_ddp_two_ranks_match_one_process(single, tmp_path):
    ddp = tmp_path / "ddp"
    summary = _train(ddp, "train.micro_batch=2", "parallel=ddp", ranks=2)
    reference = json.loads((single / "summary.json").read_text())
    torch.testing.assert_close(summary["losses"], reference["losses"], rtol=1e-5, atol=0)
    assert len(_samples(ddp)) == 2 and _samples(ddp) == _samples(single)
    _assert_same_weights(_weights(ddp / "checkpoints" / "step_4"), _weights(single / "checkpoints" / "step_4"))


@pytest.mark.slow
def test_resume_with_another_world_size_is_refused(single, tmp_path):
    proc = subprocess.run(
        [
            *python_launcher(2),
            "-m",
            "flexengine.train",
            *RUN,
            "train.micro_batch=2",
            f"train.output_dir={tmp_path}",
            f"hydra.run.dir={tmp_path}",
            f"train.resume={single / 'checkpoints' / 'step_4'}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "written by 1 rank(s) but this job has 2" in proc.stderr


def test_single_process_is_untouched_and_loss_forward_matches(tiny_llama):
    module = apply_parallel(tiny_llama, ParallelSpec(), DistInfo(), torch.device("cpu"), LossConfig(chunk_size=5))
    assert isinstance(module, LossForward) and not any(hasattr(p, "to_local") for p in tiny_llama.parameters())
    ids = torch.randint(0, 256, (2, 12))
    batch = {"input_ids": ids, "position_ids": torch.arange(12).expand(2, 12), "labels": ids}
    torch.testing.assert_close(module(batch), forward_loss_sum(tiny_llama, batch, 0))


@pytest.fixture
def one_rank_group(tmp_path):
    """An in-process gloo group of one rank (fully_shard needs a process group), destroyed afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("mode", "device"), [("bf16_mixed", "cuda"), ("bf16_sr", "cuda"), ("bf16_mixed", "cpu")])
def test_fsdp_shards_with_the_policy_the_precision_spec_gives_and_the_trainer_asks_it(
    one_rank_group, tiny_llama, mode, device, tmp_path, caplog
):
    """apply_fsdp takes its MixedPrecisionPolicy from the recorded spec (not parallel.mixed_precision alone: bf16_sr
    gets none), records it, and the trainer's compute context follows the record (no autocast over FSDP's cast)."""
    from flexengine.core.config import JobConfig
    from flexengine.surgery.applied import applied
    from flexengine.surgery.parallel import apply_fsdp
    from flexengine.surgery.precision import SPECS, apply_precision

    spec = SPECS[mode]
    apply_precision(tiny_llama, spec)
    root = LossForward(tiny_llama)
    # a CUDA device object needs no GPU: it only picks the policy, the one-rank gloo mesh shards on the CPU
    with caplog.at_level(logging.INFO, logger="flexengine.surgery.parallel"):
        apply_fsdp(root, tiny_llama, ParallelSpec(Strategy.FSDP, mixed_precision=True), torch.device(device))
    policy = spec.fsdp_policy(torch.device(device), enabled=True)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fsdp: ")]
    assert line.endswith("ranks" if policy is None else "ranks (bfloat16 params, float32 reduce)")
    assert applied(tiny_llama).fsdp_policy == policy
    shard_policy = tiny_llama.model.layers[0]._get_fsdp_state()._mp_policy
    assert (shard_policy.param_dtype, shard_policy.reduce_dtype) == (
        (policy.param_dtype, policy.reduce_dtype) if policy is not None else (None, None)
    )
    trainer = trainer_for(JobConfig(), tiny_llama, None, tmp_path, precision=spec)
    with trainer.forward.compute_context():
        assert torch.is_autocast_enabled("cpu") == (spec.autocast and policy is None)


def test_fsdp_accumulates_unsynced_gradients_in_the_dtype_the_planner_counts(one_rank_group, tiny_llama):
    """Measured FSDP2 under bf16_mixed's cast (bf16 gather, fp32 reduce) with gradient sync off, as in an
    accumulation window: every group's unsharded gradient, the root's (embeddings, lm_head) too, is held in fp32 as
    unsharded_accumulated_grad, and the planner's window terms count exactly those bytes (it counted the root's at
    bf16: 1.56 GiB short at deepseek-7B)."""
    import dataclasses

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from flexengine.core.config import HardwareConfig, JobConfig
    from flexengine.planning.costs import fsdp_unsharded_grads
    from flexengine.planning.shapes import ModelShape
    from flexengine.surgery.precision import SPECS
    from tests.helpers import plan_inputs_of

    # built here, not from the spec (on CPU it gives none, and the planner's dtypes come from the spec: circular)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = LossForward(tiny_llama)
    layers = list(tiny_llama.model.layers)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(root, mp_policy=policy)
    root.set_requires_gradient_sync(False)  # parallel.gradient_sync's first micro-batches
    ids = torch.randint(0, tiny_llama.config.vocab_size, (2, 16))
    root({"input_ids": ids, "position_ids": torch.arange(16).expand(2, 16), "labels": ids}).backward()

    def held(module: torch.nn.Module) -> tuple[int, set]:
        params = module._get_fsdp_state()._fsdp_param_group.fsdp_params
        assert all(p._unsharded_param.grad is None for p in params)  # moved into the sum, nothing else held
        sums = [p.unsharded_accumulated_grad for p in params]
        return sum(t.numel() * t.element_size() for t in sums), {t.dtype for t in sums}

    root_bytes, root_dtypes = held(root)
    blocks = [held(layer) for layer in layers]
    assert root_dtypes == {torch.float32} and all(dtypes == {torch.float32} for _, dtypes in blocks)

    job = JobConfig()
    job.train.grad_accum, job.parallel.reduce_every, job.parallel.mixed_precision = 2, "window", True
    hardware = dataclasses.replace(HardwareConfig(), device="cuda", world_size=2)
    x = plan_inputs_of(job, hardware, SPECS["bf16_mixed"], on_cuda=True, hf_config=tiny_llama.config)
    assert (x.fsdp_param_bytes, x.fsdp_reduce_bytes) == (policy.param_dtype.itemsize, policy.reduce_dtype.itemsize)
    parts = fsdp_unsharded_grads(ModelShape.from_hf_config(tiny_llama.config), x)
    assert parts["root_sum"] == root_bytes
    assert parts["block_sums"] == sum(b for b, _ in blocks)


def test_the_fsdp_log_line_reads_both_dtypes_from_the_policy():
    """The log names the policy's own gather and reduce dtypes (it said fp32 reduce for any policy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from flexengine.surgery.parallel import _policy_note

    assert _policy_note(None) == ""
    assert _policy_note(MixedPrecisionPolicy(torch.bfloat16, torch.float32)) == " (bfloat16 params, float32 reduce)"
    assert _policy_note(MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16)) == " (bfloat16 params, bfloat16 reduce)"
    assert _policy_note(MixedPrecisionPolicy(torch.bfloat16)) == " (bfloat16 params, bfloat16 reduce)"


def test_parallel_config_rejects_unknown_strategy():
    from flexengine.core.errors import UserError

    with pytest.raises(UserError, match="parallel.strategy"):
        ParallelConfig(strategy="zero3")


@pytest.fixture(scope="module")
def single_grads(tmp_path_factory) -> dict:
    """One process, micro_batch 4 = 2 ranks x micro_batch 2: the same rows in every micro-batch."""
    return run_grads_script(tmp_path_factory.mktemp("single_grads") / "run", "train.micro_batch=4")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_gradients_before_the_step_equal_one_process_and_sync_once_per_window(single_grads, strategy, tmp_path):
    """Per-tensor gradients, not losses after Adam steps: Adam normalises scale, so a gradient off by
    1/world_size changed weights by only 1.6e-7 and passed the loss comparison. Measured here (gloo, CPU):
    relative norm difference <= 2.2e-7 and max |diff| <= 3e-8 for both strategies; tolerances leave ~50x."""
    run = run_grads_script(tmp_path / strategy, "train.micro_batch=2", f"parallel={strategy}", ranks=2)
    for key in ("tokens", "useful_tokens"):  # the job's rows, as one process reading them all counts them
        assert [m[key] for m in run["metrics"]] == [m[key] for m in single_grads["metrics"]], key
    ref, got = single_grads["grads"], run["grads"]
    assert got.keys() == ref.keys() and len(ref) > 0
    for name in ref:
        scale = ref[name].norm()
        assert (got[name].norm() / scale - 1).abs() < 1e-5, f"{name}: norm ratio {got[name].norm() / scale}"
        assert ((got[name] - ref[name]).norm() / scale) < 1e-5, name
        assert (got[name] - ref[name]).abs().max() < 1e-6, name

    def reductions(names: list) -> int:
        return sum("reduce" in n for n in names)  # allreduce / reduce_scatter; all-gathers scale with work

    # two micro-batches reduce gradients exactly as often as one (the trainer's own 2 all-reduces included)
    assert reductions(run["collectives"][2]) == reductions(run["collectives"][1]), run["collectives"]


@pytest.mark.slow
def test_the_fused_loss_under_fsdp_gives_one_process_gradients(single_grads, tmp_path):
    """loss.fused reads lm_head's weight inside the FSDP2 root's forward, where the root has gathered it: two ranks'
    fused chunks give the gradients of one process's loss (lm_head's reduce-scattered like every root weight)."""
    run = run_grads_script(
        tmp_path / "fused", "train.micro_batch=2", "loss.chunk_size=64", "loss.fused=true", "parallel=fsdp", ranks=2
    )
    ref, got = single_grads["grads"], run["grads"]
    assert got.keys() == ref.keys() and len(ref) > 0
    for name in ref:
        scale = ref[name].norm()
        assert ((got[name] - ref[name]).norm() / scale) < 1e-5, name


@pytest.mark.slow
def test_reduce_every_micro_batch_gives_the_window_gradients(single_grads, tmp_path):
    """parallel.reduce_every=micro_batch: FSDP2 reduce-scatters in every backward and accumulates the sharded
    gradients; the window's gradients are the same (one process on the same rows is the reference, which the
    window reduction matches above), and the step reduces more often than with one micro-batch."""
    run = run_grads_script(tmp_path / "per_mb", "train.micro_batch=2", "parallel.reduce_every=micro_batch", ranks=2)
    ref, got = single_grads["grads"], run["grads"]
    assert got.keys() == ref.keys() and len(ref) > 0
    for name in ref:
        scale = ref[name].norm()
        assert ((got[name] - ref[name]).norm() / scale) < 1e-5, name
        assert (got[name] - ref[name]).abs().max() < 1e-6, name
    reductions = {accum: sum("reduce" in n for n in names) for accum, names in run["collectives"].items()}
    assert reductions[2] > reductions[1], run["collectives"]  # a reduce-scatter per micro-batch, not per window


@pytest.mark.slow
def test_pretrained_weights_are_read_by_rank_0_only_and_broadcast(tmp_path):
    """Ranks > 0 build placeholders (random init) and receive rank 0's weights: their first gradients equal
    a single process's on the pretrained weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flexengine.data.demo import load_demo_tokenizer
    from tests.helpers import TINY_LLAMA

    model_dir = tmp_path / "pretrained"
    torch.manual_seed(7)
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "vocab_size": 2048})).save_pretrained(model_dir)
    load_demo_tokenizer().save_pretrained(model_dir)
    common = ["model.init=pretrained", f"model.path={model_dir}"]
    ref = run_grads_script(tmp_path / "one", *common, "train.micro_batch=4")
    run = run_grads_script(tmp_path / "two", *common, "train.micro_batch=2", "parallel=fsdp", ranks=2)
    for name in ref["grads"]:
        torch.testing.assert_close(run["grads"][name], ref["grads"][name], atol=1e-6, rtol=1e-4, msg=name)
    assert "its weights come by broadcast from rank 0" in run["log"] and "weights broadcast from rank 0" in run["log"]
    assert "RANDOM" not in run["log"]  # rank 1's placeholders are not what trains: no random-weights warning
