"""Typed configuration: dataclasses are the schema, recipes are YAML, `key.sub=value` overrides the CLI.

Unknown keys and wrong types fail with the key named and the closest valid key suggested.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema."""


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
    dtype: str = "float32"
    """Master weight dtype: float32 or bfloat16."""
    param_dtype: str = "float32"
    """FSDP2 compute dtype (mixed precision): float32 or bfloat16; gradients are reduced in float32."""
    attn_implementation: str = "auto"
    """auto (flash_attention_2 on CUDA when importable, else sdpa), sdpa or eager."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    trust_remote_code: bool = False
    """Run code shipped with a model directory. Off unless you trust it."""
    logprob_chunk_size: int = 1024
    """Completion positions projected to the vocabulary at once in logprob passes (bounds peak memory)."""
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
    engine: str = "hf"
    """hf (transformers; CPU and tests) or vllm (colocated, one replica per rank)."""
    n: int = 4
    """G: completions per prompt."""
    max_new_tokens: int = 64
    """Response length limit."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's logprobs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling; < 1 biases the importance ratio (the trainer does not truncate)."""
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
    adv_scale: str = "group"
    """group (GRPO), batch, none (Dr. GRPO)."""
    adv_eps: float = 1e-6
    """eps in (r - mean) / (std + eps)."""
    clip_low: float = 0.2
    """epsilon_low of the clipped surrogate."""
    clip_high: float = 0.2
    """epsilon_high (DAPO's clip-higher uses 0.28)."""
    dual_clip: float | None = None
    """c > 1 caps the token loss at -A*c where A < 0; null is off."""
    agg: str = "token-mean"
    """token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference model; 0 means no reference model at all."""
    kl_kind: str = "k3"
    """k1, abs, k2 or k3."""
    ppo_epochs: int = 1
    """Passes over each rollout batch; with 1, old logprobs are the current ones detached (no extra pass)."""
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
    tis_level: str = "token"
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
    schedule: str = "constant"
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
    """Sequences per forward/backward."""
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
    eval_before: bool = True
    """Score the held-out rows before training too (the demo skips it when the previous stage just did)."""
    eval_max_new_tokens: int = 0
    """Held-out evaluation length (0: rollout.max_new_tokens)."""


@dataclass
class Config:
    stage: str = "rl"
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


CHOICES = {
    "stage": ("rl", "sft"), "model.dtype": ("float32", "bfloat16"), "model.param_dtype": ("float32", "bfloat16"),
    "model.attn_implementation": ("auto", "sdpa", "eager", "flash_attention_2"), "rollout.engine": ("hf", "vllm"),
    "algorithm.adv_scale": ("group", "batch", "none"), "algorithm.kl_kind": ("k1", "abs", "k2", "k3"),
    "algorithm.agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "algorithm.tis_level": ("token", "sequence"), "optim.schedule": ("constant", "linear", "cosine"),
}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value, tp, key: str):
    """Check `value` against the annotation `tp`; ints are accepted for floats. Raises ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0])
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {_coerce(k, args[0], key): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads 3e-6 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return value


def _build(cls, values: dict, prefix: str = ""):
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key {prefix}{key}{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
            allowed = CHOICES.get(f"{prefix}{key}")
            if allowed and kwargs[key] not in allowed:
                raise ConfigError(f"{prefix}{key}: {kwargs[key]!r} is not one of {', '.join(allowed)}")
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
    tree[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a YAML recipe (or the defaults) and apply `key.sub=value` overrides (values parsed as YAML)."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(tree).__name__}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    where = f" (in {path})" if path else ""
    try:
        return _build(Config, tree)
    except ConfigError as error:
        raise ConfigError(f"{error}{where}") from None


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)
