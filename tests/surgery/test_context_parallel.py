"""Context parallelism (`parallel.cp`): torch's context_parallel over 2 gloo ranks against one process (logits,
loss, eval loss, gradients with flex's kernel swapped for SDPA on the same mask), and the config checks. Flex's
own backward under CP is checked on GPUs (bench/gpu_check.py cp_grads)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from flexengine.cli.doctor import compose_job
from flexengine.core.config import ParallelConfig
from flexengine.core.distributed import init_distributed
from flexengine.core.errors import UserError
from flexengine.data.targets import shift_targets
from flexengine.surgery.loss import causal_lm_loss_sum, shifted_loss_sum
from tests.helpers import python_launcher

ROOT = Path(__file__).resolve().parents[2]


def _forward_run(tmp_path_factory, ranks: int) -> dict:
    """tests/support/context_parallel_forward.py under torchrun --nproc_per_node `ranks` (gloo): rank 0's saved
    results."""
    out = tmp_path_factory.mktemp(f"cp{ranks}") / "cp.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            *python_launcher(ranks),
            str(ROOT / "tests" / "support" / "context_parallel_forward.py"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=out.parent,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory) -> dict:
    """2 ranks: dp 1 x cp 2."""
    return _forward_run(tmp_path_factory, 2)


def _expected_eval(run: dict) -> tuple[int, float]:
    """Valid targets of both eval batches, and their summed single-process token loss over that count."""
    n_valid = sum(int((b["labels"][:, 1:] != -100).sum()) for b in (run["batch"], run["other"]))
    return n_valid, float(run["ref"]["loss_sum"] + run["ref"]["other_loss_sum"]) / n_valid


def _fsdp_shards(ranks: int) -> dict:
    from tests.helpers import make_qwen_mixed

    return {n: -(-p.shape[0] // ranks) for n, p in make_qwen_mixed().named_parameters()}


def _gathered(ranks: list, key: str, full_shape: tuple) -> torch.Tensor:
    """Put each rank's [B, S/2, ...] share back at its tokens' places in the row."""
    full = torch.full(full_shape, -1)
    for r in ranks:
        index = r["token_index"].view(*r["token_index"].shape, *([1] * (len(full_shape) - 2)))
        full.scatter_(1, index.expand_as(r[key]), r[key])
    return full


@pytest.mark.slow
def test_two_ranks_give_one_process_logits_and_loss(cp_run):
    """Same packed batch (2 rows, 9 documents of 3..700 tokens, padding), 4 GQA blocks at 1,024 tokens, 2 of them
    full attention and 2 with a 200-token sliding window (two CP masks per batch, both in the PTRR order balanced
    on the full mask): 2 gloo ranks with torch's CP + FSDP2 on the (dp, cp) mesh give the single-process logits
    and token-loss sum. Measured: logits max |diff| 3.0e-7 (the dense reference differs from single-process flex
    by 2.7e-7), loss sum 11304.782 vs 11304.783."""
    ref, ranks, batch = cp_run["ref"], cp_run["ranks"], cp_run["batch"]
    B, S = ref["logits"].shape[:2]
    # each rank holds half of every row, and together they hold every token once
    assert [r["seq_len_local"] for r in ranks] == [S // 2, S // 2]
    assert [r["mask_kinds"] for r in ranks] == [2, 2]  # the full-attention mask and the window's
    for b in range(B):
        places = torch.cat([r["token_index"][b] for r in ranks])
        assert torch.equal(places.sort().values, torch.arange(S))
    torch.testing.assert_close(ref["dense_logits"], ref["logits"], atol=2e-6, rtol=0)  # the reference is sound
    for r in ranks:  # ContextParallel.logits: each rank computes its share; every rank gets the whole rows
        torch.testing.assert_close(r["logits"], ref["logits"], atol=2e-6, rtol=0)
    # every target stayed with the token that predicts it (shifted before the split)
    assert torch.equal(_gathered(ranks, "targets", (B, S)), shift_targets(batch["labels"]))
    total = sum(r["loss_sum"] for r in ranks)
    torch.testing.assert_close(total, ref["loss_sum"], rtol=1e-6, atol=0)
    # the eval path over two layouts: all ranks' token losses divided by the global count of valid targets, once
    n_valid, expected = _expected_eval(cp_run)
    assert cp_run["eval"]["tokens"] == n_valid
    assert cp_run["eval"]["loss"] == pytest.approx(expected, rel=1e-6)
    # the blocks compiled fullgraph with the CP hook inside; a new layout of the same shape compiled nothing new
    assert cp_run["graphs"] >= 1 and cp_run["new_graphs"] == 0
    # FSDP2 sharded every weight over both ranks of the flattened dp x cp mesh
    assert cp_run["fsdp_shards"] == _fsdp_shards(2)


@pytest.mark.slow
def test_samples_of_prompts_of_different_lengths_build_one_mask_variant_per_kind(cp_run):
    """Greedy samples under CP: prompts of 1 and 300 characters share one padded width (512), so torch's compiled
    CP mask builder gains one variant per mask kind for the whole call (before: one per prompt width, and dynamo
    stops the run at its 9th); the samples equal single-process greedy decoding."""
    assert cp_run["sample_mask_variants"] == cp_run["ranks"][0]["mask_kinds"] == 2
    assert cp_run["samples"] == cp_run["ref_samples"]


@pytest.fixture(scope="module")
def cp_dp_run(tmp_path_factory) -> dict:
    """4 ranks: dp 2 x cp 2."""
    return _forward_run(tmp_path_factory, 4)


@pytest.mark.slow
def test_two_groups_of_two_ranks_give_one_process_logits_loss_and_eval_loss(cp_dp_run):
    """dp 2 x cp 2 (4 gloo ranks): each data-parallel group takes its own row (group = rank // cp) and splits it
    over its cp ranks, which must be the ranks that all-gather K/V together (cp groups of consecutive ranks on
    the ("dp", "cp") mesh: with the mesh dimensions swapped, ranks holding different rows would gather each
    other's keys and no row's logits would match). Logits, loss sum and the eval loss (two batches, normalised
    once by the valid targets of all groups) equal one process on both rows."""
    ref, ranks = cp_dp_run["ref"], cp_dp_run["ranks"]
    S = ref["logits"].shape[1]
    assert [r["data_rank"] for r in ranks] == [0, 0, 1, 1]
    for r in ranks:  # the whole row of this rank's group, put together by its cp group
        assert r["seq_len_local"] == S // 2
        torch.testing.assert_close(r["logits"][0], ref["logits"][r["data_rank"]], atol=2e-6, rtol=0)
    torch.testing.assert_close(sum(r["loss_sum"] for r in ranks), ref["loss_sum"], rtol=1e-6, atol=0)
    n_valid, expected = _expected_eval(cp_dp_run)
    assert cp_dp_run["eval"]["tokens"] == n_valid  # each target counted once over 4 ranks
    assert cp_dp_run["eval"]["loss"] == pytest.approx(expected, rel=1e-6)
    assert cp_dp_run["fsdp_shards"] == _fsdp_shards(4)  # FSDP2 over all 4 ranks (dp x cp flattened)


@pytest.mark.slow
@pytest.mark.parametrize("loss", [[], ["loss.chunk_size=128", "loss.fused=true"]], ids=["chunked", "fused"])
def test_trainer_step_on_two_ranks_gives_one_process_gradients(tmp_path, loss):
    """The trainer's first step (grad_accum 2: the loss divided by the valid targets of the whole window on all
    ranks) with parallel.cp=2 gives the single process's gradients (dense reference backend) for every weight.
    Flex's kernel is replaced by SDPA on the CP BlockMask's own mask (flex has no CPU backward); torch's K/V
    all-gather and its reduce-scatter backward, PTRR order, shifted targets and FSDP2 over dp x cp are the real
    ones. Measured: relative difference <= 3.0e-7, max |diff| 2.2e-8 over 39 tensors; a gradient off by the cp
    degree would give a relative difference of 1.0. The fused loss (each rank's shifted targets in chunks) gives
    the same."""
    from flexengine.data.demo import load_demo_tokenizer
    from tests.helpers import make_llama, run_grads_script

    model_dir = tmp_path / "model"  # the same weights for both runs (read from disk)
    make_llama(vocab_size=2048, num_hidden_layers=4).save_pretrained(model_dir)
    load_demo_tokenizer().save_pretrained(model_dir)
    common = [
        "attn=packed_doc",
        "data.seq_len=512",
        "train.micro_batch=2",
        "model.init=pretrained",
        f"model.path={model_dir}",
    ]
    one = run_grads_script(tmp_path / "one", *common, "attn.backend=dense")
    cp = run_grads_script(
        tmp_path / "cp",
        *common,
        "attn.backend=flex",
        "attn.compile=false",
        "parallel.cp=2",
        *loss,
        ranks=2,
        script="context_parallel_trainer.py",
    )
    # the job read the same rows once (the two ranks of the cp group share them): whole counts, not halves
    for key in ("tokens", "useful_tokens"):
        assert cp["metrics"][0][key] == one["metrics"][0][key] and isinstance(cp["metrics"][0][key], int), key
    ref, got = one["grads"], cp["grads"]
    assert got.keys() == ref.keys() and len(ref) > 0
    for name in ref:
        scale = ref[name].norm()
        assert scale > 0, name
        assert (got[name] - ref[name]).norm() / scale < 1e-5, name


@pytest.mark.slow
def test_trainer_step_on_two_groups_of_two_ranks_gives_one_process_gradients(tmp_path):
    """dp 2 x cp 2 (4 gloo ranks, micro_batch 1 per data-parallel group) against one process at micro_batch 2,
    which reads the same rows: the groups read rows by rank // cp, the cp ranks of a group share K/V, and the
    window's valid targets are all-reduced over 4 ranks and divided by cp (not by the world size: that would
    halve every gradient, a relative difference of 0.5). Flex's kernel is SDPA on the CP mask, as above.
    Smallest shapes that still prove it: 2 blocks, 256-token rows (one 128-token block per rank)."""
    from flexengine.data.demo import load_demo_tokenizer
    from tests.helpers import make_llama, run_grads_script

    model_dir = tmp_path / "model"
    make_llama(vocab_size=2048, num_hidden_layers=2).save_pretrained(model_dir)
    load_demo_tokenizer().save_pretrained(model_dir)
    common = ["attn=packed_doc", "data.seq_len=256", "model.init=pretrained", f"model.path={model_dir}"]
    one = run_grads_script(tmp_path / "one", *common, "train.micro_batch=2", "attn.backend=dense")
    cp = run_grads_script(
        tmp_path / "cp",
        *common,
        "train.micro_batch=1",
        "attn.backend=flex",
        "attn.compile=false",
        "parallel.cp=2",
        ranks=4,
        script="context_parallel_trainer.py",
    )
    # the job's tokens: both groups' rows, each once (not a quarter of a group's, nor every row twice)
    for key in ("tokens", "useful_tokens"):
        assert cp["metrics"][0][key] == one["metrics"][0][key], key
    ref, got = one["grads"], cp["grads"]
    assert got.keys() == ref.keys() and len(ref) > 0
    for name in ref:
        scale = ref[name].norm()
        assert scale > 0, name
        assert (got[name] - ref[name]).norm() / scale < 1e-5, name


@pytest.mark.slow
def test_ranks_get_equal_attention_work(cp_run):
    """PTRR load balancing: each rank computes nearly the same number of attention blocks; a plain split into
    the first and second half of each row would give the second half more (causal rows, long documents).
    Measured on the test batch: 23 vs 24 blocks; halves: 20 vs 27."""
    from flexengine.surgery.attention.block_mask import build_block_mask
    from flexengine.surgery.attention.mask_mode import band_mode, canonical_document_ids

    blocks = [int(r["blocks"]) for r in cp_run["ranks"]]
    mask = build_block_mask(band_mode(True, None), canonical_document_ids(cp_run["batch"]["document_ids"]), 128)
    per_q_block = (mask.kv_num_blocks + mask.full_kv_num_blocks)[:, 0]  # [B, q blocks]
    half = per_q_block.shape[1] // 2
    contiguous = [int(per_q_block[:, :half].sum()), int(per_q_block[:, half:].sum())]
    assert sum(blocks) == sum(contiguous)  # the same work, divided differently
    assert abs(blocks[0] - blocks[1]) <= 2 < abs(contiguous[0] - contiguous[1])


def test_windowed_layers_stay_balanced_in_the_full_masks_order():
    """CP balances one order for all layers, on the full-attention mask; a windowed layer's query block attends at
    most window/128 + 1 key blocks wherever it sits, so its work stays even in that order (README's claim): a
    32K row of 200..12,000-token documents over 8 ranks, window 4,096. Measured: max/mean 1.006."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _PTRRLoadBalancer

    from flexengine.surgery.attention.mask_mode import band_mode, canonical_document_ids

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(200, 12000, (12,), generator=g).tolist()
    ids = canonical_document_ids(torch.repeat_interleave(torch.arange(12), torch.tensor(lengths))[None, :32768])

    def work(window):  # attended key blocks per 128-token query block
        return band_mode(True, window).block_occupancy(ids, 128)[0].sum(-1)[0].float()

    order = _PTRRLoadBalancer.ptrr_scheduling(work(None), 8)  # [rank, its query blocks]
    for window in (None, 4096):
        per_rank = torch.stack([work(window)[blocks].sum() for blocks in order])
        assert per_rank.max() / per_rank.mean() < 1.01, (window, per_rank)


def test_shifted_targets_give_the_same_loss_in_chunks():
    torch.manual_seed(0)
    hidden, head = torch.randn(2, 40, 8), torch.nn.Linear(8, 11)
    labels = torch.randint(0, 11, (2, 40))
    labels[:, [0, 7, 8, 30]] = -100
    for chunk in (0, 7):
        torch.testing.assert_close(
            shifted_loss_sum(hidden, shift_targets(labels), head, chunk),
            causal_lm_loss_sum(hidden, labels, head, chunk),
        )
    assert shift_targets(labels)[:, -1].eq(-100).all()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.cp=0"], "parallel.cp=0 must be >= 1"),
        (["parallel=ddp", "parallel.cp=2"], "composes with FSDP2 only"),
        (["parallel.cp=2", "attn.backend=varlen"], "needs attn.backend=flex"),
        (["parallel.cp=2", "attn.block_size=64"], "needs attn.block_size=128"),
        (["parallel.cp=4", "data.seq_len=1664"], "1664 must be a multiple of .* = 512: .* data.seq_len=2048"),
        # dynamic NTK rescales by the largest position id a rank sees: each rank would rotate Q/K differently
        (
            ["parallel.cp=2", "model.rope_scaling={rope_type:dynamic,factor:2.0}"],
            (
                r"parallel.cp=2 cannot train with model.rope_scaling rope_type=dynamic"
                r".*model.rope_scaling=\{rope_type:yarn"
            ),
        ),
    ],
)
def test_config_refuses_what_context_parallel_cannot_do(overrides, message):
    with pytest.raises(UserError, match=message):
        compose_job(["attn=packed_doc", "data.seq_len=2048", *overrides])


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 512},  # + its factor lists
    ],
)
def test_checkpoint_with_position_dependent_rope_is_refused_under_context_parallel(tmp_path, monkeypatch, rope):
    """A checkpoint whose config.json carries dynamic or longrope RoPE (no model.rope_scaling in the job), with rows
    past its trained context (within it the pretrained frequencies stay): refused from the model's own config,
    before the process group exists."""
    from transformers import LlamaConfig

    from flexengine.run import build_trainer
    from tests.helpers import TINY_LLAMA

    head_dim = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
    if rope["rope_type"] == "longrope":  # one factor per rotated frequency
        rope = {**rope, "short_factor": [1.0] * (head_dim // 2), "long_factor": [2.0] * (head_dim // 2)}
    LlamaConfig(**TINY_LLAMA, rope_parameters={"rope_theta": 10000.0, **rope}).save_pretrained(tmp_path / "model")
    monkeypatch.delenv("RANK", raising=False)  # without the check: "launch with torchrun" instead
    job = compose_job(
        [
            "attn=packed_doc",
            "data.seq_len=2048",  # past TINY_LLAMA's 1,024 trained positions
            "parallel.cp=2",
            f"model.path={tmp_path / 'model'}",
            f"train.output_dir={tmp_path / 'out'}",
        ]
    )
    with pytest.raises(
        UserError,
        match=f"parallel.cp=2 cannot train with model.path=.*model, whose config.json "
        f"has rope_type={rope['rope_type']}.*yarn, linear or llama3",
    ):
        build_trainer(job, tmp_path / "out")


def test_config_accepts_flex_rows_in_whole_blocks_per_rank():
    job = compose_job(["attn=packed_doc", "attn.backend=flex", "data.seq_len=2048", "parallel.cp=4"])
    assert job.parallel.cp == 4


def test_context_parallel_needs_torchrun_with_a_multiple_of_cp(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(UserError, match="launch with torchrun"):
        init_distributed(ParallelConfig(cp=2), torch.device("cpu"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UserError, match=r"must divide the number of ranks \(3\)"):
        init_distributed(ParallelConfig(cp=2), torch.device("cpu"))
