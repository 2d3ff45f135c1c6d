"""Turn a Config into what the loops receive (grpo/parts.py): checked data, tokenizer, model (sharded under
torchrun), KL reference, optimizer, schedule, engine with its weight sync, scorer, held-out evaluation, the run
directory's log and the checkpointer that owns progress.

Everything that can be checked without the model is checked first, so a bad recipe fails in seconds and
writes nothing to the run directory.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from data.sampler import PromptSampler
from grpo.config import Config
from grpo.evaluate import evaluate, summarize
from grpo.parts import Policy, RLParts, SFTParts
from grpo.schedule import lr_factor
from grpo.scoring import Scorer
from launch.checkpointing import Checkpointer
from launch.config import ConfigError, to_dict
from launch.runlog import RunLog, truncate_metrics_file


class HeldOut:
    """The run's held-out evaluation (grpo.evaluate.evaluate), remembered by step, so that the loops' curve points
    (trainer.eval_every) and the before/after table are one evaluation, never two."""

    def __init__(self, evaluate_rows: Callable[[], dict]):
        self.evaluate_rows, self.results = evaluate_rows, {}

    def result(self, step: int) -> dict:
        """The whole result after step `step` (per-prompt values and records included)."""
        if step not in self.results:
            self.results[step] = self.evaluate_rows()
        return self.results[step]

    def __call__(self, step: int) -> dict:
        """What the loops log: flat eval/<metric> numbers (grpo.evaluate.summarize)."""
        return summarize(self.result(step))


@dataclass(frozen=True)
class Run:
    """A built run: the loop's parts and what launch.train needs around the loop."""
    parts: RLParts | SFTParts
    run_dir: Path
    log: RunLog
    checkpoints: Checkpointer
    held_out: HeldOut | None  # None without held-out rows
    engine: object | None


def _read_rows(files: list[str], key: str) -> list[dict]:
    from data.rows import read_rows
    rows = []
    for path in files:
        if not Path(path).is_file():
            raise ConfigError(f"{key}: file not found: {path}")
        try:
            rows.extend(read_rows(path))
        except (OSError, ValueError) as error:
            raise ConfigError(f"{key}: {error}") from None
    return rows


def check_config(cfg: Config, dist) -> tuple[list[dict], list[dict]]:
    """Checks that need no model: files, reward names, batch arithmetic. Returns (train rows, eval rows)."""
    import rewards
    from launch.triples import check_reward_config
    for data_source, dotted in cfg.reward.functions.items():
        rewards.register(data_source, rewards.get_reward(dotted), overwrite=True)
    check_reward_config(cfg.reward)
    if cfg.reward.corpus_index is not None:
        if not Path(cfg.reward.corpus_index).is_dir():
            raise ConfigError(f"reward.corpus_index: index directory not found: {cfg.reward.corpus_index} (build it "
                              f"with: python -m rewards.corpus build --input corpus.jsonl --out {cfg.reward.corpus_index})")
        from rewards.corpus import check_index
        try:  # a corrupt index fails here, naming the path and the build command, not at the first reward
            check_index(Path(cfg.reward.corpus_index))
        except (OSError, ValueError) as error:
            raise ConfigError(f"reward.corpus_index: {error}") from None
        os.environ["NANOGRPO_CORPUS_INDEX"] = str(cfg.reward.corpus_index)
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: name at least one rows file (JSONL or Parquet)")
    rows = _read_rows(cfg.data.train_files, "data.train_files")
    eval_rows = _read_rows(cfg.data.eval_files, "data.eval_files")
    if cfg.data.eval_size:
        eval_rows = eval_rows[: cfg.data.eval_size]
    if not rows:
        raise ConfigError(f"data.train_files: no rows in {cfg.data.train_files}")
    for row in rows + eval_rows:
        try:
            rewards.get_reward(row["data_source"])
        except ValueError as error:
            raise ConfigError(f"data: row index {row.get('extra_info', {}).get('index')} has data_source "
                              f"{row['data_source']!r} with no reward function: {error}") from None
        if cfg.stage == "sft" and not isinstance(row.get("extra_info", {}).get("target"), str):
            raise ConfigError(f"stage=sft needs extra_info.target in every row; row index "
                              f"{row.get('extra_info', {}).get('index')} has none")
    if cfg.rollout.num_threads is not None and cfg.rollout.num_threads < 1:
        raise ConfigError(f"rollout.num_threads={cfg.rollout.num_threads}: give at least 1, or null for torch's setting")
    if cfg.stage == "rl" and cfg.rollout.n < 2:
        raise ConfigError(f"rollout.n={cfg.rollout.n}: a group needs at least 2 completions for a baseline")
    if cfg.stage == "rl":
        _check_rl(cfg)
    elif cfg.trainer.micro_batch_size < 1:
        raise ConfigError(f"trainer.micro_batch_size={cfg.trainer.micro_batch_size}: give at least 1")
    if len(rows) < dist.world_size:
        raise ConfigError(f"data.train_files: {len(rows)} rows cannot feed world size {dist.world_size}")
    if cfg.algorithm.overlong_cache_len > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algorithm.overlong_cache_len={cfg.algorithm.overlong_cache_len} exceeds "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
    if cfg.init_from is not None and not Path(cfg.init_from).is_dir():
        raise ConfigError(f"init_from: checkpoint directory not found: {cfg.init_from}")
    return rows, eval_rows


# A sequence-level ratio (GSPO) moves by the MEAN token log-ratio, a few 1e-4 per update: a clip range meant
# for token ratios (0.2) would never bind. GSPO's paper uses 3e-4 / 4e-4; anything above this is refused.
SEQUENCE_CLIP_LIMIT = 0.05


def _check_rl(cfg: Config) -> None:
    """The RL batch arithmetic and the algorithm settings that contradict each other."""
    algo, trainer, rollout = cfg.algorithm, cfg.trainer, cfg.rollout
    mini = algo.ppo_mini_batch_size
    if mini is not None and (mini < 1 or trainer.prompts_per_step % mini):
        raise ConfigError(f"algorithm.ppo_mini_batch_size={mini} does not divide trainer.prompts_per_step="
                          f"{trainer.prompts_per_step} (both count prompts per rank; one optimizer step each)")
    if algo.ppo_epochs < 1:
        raise ConfigError(f"algorithm.ppo_epochs={algo.ppo_epochs}: give at least 1")
    rows = (mini or trainer.prompts_per_step) * rollout.n
    size = trainer.micro_batch_size
    if trainer.max_tokens_per_micro_batch < 0:
        raise ConfigError(f"trainer.max_tokens_per_micro_batch={trainer.max_tokens_per_micro_batch}: give a token "
                          f"budget, or 0 to form micro-batches of trainer.micro_batch_size rows")
    if not trainer.max_tokens_per_micro_batch and (size < 1 or (rows % size and size < rows)):
        raise ConfigError(f"trainer.micro_batch_size={size} does not divide the mini-batch of {rows} sequences "
                          f"((algorithm.ppo_mini_batch_size or trainer.prompts_per_step) * rollout.n)")
    if algo.ratio_level == "sequence" and max(algo.clip_low, algo.clip_high) > SEQUENCE_CLIP_LIMIT:
        raise ConfigError(f"algorithm.ratio_level=sequence (GSPO) with algorithm.clip_low={algo.clip_low}, "
                          f"algorithm.clip_high={algo.clip_high}: a sequence ratio is exp of a MEAN log-ratio and "
                          f"moves far less than a token's, so a token-level range never clips; GSPO uses "
                          f"clip_low=3e-4, clip_high=4e-4 (at most {SEQUENCE_CLIP_LIMIT} accepted)")
    if algo.kl_in_reward and algo.kl_coef <= 0:
        raise ConfigError(f"algorithm.kl_in_reward=true needs algorithm.kl_coef > 0 (got {algo.kl_coef}): it "
                          f"is the coefficient of the KL subtracted from the reward")
    if algo.tis_cap is not None and (rollout.top_p < 1 or rollout.top_k > 0):
        # The engines report logprobs of the distribution they sampled from, here the renormalised nucleus;
        # the trainer's are of the full one, so exp(old - rollout) would be each token's nucleus mass, a
        # down-weighting of uncertain tokens, not the engine/trainer mismatch truncated IS is meant to correct.
        raise ConfigError(f"algorithm.tis_cap={algo.tis_cap} with rollout.top_p={rollout.top_p}, rollout.top_k="
                          f"{rollout.top_k}: truncated importance sampling compares the engine's logprobs of the "
                          f"truncated distribution with the trainer's of the full one; sample with top_p: 1.0 "
                          f"and top_k: 0, or set algorithm.tis_cap: null")
    if cfg.model.packed_logprobs and cfg.model.attn_implementation == "eager":
        raise ConfigError("model.packed_logprobs=true runs on sdpa or flash_attention_2; "
                          "model.attn_implementation=eager cannot pack")


def _tokenize_prompts(cfg: Config, tokenizer, rows: list[dict], key: str) -> list[list[int]]:
    from models import render_prompt
    prompt_ids = [render_prompt(tokenizer, row["prompt"]) for row in rows]
    for row, ids in zip(rows, prompt_ids):
        if len(ids) > cfg.data.max_prompt_tokens:
            raise ConfigError(f"{key}: row index {row.get('extra_info', {}).get('index')} has a {len(ids)}-token "
                              f"prompt, longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    return prompt_ids


def _sft_examples(cfg: Config, tokenizer, rows: list[dict], prompt_ids: list[list[int]]) -> list[tuple]:
    """(prompt ids, target ids + eos) per row; an example longer than trainer.sft_max_len fails by row."""
    examples = []
    for row, ids in zip(rows, prompt_ids):
        target = tokenizer.encode(row["extra_info"]["target"], add_special_tokens=False) + [tokenizer.eos_token_id]
        if len(ids) + len(target) > cfg.trainer.sft_max_len:
            raise ConfigError(f"row index {row['extra_info'].get('index')}: prompt + target is "
                              f"{len(ids) + len(target)} tokens > trainer.sft_max_len={cfg.trainer.sft_max_len}")
        examples.append((ids, target))
    return examples


@dataclass(frozen=True)
class Reference:
    """The KL reference: logprobs of a padded batch under the frozen model the run started from, or, with
    LoRA, under the policy with its adapters disabled."""
    model: torch.nn.Module
    adapters_off: bool
    temperature: float
    chunk_size: int

    def __call__(self, batch: dict) -> torch.Tensor:
        from models.logprobs import completion_logprobs
        from models.lora import disabled_adapters
        with disabled_adapters(self.model) if self.adapters_off else contextlib.nullcontext():
            return completion_logprobs(self.model, batch, temperature=self.temperature, chunk_size=self.chunk_size)[0]


def _load(cfg: Config, dist, source: str | None, key: str, load: dict, *, gradient_checkpointing: bool = False,
          prepare: Callable[[torch.nn.Module], object] | None = None) -> torch.nn.Module:
    """One model, `prepare`d (LoRA), sharded under torchrun. With several ranks only rank 0 reads the weights;
    the others build the model on the meta device and receive their shards (models.fsdp.load_sharded_model),
    so a node never holds a full copy per rank (8 ranks x 8B in fp32 would be 256 GB of host memory)."""
    from models import load_model
    try:
        if dist.world_size > 1:
            from models.fsdp import load_sharded_model
            return load_sharded_model(source, dist.mesh, param_dtype=getattr(torch, cfg.model.param_dtype),
                                      device=dist.device, attn_implementation=load["attn_implementation"],
                                      gradient_checkpointing=gradient_checkpointing, dtype=load["dtype"],
                                      trust_remote_code=load["trust_remote_code"], prepare=prepare)
        model = load_model(source, gradient_checkpointing=gradient_checkpointing, **load)
        if prepare is not None:
            prepare(model)
        return model
    except ConfigError:
        raise
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}: {error}") from None


def _policy(cfg: Config, dist, source: str | None, key: str, load: dict):
    """(Policy, reference-logprob function or None): the model (LoRA adapters applied, sharded under torchrun),
    fused AdamW over its trainable weights, the warmup/decay schedule, and the frozen KL reference."""
    lora, prepare = cfg.model.lora, None
    if lora.enabled:
        from models.lora import apply_lora

        def prepare(model):
            try:
                apply_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                           target_modules=lora.target_modules, seed=cfg.seed)
            except ValueError as error:
                raise ConfigError(str(error)) from None
    model = _load(cfg, dist, source, key, load, gradient_checkpointing=cfg.model.gradient_checkpointing,
                  prepare=prepare)
    model.train()  # gradient checkpointing and dropout only act in train mode; engines restore it after generate
    reference = None
    if cfg.stage == "rl" and cfg.algorithm.kl_coef > 0:
        # LoRA: the policy with its adapters off (no second model); else the frozen starting model.
        reference_model = model if lora.enabled else _load(cfg, dist, source, key, load).eval().requires_grad_(False)
        reference = Reference(reference_model, adapters_off=lora.enabled, temperature=cfg.rollout.temperature,
                              chunk_size=cfg.model.logprob_chunk_size)
    # fused: one kernel over all parameters (CPU and CUDA, DTensor shards too); measured 4x faster than the
    # per-parameter loop on CPU (bench/README.md).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, warmup_steps=cfg.optim.warmup_steps, total_steps=cfg.trainer.steps, schedule=cfg.optim.schedule,
        min_ratio=cfg.optim.min_lr_ratio))
    return Policy(model, optimizer, scheduler), reference


def build(cfg: Config, dist, *, resume: bool = False, stop_requested: Callable[[], bool] = lambda: False) -> Run:
    """Everything a run needs, checked in order of cost. stop_requested: asked once per step (Ctrl-C)."""
    from models import load_tokenizer, resolve_model_dir
    from models.checkpoint import latest_checkpoint

    rows, eval_rows = check_config(cfg, dist)
    run_dir = Path(cfg.trainer.out_dir) / cfg.trainer.run_name
    latest = latest_checkpoint(run_dir / "checkpoints") if resume else None
    if resume and latest is None:
        raise ConfigError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
    # A resumed run rebuilds the model from where the run started; the checkpointer (which verifies every file
    # first) then restores the weights, so a damaged checkpoint is refused before anything is loaded.
    source = cfg.init_from or cfg.model.name_or_path
    key = "init_from" if cfg.init_from else "model.name_or_path"
    try:
        resolve_model_dir(source)  # a missing path or a directory without weights fails here, by name
        tokenizer = load_tokenizer(source, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}: {error}") from None
    prompt_ids = _tokenize_prompts(cfg, tokenizer, rows, "data.train_files")
    budget = cfg.trainer.max_tokens_per_micro_batch
    longest = max(len(ids) for ids in prompt_ids) + cfg.rollout.max_new_tokens
    if cfg.stage == "rl" and budget and longest > budget:
        raise ConfigError(f"trainer.max_tokens_per_micro_batch={budget} is less than the longest sequence a step "
                          f"can hold: {longest} tokens (the longest prompt + rollout.max_new_tokens)")
    eval_prompt_ids = _tokenize_prompts(cfg, tokenizer, eval_rows, "data.eval_files")
    examples = _sft_examples(cfg, tokenizer, rows, prompt_ids) if cfg.stage == "sft" else []

    torch.manual_seed(cfg.seed)
    load = dict(dtype=getattr(torch, cfg.model.dtype), device=dist.device,
                attn_implementation=cfg.model.attn_implementation, trust_remote_code=cfg.model.trust_remote_code)
    policy, reference = _policy(cfg, dist, source, key, load)
    sampler = PromptSampler(len(rows), seed=cfg.seed, rank=dist.rank, world_size=dist.world_size,
                            shuffle=cfg.data.shuffle)
    checkpoints = Checkpointer(run_dir, policy, tokenizer, sampler, dist, lora=cfg.model.lora, steps=cfg.trainer.steps,
                               save_every=cfg.trainer.save_every, stop_requested=stop_requested)
    if latest is not None:
        try:
            checkpoints.resume(latest)
        except (OSError, ValueError) as error:
            raise ConfigError(f"--resume from {latest}: {error}") from None

    engine, sync_weights = None, (lambda: {})
    if cfg.stage == "rl" or eval_rows:
        engine, sync_weights = _build_engine(cfg, dist, policy.model, tokenizer, source, load)
    from launch.triples import install_factqa_reward
    install_factqa_reward(cfg.reward, device=str(dist.device))  # a non-default factqa_corpus reward (model extractor)

    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        if latest is not None:
            truncate_metrics_file(run_dir, checkpoints.start_step)
    log = RunLog(run_dir, total_steps=cfg.trainer.steps, start_step=checkpoints.start_step, enabled=dist.is_main,
                 description=cfg.stage)

    import rewards
    from models.chat import prefix_decoder
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    scorer = Scorer(rewards.compute_score, prefix_decoder(tokenizer), sentence_coef=cfg.reward.sentence_coef,
                    correct_threshold=cfg.reward.correct_threshold)
    held_out = None
    if eval_rows:
        held_out = HeldOut(functools.partial(
            evaluate, engine, scorer, eval_rows, eval_prompt_ids, dist,
            max_new_tokens=cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens))
    if cfg.stage == "sft":
        parts = SFTParts(policy, examples, sampler, pad_id, log, checkpoints, evaluate=held_out)
    else:
        parts = RLParts(policy, engine, sync_weights, reference, rows, prompt_ids, sampler, scorer, pad_id, log,
                        checkpoints, evaluate=held_out)
    return Run(parts, run_dir, log, checkpoints, held_out, engine)


def _build_engine(cfg: Config, dist, model, tokenizer, source, load):
    """The rollout engine and a function that syncs the policy's weights into it after each update."""
    from rollout.sync import sync_weights
    bucket = cfg.rollout.sync_bucket_mb << 20
    if cfg.rollout.engine == "vllm":
        from models.loading import resolve_model_dir
        from rollout.vllm_engine import VLLMEngine
        engine = VLLMEngine(str(resolve_model_dir(source)), dtype=cfg.model.param_dtype, seed=dist.rank,
                            kv_cache_memory_bytes=cfg.rollout.vllm_kv_cache_mb << 20,
                            gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
                            tensor_parallel_size=cfg.rollout.tensor_parallel_size)
        engine_sync = lambda: sync_weights(model, engine, bucket_bytes=bucket)  # noqa: E731
        engine_sync()  # the policy may hold resumed/initial weights the directory does not
        return engine, engine_sync
    from rollout.hf_engine import HFEngine
    if dist.world_size == 1:
        # One process: the engine generates with the policy module itself; nothing to sync.
        return HFEngine(model, tokenizer, shared=True, num_threads=cfg.rollout.num_threads), (lambda: {})
    # Under FSDP every forward is a collective, and ranks stop generating at different times: the engine
    # needs its own full copy, refreshed from the shards after every update.
    from models import load_model
    engine = HFEngine(load_model(source, **load).eval().requires_grad_(False), tokenizer, shared=False,
                      num_threads=cfg.rollout.num_threads)
    engine_sync = lambda: sync_weights(model, engine, bucket_bytes=bucket)  # noqa: E731
    engine_sync()
    return engine, engine_sync
