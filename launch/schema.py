"""The typed schema of a run: one dataclass per section of a recipe, a docstring per field, the valid choices and
numeric ranges beside the field that takes them (grpo.config.choice / bounded). Recipes (launch/configs/*.yaml)
and `key.sub=value` overrides are read into it by launch/config.py; launch/build.py reads it once into the
frozen specs and parts the loops receive (grpo/parts.py). The algorithm's own section is grpo.config's.

A numeric setting outside its range (`trainer.steps=-1`, `rollout.top_p=1.5`) is refused when the recipe is
read, naming the key, the value and the range; checks that relate two fields live in launch/preflight.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from grpo.config import AlgorithmConfig, bounded, choice
from grpo.schedule import SCHEDULES

STAGES = ("rl", "sft")
DTYPES = ("float32", "bfloat16")
ATTENTIONS = ("auto", "sdpa", "eager", "flash_attention_2")
ENGINES = ("hf", "vllm")
RESUMES = ("never", "auto", "always")
PLACEMENTS = ("colocated", "separate")


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters (peft) instead of all weights; the reference model is then the policy with its
    adapters disabled (no second model), and the engine receives merged weights."""
    rank: int = bounded(16, 1)
    """LoRA rank r (the published factual-QA runs used 128)."""
    alpha: float = bounded(32.0, 0, low_open=True)
    """LoRA alpha; the update is scaled by alpha / rank (published: 256)."""
    dropout: float = bounded(0.0, 0, 1, high_open=True)
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
    logprob_chunk_size: int = bounded(1024, 1)
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
    eval_size: int = bounded(0, 0)
    """Rows taken from eval_files (0: all)."""
    shuffle: bool = True
    """Shuffle training rows every epoch (seeded)."""
    max_prompt_tokens: int = bounded(1024, 1)
    """Prompts longer than this fail at start-up, naming the row."""


@dataclass
class RewardConfig:
    functions: dict[str, str] = field(default_factory=dict)
    """Extra reward functions: {data_source: "package.module:function"} registered before training."""
    sentence_coef: float = bounded(1.0, 0)
    """lambda of the sentence-level shaping G_i(t) = R_i + lambda * r_sent (only for rewards with sentences)."""
    corpus_index: str | None = None
    """infini-gram index directory for the factqa_corpus reward (python -m rewards.corpus build --input
    corpus.jsonl --out DIR); exported to the reward as NANOGRPO_CORPUS_INDEX."""
    correct_threshold: float = bounded(0.5)
    """A completion counts as correct (for accuracy and DAPO's filter) when its `acc` component, or else its
    score, is at least this."""
    triple_extractor: str = "rule"
    """factqa_corpus: rule (rewards.triples.RuleTripleExtractor) or model (a local causal LM prompted few-shot,
    the first valid triple of its greedy output; the corpus paper uses a fine-tuned 0.5B extractor).
    Applied by launch.triples.install_factqa_reward."""
    triple_extractor_model: str | None = None
    """The extractor LM for triple_extractor=model: a local HF directory or a cached org/name; null is the
    embedded SmolLM2-135M-Instruct."""
    triple_extractor_max_new_tokens: int = bounded(48, 1)
    """Greedy tokens the extractor LM may write per sentence (one `head | relation | tail` line)."""
    cooccurrence_semantics: str = "engine"
    """factqa_corpus window definition: engine (infini-gram's count_cnf, what the paper's count thresholds
    were calibrated on) or document (each side checked within the document; docs/recipes.md, "Corpus counts")."""
    num_workers: int = bounded(0, 0)
    """Reward worker processes: a step's completions are scored concurrently, so a slow reward does not
    serialize the step, and a hung one can be abandoned (reward.timeout_s). 0 scores in the training process.
    Workers re-register reward.functions by path; a reward registered in code only cannot be used with them."""
    timeout_s: float | None = bounded(None, 0, low_open=True)
    """Seconds one reward call may take before the run ends with an error naming the row (its worker is
    killed and replaced); null waits forever. Needs reward.num_workers >= 1."""


@dataclass
class RolloutConfig:
    engine: str = choice("hf", ENGINES)
    """hf (transformers; CPU and tests) or vllm (colocated, one replica per rank)."""
    n: int = bounded(4, 1)
    """G: completions per prompt."""
    max_new_tokens: int = bounded(64, 1)
    """Response length limit."""
    temperature: float = bounded(1.0, 0, low_open=True)
    """Sampling temperature; the trainer's logprobs use the same temperature."""
    top_p: float = bounded(1.0, 0, 1, low_open=True)
    """Nucleus sampling. The trainer does not truncate: with top_p < 1 the engine's logprobs are of the
    renormalised nucleus, so algorithm.tis_cap with top_p < 1 (or top_k > 0) is refused at start-up, and
    without it start-up warns that the update is off-policy by the truncation."""
    top_k: int = bounded(0, 0)
    """Top-k sampling; 0 is off."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the completion is cut after the stop string."""
    num_threads: int | None = bounded(None, 1)
    """torch threads while the transformers engine generates; null keeps torch's setting (all cores). 1 is
    faster on a CPU shared with other jobs (rollout/engine.py torch_threads)."""
    sync_bucket_mb: int = bounded(1024, 1)
    """Weight-sync bucket size into the engine."""
    sync_timeout_s: float = bounded(1800.0, 0, low_open=True)
    """Seconds a weight sync into the engine may take; past it the rank prints an error naming the phase, the
    step and the rank, and exits (code 124): a stalled sync cannot be interrupted from inside."""
    vllm_kv_cache_mb: int = bounded(256, 1)
    """vLLM KV cache on CPU (given as kv_cache_memory_bytes); on GPUs the cache is sized by
    vllm_gpu_memory_utilization instead (a byte cap there would override it)."""
    vllm_gpu_memory_utilization: float = bounded(0.4, 0, 1, low_open=True)
    """Fraction of GPU memory vLLM may take when colocated."""
    max_model_len: int | None = bounded(None, 1)
    """vLLM's context (prompt + completion tokens per sequence); null: data.max_prompt_tokens plus the longest
    completion a run asks for (rollout.max_new_tokens, or trainer.eval_max_new_tokens when longer)."""
    enforce_eager: bool | None = None
    """vLLM without CUDA graphs; null: eager on CPU, CUDA graphs on GPUs (decoding a 1-8B model is bound by
    kernel launches without them)."""
    placement: str = choice("colocated", PLACEMENTS)
    """colocated: every rank generates, then trains (the engine sleeps during the update on GPUs); separate: the
    last rollout.num_ranks ranks of the torchrun world only generate and score, the others only train, and with
    algorithm.max_staleness=1 generation of step n+1 overlaps the update of step n (launch/separate.py)."""
    num_ranks: int = bounded(0, 0)
    """placement=separate: the ranks that run engines (the last ones of the world); each replica of
    tensor_parallel_size of them serves an equal share of the trainer ranks."""
    tensor_parallel_size: int = bounded(1, 1)
    """vLLM tensor parallelism inside the torchrun world: each group of this many consecutive ranks runs one
    replica, draws the same prompts and seeds, and each of its ranks trains on its own share of the groups."""


@dataclass
class OptimConfig:
    lr: float = bounded(1e-6, 0, low_open=True)
    """Peak learning rate (AdamW)."""
    weight_decay: float = bounded(0.0, 0)
    """AdamW weight decay."""
    betas: list[float] = bounded([0.9, 0.999], 0, 1, high_open=True)
    """AdamW betas."""
    warmup_steps: int = bounded(0, 0)
    """Linear warmup steps."""
    schedule: str = choice("constant", SCHEDULES)
    """constant, linear or cosine decay after warmup."""
    min_lr_ratio: float = bounded(0.0, 0, 1)
    """Final lr as a fraction of the peak for linear/cosine."""
    grad_clip: float = bounded(1.0, 0)
    """Max global gradient norm; 0 is off."""


@dataclass
class TrainerConfig:
    steps: int = bounded(10, 1)
    """Optimizer steps (RL) or SFT steps."""
    prompts_per_step: int = bounded(2, 1)
    """P: prompts per rank per step (each rank owns whole groups)."""
    micro_batch_size: int = bounded(8, 1)
    """Sequences per forward/backward (when max_tokens_per_micro_batch is 0)."""
    max_tokens_per_micro_batch: int = bounded(0, 0)
    """Form micro-batches by token count instead: at most this many prompt + completion tokens each
    (models.batching.micro_batches_by_tokens), every rank the same number. 0: micro_batch_size rows."""
    sft_batch_size: int = bounded(8, 1)
    """SFT: examples per step per rank."""
    sft_max_len: int = bounded(1024, 1)
    """SFT: longer examples fail at start-up."""
    save_every: int = bounded(0, 0)
    """Checkpoint every N steps (0: only at the end)."""
    keep_last: int = bounded(0, 0)
    """Keep only the newest K checkpoints; older ones are deleted only after a newer one is complete (0: keep all)."""
    resume: str = choice("never", RESUMES)
    """never: start at step 0; auto: continue from the latest complete checkpoint when there is one, else start
    fresh (what a restarted job wants, e.g. under `torchrun --max-restarts`); always: continue from it, and fail
    when there is none (the --resume flag)."""
    collective_timeout_s: float = bounded(1800.0, 0, low_open=True)
    """Seconds a collective (all-reduce, FSDP all-gather) may wait for the other ranks before the run fails
    naming the phase, the step and the rank (torch.distributed's process-group timeout)."""
    nccl_blocking_wait: bool = True
    """NCCL (GPUs) only: collectives wait in the calling thread (TORCH_NCCL_BLOCKING_WAIT=1), so a timed-out one
    raises there and the run ends naming the phase, the step and the rank; false leaves NCCL's watchdog to
    tear the process down with its own message (slightly less host overhead per collective)."""
    out_dir: str = "runs"
    """Parent of run directories."""
    run_name: str = "run"
    """runs/<run_name>/ holds config, metrics, samples, checkpoints."""
    wandb_project: str | None = None
    """Also log every step's numbers to this Weights & Biases project (needs `pip install wandb`; WANDB_MODE=offline
    keeps the run under the run directory). null: metrics.jsonl and TensorBoard only."""
    max_consecutive_skips: int = bounded(3, 1)
    """Stop after this many optimizer steps skipped for a non-finite loss or gradient."""
    warn_after_steps: int = bounded(3, 1)
    """Warn when truncation or flat groups stay above their threshold this many steps in a row."""
    warn_truncation: float = bounded(0.5, 0, 1)
    """Truncation-rate threshold for the warning."""
    warn_flat_groups: float = bounded(0.9, 0, 1)
    """Flat-group-fraction threshold for the warning."""
    eval_every: int = bounded(0, 0)
    """Score the held-out rows before the first step, every N steps and after the last one, into
    metrics.jsonl (eval/<metric> with eval/<metric>_low/_high, its 95% interval); 0: only before and after."""
    eval_before: bool = True
    """Score the held-out rows before training too (the demo skips it when the previous stage just did: its
    "after" is this stage's start)."""
    eval_max_new_tokens: int = bounded(0, 0)
    """Held-out evaluation length (0: rollout.max_new_tokens)."""
    eval_batch_size: int = bounded(16, 1)
    """Held-out prompts completed at once (similar lengths together); larger batches decode faster per prompt
    and need more KV-cache memory (bench/README.md)."""
    keep_freed_memory: bool = True
    """CPU runs: glibc keeps freed memory for reuse instead of returning it to the kernel (launch/allocator.py),
    so large tensors are not page-faulted in again every step (bench/README.md, "Freed memory kept in the
    process"). No effect on CUDA memory or off glibc."""


@dataclass
class Config:
    stage: str = choice("rl", STAGES)
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
