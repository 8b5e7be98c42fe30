"""Shared test helpers, imported by tests (`from tests.helpers import make_llama`); fixtures stay in conftest.

Tiny HF models built in-process (no downloads), fp32, deterministic.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import sys
import traceback
from pathlib import Path
from typing import Optional

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from flexengine.cli.common import compose_job
from flexengine.core.config import HardwareConfig, JobConfig

# A run of seconds (24 demo documents, 256-token rows, no progress bar, a 2-step warmup) that keeps the default
# loop shape: grad_accum 2, which the loss-normalisation and resume tests need. The test sets its step count.
FAST = ("data.demo_max_files=24", "data.seq_len=256", "train.progress=false", "optim.warmup_steps=2")
# debug=fast's loop on top: 4 steps of micro_batch 2, grad_accum 1, and its own 1-step warmup (restated: a value
# override beats the group's, and FAST's comes first)
DEBUG_FAST = ("debug=fast", "optim.warmup_steps=1")


def run_entry_point(overrides: list[str]) -> tuple[int, str]:
    """`python -m flexengine.train <overrides>` in this process: (exit status, stderr)."""
    from flexengine.cli import train

    err = io.StringIO()
    argv = sys.argv
    sys.argv = ["flexengine.train", *overrides]
    code = 0
    try:
        with contextlib.redirect_stderr(err):
            train.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:  # any exception is a crash a caller reports (with its traceback)
        err.write("".join(traceback.format_exception(type(e), e, e.__traceback__)))
        code = 1
    finally:
        sys.argv = argv
        logging.getLogger().handlers.clear()  # Hydra's handlers hold this run's StringIO and log file
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().cfg = None  # later compositions in this process must not see this run's overrides
    return code, err.getvalue()


def make_job(out_dir: Path, *overrides: str) -> JobConfig:
    """conf/ composed exactly like the entry point does: FAST, train.output_dir=out_dir, then the overrides."""
    return compose_job([*FAST, f"train.output_dir={out_dir}", *overrides])


def job_precision(job: JobConfig, model):
    """The spec a model prepared by hand trains under: the one apply_precision recorded on it, else the job's
    precision.mode (auto: fp32 weights train as fp32). run.py hands the planner's resolved spec instead."""
    from flexengine.surgery.applied import applied
    from flexengine.surgery.precision import precision_spec

    if applied(model).precision is not None:
        return applied(model).precision
    mode = job.precision.mode
    if mode == "auto":
        assert next(model.parameters()).dtype == torch.float32, "precision=auto on a hand-built model: fp32 only"
        mode = "fp32"
    return precision_spec(mode, job.optim.name)


def job_forward(job: JobConfig, model, device=None, *, precision=None, train_module=None, context_parallel=None):
    """ForwardPath.build from a job, as a test builds it by hand: the job's loss and precision (job_precision)."""
    from flexengine.loop.forward import ForwardPath

    return ForwardPath.build(
        job.loss,
        model,
        device if device is not None else torch.device("cpu"),
        precision=precision if precision is not None else job_precision(job, model),
        train_module=train_module,
        context_parallel=context_parallel,
    )


def job_components(job: JobConfig, forward, loader, out_dir: Path, *, tokenizer=None, dist=None, held_out=None):
    """build_components from a job by hand, with flexengine.run.trainer_setup's sections of it; (setup, components)."""
    from flexengine.core.distributed import DistInfo
    from flexengine.core.parallel_spec import resolve_parallel
    from flexengine.loop.components import build_components
    from flexengine.run import trainer_setup

    setup = trainer_setup(job, forward.model, parallel=resolve_parallel(job.parallel))
    dist = dist if dist is not None else DistInfo()
    components = build_components(setup, forward, loader, tokenizer, out_dir=out_dir, dist=dist, held_out=held_out)
    return setup, components


def trainer_for(job: JobConfig, model, loader, out_dir: Path, *, tokenizer=None, dist=None, device=None, **forward):
    """A Trainer of `model` over `loader` by the one path (Trainer(setup, components)) without the entry point: no
    plan, no held-out set, no data plan to check on resume. forward: job_forward's precision, train_module,
    context_parallel."""
    from flexengine.loop.trainer import Trainer

    path = job_forward(job, model, device, **forward)
    return Trainer(*job_components(job, path, loader, out_dir, tokenizer=tokenizer, dist=dist))


def job_data(job: JobConfig, tokenizer, dist=None, **options):
    """flexengine.data.build.build_data of a job's sections (options: flex, pin_memory)."""
    from flexengine.core.distributed import DistInfo
    from flexengine.data.build import build_data

    dist = dist if dist is not None else DistInfo()
    return build_data(job.data, job.train, tokenizer, dist, timeout_s=job.parallel.data_timeout_s, **options)


# ChatML, with HF's {% generation %} markers so transformers' own assistant mask can serve as a reference. The
# block closes at <|im_end|>: the newline after it is the template's trailer, which the model never generates.
CHATML_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>"
    "{% endgeneration %}{{ '\\n' }}"  # an expression: jinja's trim_blocks would eat a literal newline here
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_chatml(tokenizer, eos: Optional[str] = None):
    """`tokenizer` with ChatML's special tokens and chat template; eos: make that token its eos (an instruct
    tokenizer's, e.g. <|im_end|>, where the base model's end-of-text stays in the vocabulary)."""
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    if eos is not None:
        tokenizer.eos_token = eos
    return tokenizer


def save_pretrained_instruct(path: Path) -> Path:
    """A tiny instruct-model directory like SmolLM2-135M-Instruct's: LLaMA weights and a ChatML tokenizer whose eos
    is <|im_end|> (the chat end-of-turn), with the base model's <|endoftext|> in its vocabulary."""
    from flexengine.data.demo import load_demo_tokenizer

    tokenizer = with_chatml(load_demo_tokenizer(), eos="<|im_end|>")
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "vocab_size": len(tokenizer)})).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_pretrained_llama(path: Path) -> Path:
    """A small pretrained-looking HF directory at `path` (weights, config.json, the demo tokenizer): what a user's
    model.path holds, at the demo tokenizer's vocabulary."""
    from flexengine.data.demo import load_demo_tokenizer

    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "vocab_size": 2048})).save_pretrained(path)
    load_demo_tokenizer().save_pretrained(path)
    return path


# the GPU checks' small LLaMA (wide enough for flex's 128-token blocks and bf16 tolerances)
GPU_TINY_LLAMA = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=65536,
    use_cache=False,
    tie_word_embeddings=False,
)

# An A100-80GB as the planner tests plan for it: named card, its peak, PCIe and a host budget
A100 = HardwareConfig(name="a100_80g", device="cuda", memory_gb=80, peak_tflops=312, pcie_gb_s=25, host_memory_gb=120)

TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    use_cache=False,
    tie_word_embeddings=False,
)


def make_llama(seed: int = 0, attn_implementation: str = "eager", **overrides) -> LlamaForCausalLM:
    """A tiny GQA LLaMA with its own config object (set_attn_implementation mutates the config)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def make_mistral(seed: int = 0, sliding_window: int = 8, attn_implementation: str = "eager") -> MistralForCausalLM:
    """A tiny GQA Mistral with a native sliding window."""
    torch.manual_seed(seed)
    config = MistralConfig(**{**TINY_LLAMA, "sliding_window": sliding_window})
    model = MistralForCausalLM(config).eval()
    model.set_attn_implementation(attn_implementation)
    return model


QWEN_MIXED = dict(TINY_LLAMA, num_hidden_layers=4, use_sliding_window=True, sliding_window=6, max_window_layers=2)


def make_qwen_mixed(seed: int = 0, **overrides) -> Qwen2ForCausalLM:
    """A tiny Qwen2 whose layers 2 and 3 use a sliding window (6 tokens by default) and layers 0 and 1 full
    attention (its config's layer_types): one model with two mask kinds."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**{**QWEN_MIXED, **overrides})).eval()
    model.set_attn_implementation("eager")
    return model


class CharTokenizer:
    """A tokenizer stand-in for greedy samples on tiny models: one id per character (< 256), id 0 pads."""

    pad_token_id, eos_token_id = 0, None

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) % 256 for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


def clone_model(model: torch.nn.Module, attn_implementation: str = "eager") -> torch.nn.Module:
    """Same weights, independent config (so patching one never changes the other)."""
    twin = copy.deepcopy(model)
    twin.config = copy.deepcopy(model.config)
    for module in twin.modules():
        if hasattr(module, "config"):
            module.config = twin.config
    twin.set_attn_implementation(attn_implementation)
    return twin


def assert_same_loss_gradients(model, reference, batch) -> None:
    """Run both patched models' decoder + summed LM loss on batch; outputs and every parameter gradient must match."""
    from flexengine.surgery.loss import causal_lm_loss_sum

    outs = []
    for m in (model, reference):
        out = m.get_decoder()(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        causal_lm_loss_sum(out.last_hidden_state, batch["labels"], m.lm_head).backward()
        outs.append(out.last_hidden_state.detach())
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


GRAD_RUN = ["debug=fast", "optim.grad_clip=0", "data.shuffle=true"]  # no clipping: raw gradients compared


def free_port() -> int:
    """A TCP port no process listens on now (the OS picks it): concurrent launchers, xdist workers included, never
    share a rendezvous port the way ports derived from a pid could."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def python_launcher(ranks: int) -> list:
    """`python` (ranks 0), or `python -m torch.distributed.run` with `ranks` processes on a free port."""
    import sys

    if ranks == 0:
        return [sys.executable]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(ranks),
        "--master_port",
        str(free_port()),
    ]


def run_grads_script(out, *overrides: str, ranks: int = 0, script: str = "parallel_grads.py") -> dict:
    """tests/support/<script> (torchrun with `ranks` processes; 0 = plain): the first step's gradients +
    collectives."""
    import os
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(here.parent)}
    proc = subprocess.run(
        [*python_launcher(ranks), str(here / "support" / script), str(out), *GRAD_RUN, *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=Path(out).parent,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {**torch.load(Path(out) / "grads.pt"), "log": proc.stderr}


def sdpa_on_block_mask(query, key, value, block_mask, scale=None, enable_gqa=False):
    """FlexAttention's result computed by SDPA on the boolean mask the BlockMask's own mask_mod defines
    (materialised by torch's create_mask): a stand-in with a CPU backward (flex has none) for CPU gradient checks
    of the code around the kernel."""
    from torch.nn.attention.flex_attention import create_mask

    B, _, Q, _ = query.shape
    mask = create_mask(block_mask.mask_mod, B, 1, Q, key.shape[2], query.device)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )


def flip_one_byte(path: Path) -> None:
    """Finite damage: one bit in the middle of the file (inside a safetensors file's tensor data, a value changes
    and the file still parses)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def trained_optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    """AdamW after one step on a tiny model (non-empty state), with a constant LambdaLR."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(input_ids=torch.randint(0, 256, (1, 8))).logits.sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return opt, sched


def checkpoint_state(model: torch.nn.Module, step: int) -> dict:
    """A trainer state of the shape the Checkpointer saves (counters, optimizer, schedule, data cursor, RNG)."""
    from flexengine.loop.checkpointer import _rng_state

    opt, sched = trained_optimizer(model)
    return {
        "train": {"step": step, "losses": [0.0] * step},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "data": {"epoch": 0, "cursor": step},
        "rng": _rng_state(),
    }


def random_row_loader(micro_batch: int, seq_len: int = 64, n_docs: int = 60):
    """A RowLoader over `n_docs` random documents of 5-39 tokens (ids 1-255), packed bfd into rows of `seq_len`, in
    order: a hand-built Trainer's data without tokenizing anything."""
    import numpy as np

    from flexengine.data.corpus import Corpus
    from flexengine.data.loader import RowLoader
    from flexengine.data.packing import flatten_documents, plan_packing

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 256, int(k)) for k in rng.integers(5, 40, n_docs)]
    tokens, offsets = flatten_documents(docs)
    corpus = Corpus(tokens=tokens, offsets=offsets)
    plan = plan_packing(corpus.lengths, seq_len, "bfd")
    return RowLoader(corpus, plan, seq_len=seq_len, micro_batch=micro_batch, pad_id=0, shuffle=False)


def plan_inputs_of(job: JobConfig, hardware, precision, on_cuda=None, hf_config=None):
    """PlanInputs of a whole job as the plan command builds them: attn.* resolved for the hardware's device, the
    job's resolved specs (flexengine.planning.specs), under a PrecisionSpec. hf_config: None = the job's model."""
    from flexengine.planning.fit import plan_specs
    from flexengine.planning.specs import plan_inputs, planned_attention
    from flexengine.surgery.model import build_hf_config

    hf_config = hf_config if hf_config is not None else build_hf_config(job.model)
    specs = plan_specs(job, hf_config, planned_attention(job.attn, hf_config, hardware))
    return plan_inputs(specs, hardware, precision, on_cuda)


def hide_package(monkeypatch, package: str) -> None:
    """Make `package` (and its submodules) unimportable for one test, as if it were not installed: `import` raises
    ModuleNotFoundError naming it, and importlib.util.find_spec finds nothing."""
    import sys

    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)
