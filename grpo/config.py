"""The run's settings: one frozen dataclass per section of a recipe, each field with its docstring and its valid
choices or range, checked when the section is built; `check` holds the rules that relate fields to each other and
to the world size (start-up and `--dry-run` run it). Code that uses a setting reads its section, by the same name."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from grpo.advantages import ESTIMATORS
from rewards.cooccurrence import SEMANTICS

# The loss's modes (grpo.losses implements one entry per name).
POLICY_LOSSES = ("ppo", "cispo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "abs", "k2", "k3")


class ConfigError(ValueError):
    """A recipe, an override or a combination of settings that cannot run; the message names the key."""


def refuse(condition, message: str) -> None:
    """One rule of the settings: ConfigError(message), naming the keys and values, where `condition` holds."""
    if condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class Range:
    """A numeric field's valid values: finite, in [low, high]; an open end excludes its bound; low None: unbounded."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        above = self.low is None or value > self.low or (value == self.low and not self.low_open)
        below = self.high is None or value < self.high or (value == self.high and not self.high_open)
        return math.isfinite(value) and above and below

    def __str__(self) -> str:
        if self.low is None:
            return "a finite number"
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


# The metadata of a setting a resume may change without naming it in trainer.resume_changes (choice and bounded
# take free=True): how the run is executed, evaluated, logged and checkpointed, and its length; every other setting
# defines what the checkpoint's run trains (resume_differences).
FREE = {"resume_free": True}


def choice(default: str, choices: tuple[str, ...], *, free: bool = False):
    """A string field whose value must be one of `choices`; free: a resume may change it (FREE)."""
    return field(default=default, metadata={"choices": choices, "resume_free": free})


def bounded(default, low: float | None = None, high: float | None = None, *, low_open: bool = False,
            high_open: bool = False, free: bool = False):
    """A numeric field (a list: each element) within Range(low, high, ...); None, where the type allows it, is "off";
    free: a resume may change it (FREE)."""
    metadata = {"range": Range(low, high, low_open, high_open), "resume_free": free}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


class Section:
    """Checks its fields' choices and ranges when built; KEY is the section's dotted name in a recipe."""
    KEY = ""

    def __post_init__(self):
        for spec in fields(self):
            value, key = getattr(self, spec.name), f"{self.KEY}{spec.name}"
            allowed = spec.metadata.get("choices")
            if allowed and value not in allowed:
                raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
            valid = spec.metadata.get("range")
            for index, number in enumerate(value if isinstance(value, list) else [value]):
                if valid is not None and number is not None and not valid.contains(number):
                    where = f"{key}[{index}]" if isinstance(value, list) else key
                    raise ConfigError(f"{where}={number!r} is out of range: it must be {valid}")


@dataclass(frozen=True)
class LoraConfig(Section):
    KEY = "model.lora."
    enabled: bool = False
    """Train peft LoRA adapters only; the KL reference is the policy with adapters off; engines get merged weights."""
    rank: int = bounded(16, 1)
    """LoRA rank r (the published factual-QA runs used 128)."""
    alpha: float = bounded(32.0, 0, low_open=True)
    """LoRA alpha; the update is scaled by alpha / rank (published: 256)."""
    dropout: float = bounded(0.0, 0, 1, high_open=True)
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    """Linear layers that get adapters (not lm_head: the logprob pass reads its weight directly)."""
    merged_export: bool = False
    """Also write a merged HF model under checkpoints/step_<n>/merged (what init_from / eval / vLLM load)."""


@dataclass(frozen=True)
class ModelConfig(Section):
    KEY = "model."
    name_or_path: str | None = None
    """Local HF directory, an HF id in the local cache, or null for the embedded SmolLM2-135M-Instruct."""
    dtype: str = choice("float32", ("float32", "bfloat16"))
    """Master weight dtype."""
    param_dtype: str = choice("float32", ("float32", "bfloat16"))
    """Compute dtype (FSDP2 mixed precision under torchrun, autocast in one process); gradients in float32."""
    attn_implementation: str = choice("auto", ("auto", "sdpa", "eager", "flash_attention_2"))
    """auto (flash_attention_2 on CUDA with flash-attn and a half compute dtype, else sdpa), sdpa or eager."""
    gradient_checkpointing: bool = field(default=False, metadata=FREE)
    """Recompute activations in backward to save memory."""
    trust_remote_code: bool = False
    """Run code shipped with a model directory. Off unless you trust it."""
    logprob_chunk_size: int = bounded(1024, 1, free=True)
    """Completion positions projected to the vocabulary at once in logprob passes (bounds peak memory)."""
    packed_logprobs: bool = False
    """Padding-free logprob passes (each distinct prompt once, every completion at its length); sdpa / flash only."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (off by default)."""


@dataclass(frozen=True)
class DataConfig(Section):
    KEY = "data."
    train_files: list[str] = field(default_factory=list)
    """Row files (JSONL or Parquet, verl format) to train on."""
    eval_files: list[str] = field(default_factory=list, metadata=FREE)
    """Held-out row files scored greedily at the start and the end of the run."""
    eval_size: int = bounded(0, 0, free=True)
    """Rows taken from eval_files (0: all)."""
    shuffle: bool = True
    """Shuffle training rows every epoch (seeded)."""
    max_prompt_tokens: int = bounded(1024, 1)
    """Prompts longer than this fail at start-up, naming the row (or are dropped: filter_overlong_prompts)."""
    filter_overlong_prompts: bool = False
    """Drop rows whose prompt is longer than max_prompt_tokens, and say how many (verl's option), instead."""


@dataclass(frozen=True)
class RewardConfig(Section):
    KEY = "reward."
    functions: dict[str, str] = field(default_factory=dict)
    """Extra reward functions {data_source: "package.module:function" or "file.py:function"}, registered first."""
    sentence_coef: float = bounded(1.0, 0)
    """lambda of the sentence-level shaping G_i(t) = R_i + lambda * r_sent (only for rewards with sentences)."""
    corpus_index: str | None = None
    """infini-gram index directory for the factqa_corpus reward (`python -m rewards.corpus build`)."""
    correct_threshold: float = bounded(0.5)
    """Correct (accuracy, DAPO's filter) when the `acc` component, else the score, is at least this."""
    triple_extractor: str = choice("rule", ("rule", "model"))
    """factqa_corpus: rule-based triples, or a local causal LM prompted few-shot (its first valid triple)."""
    triple_extractor_model: str | None = None
    """The extractor LM for triple_extractor=model (local or cached); null: the embedded SmolLM2-135M-Instruct."""
    triple_extractor_max_new_tokens: int = bounded(48, 1)
    """Greedy tokens the extractor LM may write per sentence (one `head | relation | tail` line)."""
    cooccurrence_semantics: str = choice("engine", SEMANTICS)
    """factqa_corpus window: engine (infini-gram's count_cnf, the paper's) or document (docs/recipes.md)."""
    num_workers: int = bounded(0, 0, free=True)
    """Reward worker processes scoring a step's completions concurrently (0: in the training process)."""
    timeout_s: float | None = bounded(None, 0, low_open=True, free=True)
    """Seconds a reward call may take in a worker before the run ends naming the row; null waits forever."""


@dataclass(frozen=True)
class RolloutConfig(Section):
    KEY = "rollout."
    engine: str = choice("hf", ("hf", "vllm"))
    """hf (transformers; CPU and tests) or vllm."""
    n: int = bounded(4, 1)
    """G: completions per prompt."""
    max_new_tokens: int = bounded(64, 1)
    """Response length limit."""
    temperature: float = bounded(1.0, 0, low_open=True)
    """Sampling temperature; the trainer's logprobs use the same temperature."""
    top_p: float = bounded(1.0, 0, 1, low_open=True)
    """Nucleus sampling; below 1 the update is off-policy by the truncation (a warning, or tis_cap refused)."""
    top_k: int = bounded(0, 0)
    """Top-k sampling; 0 is off (other than 0: as top_p)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the completion ends with the token that completes one."""
    tools: dict[str, list[str]] = field(default_factory=dict)
    """Tools per data_source, {source: [name or "package.module:function"]} (rollout/tools.py); {}: one turn."""
    max_turns: int = bounded(4, 1)
    """Model turns per trajectory where the row's data source has tools; max_new_tokens bounds them all together."""
    tool_timeout_s: float = bounded(10.0, 0, low_open=True)
    """Seconds a tool call may run before the model is told that it timed out (and the trajectory goes on)."""
    search_index: str | None = None
    """The `search` tool's index directory (`python -m data.scifact --search --out DIR` writes DIR/search_index)."""
    num_threads: int | None = bounded(None, 1, free=True)
    """torch threads while the transformers engine generates (null: torch's; 1 is faster on a busy CPU)."""
    sync_bucket_mb: int = bounded(1024, 1, free=True)
    """Weight-sync bucket size into the engine."""
    sync_timeout_s: float = bounded(1800.0, 0, low_open=True, free=True)
    """Seconds a weight sync may take; past it the rank ends naming the phase, step and rank (exit code 124)."""
    vllm_kv_cache_mb: int = bounded(256, 1, free=True)
    """vLLM's KV cache on CPU (kv_cache_memory_bytes); on GPUs vllm_gpu_memory_utilization sizes it."""
    vllm_gpu_memory_utilization: float | None = bounded(None, 0, 1, low_open=True, free=True)
    """Fraction of GPU memory vLLM may take; null: 0.4 beside a trainer (colocated), 0.85 on a rollout rank's own
    GPU (placement=separate)."""
    max_model_len: int | None = bounded(None, 1)
    """vLLM's context; null: data.max_prompt_tokens plus the longest completion the run asks for."""
    enforce_eager: bool | None = field(default=None, metadata=FREE)
    """vLLM without CUDA graphs; null: eager on CPU, CUDA graphs on GPUs."""
    placement: str = choice("colocated", ("colocated", "separate"))
    """colocated: every rank generates, then trains; separate: the last num_ranks ranks only generate (separate.py)."""
    num_ranks: int = bounded(0, 0)
    """placement=separate: the ranks that run engines (the last ones of the torchrun world)."""
    tensor_parallel_size: int = bounded(1, 1)
    """vLLM tensor parallelism: each group of this many consecutive ranks runs one replica."""

    @property
    def tp_size(self) -> int:
        """Ranks per engine replica: vLLM's tensor parallelism; the transformers engine is one rank."""
        return self.tensor_parallel_size if self.engine == "vllm" else 1


@dataclass(frozen=True)
class AlgorithmConfig(Section):
    KEY = "algorithm."
    adv_estimator: str = choice("grpo", tuple(ESTIMATORS))
    """The advantage estimator (grpo.advantages); grpo, dr_grpo and batch_std take sentence rewards."""
    policy_loss: str = choice("ppo", POLICY_LOSSES)
    """ppo (the clipped surrogate; GSPO with ratio_level=sequence) or cispo (clipped, detached IS weights)."""
    adv_eps: float = bounded(1e-6, 0)
    """eps in (r - mean) / (std + eps)."""
    clip_low: float = bounded(0.2, 0, 1, high_open=True)
    """epsilon_low of the clipped surrogate."""
    clip_high: float = bounded(0.2, 0)
    """epsilon_high (DAPO's clip-higher uses 0.28)."""
    dual_clip: float | None = bounded(None, 1, low_open=True)
    """c > 1 caps the token loss at -A*c where A < 0 (Ye et al. 2020); null is off."""
    agg: str = choice("token-mean", AGGREGATIONS)
    """token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO; over max_new_tokens)."""
    kl_coef: float = bounded(0.0, 0)
    """Weight of the KL penalty to the frozen reference model; 0: no reference model at all."""
    kl_kind: str = choice("k3", KL_KINDS)
    kl_in_reward: bool = False
    """verl's use_kl_in_reward: kl_coef * the summed token KL leaves the loss and is taken off the reward."""
    ppo_epochs: int = bounded(1, 1)
    """Passes over each rollout batch."""
    ppo_mini_batch_size: int | None = bounded(None, 1)
    """Prompts per optimizer step over ALL ranks, as in verl; null: the whole batch, one step per epoch."""
    cispo_clip_low: float | None = bounded(None, 0, 1)
    """cispo: the weight is at least 1 - this; null: no lower bound (MiniMax-M1; verl uses clip_low)."""
    cispo_clip_high: float = bounded(4.0, 0)
    """cispo: the weight is at most 1 + this (4: ScaleRL's and TRL's cap of 5; TRL's epsilon_high - 1)."""
    ratio_level: str = choice("token", ("token", "sequence"))
    """token (PPO/GRPO/DAPO) or sequence (GSPO: clips near 3e-4 / 4e-4 and agg seq-mean-token-mean)."""
    entropy_coef: float = bounded(0.0, 0)
    """Entropy bonus, aggregated as the policy loss; 0 is off."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose correctness is constant and generate more until the batch is full."""
    max_gen_batches: int = bounded(3, 1)
    """Generation rounds per step allowed for dynamic sampling before training on what is there."""
    overlong_cache_len: int = bounded(0, 0)
    """DAPO overlong shaping: penalty ramp length in tokens before max_new_tokens; 0 is off."""
    overlong_factor: float = bounded(1.0, 0)
    """Maximum overlong penalty."""
    max_staleness: int = bounded(0, 0, 1)
    """placement=separate: 1 lets the engines generate step n+1 during step n's update (needs tis_cap)."""
    tis_cap: float | None = bounded(None, 0, low_open=True)
    """Truncated IS for the rollout/trainer mismatch: weights min(exp(old - rollout), cap); null is off."""
    tis_level: str = choice("token", ("token", "sequence"))
    teacher: str | None = None
    """On-policy distillation: the teacher (model path or checkpoint, the student's tokenizer); null is off."""
    distill_coef: float = bounded(1.0, 0)
    """Weight of the teacher's per-token signal, teacher logprob - student logprob, added to the advantage."""


@dataclass(frozen=True)
class OptimConfig(Section):
    KEY = "optim."
    lr: float = bounded(1e-6, 0, low_open=True)
    """Peak learning rate (AdamW)."""
    weight_decay: float = bounded(0.0, 0)
    """AdamW weight decay."""
    betas: list[float] = bounded([0.9, 0.999], 0, 1, high_open=True)
    """AdamW betas."""
    warmup_steps: int = bounded(0, 0)
    """Linear warmup steps."""
    schedule: str = choice("constant", ("constant", "linear", "cosine"))
    """constant, linear or cosine decay after warmup."""
    min_lr_ratio: float = bounded(0.0, 0, 1)
    """Final lr as a fraction of the peak for linear/cosine."""
    grad_clip: float = bounded(1.0, 0)
    """Max global gradient norm; 0 is off."""


@dataclass(frozen=True)
class TrainerConfig(Section):
    KEY = "trainer."
    steps: int = bounded(10, 1, free=True)
    """Training steps (RL: one rollout each)."""
    prompts_per_step: int = bounded(2, 1)
    """P: prompts per rank per step (each rank owns whole groups)."""
    micro_batch_size: int = bounded(8, 1)
    """Sequences per forward/backward (when max_tokens_per_micro_batch is 0)."""
    max_tokens_per_micro_batch: int = bounded(0, 0)
    """Micro-batches of at most this many prompt + completion tokens instead, as many on every rank; 0 is off."""
    sft_batch_size: int = bounded(8, 1)
    """SFT: examples per step per rank."""
    sft_max_len: int = bounded(1024, 1)
    """SFT: longer examples fail at start-up."""
    checkpoint: str = choice("full", ("full", "weights", "none"), free=True)
    """full (weights, optimizer, RNG: resumable), weights (HF model or LoRA adapter: for init_from, eval), or none."""
    save_every: int = bounded(0, 0, free=True)
    """Checkpoint every N steps (0: only at the end)."""
    keep_last: int = bounded(0, 0, free=True)
    """Keep only the newest K complete checkpoints (0: all)."""
    resume: str = choice("never", ("never", "auto", "always"), free=True)
    """never; auto: from the latest complete checkpoint when there is one (torchrun --max-restarts); always."""
    resume_changes: list[str] = field(default_factory=list, metadata=FREE)
    """Settings a resume may change from the run's recorded ones, e.g. [optim.lr]; other differences are refused."""
    resume_fallback: bool = field(default=False, metadata=FREE)
    """A resume whose latest checkpoint is damaged continues from the newest intact one before it (false: refused)."""
    overwrite: bool = field(default=False, metadata=FREE)
    """A fresh run in a directory holding an earlier run's checkpoints removes them first (false: refused)."""
    collective_timeout_s: float = bounded(1800.0, 0, low_open=True, free=True)
    """Seconds a collective may wait for the other ranks before the run fails naming phase, step and rank."""
    nccl_blocking_wait: bool = field(default=False, metadata=FREE)
    """NCCL only: a timed-out collective raises in the calling thread, naming phase, step and rank, but collectives
    then spin the CPU (TORCH_NCCL_BLOCKING_WAIT=1) and FSDP2's prefetches stop overlapping compute. Off: NCCL's
    watchdog ends the rank after collective_timeout_s, naming the collective and the rank."""
    out_dir: str = field(default="runs", metadata=FREE)
    """Parent of run directories."""
    run_name: str = field(default="run", metadata=FREE)
    """out_dir/run_name/ holds config, metrics, samples, checkpoints."""
    wandb_project: str | None = field(default=None, metadata=FREE)
    """Also log every step to this Weights & Biases project (pip install wandb; WANDB_MODE=offline works)."""
    max_consecutive_skips: int = bounded(3, 1, free=True)
    """Stop after this many optimizer steps skipped for a non-finite loss or gradient."""
    warn_after_steps: int = bounded(3, 1, free=True)
    """Warn when truncation or flat groups stay above their threshold this many steps in a row."""
    warn_truncation: float = bounded(0.5, 0, 1, free=True)
    """Truncation-rate threshold for the warning."""
    warn_flat_groups: float = bounded(0.9, 0, 1, free=True)
    """Flat-group-fraction threshold for the warning."""
    eval_every: int = bounded(0, 0, free=True)
    """Also score the held-out rows every N steps into metrics.jsonl (eval/*, with 95% intervals); 0: not between."""
    eval_before: bool = field(default=True, metadata=FREE)
    """Score the held-out rows before the first step (and after the last one in any case)."""
    eval_max_new_tokens: int = bounded(0, 0, free=True)
    """Held-out evaluation length (0: rollout.max_new_tokens)."""
    eval_batch_size: int = bounded(16, 1, free=True)
    """Held-out prompts completed at once (larger: faster per prompt, more KV-cache memory)."""
    keep_freed_memory: bool = field(default=True, metadata=FREE)
    """CPU: glibc keeps freed memory for reuse, so large tensors are not page-faulted in every step."""


@dataclass(frozen=True)
class Config(Section):
    stage: str = choice("rl", ("rl", "sft"))
    """rl (GRPO/DAPO) or sft."""
    seed: int = bounded(0, 0)
    """Seeds data order, sampling and initialisation."""
    init_from: str | None = None
    """A checkpoint directory whose weights start this run (e.g. the SFT stage's final checkpoint)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def eval_max_new_tokens(self) -> int:
        return self.trainer.eval_max_new_tokens or self.rollout.max_new_tokens


def resume_differences(cfg: Config, recorded: dict) -> list[str]:
    """"key: recorded -> now" for every setting that defines the run (not FREE, not in trainer.resume_changes)
    and differs from `recorded` (a config.yaml the run wrote); ConfigError for a resume_changes name no setting has."""
    def leaves(section, prefix=""):
        for spec in fields(section):
            value = getattr(section, spec.name)
            if isinstance(value, Section):
                yield from leaves(value, f"{prefix}{spec.name}.")
            else:
                yield f"{prefix}{spec.name}", (value, spec.metadata.get("resume_free", False))

    now = dict(leaves(cfg))
    unknown = [key for key in cfg.trainer.resume_changes if key not in now]
    if unknown:
        raise ConfigError(f"trainer.resume_changes: {unknown} name no setting (e.g. optim.lr)")
    differences = []
    for key, (value, free) in now.items():
        if free or key in cfg.trainer.resume_changes:
            continue
        old = recorded
        for part in key.split("."):
            old = old.get(part) if isinstance(old, dict) else None
        if old != value:
            differences.append(f"{key}: {old!r} -> {value!r}")
    return differences


GSPO_AGGREGATION = "seq-mean-token-mean"
# A sequence-level ratio (GSPO) moves by the MEAN token log-ratio, a few 1e-4 per update: a clip range meant
# for token ratios (0.2) would never bind. GSPO's paper uses 3e-4 / 4e-4; anything above this is refused.
SEQUENCE_CLIP_LIMIT = 0.05


def check(cfg: Config, world_size: int = 1, *, whole_world: int | None = None) -> None:
    """Every rule that relates settings to each other and to the world (ConfigError naming the keys). world_size:
    the ranks that train; whole_world: the torchrun world's (more under rollout.placement=separate)."""
    trainer, rollout = cfg.trainer, cfg.rollout
    if cfg.stage == "rl":
        refuse(rollout.n < 2, f"rollout.n={rollout.n}: a group needs at least 2 completions for a baseline")
        check_algorithm(cfg.algorithm)
        _check_rl(cfg, world_size)
        check_placement(cfg, whole_world or world_size)
    refuse(cfg.algorithm.overlong_cache_len > rollout.max_new_tokens, f"algorithm.overlong_cache_len="
           f"{cfg.algorithm.overlong_cache_len} exceeds rollout.max_new_tokens={rollout.max_new_tokens}")
    refuse(trainer.eval_every > trainer.steps, f"trainer.eval_every={trainer.eval_every} exceeds trainer.steps="
           f"{trainer.steps}: no held-out point would fall inside the run (0 scores before and after only)")
    refuse(trainer.save_every and trainer.checkpoint == "none", f"trainer.save_every={trainer.save_every} with "
           f"trainer.checkpoint=none: nothing would be written; set trainer.save_every=0 or trainer.checkpoint=full")
    refuse(trainer.eval_every and not cfg.data.eval_files,
           f"trainer.eval_every={trainer.eval_every} needs held-out rows: data.eval_files is empty")
    refuse(cfg.reward.timeout_s is not None and cfg.reward.num_workers == 0, f"reward.timeout_s={cfg.reward.timeout_s} "
           "needs reward.num_workers >= 1: a reward call that hangs inside the training process cannot be abandoned")
    refuse(any("search" in names for names in rollout.tools.values()) and rollout.search_index is None,
           "rollout.tools names the search tool but rollout.search_index is null: build an index with "
           "`python -m data.scifact --search --out DIR` and name DIR/search_index")
    refuse(rollout.tensor_parallel_size > 1 and rollout.engine != "vllm", f"rollout.tensor_parallel_size="
           f"{rollout.tensor_parallel_size} needs rollout.engine=vllm (the transformers engine runs on one rank)")
    needed = cfg.data.max_prompt_tokens + max(rollout.max_new_tokens, trainer.eval_max_new_tokens)
    refuse(rollout.engine == "vllm" and rollout.max_model_len is not None and rollout.max_model_len < needed,
           f"rollout.max_model_len={rollout.max_model_len} cannot hold the longest prompt allowed "
           f"(data.max_prompt_tokens={cfg.data.max_prompt_tokens}) plus {needed - cfg.data.max_prompt_tokens} new "
           f"tokens: {needed} would fit (or null to size it so)")
    model = cfg.model
    refuse(model.attn_implementation == "flash_attention_2" and model.param_dtype not in ("bfloat16", "float16"),
           f"model.attn_implementation=flash_attention_2 computes in bf16/fp16 only, but model.param_dtype="
           f"{model.param_dtype}; set model.param_dtype=bfloat16 or use sdpa")
    refuse(model.packed_logprobs and model.attn_implementation == "eager", "model.packed_logprobs=true runs on sdpa "
           "or flash_attention_2; model.attn_implementation=eager cannot pack")


def check_algorithm(algo: AlgorithmConfig) -> None:
    """The algorithm settings that contradict each other."""
    refuse(algo.ratio_level == "sequence" and max(algo.clip_low, algo.clip_high) > SEQUENCE_CLIP_LIMIT,
           f"algorithm.ratio_level=sequence (GSPO) with algorithm.clip_low={algo.clip_low}, algorithm.clip_high="
           f"{algo.clip_high}: a sequence ratio is exp of a MEAN log-ratio and moves far less than a token's, so a "
           f"token-level range never clips; GSPO uses clip_low=3e-4, clip_high=4e-4 (at most {SEQUENCE_CLIP_LIMIT} "
           f"accepted)")
    refuse(algo.policy_loss == "cispo" and (algo.dual_clip is not None or algo.ratio_level != "token"),
           f"algorithm.policy_loss=cispo weighs each token by its clipped ratio: it takes no algorithm.dual_clip "
           f"({algo.dual_clip}) and ratio_level token (got {algo.ratio_level})")
    # A token mean would weight each sequence by its length: another objective (verl forces this one for GSPO).
    refuse(algo.ratio_level == "sequence" and algo.agg != GSPO_AGGREGATION, f"algorithm.ratio_level=sequence (GSPO) "
           f"with algorithm.agg={algo.agg}: GSPO's objective is a mean over sequences; set algorithm.agg="
           f"{GSPO_AGGREGATION}")
    refuse(algo.adv_estimator == "none" and (algo.teacher is None or algo.distill_coef == 0 or algo.dynamic_sampling),
           f"algorithm.adv_estimator=none trains on distillation alone: it needs algorithm.teacher (got "
           f"{algo.teacher}), algorithm.distill_coef > 0 (got {algo.distill_coef}) and no algorithm.dynamic_sampling "
           f"(it would drop every group whose rewards are flat)")
    refuse(algo.kl_in_reward and algo.kl_coef <= 0, f"algorithm.kl_in_reward=true needs algorithm.kl_coef > 0 (got "
           f"{algo.kl_coef}): it is the coefficient of the KL subtracted from the reward")


def _check_rl(cfg: Config, world_size: int) -> None:
    """The RL batch arithmetic, and settings of different sections that contradict each other."""
    algo, trainer, rollout = cfg.algorithm, cfg.trainer, cfg.rollout
    mini = algo.ppo_mini_batch_size
    refuse(mini is not None and (mini % world_size or trainer.prompts_per_step % (mini // world_size)),
           f"algorithm.ppo_mini_batch_size={mini} (prompts per optimizer step over all {world_size} ranks, as in "
           f"verl) must be a multiple of the world size {world_size} whose share per rank divides "
           f"trainer.prompts_per_step={trainer.prompts_per_step} (per rank): e.g. "
           f"{trainer.prompts_per_step * world_size} for one optimizer step per rollout")
    rows = (mini // world_size if mini else trainer.prompts_per_step) * rollout.n
    size = trainer.micro_batch_size
    refuse(not trainer.max_tokens_per_micro_batch and rows % size and size < rows,
           f"trainer.micro_batch_size={size} does not divide the mini-batch of {rows} sequences "
           f"((algorithm.ppo_mini_batch_size or trainer.prompts_per_step) * rollout.n)")
    # Refused here rather than at the first sentence reward: one rank raising alone would leave the others waiting
    # in a collective.
    refuse(not ESTIMATORS[algo.adv_estimator].token_returns and cfg.reward.sentence_coef > 0,
           f"algorithm.adv_estimator={algo.adv_estimator} is defined for outcome rewards only; set "
           f"reward.sentence_coef=0 (or use grpo, dr_grpo or batch_std for sentence rewards)")
    # exp(old - rollout) would be each token's nucleus mass (the engines report logprobs of the renormalised
    # nucleus), a down-weighting of uncertain tokens, not the engine/trainer mismatch truncated IS corrects.
    refuse(algo.tis_cap is not None and (rollout.top_p < 1 or rollout.top_k > 0),
           f"algorithm.tis_cap={algo.tis_cap} with rollout.top_p={rollout.top_p}, rollout.top_k={rollout.top_k}: "
           f"truncated importance sampling compares the engine's logprobs of the truncated distribution with the "
           f"trainer's of the full one; sample with top_p: 1.0 and top_k: 0, or set algorithm.tis_cap: null")


def check_placement(cfg: Config, world_size: int) -> None:
    """The rules of rollout.placement and its replicas; world_size: the whole torchrun world."""
    rollout, algo = cfg.rollout, cfg.algorithm
    if rollout.placement == "colocated":
        refuse(rollout.num_ranks, f"rollout.num_ranks={rollout.num_ranks} needs rollout.placement=separate")
        refuse(algo.max_staleness, f"algorithm.max_staleness={algo.max_staleness} needs rollout.placement=separate: "
               f"colocated ranks generate with the weights they train")
        refuse(world_size % rollout.tp_size, f"rollout.tensor_parallel_size={rollout.tp_size} does not divide the "
               f"world size {world_size}: every rank must belong to one replica")
        return
    refuse(not 0 < rollout.num_ranks < world_size, f"rollout.placement=separate with rollout.num_ranks="
           f"{rollout.num_ranks} in a world of {world_size} ranks: at least one rank must generate and at least one "
           f"must train (launch with torchrun --nproc_per_node >= {rollout.num_ranks + 1})")
    # A rollout rank's vLLM runs in a process and a world of its own (launch.plan.vllm_arguments); spanning several
    # rollout ranks' devices with one tensor-parallel engine is not built.
    refuse(rollout.tp_size > 1, f"rollout.tensor_parallel_size={rollout.tp_size} with rollout.placement=separate: "
           f"each rollout rank runs one engine on its own device (tensor_parallel_size 1); use more rollout.num_ranks")
    trainers, replicas = world_size - rollout.num_ranks, rollout.num_ranks
    refuse(trainers % replicas, f"rollout.num_ranks={rollout.num_ranks} makes {replicas} engine replicas, which do "
           f"not divide the {trainers} trainer ranks: each replica serves an equal share of them")
    refuse(algo.max_staleness and algo.tis_cap is None, f"algorithm.max_staleness={algo.max_staleness} needs "
           f"algorithm.tis_cap: the batches come from an older policy, which truncated importance sampling corrects")


def startup_warnings(cfg: Config) -> list[str]:
    """Settings that are allowed but train something a user may not expect; printed once at start-up."""
    rollout = cfg.rollout
    if cfg.stage == "rl" and cfg.algorithm.tis_cap is None and (rollout.top_p < 1 or rollout.top_k > 0):
        return [f"rollout.top_p={rollout.top_p}, rollout.top_k={rollout.top_k}: the engine samples from the "
                f"truncated distribution, the trainer's ratio is of the full one, so the update is off-policy by "
                f"the truncation and nothing corrects it; expect logprob_gap to read the mean -log(probability "
                f"mass kept) of the sampled tokens (e.g. 0.69 where top_p=0.5 keeps half the mass) instead of ~0. "
                f"Sample with top_p: 1.0 and top_k: 0 for on-policy RL"]
    return []
