"""The fused linear cross-entropy equals the chunked loss (value and gradients w.r.t. hidden, weight and bias) for
tied, untied and frozen heads, holds what the planner says it holds, and refuses what it cannot fuse."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from flexengine.core.errors import UserError
from flexengine.planning.activations import constant_bytes, loss_transient_bytes
from flexengine.planning.shapes import ModelShape, Workload
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.fused_loss import check_fusable_head, fused_linear_cross_entropy_sum
from flexengine.surgery.loss import causal_lm_loss_sum
from flexengine.surgery.memory.meter import measure_peak_bytes
from flexengine.surgery.parallel import LossForward
from tests.helpers import make_llama

B, S, H, V = 3, 41, 16, 50
VALID = B * (S - 1) - 11  # the predicting positions of _labels()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (Frobenius norms, computed in fp64)."""
    return float((got.double() - want.double()).norm() / want.double().norm())


def _labels(generator: torch.Generator) -> torch.Tensor:
    labels = torch.randint(0, V, (B, S), generator=generator)
    labels[0, :10] = -100  # ignored targets: index_select drops them before either loss sees them
    labels[2, 20] = -100
    return labels


class _Tied(nn.Module):
    """An embedding whose weight is also lm_head's: the input's gradient reaches the same tensor twice."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.mix = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=bias)
        self.lm_head.weight = self.embed.weight

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(self.embed(ids)))


def _losses_and_grads(tied: bool, bias: bool, frozen: bool, chunk_size: int, fused: bool, dtype=None):
    """(loss, {name: grad}) of one backward of 0.37 x the summed loss (a grad_output that is not 1)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = _Tied(bias)
    if not tied:
        model.lm_head.weight = nn.Parameter(torch.randn(V, H, generator=g) * 0.3)
    model.lm_head.requires_grad_(not frozen)
    ids = torch.randint(0, V, (B, S), generator=g)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = causal_lm_loss_sum(model.hidden(ids), _labels(g), model.lm_head, chunk_size, fused=fused)
    (0.37 * loss).backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize("chunk_size", [1, 7, 32, VALID - 1])  # 7 and 32 leave a ragged last chunk, VALID - 1 two
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fused_equals_chunked_in_fp32(chunk_size, tied, bias):
    want_loss, want = _losses_and_grads(tied, bias, False, chunk_size, fused=False)
    got_loss, got = _losses_and_grads(tied, bias, False, chunk_size, fused=True)
    assert _relative(got_loss, want_loss) <= 1e-6
    assert set(got) == set(want) and ("lm_head.weight" in want) != tied  # tied: one tensor, named once
    for name in want:
        assert _relative(got[name], want[name]) <= 1e-6, name


def test_a_frozen_head_gets_no_gradient_and_the_rest_are_the_chunked_ones():
    want_loss, want = _losses_and_grads(False, True, True, 7, fused=False)
    got_loss, got = _losses_and_grads(False, True, True, 7, fused=True)
    assert "lm_head.weight" not in got and "lm_head.bias" not in got
    assert _relative(got_loss, want_loss) <= 1e-6
    for name in want:
        assert _relative(got[name], want[name]) <= 1e-6, name


def _head_grads(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, fused: bool) -> dict:
    """{name: grad} of 0.37 x the summed loss over hidden and head's parameters (None: no gradient reached it)."""
    leaves = {"hidden": hidden, "weight": head.weight, "bias": head.bias}
    leaves = {name: t for name, t in leaves.items() if t is not None}
    for t in leaves.values():
        t.grad = None
    if fused:
        loss = fused_linear_cross_entropy_sum(hidden, targets, head, 7)
    else:
        loss = nn.functional.cross_entropy(head(hidden), targets, reduction="sum")
    (0.37 * loss).backward()
    return {name: t.grad for name, t in leaves.items()}


@pytest.mark.parametrize(
    "hidden_grad, weight_grad, bias",
    [(True, False, True), (False, True, False), (False, True, True), (False, False, True)],
    ids=["frozen_weight_trained_bias", "head_only_nobias", "head_only_bias", "bias_only"],
)
def test_a_partly_frozen_head_gets_the_reference_gradients(hidden_grad, weight_grad, bias):
    """Each gradient reaches its own input whichever of the others are absent (the saved ones keep their slots)."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(30, H, generator=g).requires_grad_(hidden_grad)
    head = nn.Linear(H, V, bias=bias)
    head.weight.requires_grad_(weight_grad)
    targets = torch.randint(0, V, (30,), generator=g)
    want = _head_grads(hidden, head, targets, fused=False)
    got = _head_grads(hidden, head, targets, fused=True)
    assert {k for k, v in got.items() if v is not None} == {k for k, v in want.items() if v is not None}
    for name, grad in want.items():
        if grad is not None:
            assert _relative(got[name], grad) <= 1e-6, name


def test_a_double_backward_is_refused():
    """The backward scales the saved gradients in place: a graph of it (create_graph) would be wrong, so none."""
    hidden, head = torch.randn(20, H, requires_grad=True), nn.Linear(H, V)
    loss = fused_linear_cross_entropy_sum(hidden, torch.randint(0, V, (20,)), head, 8)
    scale = torch.tensor(0.37, requires_grad=True)  # an incoming gradient in the graph: the second order needs it
    (grad_hidden,) = torch.autograd.grad(loss, hidden, grad_outputs=scale, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_hidden.sum().backward()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_is_close_to_chunked_under_bf16_autocast(tied):
    want_loss, want = _losses_and_grads(tied, True, False, 7, fused=False, dtype=torch.bfloat16)
    got_loss, got = _losses_and_grads(tied, True, False, 7, fused=True, dtype=torch.bfloat16)
    assert got_loss.dtype == torch.float32 and _relative(got_loss, want_loss) <= 1e-5  # the same bf16 logits
    for name in want:
        # the chunked path sums lm_head's chunk gradients in bf16, the fused one in the fp32 weight's dtype
        assert got[name].dtype == want[name].dtype and _relative(got[name], want[name]) <= 2e-2, name


class _MatmulShapes(TorchDispatchMode):
    """Records the shape of every matmul's output run under it."""

    MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm.out)

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.MATMULS:
            self.shapes.append(tuple(out.shape))
        return out


def test_under_autocast_the_weight_gradient_is_summed_slice_by_slice():
    """A vocabulary of 600 with chunks of 7 rows: the fp32 sum takes three slices (256, 256, 88) of each chunk's
    bf16 product, never one [V, H] product (a second lm_head-sized tensor); together they are the chunked loss's
    gradient."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(60, H, generator=g, requires_grad=True)
    head = nn.Linear(H, 600)
    targets = torch.randint(0, 600, (60,), generator=g)
    grads = []
    for fused in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16), _MatmulShapes() as matmuls:
            loss = causal_lm_loss_sum(hidden[None], torch.cat([targets[:1], targets])[None], head, 7, fused=fused)
        grads.append(torch.autograd.grad(loss, (hidden, head.weight, head.bias)))
    # the fused run's (the last) products [rows, H] of more rows than a chunk: the weight gradient's vocabulary slices
    weight_products = [shape for shape in matmuls.shapes if shape[1] == H and shape[0] > 7]
    assert len(weight_products) == 3 * -(-60 // 7) and max(rows for rows, _ in weight_products) == 256
    for want, got in zip(*grads):
        assert got.dtype == torch.float32 and _relative(got, want) <= 2e-2


def test_without_grad_it_only_sums_the_loss():
    g = torch.Generator().manual_seed(1)
    hidden, head = torch.randn(50, H, generator=g), nn.Linear(H, V)
    targets = torch.randint(0, V, (50,), generator=g)
    with torch.no_grad():
        got = fused_linear_cross_entropy_sum(hidden, targets, head, 16)
        want = nn.functional.cross_entropy(head(hidden), targets, reduction="sum")
    assert not got.requires_grad and _relative(got, want) <= 1e-6


def test_a_second_backward_is_refused_not_scaled_twice():
    hidden, head = torch.randn(20, H, requires_grad=True), nn.Linear(H, V)
    loss = fused_linear_cross_entropy_sum(hidden, torch.randint(0, V, (20,)), head, 8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="loss.fused=false"):
        loss.backward()


class _Wrapped(nn.Linear):
    """A subclass with its own forward, as a LoRA layer or FSDP's per-module class would be."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_a_head_that_is_not_a_plain_linear_is_refused_with_the_key():
    assert check_fusable_head(nn.Linear(2, 3)).out_features == 3
    with pytest.raises(UserError, match=r"loss.fused=true needs lm_head to be a plain torch.nn.Linear.*_Wrapped"):
        check_fusable_head(_Wrapped(2, 3))
    model = make_llama()
    model.lm_head = _Wrapped(model.config.hidden_size, model.config.vocab_size, bias=False)
    with pytest.raises(UserError, match="set loss.fused=false"):
        LossForward(model, chunk_size=8, fused=True)  # at build, before any step
    LossForward(model, chunk_size=8)  # the chunked loss calls the wrapper itself


@pytest.mark.parametrize("mode", ["fp32", "bf16_autocast", "bf16"])
def test_the_measured_peak_is_the_planned_one_and_below_the_chunked_loss(mode):
    """16,384 tokens, vocab 4,096, chunks of 1,024: the fused loss's forward holds the rows' and lm_head's
    gradients and one chunk's logits (fused_loss_moments); both paths are measured with the planner's terms."""
    torch.manual_seed(0)
    n, hidden_size, vocab, chunk = 16_384, 64, 4096, 1024
    autocast, dtype = mode == "bf16_autocast", torch.bfloat16 if mode == "bf16" else torch.float32
    p = 4 if mode == "fp32" else 2
    shape = ModelShape(hidden_size, 1, 1, hidden_size, hidden_size, 0, vocab, 0)
    peaks, planned = {}, {}
    for fused in (False, True):
        hidden = torch.randn(1, n, hidden_size, dtype=dtype, requires_grad=True)
        head = nn.Linear(hidden_size, vocab, bias=False, dtype=dtype)
        labels = torch.randint(0, vocab, (1, n))

        def step(hidden=hidden, head=head, labels=labels, fused=fused) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = causal_lm_loss_sum(hidden, labels, head, chunk, fused=fused)
            loss.backward()

        peaks[fused] = measure_peak_bytes(step)
        w = Workload(1, n, p, AttnBackend.FLEX, chunk, autocast=autocast, fused_loss=fused)
        # the loss's held inputs and its transient, the .grad of hidden and lm_head, autocast's copy of lm_head
        planned[fused] = constant_bytes(shape, w, False)["loss_inputs"] + loss_transient_bytes(shape, w)
        planned[fused] += (n + vocab) * hidden_size * dtype.itemsize + (vocab * hidden_size * 2 if autocast else 0)
    for fused in (False, True):
        assert peaks[fused] == pytest.approx(planned[fused], rel=0.02), fused
    assert peaks[True] < 0.8 * peaks[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_fused_equals_chunked_on_cuda(autocast):
    """On CUDA's kernels: the same loss and gradients as the chunked loss (an untied head with a bias, a ragged
    last chunk), and a lower peak than the chunked loss's re-run in backward."""
    n, hidden_size, vocab, chunk = 4097, 256, 32_000, 1024
    results, peaks = {}, {}
    for fused in (False, True):
        g = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(1, n, hidden_size, device="cuda", generator=g, requires_grad=True)
        head = nn.Linear(hidden_size, vocab, device="cuda")
        with torch.no_grad():
            head.weight.copy_(torch.randn(vocab, hidden_size, device="cuda", generator=g) * 0.05)
            head.bias.copy_(torch.randn(vocab, device="cuda", generator=g) * 0.05)
        labels = torch.randint(0, vocab, (1, n), device="cuda", generator=g)
        labels[0, :100] = -100
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = causal_lm_loss_sum(hidden, labels, head, chunk, fused=fused)
        grads = torch.autograd.grad(0.37 * loss, (hidden, head.weight, head.bias))
        torch.cuda.synchronize()
        peaks[fused] = torch.cuda.max_memory_allocated() - start
        results[fused] = (loss.detach(), grads)
    (want_loss, want), (got_loss, got) = results[False], results[True]
    tolerance = 2e-2 if autocast else 1e-5
    assert _relative(got_loss, want_loss) <= (1e-5 if autocast else 1e-6)
    for name, w, x in zip(("hidden", "weight", "bias"), want, got):
        assert x.dtype == w.dtype and _relative(x, w) <= tolerance, name
    assert peaks[True] < peaks[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger_kernel is not installed")
def test_fused_equals_liger_on_cuda():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4096, 256, device="cuda", generator=g, requires_grad=True)
    head = nn.Linear(256, 32_000, bias=False, device="cuda")
    targets = torch.randint(0, 32_000, (4096,), device="cuda", generator=g)
    ours = fused_linear_cross_entropy_sum(hidden, targets, head, 1024)
    ours_grads = torch.autograd.grad(ours, (hidden, head.weight))
    theirs = liger_fused_linear_cross_entropy(hidden, head.weight, targets, reduction="sum")
    theirs_grads = torch.autograd.grad(theirs, (hidden, head.weight))
    assert _relative(ours, theirs) <= 1e-5
    for got, want in zip(ours_grads, theirs_grads):
        assert _relative(got, want) <= 1e-4
