"""Typed configuration: one dataclass per Hydra group plus the top-level `JobConfig` (model.* and data.* live in
config_model.py and config_data.py, the value checks and choice lists they share in config_checks.py; every name
other modules import from those is re-exported here).

These classes are the schemas Hydra validates overrides against (registered by `cli/common.register_schema`), and
the only configuration objects the library sees: the `DictConfig` is converted once at the entry point.
Cross-field rules live in `__post_init__` and raise `UserError` naming the key to change; the ones that need what an
attention mode means live beside the mode table (flexengine.surgery.attention.job_rules), applied at composition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

# The schemas and checks live in config_model / config_data / config_checks (each file one kind of thing), but
# `from flexengine.core.config import X` stays the one import site for every config name (dozens of call sites in
# the package and tests, and the documented public surface), so this module re-exports them.
from flexengine.core.config_checks import (  # noqa: F401 (re-exported)
    ATTN_BACKENDS,
    CP_BLOCK_SIZE,
    DATA_FORMATS,
    DATA_SOURCES,
    EVAL_OVERLAP,
    FIXED_ROPE_INSTEAD,
    LONG_DOC_POLICIES,
    MAX_SAMPLE_TOKENS,
    MODEL_INITS,
    OPTIM_NAMES,
    PACKING_STRATEGIES,
    PARALLEL_STRATEGIES,
    POSITION_DEPENDENT_ROPE,
    REDUCE_EVERY,
    ROPE_SCALING_TYPES,
    SCHEDULES,
    check_arch_sizes,
    check_choice,
    check_finite,
    check_fixed_rope,
    parse_tiled_mlp,
)
from flexengine.core.config_data import SEQ_LEN_AUTO, DataConfig, MixSource  # noqa: F401 (re-exported)
from flexengine.core.config_model import LoraConfig, ModelConfig, RopeScalingConfig  # noqa: F401 (re-exported)
from flexengine.core.device_speed import DeviceSpeed
from flexengine.core.errors import UserError
from flexengine.core.memory_policies import MEMORY_POLICIES
from flexengine.core.optimizers import OPTIMIZERS

DEFAULT_WARMUP_STEPS = 10  # optim.warmup_steps when neither it nor optim.warmup_ratio is set
RESUME_SCHEDULES = ("continue", "rederive")  # train.resume_schedule


def conf_dir() -> Path:
    """The directory of the shipped Hydra configs, the package flexengine.conf: the top-level conf/ of a checkout,
    flexengine/conf/ inside an installed wheel."""
    import flexengine.conf

    return Path(flexengine.conf.__file__).resolve().parent


@dataclass
class PrecisionConfig:
    """Storage and compute dtypes of weights, grads and optimizer states (see flexengine.surgery.precision)."""

    # auto: the fastest mode that fits and trains correctly (flexengine.planning.fit) | fp32 | bf16_mixed (fp32 masters,
    # bf16 compute) | bf16_sr (bf16 weights, stochastic-rounding AdamW) | bf16_cpu_master (fp32 masters + states in
    # host RAM) | bf16_pure (bf16 everything: small updates round away; only when asked). The names are
    # flexengine.surgery.precision.SPECS (= the conf/precision/*.yaml names, which composition checks it against:
    # flexengine.cli.common.group_options)
    mode: str = "auto"


@dataclass
class AttnConfig:
    """How attention sees a packed row."""

    # causal | packed_doc | sliding_window | packed_sliding: the names of flexengine.surgery.attention.masks.MODES,
    # checked with the rules that tie a mode to the rest of the job (surgery/attention/job_rules.py)
    mode: str = "causal"
    # auto (flex on CUDA, varlen on CPU) | flex | varlen (CPU: per-document SDPA calls, the causal kernel's cost)
    # | dense (boolean-mask SDPA: the exact reference) | sdpa (HF's own, padded baseline)
    backend: str = "auto"
    window: Optional[int] = None  # sliding modes: window in tokens (HF `sliding_window` semantics) on the
    # model's windowed layers (every layer if it has none); None = the model's own, per layer (`layer_types`)
    block_size: int = 128  # FlexAttention block size in tokens (also the unit of the reported block density)
    compile: bool = True  # compile flex_attention (uncompiled flex materialises scores: slow and memory hungry)
    dense_chunk: int = 512  # dense backend: queries per SDPA call; keys before the chunk's first document skipped

    def __post_init__(self) -> None:
        check_choice("attn.backend", self.backend, ATTN_BACKENDS)
        if self.block_size <= 0:
            raise UserError(f"attn.block_size={self.block_size} must be a positive number of tokens (e.g. 128).")
        if self.dense_chunk <= 0:
            raise UserError(f"attn.dense_chunk={self.dense_chunk} must be a positive number of query tokens.")
        if self.window is not None and self.window <= 0:
            raise UserError(f"attn.window={self.window} must be a positive number of tokens (or null).")


@dataclass
class MemoryConfig:
    """Activation memory policy per decoder block (see flexengine.surgery.memory)."""

    # a name of core/memory_policies.MEMORY_POLICIES (none | full | selective | offload), or auto: the planner picks
    policy: str = "none"  # (the shipped conf/ default is memory=auto)
    # The three below: null under policy=auto lets the planner choose; a value given is respected by it.
    # Under a concrete policy null means all / block / false.
    layers: Optional[str] = None  # all | every_<n> | first_<k> | last_<k> | spread_<k> | list of blocks, "0,3,7"
    # block | attention | mlp | ops (op-level SAC: save matmuls/attention): a kind of surgery/memory/kinds.KINDS,
    # checked against that table where the job is composed (kinds.check_granularity)
    granularity: Optional[str] = None
    offload: Optional[bool] = None  # with full/selective: also keep the checkpoint inputs in (pinned) CPU memory
    # MLP over tiles of this many tokens (B x S flattened), each recomputed in backward: the tokens x
    # intermediate_size tensors exist one tile at a time | 0 = off | auto = the planner tiles (hidden_size tokens
    # per tile) when that is what makes the step fit. Composes with every policy but selective/mlp.
    tiled_mlp: Any = 0

    def __post_init__(self) -> None:
        self.tiled_mlp = parse_tiled_mlp(self.tiled_mlp)
        check_choice("memory.policy", self.policy, (*MEMORY_POLICIES, "auto"))  # read now: a test may add one
        if self.policy == "auto":
            return
        policy = MEMORY_POLICIES[self.policy]
        self.layers = "all" if self.layers is None else self.layers
        self.granularity = (policy.granularity or "block") if self.granularity is None else self.granularity
        self.offload = bool(self.offload)
        policy.check(self)


@dataclass
class LossConfig:
    """Cross-entropy computation."""

    chunk_size: int = 0  # tokens per chunk of the lm_head + CE (0 = whole sequence at once); bounds logits memory
    fused: bool = False  # compute each chunk's gradients in the forward (surgery/fused_loss.py): backward does not
    # run lm_head's forward again (2 x hidden x vocab FLOPs per token); needs chunk_size > 0 and a plain nn.Linear
    # lm_head

    def __post_init__(self) -> None:
        if self.chunk_size < 0:
            raise UserError(f"loss.chunk_size={self.chunk_size} must be >= 0 (0 = the whole sequence at once).")
        if self.fused and self.chunk_size == 0:
            raise UserError(
                "loss.fused=true needs loss.chunk_size > 0 (e.g. 1024): the fused loss computes the gradients chunk by "
                "chunk; with the whole sequence in one piece nothing is re-run to save. Set loss.chunk_size or "
                "loss.fused=false."
            )


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
        check_choice("optim.name", self.name, tuple(OPTIMIZERS))  # read now: a test may add one
        check_choice("optim.schedule", self.schedule, SCHEDULES)
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
        check_finite("optim.lr", self.lr, low=0.0, hint=" (the peak learning rate, e.g. 1e-4; 0 = frozen weights)")
        check_finite("optim.eps", self.eps, low=0.0, low_ok=False, hint=" (e.g. 1e-8)")
        check_finite("optim.weight_decay", self.weight_decay, low=0.0, hint=" (0 = none, e.g. 0.1)")
        check_finite("optim.grad_clip", self.grad_clip, low=0.0, hint=" (the max global grad norm; 0 = no clipping)")
        if len(self.betas) != 2:
            raise UserError(f"optim.betas={list(self.betas)} must be two numbers, e.g. [0.9,0.95].")
        for i, beta in enumerate(self.betas):
            check_finite(f"optim.betas[{i}]", beta, low=0.0, high=1.0, high_ok=False, hint=" (e.g. [0.9,0.95])")


@dataclass
class HardwareConfig:
    """The machine a run targets: memory budgets, peak FLOP/s for MFU, PCIe bandwidth (flexengine.core.hardware)."""

    name: str = "auto"  # auto: detected at run time (CUDA device name, else cpu)
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    memory_gb: Optional[float] = None  # the device's memory (GiB) as torch reports it; None = measured (CUDA:
    # total memory of the device, a named card never above it; CPU: the host's available memory). The planner
    # fits into it less the CUDA context and the fragmentation margin (flexengine.planning.budget)
    cuda_context_gb: Optional[float] = None  # GiB the CUDA context (and any other process) holds outside the
    # allocator; None = measured at start-up on a GPU, assumed 0.8 when planning for a card without one
    memory_margin_gb: Optional[float] = None  # GiB of the card no plan may fill: the caching allocator's
    # fragmentation, cuBLAS/Inductor workspaces, the planner's own error; None = max(5 % of the card, 3 GiB) on
    # CUDA, 0 on CPU; 0 = plan to the last byte
    peak_tflops: Optional[float] = None  # dense bf16 (GPU) / fp32 (CPU) peak, TFLOP/s per device, for MFU;
    # None = from the table of known devices; unknown devices report no MFU rather than a wrong one
    pcie_gb_s: float = 25.0  # host<->device bandwidth, GB/s, for offload traffic estimates
    host_memory_gb: Optional[float] = None  # host memory (GiB) this process may use for offloaded activations
    # and host optimizer state; None = the available host memory divided among the node's local ranks
    world_size: int = 1  # devices in the job (torchrun sets the real value)
    interconnect_gb_s: Optional[float] = None  # GPU<->GPU bandwidth per GPU (GB/s, one direction, what NCCL's
    # reduce-scatter achieves) for FSDP's gradient reduction time; None = by hardware.name (NVLink estimates in
    # planning/costs.INTERCONNECT_GB_S), else pcie_gb_s
    # The device's measured speed, one per compute dtype (flexengine.core.device_speed): filled in when a run or a
    # plan is for the device it runs on, never from a config file (a measurement is this machine's, not a setting)
    speed: tuple[DeviceSpeed, ...] = field(default=(), metadata={"omegaconf_ignore": True})

    @property
    def on_cuda(self) -> bool:
        """The device is a GPU (device as flexengine.core.hardware resolved it)."""
        return self.device == "cuda"

    @property
    def on_cpu(self) -> bool:
        """The device is the host itself (its memory is the host memory: one pool)."""
        return self.device == "cpu"

    def __post_init__(self) -> None:
        check_choice("hardware.device", self.device, ("auto", "cpu", "cuda"))
        for key in ("memory_gb", "peak_tflops", "host_memory_gb", "interconnect_gb_s"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise UserError(f"hardware.{key}={value} must be positive (or null to measure/look it up).")
        for key in ("cuda_context_gb", "memory_margin_gb"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise UserError(f"hardware.{key}={value} must be >= 0 (or null for the measured/default figure).")


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
        check_choice("parallel.strategy", self.strategy, PARALLEL_STRATEGIES)
        check_choice("parallel.backend", self.backend, ("auto", "nccl", "gloo"))
        check_choice("parallel.reduce_every", self.reduce_every, REDUCE_EVERY)
        if self.data_timeout_s <= 0:
            raise UserError(f"parallel.data_timeout_s={self.data_timeout_s} must be a positive number of seconds.")
        if self.cp < 1:
            raise UserError(f"parallel.cp={self.cp} must be >= 1 (1 = no context parallelism).")
        if self.cp > 1 and self.strategy != "fsdp":
            raise UserError(
                f"parallel.cp={self.cp} composes with FSDP2 only (parallel=fsdp): the (dp, cp) mesh and "
                "the gradient checks are built for it; DDP under CP is not implemented."
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
    # a resume whose train.max_steps differs from the saved run's: continue (the lr goes on from the saved step's,
    # the rest of the saved schedule stretched over the steps left) | rederive (the schedule planned over the new
    # length from step 0: the lr jumps to where that schedule is at the saved step)
    resume_schedule: str = "continue"
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
        check_choice("train.resume_schedule", self.resume_schedule, RESUME_SCHEDULES)
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
        # attn.mode's rules against data.packing, the window and RoPE: surgery/attention/job_rules.py (they need the
        # mode table, which core does not see), applied by every entry point after composition
        if self.parallel.cp > 1:
            check_context_parallel(
                self.parallel.cp, self.attn, self.data.fixed_seq_len, self.model.rope_scaling.rope_type
            )
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
