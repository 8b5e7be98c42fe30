"""The activation meter (flexengine/surgery/memory/meter.py) on ops whose saved tensors are known by hand: exp saves
its output, sin its input, sum only a shape. What backward will read is counted at the block that made it, and what
nothing keeps is not counted."""

from __future__ import annotations

import torch
from torch import nn

from flexengine.core.config import MemoryConfig
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory.meter import ActivationReport, measure_activations, measure_peak_bytes
from flexengine.surgery.memory.policy import apply_memory_policy
from flexengine.surgery.memory.spec import block_memory_specs
from tests.helpers import clone_model, make_llama

N = 1000  # floats per tensor: 4,000 bytes


class _Op(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.anchor = nn.Parameter(torch.zeros(()))  # measure_activations asks the model for its device

    def forward(self, x):
        return self.fn(x)


def _measure(*fns):
    layers = nn.ModuleList([_Op(fn) for fn in fns])
    x = torch.randn(N, requires_grad=True)  # made before the forward: not the forward's

    def forward():
        h = x
        for layer in layers:
            h = layer(h)
        return h.sum()

    return measure_activations(layers, forward, layers)


def test_a_tensor_backward_reads_is_counted_at_the_block_that_made_it():
    report, out = _measure(torch.exp, torch.sin)
    # exp's output (block 0) is saved twice (by exp, and by sin as its input): counted once; sin's output is read
    # by nothing (sum keeps only a shape) and is gone; the 0-d sum is the output, alive outside every block
    assert report.per_block == [4 * N, 0] and report.other_bytes == 4
    assert report.total_bytes == 4 * N + 4 and report.offloaded_bytes == 0 and report.cuda_peak_bytes is None
    out.backward()  # the output is handed back, graph intact


def test_a_view_is_counted_where_its_storage_was_made():
    report, _ = _measure(torch.exp, lambda h: h.view(10, 100), torch.sin)
    assert report.per_block == [4 * N, 0, 0]  # the view in block 1 shares block 0's storage


def test_nothing_saved_nothing_counted():
    report, _ = _measure(lambda h: h * 2, lambda h: h + 1)  # mul by a constant and add save no tensor
    assert report.per_block == [0, 0] and report.total_bytes == 4


def test_report_as_dict_names_every_figure():
    report = ActivationReport(10, [4, 6], 0, 3, None)
    assert report.as_dict() == {
        "activation_bytes": 10,
        "activation_bytes_per_block": [4, 6],
        "activation_other_bytes": 0,
        "activation_offloaded_bytes": 3,
        "forward_cuda_peak_bytes": None,
    }


def test_peak_is_the_most_bytes_alive_at_once_and_ignores_what_existed_before():
    before = torch.ones(10 * N)

    def work():
        a = torch.ones(N)  # alive: a = 4N bytes
        b = torch.ones(N)  # a + b = 8N
        del a
        c = torch.ones(3 * N)  # b + c = 16N: the peak (a is gone)
        del b, c
        return before.sum()  # 4 bytes, and `before` itself is not the fn's

    assert measure_peak_bytes(work) == 16 * N


def test_meter_sees_sac_cache_and_checkpoint_closures():
    """A saved-tensor-hooks count would report ~0 for SAC (its cache is not autograd-saved)."""
    small = make_llama(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    B, S = 1, 256
    ids = torch.randint(0, 512, (B, S))
    batch = {"input_ids": ids, "position_ids": torch.arange(S).expand(B, S), "labels": ids}
    per_block = {}
    for label, memory in [
        ("none", MemoryConfig()),
        ("ops", MemoryConfig(policy="selective", granularity="ops")),
        ("full", MemoryConfig(policy="full")),
    ]:
        model = clone_model(small)
        patch_attention(model, mode="packed_doc", backend="dense")
        apply_memory_policy(model, block_memory_specs(memory, model.config.num_hidden_layers))
        report, _ = measure_activations(model, lambda model=model: forward_loss_sum(model, batch))
        per_block[label] = report.per_block[1]
    assert per_block["full"] < per_block["ops"] < per_block["none"]
    assert per_block["full"] == B * S * 128 * 4  # the block's input, fp32
