"""Typed configuration: one dataclass per Hydra group plus the top-level `JobConfig`.

These classes are the schemas Hydra validates overrides against (registered in `train.py`), and the only
configuration objects the library sees: the `DictConfig` is converted once at the entry point.
Cross-field rules live in `__post_init__` and raise `UserError` naming the key to change.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional

from flexengine.core.errors import UserError


class AttnMode(Enum):
    """attn.mode as a composition of two masks on top of causal: per-document and sliding-window."""

    CAUSAL = "causal"  # one document per row (padded)
    PACKED_DOC = "packed_doc"  # packed documents, each attending only to itself
    SLIDING_WINDOW = "sliding_window"  # one document per row, the last `window` keys
    PACKED_SLIDING = "packed_sliding"  # both

    @property
    def documents(self) -> bool:
        """Rows hold several documents separated by the mask (positions restart per document)."""
        return self in (AttnMode.PACKED_DOC, AttnMode.PACKED_SLIDING)

    @property
    def windowed(self) -> bool:
        """Queries see only a sliding window of keys (the model's own, or attn.window)."""
        return self in (AttnMode.SLIDING_WINDOW, AttnMode.PACKED_SLIDING)


ATTN_MODES = tuple(m.value for m in AttnMode)
ATTN_BACKENDS = ("auto", "flex", "dense", "varlen", "sdpa")
PACKING_STRATEGIES = ("auto", "bfd", "greedy", "none")
LONG_DOC_POLICIES = ("split", "truncate", "drop")
DATA_FORMATS = ("text", "chat", "pretokenized", "mixed")
DATA_SOURCES = ("demo", "jsonl", "parquet", "hf")
EVAL_OVERLAP = ("auto", "drop", "refuse", "allow")  # data.eval_overlap
MODEL_INITS = ("auto", "pretrained", "random")
PRECISIONS = ("auto", "fp32", "bf16_mixed", "bf16_sr", "bf16_cpu_master", "bf16_pure")
MEMORY_POLICIES = ("none", "full", "selective", "offload", "auto")
MEMORY_GRANULARITIES = ("block", "attention", "mlp", "ops")
ROPE_SCALING_TYPES = ("linear", "dynamic", "yarn", "llama3")
DEFAULT_WARMUP_STEPS = 10  # optim.warmup_steps when neither it nor optim.warmup_ratio is set
REDUCE_EVERY = ("auto", "window", "micro_batch")
SCHEDULES = ("cosine", "linear", "constant", "constant_with_warmup", "warmup_stable_decay")
OPTIM_NAMES = ("adamw", "adamw_8bit", "adamw_bf16", "adamw_cpu_offload")  # flexengine.loop.optim builds each


def conf_dir() -> Path:
    """The directory of the shipped Hydra configs, the package flexengine.conf: the top-level conf/ of a checkout,
    flexengine/conf/ inside an installed wheel."""
    import flexengine.conf

    return Path(flexengine.conf.__file__).resolve().parent


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise UserError(f"{key}={value!r} is not valid; choose one of {', '.join(choices)}.")


def _check_finite(
    key: str,
    value: float,
    *,
    low: float = -math.inf,
    low_ok: bool = True,
    high: float = math.inf,
    high_ok: bool = True,
    hint: str = "",
) -> None:
    """A number that must be finite and inside [low, high] (open ends where *_ok is False): NaN compares false
    with everything, so without this a NaN slips through every `<` check (grad_clip=nan meant "no clipping")."""
    inside = (value >= low if low_ok else value > low) and (value <= high if high_ok else value < high)
    if not math.isfinite(value) or not inside:
        if math.isinf(high):
            where = f"{'>=' if low_ok else '>'} {low:g}"
        else:
            where = "in " + ("[" if low_ok else "(") + f"{low:g}, {high:g}" + ("]" if high_ok else ")")
        raise UserError(f"{key}={value} must be a finite number {where}{hint}.")


# model.arch sizes a model cannot have zero (or fewer) of: HF builds such a config and fails deep in torch
ARCH_POSITIVE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "head_dim",
)
MAX_SAMPLE_TOKENS = 4096  # train.sample_tokens: generation re-runs the whole row per token (no KV cache)


@dataclass
class RopeScalingConfig:
    """HF RoPE scaling (model.rope_scaling.*) for positions past the trained context; rope_type=null: none.

    E.g. model.rope_scaling={rope_type:yarn,factor:2.0}. Written into the HF config's rope_parameters before the
    model is built, so checkpoints (config.json) load the same way. Unset (null) keys take HF's defaults."""

    rope_type: Optional[str] = None  # null (no scaling) | linear | dynamic | yarn | llama3
    factor: float = 1.0  # supported context / trained context (>= 1)
    original_max_position_embeddings: Optional[int] = None  # yarn/llama3: trained context; null = the config's
    low_freq_factor: Optional[float] = None  # llama3 (required there; Llama-3.1 uses 1.0)
    high_freq_factor: Optional[float] = None  # llama3 (required there; Llama-3.1 uses 4.0)
    attention_factor: Optional[float] = None  # yarn: cos/sin scale; null = 0.1 ln(factor) + 1
    beta_fast: Optional[float] = None  # yarn: extrapolation boundary in rotations (HF default 32)
    beta_slow: Optional[float] = None  # yarn: interpolation boundary in rotations (HF default 1)

    def __post_init__(self) -> None:
        if self.rope_type is None:
            return
        _check_choice("model.rope_scaling.rope_type", self.rope_type, ROPE_SCALING_TYPES)
        if self.factor < 1:
            raise UserError(
                f"model.rope_scaling.factor={self.factor} must be >= 1 (supported context / trained "
                f"context), e.g. model.rope_scaling={{rope_type:{self.rope_type},factor:2.0}}."
            )

    def as_hf(self) -> dict:
        """The keys HF's rope_parameters takes ({} without scaling)."""
        if self.rope_type is None:
            return {}
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class LoraConfig:
    """LoRA adapters through peft (model.lora.*); r=0 trains every weight instead."""

    r: int = 0  # adapter rank; 0 = full fine-tune (no adapters)
    alpha: float = 16.0  # scaling numerator: the update is (alpha / r) * B @ A
    dropout: float = 0.0  # dropout on the adapter input
    target_modules: Optional[List[str]] = None  # module-name suffixes that get adapters; null = every attention
    # and MLP projection of the model's family (flexengine.surgery.family: the names are the model's, not ours)

    def __post_init__(self) -> None:
        if self.r < 0:
            raise UserError(f"model.lora.r={self.r} must be >= 0 (0 = no LoRA, full fine-tune).")
        if self.r > 0 and self.target_modules is not None and not self.target_modules:
            raise UserError(
                "model.lora.target_modules is empty: name the Linear layers to adapt (suffixes of their module "
                "names), or leave it null for every attention and MLP projection of the model's family."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"model.lora.dropout={self.dropout} must be in [0, 1).")


@dataclass
class ModelConfig:
    """Which causal LM to train and how to build it."""

    name: str = "tiny"  # label used in logs and run names
    path: Optional[str] = None  # local HF directory (config.json, tokenizer, *.safetensors): its architecture
    # and weights are what trains; None = the architecture in `arch` with random weights
    init: str = "auto"  # auto: load `path`'s weights when given, else random | pretrained: `path` required |
    # random: random weights (architecture from `path` or `arch`), said loudly in the log
    arch: Dict[str, Any] = field(default_factory=dict)  # HF config fields used when `path` is None (needs model_type)
    tokenizer: Optional[str] = None  # tokenizer directory; None = `path`, or the offline demo tokenizer without one
    trust_remote_code: bool = False  # only for model directories that ship their own modelling code
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (model.lora.r > 0) instead of full fine-tune
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # positions past the trained context
    allow_long_context: bool = False  # train documents longer than the (scaled) context anyway, positions untrained

    def __post_init__(self) -> None:
        _check_choice("model.init", self.init, MODEL_INITS)
        if self.init == "pretrained" and self.path is None:
            raise UserError(
                f"model={self.name} loads pretrained weights, so model.path must name a local Hugging Face "
                "directory (config.json, tokenizer files, *.safetensors), e.g.\n"
                f"  python -m flexengine.train model={self.name} model.path=/models/deepseek-llm-7b-base\n"
                "or build the architecture with random weights (benchmarks): model.init=random"
            )
        if self.path is None and "model_type" not in self.arch:
            raise UserError(f"model={self.name}: without model.path, model.arch must give at least model_type.")
        check_arch_sizes(self.arch, "model.arch")

    @property
    def loads_weights(self) -> bool:
        """Whether the weights come from model.path (else they are initialised at random)."""
        return self.path is not None and self.init != "random"


def check_arch_sizes(arch: Any, where: str) -> None:
    """Positive model sizes (hidden_size, num_hidden_layers, ...) in an HF config dict: `where` names the source
    (model.arch, or model.path's config.json)."""
    for key in ARCH_POSITIVE_KEYS:
        value = arch.get(key) if hasattr(arch, "get") else getattr(arch, key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(f"{where}.{key}={value!r} must be a positive integer (e.g. {where}.{key}=256).")


@dataclass
class PrecisionConfig:
    """Storage and compute dtypes of weights, grads and optimizer states (see flexengine.surgery.precision)."""

    # auto: the fastest mode that fits and trains correctly (flexengine.planning.fit) | fp32 | bf16_mixed (fp32 masters,
    # bf16 compute) | bf16_sr (bf16 weights, stochastic-rounding AdamW) | bf16_cpu_master (fp32 masters + states in
    # host RAM) | bf16_pure (bf16 everything: small updates round away; only when asked)
    mode: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("precision.mode", self.mode, PRECISIONS)


@dataclass
class AttnConfig:
    """How attention sees a packed row."""

    mode: str = "causal"  # causal | packed_doc | sliding_window | packed_sliding
    # auto (flex on CUDA, varlen on CPU) | flex | varlen (CPU: per-document SDPA calls, the causal kernel's cost)
    # | dense (boolean-mask SDPA: the exact reference) | sdpa (HF's own, padded baseline)
    backend: str = "auto"
    window: Optional[int] = None  # sliding modes: window in tokens (HF `sliding_window` semantics) on the
    # model's windowed layers (every layer if it has none); None = the model's own, per layer (`layer_types`)
    block_size: int = 128  # FlexAttention block size in tokens (also the unit of the reported block density)
    compile: bool = True  # compile flex_attention (uncompiled flex materialises scores: slow and memory hungry)
    dense_chunk: int = 512  # dense backend: queries per SDPA call; keys before the chunk's first document skipped

    def __post_init__(self) -> None:
        _check_choice("attn.mode", self.mode, ATTN_MODES)
        _check_choice("attn.backend", self.backend, ATTN_BACKENDS)
        if self.block_size <= 0:
            raise UserError(f"attn.block_size={self.block_size} must be a positive number of tokens (e.g. 128).")
        if self.dense_chunk <= 0:
            raise UserError(f"attn.dense_chunk={self.dense_chunk} must be a positive number of query tokens.")
        if self.window is not None and self.window <= 0:
            raise UserError(f"attn.window={self.window} must be a positive number of tokens (or null).")
        if self.window is not None and not self.attn_mode.windowed:
            raise UserError(
                f"attn.window={self.window} is set but attn={self.mode} has no sliding window; "
                "use attn=packed_sliding (or attn=sliding_window), or drop attn.window."
            )

    @property
    def attn_mode(self) -> AttnMode:
        """attn.mode as the enum the rest of the code dispatches on."""
        return AttnMode(self.mode)

    @property
    def packs_documents(self) -> bool:
        """Whether rows hold several documents separated by the mask (else one document per row)."""
        return self.attn_mode.documents


def _parse_tiled_mlp(value: Any) -> Any:
    """memory.tiled_mlp: 0/off -> 0, a positive number of tokens per tile, or 'auto' (the planner decides)."""
    if value in (None, False, "off", "none"):
        return 0
    if value == "auto":
        return value
    tokens = value if isinstance(value, int) and not isinstance(value, bool) else -1
    if isinstance(value, str) and value.strip().isdigit():
        tokens = int(value)
    if tokens < 0:
        raise UserError(
            f"memory.tiled_mlp={value!r}: give tokens per tile (e.g. memory.tiled_mlp=4096), 0 for "
            "off, or auto (the planner tiles when that makes the step fit)"
        )
    return tokens


@dataclass
class MemoryConfig:
    """Activation memory policy per decoder block (see flexengine.surgery.memory)."""

    # none: keep everything | full: recompute whole selected blocks | selective: recompute at `granularity` |
    # offload: keep the selected blocks' saved tensors in CPU memory (no recompute) | auto: the planner picks
    policy: str = "none"  # (the shipped conf/ default is memory=auto)
    # The three below: null under policy=auto lets the planner choose; a value given is respected by it.
    # Under a concrete policy null means all / block / false.
    layers: Optional[str] = None  # all | every_<n> | first_<k> | last_<k> | spread_<k> | list of blocks, "0,3,7"
    granularity: Optional[str] = None  # block | attention | mlp | ops (op-level SAC: save matmuls/attention)
    offload: Optional[bool] = None  # with full/selective: also keep the checkpoint inputs in (pinned) CPU memory
    # MLP over tiles of this many tokens (B x S flattened), each recomputed in backward: the tokens x
    # intermediate_size tensors exist one tile at a time | 0 = off | auto = the planner tiles (hidden_size tokens
    # per tile) when that is what makes the step fit. Composes with every policy but selective/mlp.
    tiled_mlp: Any = 0

    def __post_init__(self) -> None:
        self.tiled_mlp = _parse_tiled_mlp(self.tiled_mlp)
        _check_choice("memory.policy", self.policy, MEMORY_POLICIES)
        if self.policy != "auto":
            self.layers = "all" if self.layers is None else self.layers
            self.granularity = "block" if self.granularity is None else self.granularity
            self.offload = bool(self.offload)
        if self.granularity is not None:
            _check_choice("memory.granularity", self.granularity, MEMORY_GRANULARITIES)
        if self.policy == "auto":
            return
        if self.policy == "full" and self.granularity != "block":
            raise UserError(
                f"memory=full recomputes whole blocks, but memory.granularity={self.granularity}; "
                f"use memory=selective memory.granularity={self.granularity}."
            )
        if self.policy in ("none", "offload") and self.offload:
            raise UserError(
                f"memory.offload=true offloads checkpoint inputs; memory.policy={self.policy} has none. "
                "Use memory=offload to offload every saved tensor, or memory=full memory.offload=true."
            )
        if self.tiled_mlp and self.policy == "selective" and self.granularity == "mlp":
            raise UserError(
                f"memory.tiled_mlp={self.tiled_mlp} already recomputes the MLP (per tile) and "
                "memory.granularity=mlp would recompute it again around the tiles: use one of them."
            )


@dataclass
class LossConfig:
    """Cross-entropy computation."""

    chunk_size: int = 0  # tokens per chunk of the lm_head + CE (0 = whole sequence at once); bounds logits memory


@dataclass
class MixSource:
    """One source of a data mixture (data.mix): read with data.*'s fields, and its format unless it names one."""

    path: str = ""  # file, directory or glob, like data.path
    weight: float = 1.0  # share of the training tokens (weights are normalised); a source is repeated or
    # subsampled (whole documents) to reach it
    source: Optional[str] = None  # jsonl | parquet | hf; None = data.source
    format: Optional[str] = None  # text | chat | pretokenized | mixed; None = data.format (a text file and a
    # chat file mix as [{path: code.jsonl}, {path: chats.jsonl, format: chat}])
    name: Optional[str] = None  # label in the packing report; None = the path


@dataclass
class DataConfig:
    """Where documents come from and how they are packed into rows."""

    source: str = "demo"  # demo (Python stdlib sources, offline) | jsonl | parquet | hf (HF `datasets`: local
    # JSON/Parquet/Arrow files via load_dataset, or a save_to_disk directory via load_from_disk; never the hub)
    path: Optional[str] = None  # file, directory or glob (several separated by commas) for jsonl/parquet/hf
    hf_split: str = "train"  # source=hf: the split of a saved DatasetDict
    mix: List[MixSource] = field(default_factory=list)  # several sources with weights instead of data.path, e.g.
    # data.mix='[{path: /d/code.jsonl, weight: 3}, {path: /d/chat.jsonl, weight: 1}]'; shares per source reported
    format: str = "text"  # text | chat | pretokenized | mixed (text and chat records, by data.format_field)
    text_field: str = "text"  # record field holding the document text (format=text)
    messages_field: str = "messages"  # record field holding the chat turns (format=chat)
    format_field: str = "format"  # format=mixed: the record field saying "text" or "chat" for that record
    train_on: str = "assistant"  # chat: assistant (completion-only loss: the replies and their end-of-turn
    # markers) | all (full-sequence loss)
    assistant_mask: str = "auto"  # chat: where replies are found. template: the chat template's
    # {% generation %} markers (transformers' return_assistant_tokens_mask) | prefix: render turn by turn |
    # auto: template when it has the markers, else prefix (the log says which)
    long_chats: str = "truncate"  # chat longer than seq_len: truncate (after the last assistant turn that fits)
    # | drop | split (mid-turn, by data.long_docs: an explicit choice); truncated and dropped ones are counted
    max_docs: Optional[int] = None  # use only the first N documents (None = all)
    on_error: str = "raise"  # raise: stop at the first bad record with file:line | skip: skip and count
    max_record_bytes: int = 64 << 20  # a JSONL line (one record) longer than this is a bad record (data.on_error),
    # read no further than this: a runaway single-line file would otherwise be held and tokenized whole
    seq_len: int = 1024  # tokens per packed row
    packing: str = "auto"  # auto (bfd for packed attn modes, none otherwise) | bfd (best-fit decreasing) | greedy
    # (data order) | none (one document per row, padded to the batch's longest)
    long_docs: str = "split"  # documents longer than seq_len: split | truncate | drop (always counted)
    bucket: bool = False  # packing=none: group documents of similar length into batches (less padding)
    add_eos: bool = True  # format=text: append the tokenizer's EOS to every document (chat: the template decides)
    cache_dir: Optional[str] = None  # tokenized-corpus cache; None = $FLEXENGINE_CACHE or ~/.cache/flexengine
    num_workers: int = 2  # tokenization processes; 0 or 1 = in this process (the Rust tokenizer's own threads)
    shuffle: bool = True  # shuffle packed rows each epoch (seeded by train.seed, resumable)
    demo_max_files: int = 400  # demo corpus: number of stdlib source files read
    eval_path: Optional[str] = None  # held-out documents (same source and format as data.path); None = split
    eval_split: Optional[str] = None  # data.eval_path as a saved HF DatasetDict: the split evaluated on;
    # None = "validation", else "test" (the log says which)
    eval_overlap: str = "auto"  # data.eval_path documents that are also training documents (identical tokens):
    # auto = drop them from the eval set (a WARNING gives the count) when they are <= 1 % of it (short repeated
    # records, e.g. wikitext's heading lines), refuse the run above that | drop (any number) | refuse (any) |
    # allow (keep them, with a warning: the eval loss then partly measures training data)
    eval_fraction: float = 0.0  # with no eval_path: this fraction of the documents is held out for evaluation
    # (whole documents, chosen by a hash of their tokens: stable across runs and seeds); 0 = no held-out set

    def __post_init__(self) -> None:
        _check_choice("data.source", self.source, DATA_SOURCES)
        _check_choice("data.format", self.format, DATA_FORMATS)
        _check_choice("data.packing", self.packing, PACKING_STRATEGIES)
        _check_choice("data.long_docs", self.long_docs, LONG_DOC_POLICIES)
        _check_choice("data.on_error", self.on_error, ("raise", "skip"))
        if self.max_record_bytes <= 0:
            raise UserError(f"data.max_record_bytes={self.max_record_bytes} must be a positive number of bytes.")
        _check_choice("data.train_on", self.train_on, ("assistant", "all"))
        _check_choice("data.assistant_mask", self.assistant_mask, ("auto", "template", "prefix"))
        _check_choice("data.long_chats", self.long_chats, ("truncate", "drop", "split"))
        if self.seq_len <= 0:
            raise UserError(f"data.seq_len={self.seq_len} must be a positive number of tokens, e.g. data.seq_len=4096.")
        if self.mix:
            if self.path:
                raise UserError("data.path and data.mix are both set: a mixture names its files in data.mix[*].path.")
            for i, part in enumerate(self.mix):
                part.source = part.source or self.source
                _check_choice(f"data.mix[{i}].source", part.source, DATA_SOURCES[1:])
                part.format = part.format or self.format
                _check_choice(f"data.mix[{i}].format", part.format, DATA_FORMATS)
                if not part.path:
                    raise UserError(f"data.mix[{i}] has no path.")
                if not part.weight > 0:
                    raise UserError(f"data.mix[{i}].weight={part.weight} must be positive.")
        elif self.source != "demo" and not self.path:
            raise UserError(
                f"data={self.source} needs data.path, e.g. data={self.source} data.path=/data/train.{self.source}"
            )
        if self.max_docs is not None and self.max_docs <= 0:
            raise UserError(f"data.max_docs={self.max_docs} must be positive (or null for all documents).")
        if self.source == "demo" and self.format != "text" and not self.mix:
            raise UserError(f"data=demo is plain text; data.format={self.format} needs data=jsonl or data=parquet.")
        if self.num_workers < 0:
            raise UserError(f"data.num_workers={self.num_workers} must be >= 0 (0 = tokenize in this process).")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise UserError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1) (0 = no held-out split).")
        if self.eval_path and self.eval_fraction:
            raise UserError(
                f"data.eval_path and data.eval_fraction={self.eval_fraction} both set: use one (the "
                "held-out set comes from a file, or from splitting data.path), e.g. data.eval_fraction=0."
            )
        _check_choice("data.eval_overlap", self.eval_overlap, EVAL_OVERLAP)
        if self.eval_split and not self.eval_path:
            raise UserError(
                f"data.eval_split={self.eval_split} names a split of data.eval_path, which is not set: set "
                "data.eval_path=<the saved DatasetDict> (it may be data.path itself)."
            )
        if self.eval_path and self.source == "demo":
            raise UserError(
                "data.eval_path needs a file source (data=jsonl or data=parquet); the demo corpus "
                "splits itself with data.eval_fraction."
            )

    @property
    def formats(self) -> set:
        """The record formats read: data.format, or each mixture source's."""
        return {m.format or self.format for m in self.mix} or {self.format}

    @property
    def has_eval(self) -> bool:
        """Whether a held-out set is configured."""
        return bool(self.eval_path) or self.eval_fraction > 0


@dataclass
class OptimConfig:
    """AdamW and its schedule."""

    lr: float = 1e-3  # peak learning rate
    schedule: str = "cosine"  # cosine | linear (to 0) | constant | constant_with_warmup | warmup_stable_decay
    min_lr_ratio: float = 0.1  # cosine and warmup_stable_decay end at lr * min_lr_ratio
    warmup_steps: Optional[int] = None  # linear warmup, in optimizer steps; None = 10 (or optim.warmup_ratio)
    warmup_ratio: Optional[float] = None  # warmup as a fraction of train.max_steps, e.g. 0.05 (instead of
    # optim.warmup_steps: setting both is refused)
    decay_fraction: float = 0.2  # warmup_stable_decay: the last fraction of the steps decays (cosine)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global grad norm (0 = no clipping)
    impl: str = "auto"  # auto (fused on CUDA, foreach on CPU) | fused | foreach | for_loop
    name: str = "adamw"  # adamw | adamw_8bit | adamw_bf16 (both torchao) | adamw_cpu_offload (states in host RAM)

    def __post_init__(self) -> None:
        _check_choice("optim.name", self.name, OPTIM_NAMES)
        _check_choice("optim.schedule", self.schedule, SCHEDULES)
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise UserError(f"optim.warmup_steps={self.warmup_steps} must be >= 0.")
        if self.warmup_ratio is not None:
            if self.warmup_steps is not None:
                raise UserError(
                    f"optim.warmup_steps={self.warmup_steps} and optim.warmup_ratio={self.warmup_ratio} are both set "
                    "(typed together on the command line, or both in config files): use one. Either one typed "
                    "alone on the command line overrides the other from a config file."
                )
            if not 0.0 <= self.warmup_ratio < 1.0:
                raise UserError(
                    f"optim.warmup_ratio={self.warmup_ratio} must be in [0, 1): the fraction of train.max_steps "
                    "spent warming up (1 would never reach the peak lr)."
                )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1].")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise UserError(f"optim.decay_fraction={self.decay_fraction} must be in (0, 1].")
        self._check_values()

    def warmup_for(self, max_steps: int) -> int:
        """Warmup steps of a run of max_steps optimizer steps: warmup_ratio of them, else warmup_steps (None: 10)."""
        if self.warmup_ratio is not None:
            return round(self.warmup_ratio * max_steps)
        return DEFAULT_WARMUP_STEPS if self.warmup_steps is None else self.warmup_steps

    def _check_values(self) -> None:
        """Each number a finite value the optimizer can use: a NaN lr or weight decay writes NaN weights, a
        negative eps or a beta >= 1 fails late inside torch, and grad_clip=nan meant no clipping."""
        _check_finite("optim.lr", self.lr, low=0.0, hint=" (the peak learning rate, e.g. 1e-4; 0 = frozen weights)")
        _check_finite("optim.eps", self.eps, low=0.0, low_ok=False, hint=" (e.g. 1e-8)")
        _check_finite("optim.weight_decay", self.weight_decay, low=0.0, hint=" (0 = none, e.g. 0.1)")
        _check_finite("optim.grad_clip", self.grad_clip, low=0.0, hint=" (the max global grad norm; 0 = no clipping)")
        if len(self.betas) != 2:
            raise UserError(f"optim.betas={list(self.betas)} must be two numbers, e.g. [0.9,0.95].")
        for i, beta in enumerate(self.betas):
            _check_finite(f"optim.betas[{i}]", beta, low=0.0, high=1.0, high_ok=False, hint=" (e.g. [0.9,0.95])")


@dataclass
class HardwareConfig:
    """The machine a run targets: memory budgets, peak FLOP/s for MFU, PCIe bandwidth (flexengine.core.hardware)."""

    name: str = "auto"  # auto: detected at run time (CUDA device name, else cpu)
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    memory_gb: Optional[float] = None  # per-device memory budget (GiB) the planner fits into; None = measured
    # (CUDA: total memory of the device; CPU: the host's available memory)
    peak_tflops: Optional[float] = None  # dense bf16 (GPU) / fp32 (CPU) peak, TFLOP/s per device, for MFU;
    # None = from the table of known devices; unknown devices report no MFU rather than a wrong one
    pcie_gb_s: float = 25.0  # host<->device bandwidth, GB/s, for offload traffic estimates
    host_memory_gb: Optional[float] = None  # host memory (GiB) this process may use for offloaded activations
    # and host optimizer state; None = the available host memory divided among the node's local ranks
    world_size: int = 1  # devices in the job (torchrun sets the real value)
    interconnect_gb_s: Optional[float] = None  # GPU<->GPU bandwidth per GPU (GB/s, one direction, what NCCL's
    # reduce-scatter achieves) for FSDP's gradient reduction time; None = by hardware.name (NVLink estimates in
    # memory/planner.INTERCONNECT_GB_S), else pcie_gb_s

    def __post_init__(self) -> None:
        _check_choice("hardware.device", self.device, ("auto", "cpu", "cuda"))
        for key in ("memory_gb", "peak_tflops", "host_memory_gb", "interconnect_gb_s"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise UserError(f"hardware.{key}={value} must be positive (or null to measure/look it up).")


@dataclass
class ParallelConfig:
    """How a torchrun job (WORLD_SIZE > 1) splits the work; a single process ignores it."""

    strategy: str = "fsdp"  # fsdp: FSDP2 fully_shard per decoder block + root | ddp: full replica per rank
    backend: str = "auto"  # process-group backend: auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    reshard_after_forward: bool = True  # fsdp: free gathered block weights after forward (re-gathered in
    # backward); false keeps them, one all-gather less per block for the memory of a full block per rank
    mixed_precision: bool = True  # fsdp on CUDA: bf16 compute weights, fp32 gradient reduction (CPU: ignored)
    data_timeout_s: float = 7200.0  # ranks > 0 wait this long for rank 0 to tokenize the corpus (a CPU-side
    # gloo barrier of its own: NCCL's 10-minute default timeout stays for training collectives)
    # fsdp with grad_accum > 1: when gradients are reduce-scattered. window: once, in the last micro-batch's
    # backward (every block's unsharded fp32 gradient lives through the window: 4 bytes/param, 24 GiB per GPU at
    # 7B) | micro_batch: in every backward (one block's at a time, grad_accum x the reduce-scatter traffic) |
    # auto: the planner picks the cheaper step that fits (flexengine.planning.planner)
    reduce_every: str = "auto"
    cp: int = 1  # context parallel degree: each row's tokens are split over cp ranks (torch's context_parallel,
    # FlexAttention with K/V all-gathered); the torchrun world is a (world/cp data-parallel x cp) mesh. 1 = off

    def __post_init__(self) -> None:
        _check_choice("parallel.strategy", self.strategy, ("fsdp", "ddp"))
        _check_choice("parallel.backend", self.backend, ("auto", "nccl", "gloo"))
        _check_choice("parallel.reduce_every", self.reduce_every, REDUCE_EVERY)
        if self.data_timeout_s <= 0:
            raise UserError(f"parallel.data_timeout_s={self.data_timeout_s} must be a positive number of seconds.")
        if self.cp < 1:
            raise UserError(f"parallel.cp={self.cp} must be >= 1 (1 = no context parallelism).")
        if self.cp > 1 and self.strategy != "fsdp":
            raise UserError(
                f"parallel.cp={self.cp} composes with FSDP2 only (parallel=fsdp): the (dp, cp) mesh and "
                "the gradient checks are built for it; DDP under CP is not implemented."
            )


# torch's CP BlockMask (_create_cp_block_mask) is built with FlexAttention's default 128-token blocks
CP_BLOCK_SIZE = 128
# HF RoPE types whose frequencies follow the positions of the tensor they are given (transformers'
# dynamic_rope_update: dynamic NTK rescales by max(position_ids) + 1, longrope picks its short or long factors by
# it, and the result is cached across batches): under CP each rank holds only its share of a row, so the ranks
# would rotate Q and K differently; under packing a document's rotation depends on its neighbours in the batch
# (2.4e-3 in logits for a 600-token document packed next to a 1,000-token one, measured with transformers 5.24)
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
FIXED_ROPE_INSTEAD = "model.rope_scaling={rope_type:yarn,factor:F} (or linear, llama3)"


def check_fixed_rope(
    rope_type: Optional[str],
    source: str,
    *,
    cp: int = 1,
    packed_attn: Optional[str] = None,
    instead: str = FIXED_ROPE_INSTEAD,
) -> None:
    """Refuse a RoPE whose frequencies depend on the positions in the tensor it gets where tokens that belong
    together would see different ones: context parallelism (cp > 1) or packed documents (packed_attn: attn.mode
    when it packs). `source`: where rope_type is set; `instead`: how to set a fixed scaling there."""
    if rope_type not in POSITION_DEPENDENT_ROPE:
        return
    if cp > 1:
        raise UserError(
            f"parallel.cp={cp} cannot train with {source} rope_type={rope_type}: that RoPE derives its frequencies "
            "from the largest position id in the tensor it gets, and under context parallelism each rank holds "
            "only its share of the row, so the ranks would rotate queries and keys with different frequencies. "
            f"Use a fixed scaling, {instead}, or parallel.cp=1."
        )
    if packed_attn is not None:
        # Only the fixed scalings are offered: attn=causal is no remedy (with micro_batch > 1 its rows share the
        # batch's largest position; even at micro_batch=1 dynamic NTK keeps an earlier, longer batch's frequencies).
        raise UserError(
            f"attn={packed_attn} packs several documents into a row, which cannot train with {source} "
            f"rope_type={rope_type}: that RoPE derives its frequencies from the largest position id in the batch "
            "(and transformers caches them across batches), so a packed document would be rotated differently "
            "depending on the documents packed next to it and on the batch before. Use a fixed scaling whose "
            f"frequencies depend only on the configured length, {instead}."
        )


def check_context_parallel(cp: int, attn: AttnConfig, seq_len: Optional[int], rope_type: Optional[str] = None) -> None:
    """The attention settings context parallelism can shard (UserError naming the key otherwise). seq_len None:
    rows of any length (plan.max_seq_len picks its own); rope_type: model.rope_scaling.rope_type."""
    check_fixed_rope(rope_type, "model.rope_scaling", cp=cp)
    if attn.backend not in ("auto", "flex"):
        raise UserError(
            f"parallel.cp={cp} needs attn.backend=flex (or auto on CUDA): torch's context parallel shards packed-"
            f"document attention through FlexAttention (K/V all-gathered, a CP BlockMask); attn.backend="
            f"{attn.backend} has no context-parallel path (SDPA's ring attention cannot mask documents)."
        )
    if attn.block_size != CP_BLOCK_SIZE:
        raise UserError(
            f"parallel.cp={cp} needs attn.block_size={CP_BLOCK_SIZE}: torch builds the per-rank "
            f"BlockMask with FlexAttention's default block size (attn.block_size={attn.block_size})."
        )
    if seq_len is not None and seq_len % (cp * CP_BLOCK_SIZE):
        raise UserError(
            f"data.seq_len={seq_len} must be a multiple of parallel.cp x {CP_BLOCK_SIZE} = {cp * CP_BLOCK_SIZE}: "
            "rows are load-balanced in whole 128-token blocks, the same number per rank; e.g. data.seq_len="
            f"{-(-seq_len // (cp * CP_BLOCK_SIZE)) * cp * CP_BLOCK_SIZE}."
        )


@dataclass
class TrainConfig:
    """The training loop."""

    max_steps: int = 120  # optimizer steps (ignored when train.epochs is set)
    epochs: Optional[float] = None  # train this many passes over the packed rows instead (max_steps computed)
    micro_batch: int = 2  # packed rows per forward
    grad_accum: int = 2  # micro-batches per optimizer step
    save_every: int = 0  # checkpoint every N optimizer steps (0 = only at the end)
    save_final: bool = True  # checkpoint at the end of the run
    resume: Optional[str] = None  # auto (newest checkpoint of train.output_dir that verifies) | path to step_<N>
    resume_new_data: bool = False  # resume even though the data stream changed (corpus, seq_len, packing,
    # micro_batch, ranks, seed): keep weights, optimizer and step; read the new data from its first row
    seed: int = 0
    log_every: int = 1  # optimizer steps between log lines (console, metrics.jsonl, TensorBoard)
    keep_last: int = 0  # keep the newest N step_<N> checkpoints (never the best or the resumed-from); 0 = all
    eval_every: int = 0  # evaluate the held-out set every N optimizer steps (and always at the end); 0 = end only
    eval_batches: int = 0  # micro-batches per evaluation, the same ones each time; 0 = the whole held-out set
    save_best: bool = True  # with a held-out set: checkpoint each new best eval loss (checkpoints/best points to
    # it); only in runs that write checkpoints at all (save_final or save_every)
    early_stop_patience: int = 0  # stop after this many evaluations without a new best eval loss; 0 = never
    sample_prompts: List[str] = field(default_factory=list)  # greedily continued into TensorBoard text
    sample_every: int = 0  # optimizer steps between samples (and at the end); 0 = with every evaluation
    sample_tokens: int = 32  # new tokens generated per prompt
    skip_nonfinite: bool = False  # skip (and count) a step whose loss is NaN/Inf instead of stopping
    compile: bool = False  # torch.compile each decoder block (fullgraph)
    compile_backend: str = "inductor"
    output_dir: Optional[str] = None  # None = Hydra's run dir
    profile: bool = False  # record a torch.profiler trace
    profile_steps: int = 3
    progress: bool = True  # tqdm progress bar, only when stderr is a terminal (job logs get the log lines)
    merge_lora_on_save: bool = False  # with model.lora.r > 0: checkpoints hold base+adapter merged weights
    # (a plain HF model) next to the adapter files; false: adapters only (small, needs the base to load)

    def __post_init__(self) -> None:
        for key in ("max_steps", "micro_batch", "grad_accum"):
            if getattr(self, key) <= 0:
                raise UserError(f"train.{key}={getattr(self, key)} must be a positive integer.")
        for key in ("save_every", "keep_last", "eval_every", "eval_batches", "early_stop_patience", "sample_every"):
            if getattr(self, key) < 0:
                raise UserError(f"train.{key}={getattr(self, key)} must be >= 0 (0 = off / default).")
        if self.log_every <= 0:
            raise UserError(f"train.log_every={self.log_every} must be a positive number of steps.")
        if self.epochs is not None and self.epochs <= 0:
            raise UserError(f"train.epochs={self.epochs} must be positive (or null to use train.max_steps).")
        if not 0 < self.sample_tokens <= MAX_SAMPLE_TOKENS:
            raise UserError(
                f"train.sample_tokens={self.sample_tokens} must be in 1..{MAX_SAMPLE_TOKENS}: each new token re-runs "
                "the whole row (no KV cache), so long samples take minutes to hours between steps."
            )


@dataclass
class JobConfig:
    """Everything one training run needs; built once from Hydra's composed config."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(init="random", arch={"model_type": "llama"}))
    attn: AttnConfig = field(default_factory=AttnConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.data.packing == "auto":
            self.data.packing = "bfd" if self.attn.packs_documents else "none"
        window = self.attn.window
        if window is not None and window > self.data.seq_len:
            raise UserError(
                f"attn.window={window} is longer than data.seq_len={self.data.seq_len}: the window would never "
                "apply. Lower attn.window or use attn=packed_doc."
            )
        if self.attn.packs_documents and self.data.packing == "none":
            raise UserError(
                f"attn={self.attn.mode} masks packed documents but data.packing=none puts one per row; "
                "use data.packing=bfd (or attn=causal for the padded baseline)."
            )
        if self.parallel.cp > 1:
            check_context_parallel(self.parallel.cp, self.attn, self.data.seq_len, self.model.rope_scaling.rope_type)
        packed = self.attn.mode if self.attn.packs_documents else None
        check_fixed_rope(self.model.rope_scaling.rope_type, "model.rope_scaling", packed_attn=packed)
        positions = self.model.arch.get("max_position_embeddings") if self.model.path is None else None
        if positions and self.train.sample_prompts and self.train.sample_tokens > positions:
            raise UserError(
                f"train.sample_tokens={self.train.sample_tokens} is more than the model's "
                f"max_position_embeddings={positions}: generation past it is untrained positions; lower it."
            )
        if self.train.early_stop_patience and not self.data.has_eval:
            raise UserError(
                f"train.early_stop_patience={self.train.early_stop_patience} watches the eval loss, but "
                "there is no held-out set: set data.eval_fraction (e.g. 0.05) or data.eval_path."
            )
        if not self.attn.packs_documents and self.data.packing != "none":
            raise UserError(
                f"attn={self.attn.mode} has no per-document mask, so packing several documents into one row "
                f"(data.packing={self.data.packing}) would let them attend to each other. Use attn=packed_doc, "
                "or data.packing=none for one document per row."
            )
