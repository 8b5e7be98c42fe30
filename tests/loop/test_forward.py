"""loop/forward.py: the forward path (a plain loss module unless a parallel root is given, only the precision the
model was prepared for) and the batch preparation the step and the evaluations share."""

from __future__ import annotations

import pytest
import torch

from flexengine.core.config import JobConfig
from flexengine.loop.forward import ForwardPath
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.attention.patch import MASK_KWARG
from flexengine.surgery.parallel import LossForward
from flexengine.surgery.precision import SPECS, apply_precision
from tests.helpers import job_forward, make_llama

CPU = torch.device("cpu")


def test_defaults_a_loss_module_and_the_weights_precision():
    job = JobConfig()
    job.loss.chunk_size = 16
    model = make_llama()
    path = job_forward(job, model)
    assert isinstance(path.train_module, LossForward) and path.train_module.model is model
    assert path.train_module.chunk_size == 16
    assert path.precision == SPECS["fp32"] and path.cp == 1 and path.context_parallel is None
    root = torch.nn.Identity()
    assert job_forward(job, model, train_module=root).train_module is root  # the FSDP/DDP root


def test_the_precision_the_model_was_prepared_for_wins_and_another_is_refused():
    model = make_llama()
    apply_precision(model, SPECS["bf16_mixed"])
    assert job_forward(JobConfig(), model).precision == SPECS["bf16_mixed"]
    with pytest.raises(ValueError, match="prepared for precision=bf16_mixed"):
        ForwardPath.build(JobConfig().loss, model, CPU, precision=SPECS["fp32"])


def test_prepare_builds_the_masks_of_a_patched_model_and_none_for_hf_attention():
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    batch = {"document_ids": ids}
    patched = patch_attention(make_llama(), mode="packed_doc", backend="dense")
    same, kwargs = job_forward(JobConfig(), patched).prepare(batch)
    assert same is batch and set(kwargs) == {MASK_KWARG}
    assert job_forward(JobConfig(), make_llama()).prepare(batch) == (batch, {})
