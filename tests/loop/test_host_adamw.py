"""CPUOffloadAdamW (flexengine/loop/host_adamw.py): the fused host step against foreach AdamW, downloads under the last
backward against the plain step (exactly equal, with accumulation and clipping), the CUDA ordering through a
recording fake, host bytes against the planner's terms, and the HF export of the fp32 masters."""

from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors.torch import load_file

from flexengine.core.config import HardwareConfig, JobConfig, OptimConfig, PrecisionConfig, TrainConfig
from flexengine.data.loader import RowLoader
from flexengine.loop.host_adamw import CPUOffloadAdamW
from flexengine.loop.optim import build_optimizer, clip_gradients, last_backward
from flexengine.loop.trainer import Trainer
from flexengine.planning.costs import host_optimizer_bytes, host_optimizer_seconds
from flexengine.planning.shapes import ModelShape
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.precision import SPECS
from tests.helpers import make_llama, plan_inputs_of, random_row_loader, trainer_for

CPU = torch.device("cpu")
A100 = HardwareConfig(name="a100_80g", device="cuda", memory_gb=79.3, peak_tflops=312, host_memory_gb=128)


def _bf16_llama(seed: int = 0) -> torch.nn.Module:
    return make_llama(seed).to(torch.bfloat16).train()


def _window(model, opt, steps: int, *, accum: int = 3, max_norm: float = float("inf"), overlap: bool, seed: int = 0):
    """`steps` optimizer steps of `accum` micro-batches; the last backward of each window inside last_backward()
    when `overlap`. Returns the grad norms."""
    gen = torch.Generator().manual_seed(seed)
    norms = []
    for _ in range(steps):
        for i in range(accum):
            ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
            with last_backward(opt, enabled=overlap and i == accum - 1):
                (model(input_ids=ids, labels=ids).loss / accum).backward()
        norms.append(float(clip_gradients(opt, model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def _masters(opt: CPUOffloadAdamW) -> list[torch.Tensor]:
    return [m.detach().clone() for _, m in opt._pairs]


def test_host_step_is_fused_adamw_and_equals_foreach_adamw_on_the_masters():
    """Same gradients (bf16, as they come off the device) into the host step and into foreach AdamW over fp32 copies
    of the weights: the fused kernel's results agree to ~1e-9 (the order of its float operations differs)."""
    torch.manual_seed(0)
    weights = [torch.randn(256, 64) * 0.02, torch.ones(64)]
    device = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in weights]
    reference = [torch.nn.Parameter(w.to(torch.bfloat16).float()) for w in weights]
    opt = CPUOffloadAdamW([{"params": device, "weight_decay": 0.1}], lr=2e-5, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW([{"params": reference, "weight_decay": 0.1}], lr=2e-5, betas=(0.9, 0.95), foreach=True)
    assert opt.defaults["fused"] and not opt.defaults["foreach"]
    for _ in range(5):
        for d, r in zip(device, reference):
            d.grad = torch.randn_like(d, dtype=torch.float32).mul(1e-3).to(torch.bfloat16)
            r.grad = d.grad.float()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for (d, master), r in zip(opt._pairs, reference):
        torch.testing.assert_close(master, r.detach(), atol=1e-9, rtol=2.4e-7)  # <= 2 fp32 ulps
        assert torch.equal(d, master.to(torch.bfloat16))  # the device copy is the master rounded to bf16
    assert not torch.equal(opt._pairs[1][1], torch.ones(64))  # the norm weight's master moved at lr 2e-5 ...
    assert torch.equal(device[1], torch.ones(64, dtype=torch.bfloat16))  # ... its bf16 copy could not


def test_another_optimizers_state_resumes_with_masters_read_from_the_device_weights():
    """An adamw checkpoint resumed under adamw_cpu_offload (or precision=auto choosing bf16_cpu_master on a
    requeue) holds no fp32 masters: they are re-read from the weights just loaded, and its moments are kept."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 16)), torch.nn.Parameter(torch.randn(16))]
    adamw = torch.optim.AdamW([{"params": params}], lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    adamw.step()
    with torch.no_grad():
        params[0].add_(1.0)  # the weights the checkpoint restored, after the masters were built
    opt = CPUOffloadAdamW([{"params": params}], lr=1e-3)
    opt.load_state_dict(adamw.state_dict())
    assert all(torch.equal(m, p.detach()) for m, p in zip(_masters(opt), params))
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], adamw.state_dict()["state"][0]["exp_avg"])


def test_step_hooks_run_once_per_step_around_the_per_parameter_updates():
    """The host step calls torch's AdamW once per parameter; hooks registered on the optimizer (the trainer's tests,
    profilers) must still see one step. A plain AdamW built first makes torch wrap AdamW.step with its hook runner."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in range(4)]
    opt = CPUOffloadAdamW([{"params": params}], lr=1e-3)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    for p in params:
        p.grad = torch.ones(3, dtype=torch.bfloat16)
    opt.step()
    assert calls == ["pre", "post"]
    assert all(float(m[0]) == pytest.approx(-1e-3, rel=1e-3) for _, m in opt._pairs)  # every parameter stepped


@pytest.mark.parametrize("max_norm", [float("inf"), 0.05])
def test_downloads_in_the_last_backward_equal_the_plain_step_exactly(max_norm):
    """With accumulation over 3 micro-batches (and clipping at 0.05, which clips every step here), the gradients
    downloaded by hooks during the last backward give bit-identical masters and weights to the plain step; the hooks
    fire in the last micro-batch only, once per parameter."""
    overlapped, plain = _bf16_llama(), _bf16_llama()
    opt_a = build_optimizer(overlapped, OptimConfig(name="adamw_cpu_offload", lr=1e-3), CPU)
    opt_b = build_optimizer(plain, OptimConfig(name="adamw_cpu_offload", lr=1e-3), CPU)
    norms = _window(overlapped, opt_a, 3, max_norm=max_norm, overlap=True)
    assert _window(plain, opt_b, 3, max_norm=max_norm, overlap=False) == norms
    assert opt_a.hook_downloads == 3 * len(opt_a._pairs) and opt_b.hook_downloads == 0
    if max_norm < float("inf"):
        assert min(norms) > max_norm  # the clip applied on every step
    for a, b in zip(_masters(opt_a), _masters(opt_b)):
        assert torch.equal(a, b)
    for a, b in zip(overlapped.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    # no hook stays registered after the backward (a left one would keep a dropped optimizer's host memory alive)
    assert all(not p._post_accumulate_grad_hooks for p in overlapped.parameters())


def test_clip_is_applied_on_the_host_in_fp32_and_matches_torch_clipping():
    """The device grads stay as they are; the host step scales the fp32 gradient by clip_grad_norm_'s coefficient
    (torch AdamW over fp32 copies with clip_grad_norm_ as the reference)."""
    model = _bf16_llama()
    reference = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    opt = CPUOffloadAdamW([{"params": list(model.parameters())}], lr=1e-3)
    ref = torch.optim.AdamW(reference, lr=1e-3, foreach=True)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for r, p in zip(reference, model.parameters()):
        r.grad = p.grad.float()
    norm = clip_gradients(opt, model.parameters(), 0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference, 0.1)
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-2)  # bf16 norm of bf16 grads vs fp32
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # device grads untouched
    opt.step()
    ref.step()
    # the coefficient comes from the bf16-computed norm: equal to the fp32 one to bf16's 3 digits
    for (_, master), r in zip(opt._pairs, reference):
        torch.testing.assert_close(master, r.detach(), atol=2e-5, rtol=0)


class _Event:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(("host_waits", self.name))


class FakeStreams:
    """Stands in for offload.CudaStreams on CPU: plain copies, a log of side-stream use, events and waits."""

    def __init__(self):
        self.log: list[tuple] = []

    @contextlib.contextmanager
    def on_side(self):
        self.log.append(("on_side",))
        yield

    def side_waits_for_compute(self) -> None:
        self.log.append(("side_waits_for_compute",))

    def record(self):
        event = _Event(self.log, f"e{sum(e[0] == 'record' for e in self.log)}")
        self.log.append(("record", event.name))
        return event

    def compute_waits(self, event) -> None:
        self.log.append(("compute_waits", event.name))

    def used_on_side(self, t) -> None:
        self.log.append(("used_on_side",))


def test_cuda_path_queues_copies_on_the_side_stream_and_waits_per_parameter():
    """Through a recording fake of the CUDA streams: each download is queued on the side stream after it waited for
    compute and gets its own event; the step waits on that event before it reads the slot; uploads go on the side
    stream after it waited for compute; the next forward waits for them. Values equal the CPU path's."""
    model, twin = _bf16_llama(), _bf16_llama()
    fake = FakeStreams()
    opt = CPUOffloadAdamW([{"params": list(model.parameters())}], lr=1e-3, streams=fake)
    plain = CPUOffloadAdamW([{"params": list(twin.parameters())}], lr=1e-3)
    _window(model, opt, 1, accum=2, overlap=True)
    _window(twin, plain, 1, accum=2, overlap=False)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    n = len(opt._pairs)
    kinds = [e[0] for e in fake.log]
    download = ["side_waits_for_compute", "on_side", "used_on_side", "record"]
    assert kinds[: 4 * n] == download * n  # during the backward, one event per gradient
    step = kinds[4 * n :]
    assert step[0] == "side_waits_for_compute"  # before any upload overwrites a weight
    assert step[1:-2] == ["host_waits", "on_side"] * n  # wait for this slot's download, step, upload it
    downloads = [e[1] for e in fake.log[: 4 * n] if e[0] == "record"]
    assert [e[1] for e in fake.log if e[0] == "host_waits"] == downloads  # stepped in the order they came down
    assert step[-2:] == ["record", "compute_waits"]  # the next forward waits for the uploads


def test_host_bytes_are_the_planners_terms():
    """Masters + states + the transfer buffer per trainable parameter, plus one fp32 scratch of the largest
    bf16 parameter: what precision.bytes_per_param() tells the planner (within the slots' 64-byte alignment)."""
    model = _bf16_llama()
    opt = build_optimizer(model, OptimConfig(name="adamw_cpu_offload"), CPU)
    _window(model, opt, 1, accum=1, overlap=True)  # states exist after the first step
    held = opt.host_bytes()
    n = sum(p.numel() for p in model.parameters())
    per_param = SPECS["bf16_cpu_master"].bytes_per_param()
    assert held["masters"] == 4 * n and held["states"] == 8 * n + 4 * len(opt._pairs)  # + fused AdamW's fp32 steps
    assert 2 * n <= held["transfer_buffer"] < 2 * n + 64 * len(opt._pairs)
    assert (held["masters"] + held["states"] + held["transfer_buffer"]) / n == pytest.approx(per_param["host"], 1e-2)
    assert held["grad_scratch"] == per_param["host_scratch"] * max(p.numel() for p in model.parameters())
    assert not opt.pinned  # no CUDA here: a plain buffer, the same code path
    # the planner's host and PCIe terms for this model are what the optimizer holds and moves
    x = plan_inputs_of(JobConfig(), A100, SPECS["bf16_cpu_master"], on_cuda=True)
    shape = ModelShape.from_hf_config(model.config)
    assert shape.params == n
    held_total = sum(held.values()) - 4 * len(opt._pairs)  # less fused AdamW's step counters
    assert host_optimizer_bytes(shape, x) == pytest.approx(held_total, rel=1e-2)  # slot alignment
    slots = sum(slot.numel() * slot.element_size() for slot in opt._slots)
    assert host_optimizer_seconds(shape, x, compute_s=1.0)[1] == 2 * slots  # each slot down and up once a step


# -- through the trainer: the window's hooks, and the HF export of the masters --------------------------------------

SEQ_LEN = 64


def _loader(micro_batch: int) -> RowLoader:
    return random_row_loader(micro_batch, SEQ_LEN)


def _trainer(tmp_path, *, lr: float = 2e-5, max_steps: int = 4, save_every: int = 0) -> Trainer:
    job = JobConfig(
        optim=OptimConfig(lr=lr, warmup_steps=0, grad_clip=1.0, name="adamw_cpu_offload", weight_decay=0.0),
        precision=PrecisionConfig(mode="bf16_cpu_master"),
        train=TrainConfig(
            micro_batch=1, grad_accum=2, max_steps=max_steps, progress=False, save_final=False, save_every=save_every
        ),
    )
    job.data.seq_len = SEQ_LEN
    model = patch_attention(_bf16_llama(), mode="packed_doc", backend="dense")
    return trainer_for(job, model, _loader(1), tmp_path, precision=SPECS["bf16_cpu_master"])


def test_trainer_downloads_in_the_last_micro_batch_and_equals_the_plain_step(tmp_path, monkeypatch):
    hooked = _trainer(tmp_path / "a", lr=1e-3, max_steps=2)
    hooked.train()
    assert hooked.optimizer.hook_downloads == 2 * len(hooked.optimizer._pairs)  # once per parameter and step
    import flexengine.loop.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "last_backward", lambda opt, enabled: contextlib.nullcontext())
    plain = _trainer(tmp_path / "b", lr=1e-3, max_steps=2)
    plain.train()
    assert plain.optimizer.hook_downloads == 0
    assert hooked.state.losses == plain.state.losses
    for a, b in zip(hooked.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)


def _exported(path) -> dict:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def test_hf_export_writes_the_fp32_masters_and_resume_stays_exact(tmp_path):
    """At lr 2e-5 the norm weights' masters move while their bf16 device copies stay at 1.0: the export must carry
    the masters. Resuming from the step-2 export (weights rounded back to bf16, masters from the optimizer state)
    continues bit for bit like the uninterrupted run."""
    run = _trainer(tmp_path / "run", save_every=2)
    initial = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    run.train()
    exported = _exported(run.out_dir / "checkpoints" / "step_4")
    masters = run.optimizer.master_weights(run.model)
    norm = "model.norm.weight"
    assert torch.equal(run.model.get_parameter(norm), initial[norm])  # the device copy did not move ...
    assert not torch.equal(exported[norm], initial[norm].float())  # ... the exported master did
    assert masters.keys() == {n for n, _ in run.model.named_parameters()}
    for name, master in masters.items():
        assert torch.equal(exported[name], master), name

    # the checkpoint holds the masters themselves, no 4 B/param copy (25.7 GiB of host at 7B); the
    # step-2 save was synchronous, so the resume below would differ had a later step changed them first
    saved = run.trainer_state()["optimizer"]["fp32_masters"]
    assert [m.data_ptr() for m in saved] == [m.data_ptr() for _, m in run.optimizer._pairs]
    resumed = _trainer(tmp_path / "resumed", save_every=2)
    resumed.resume(str(run.out_dir / "checkpoints" / "step_2"))
    resumed.train()
    assert resumed.state.losses == run.state.losses
    for a, b in zip(run.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(_masters(run.optimizer), _masters(resumed.optimizer)):
        assert torch.equal(a, b)
