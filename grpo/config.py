"""The typed schema of a run: one dataclass per section, a docstring per field, the valid choices beside the
field that takes them. Recipes (launch/configs/*.yaml) and `key.sub=value` overrides are read into it by
launch/config.py; the loops in grpo/ receive it as it is.

The choice lists are the math's own (grpo/advantages.py, grpo/losses.py, grpo/schedule.py), so a value the
schema accepts is one the math knows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from grpo.advantages import SCALES
from grpo.losses import AGGREGATIONS, IS_LEVELS, KL_KINDS, RATIO_LEVELS
from grpo.schedule import SCHEDULES

STAGES = ("rl", "sft")
DTYPES = ("float32", "bfloat16")
ATTENTIONS = ("auto", "sdpa", "eager", "flash_attention_2")
ENGINES = ("hf", "vllm")


def choice(default: str, choices: tuple[str, ...]):
    """A string field whose value must be one of `choices` (launch/config.py checks it when a recipe is read)."""
    return field(default=default, metadata={"choices": choices})


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters (peft) instead of all weights; the reference model is then the policy with its
    adapters disabled (no second model), and the engine receives merged weights."""
    rank: int = 16
    """LoRA rank r (the published factual-QA runs used 128)."""
    alpha: float = 32.0
    """LoRA alpha; the update is scaled by alpha / rank (published: 256)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    """Linear layers that get adapters (lm_head is refused: the logprob pass reads its weight directly)."""
    merged_export: bool = False
    """Also write a merged HF model under checkpoints/step_<n>/merged (what init_from / eval / vLLM load)."""


@dataclass
class ModelConfig:
    name_or_path: str | None = None
    """Local HF directory, an HF id in the local cache, or null for the embedded SmolLM2-135M-Instruct."""
    dtype: str = choice("float32", DTYPES)
    """Master weight dtype: float32 or bfloat16."""
    param_dtype: str = choice("float32", DTYPES)
    """FSDP2 compute dtype (mixed precision): float32 or bfloat16; gradients are reduced in float32."""
    attn_implementation: str = choice("auto", ATTENTIONS)
    """auto (flash_attention_2 on CUDA when importable, else sdpa), sdpa or eager."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    trust_remote_code: bool = False
    """Run code shipped with a model directory. Off unless you trust it."""
    logprob_chunk_size: int = 1024
    """Completion positions projected to the vocabulary at once in logprob passes (bounds peak memory)."""
    packed_logprobs: bool = False
    """Run the trainer's logprob passes padding-free (models.logprobs.completion_logprobs(packed=True)): each
    distinct prompt once and every completion at its own length. The same values up to float rounding; sdpa
    or flash_attention_2 only."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (off by default)."""


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Row files (JSONL or Parquet, verl format) to train on."""
    eval_files: list[str] = field(default_factory=list)
    """Held-out row files scored greedily at the start and the end of the run."""
    eval_size: int = 0
    """Rows taken from eval_files (0: all)."""
    shuffle: bool = True
    """Shuffle training rows every epoch (seeded)."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this fail at start-up, naming the row."""


@dataclass
class RewardConfig:
    functions: dict[str, str] = field(default_factory=dict)
    """Extra reward functions: {data_source: "package.module:function"} registered before training."""
    sentence_coef: float = 1.0
    """lambda of the sentence-level shaping G_i(t) = R_i + lambda * r_sent (only for rewards with sentences)."""
    corpus_index: str | None = None
    """infini-gram index directory for the factqa_corpus reward (python -m rewards.corpus build --input
    corpus.jsonl --out DIR); exported to the reward as NANOGRPO_CORPUS_INDEX."""
    correct_threshold: float = 0.5
    """A completion counts as correct (for accuracy and DAPO's filter) when its `acc` component, or else its
    score, is at least this."""
    triple_extractor: str = "rule"
    """factqa_corpus: rule (rewards.triples.RuleTripleExtractor) or model (a local causal LM prompted few-shot,
    the first valid triple of its greedy output; the corpus paper uses a fine-tuned 0.5B extractor).
    Applied by launch.triples.install_factqa_reward."""
    triple_extractor_model: str | None = None
    """The extractor LM for triple_extractor=model: a local HF directory or a cached org/name; null is the
    embedded SmolLM2-135M-Instruct."""
    triple_extractor_max_new_tokens: int = 48
    """Greedy tokens the extractor LM may write per sentence (one `head | relation | tail` line)."""
    cooccurrence_semantics: str = "engine"
    """factqa_corpus window definition: engine (infini-gram's count_cnf, what the paper's count thresholds
    were calibrated on) or document (each side checked within the document; README, "Corpus counts")."""


@dataclass
class RolloutConfig:
    engine: str = choice("hf", ENGINES)
    """hf (transformers; CPU and tests) or vllm (colocated, one replica per rank)."""
    n: int = 4
    """G: completions per prompt."""
    max_new_tokens: int = 64
    """Response length limit."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's logprobs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling. The trainer does not truncate: with top_p < 1 the engine's logprobs are of the
    renormalised nucleus, so algorithm.tis_cap with top_p < 1 (or top_k > 0) is refused at start-up."""
    top_k: int = 0
    """Top-k sampling; 0 is off."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the completion is cut after the stop string."""
    num_threads: int | None = None
    """torch threads while the transformers engine generates; null keeps torch's setting (all cores). 1 is
    faster on a CPU shared with other jobs (rollout/engine.py torch_threads)."""
    sync_bucket_mb: int = 1024
    """Weight-sync bucket size into the engine."""
    vllm_kv_cache_mb: int = 256
    """vLLM KV cache bound on CPU (bytes are given to kv_cache_memory_bytes)."""
    vllm_gpu_memory_utilization: float = 0.4
    """Fraction of GPU memory vLLM may take when colocated."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism inside the torchrun world."""


@dataclass
class AlgorithmConfig:
    adv_scale: str = choice("group", SCALES)
    """group (GRPO), batch, none (Dr. GRPO)."""
    adv_eps: float = 1e-6
    """eps in (r - mean) / (std + eps)."""
    clip_low: float = 0.2
    """epsilon_low of the clipped surrogate."""
    clip_high: float = 0.2
    """epsilon_high (DAPO's clip-higher uses 0.28)."""
    dual_clip: float | None = None
    """c > 1 caps the token loss at -A*c where A < 0; null is off."""
    agg: str = choice("token-mean", AGGREGATIONS)
    """token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference model; 0 means no reference model at all."""
    kl_kind: str = choice("k3", KL_KINDS)
    """k1, abs, k2 or k3."""
    kl_in_reward: bool = False
    """verl's use_kl_in_reward: kl_coef * KL (kl_kind, of the rollout policy against the reference) leaves the
    reward instead of joining the loss: each completion's reward loses kl_coef * its summed token KL before
    advantages (grpo.shaping.kl_reward_penalty). Needs kl_coef > 0."""
    ppo_epochs: int = 1
    """Passes over each rollout batch. With one optimizer step per rollout (1 epoch, 1 mini-batch) the old
    logprobs are the current ones detached; otherwise one extra pass computes them once, before the first
    update."""
    ppo_mini_batch_size: int | None = None
    """Prompts per optimizer step, per rank like trainer.prompts_per_step (verl's ppo_mini_batch_size counts
    prompts over all ranks: this times the world size); each mini-batch is one optimizer step, each epoch
    visits them in order. null: the whole batch. Must divide trainer.prompts_per_step."""
    ratio_level: str = choice("token", RATIO_LEVELS)
    """token (PPO/GRPO/DAPO) or sequence (GSPO: one ratio per sequence, exp of the mean token log-ratio; use
    GSPO's small clip ranges, e.g. clip_low 3e-4, clip_high 4e-4, and agg seq-mean-token-mean)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts entropy_coef * the aggregated token entropy (same agg and global
    denominator as the policy loss); 0 is off."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose correctness is constant and generate more until the batch is full."""
    max_gen_batches: int = 3
    """Generation rounds per step allowed for dynamic sampling before training on what is there."""
    overlong_cache_len: int = 0
    """DAPO overlong shaping: penalty ramp length in tokens before max_new_tokens; 0 is off."""
    overlong_factor: float = 1.0
    """Maximum overlong penalty."""
    tis_cap: float | None = None
    """Truncated importance sampling cap C for the rollout/trainer mismatch; null is off."""
    tis_level: str = choice("token", IS_LEVELS)
    """token or sequence."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    schedule: str = choice("constant", SCHEDULES)
    """constant, linear or cosine decay after warmup."""
    min_lr_ratio: float = 0.0
    """Final lr as a fraction of the peak for linear/cosine."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 is off."""


@dataclass
class TrainerConfig:
    steps: int = 10
    """Optimizer steps (RL) or SFT steps."""
    prompts_per_step: int = 2
    """P: prompts per rank per step (each rank owns whole groups)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (when max_tokens_per_micro_batch is 0)."""
    max_tokens_per_micro_batch: int = 0
    """Form micro-batches by token count instead: at most this many prompt + completion tokens each
    (models.batching.micro_batches_by_tokens), every rank the same number. 0: micro_batch_size rows."""
    sft_batch_size: int = 8
    """SFT: examples per step per rank."""
    sft_max_len: int = 1024
    """SFT: longer examples fail at start-up."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    out_dir: str = "runs"
    """Parent of run directories."""
    run_name: str = "run"
    """runs/<run_name>/ holds config, metrics, samples, checkpoints."""
    max_consecutive_skips: int = 3
    """Stop after this many optimizer steps skipped for a non-finite loss or gradient."""
    warn_after_steps: int = 3
    """Warn when truncation or flat groups stay above their threshold this many steps in a row."""
    warn_truncation: float = 0.5
    """Truncation-rate threshold for the warning."""
    warn_flat_groups: float = 0.9
    """Flat-group-fraction threshold for the warning."""
    eval_every: int = 0
    """Score the held-out rows before the first step, every N steps and after the last one, into
    metrics.jsonl (eval/<metric> with eval/<metric>_low/_high, its 95% interval); 0: only before and after."""
    eval_before: bool = True
    """Score the held-out rows before training too (the demo skips it when the previous stage just did: its
    "after" is this stage's start)."""
    eval_max_new_tokens: int = 0
    """Held-out evaluation length (0: rollout.max_new_tokens)."""


@dataclass
class Config:
    stage: str = choice("rl", STAGES)
    """rl (GRPO/DAPO) or sft."""
    seed: int = 0
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
