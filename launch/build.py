"""Turn a Config into the parts the loops receive: checked data, tokenizer, model (sharded under torchrun),
reference model, optimizer, schedule, engine with its weight sync, and the run directory.

Everything that can be checked without the model is checked first, so a bad recipe fails in seconds and
writes nothing to the run directory.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from grpo.groups import PromptSampler
from grpo.runlog import RunLog, truncate_metrics_file
from grpo.schedule import lr_factor
from launch.config import Config, ConfigError, to_dict


@dataclass
class Parts:
    rows: list[dict]
    prompt_ids: list[list[int]]
    examples: list[tuple[list[int], list[int]]]  # SFT (prompt ids, target ids)
    eval_rows: list[dict]
    eval_prompt_ids: list[list[int]]
    tokenizer: Any
    pad_id: int
    decode_prefixes: Callable
    compute_score: Callable
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    engine: Any
    sync_weights: Callable[[], dict]
    sampler: PromptSampler
    start_step: int
    run_dir: Path
    log: RunLog
    save: Callable[[int], None]
    loss_scale_hook: Callable[[int], float]
    completed_steps: int = 0  # the loops advance it; the final checkpoint is written here
    stop_requested: Callable[[], bool] = lambda: False  # the loops ask once per step (launch.train: Ctrl-C)
    reference_from_adapters: bool = False  # LoRA + KL: the reference is the policy with adapters disabled

    def finish_step(self, done: int, trainer) -> bool:
        """Called by both loops after step `done` (1-based; trainer: cfg.trainer): records it, and returns True
        when a stop was requested (the loop then breaks and writes its final checkpoint); otherwise writes the
        periodic checkpoint when one is due (the last step's is the loop's final one)."""
        self.completed_steps = done
        if self.stop_requested():
            return True
        if trainer.save_every and done % trainer.save_every == 0 and done < trainer.steps:
            self.save(done)
        return False


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
    for data_source, dotted in cfg.reward.functions.items():
        rewards.register(data_source, rewards.get_reward(dotted), overwrite=True)
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
    batch = cfg.trainer.prompts_per_step * cfg.rollout.n
    if cfg.trainer.micro_batch_size < 1 or (cfg.stage == "rl" and batch % cfg.trainer.micro_batch_size
                                            and cfg.trainer.micro_batch_size < batch):
        raise ConfigError(f"trainer.micro_batch_size={cfg.trainer.micro_batch_size} does not divide the batch "
                          f"trainer.prompts_per_step * rollout.n = {batch}")
    if len(rows) < dist.world_size:
        raise ConfigError(f"data.train_files: {len(rows)} rows cannot feed world size {dist.world_size}")
    if cfg.algorithm.overlong_cache_len > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algorithm.overlong_cache_len={cfg.algorithm.overlong_cache_len} exceeds "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
    if cfg.init_from is not None and not Path(cfg.init_from).is_dir():
        raise ConfigError(f"init_from: checkpoint directory not found: {cfg.init_from}")
    return rows, eval_rows


def _tokenize_prompts(cfg: Config, tokenizer, rows: list[dict], key: str) -> list[list[int]]:
    from models import render_prompt
    prompt_ids = [render_prompt(tokenizer, row["prompt"]) for row in rows]
    for row, ids in zip(rows, prompt_ids):
        if len(ids) > cfg.data.max_prompt_tokens:
            raise ConfigError(f"{key}: row index {row.get('extra_info', {}).get('index')} has a {len(ids)}-token "
                              f"prompt, longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    return prompt_ids


def _loss_scale_hook() -> Callable[[int], float]:
    """Fault injection for tests: NANOGRPO_TEST_NONFINITE_STEPS="2,3" makes those steps' loss infinite."""
    steps = {int(s) for s in os.environ.get("NANOGRPO_TEST_NONFINITE_STEPS", "").split(",") if s.strip()}
    return lambda step: float("inf") if step in steps else 1.0


def build(cfg: Config, dist, *, resume: bool = False) -> Parts:
    from models import load_model, load_tokenizer, resolve_model_dir
    from models.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    rows, eval_rows = check_config(cfg, dist)
    run_dir = Path(cfg.trainer.out_dir) / cfg.trainer.run_name
    latest = latest_checkpoint(run_dir / "checkpoints") if resume else None
    if resume and latest is None:
        raise ConfigError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
    # A resumed run rebuilds the model from where the run started; load_checkpoint (which verifies every file
    # first) then restores the weights, so a damaged checkpoint is refused before anything is loaded.
    source = cfg.init_from or cfg.model.name_or_path
    key = "init_from" if cfg.init_from else "model.name_or_path"
    try:
        resolve_model_dir(source)  # a missing path or a directory without weights fails here, by name
        tokenizer = load_tokenizer(source, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}: {error}") from None
    prompt_ids = _tokenize_prompts(cfg, tokenizer, rows, "data.train_files")
    eval_prompt_ids = _tokenize_prompts(cfg, tokenizer, eval_rows, "data.eval_files")
    examples = []
    if cfg.stage == "sft":
        eos = tokenizer.eos_token_id
        for row, ids in zip(rows, prompt_ids):
            target = tokenizer.encode(row["extra_info"]["target"], add_special_tokens=False) + [eos]
            if len(ids) + len(target) > cfg.trainer.sft_max_len:
                raise ConfigError(f"row index {row['extra_info'].get('index')}: prompt + target is "
                                  f"{len(ids) + len(target)} tokens > trainer.sft_max_len={cfg.trainer.sft_max_len}")
            examples.append((ids, target))

    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.model.dtype)
    load = dict(dtype=dtype, device=dist.device, attn_implementation=cfg.model.attn_implementation,
                trust_remote_code=cfg.model.trust_remote_code)
    try:
        model = load_model(source, gradient_checkpointing=cfg.model.gradient_checkpointing, **load)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}: {error}") from None
    model.train()  # gradient checkpointing and dropout only act in train mode; engines restore it after generate
    lora = cfg.model.lora
    if lora.enabled:
        from models.lora import apply_lora
        try:
            apply_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                       target_modules=lora.target_modules, seed=cfg.seed)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    ref_model = None
    if cfg.stage == "rl" and cfg.algorithm.kl_coef > 0 and not lora.enabled:
        # The reference is the policy the run started from (init_from / the base model), frozen.
        ref_model = load_model(cfg.init_from or cfg.model.name_or_path, **load).eval().requires_grad_(False)
    if dist.world_size > 1:
        from models.fsdp import shard
        param_dtype = getattr(torch, cfg.model.param_dtype)
        shard(model, dist.mesh, param_dtype=param_dtype)
        if ref_model is not None:
            shard(ref_model, dist.mesh, param_dtype=param_dtype)
    # fused: one kernel over all parameters (CPU and CUDA, DTensor shards too); measured 4x faster than the
    # per-parameter loop on CPU (bench/README.md).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, warmup_steps=cfg.optim.warmup_steps, total_steps=cfg.trainer.steps, schedule=cfg.optim.schedule,
        min_ratio=cfg.optim.min_lr_ratio))
    sampler = PromptSampler(len(rows), seed=cfg.seed, rank=dist.rank, world_size=dist.world_size,
                            shuffle=cfg.data.shuffle)
    start_step = 0
    if latest is not None:
        if lora.enabled:
            from models.lora import load_lora_checkpoint as load_checkpoint  # adapters + optimizer
        try:
            start_step, extra = load_checkpoint(latest, model, optimizer)
        except (OSError, ValueError) as error:
            raise ConfigError(f"--resume from {latest}: {error}") from None
        scheduler.load_state_dict(extra["scheduler"])
        sampler.position = extra["sampler_position"][dist.rank]

    engine, sync_weights = None, (lambda: {})
    if cfg.stage == "rl" or eval_rows:
        engine, sync_weights = _build_engine(cfg, dist, model, tokenizer, source, load)

    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        if latest is not None:
            truncate_metrics_file(run_dir, start_step)
    log = RunLog(run_dir, total_steps=cfg.trainer.steps, start_step=start_step, enabled=dist.is_main,
                 description=cfg.stage)

    def save(step: int) -> None:
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        bad = dist.all_reduce_max(torch.tensor(float(not all(bool(torch.isfinite(p).all()) for p in local)),
                                               device=dist.device))
        if bool(bad > 0):
            raise RuntimeError(f"refusing to write checkpoint step_{step}: the model has non-finite weights")
        # Ranks consume prompts at different rates under dynamic sampling: keep every rank's position.
        one_hot = torch.zeros(dist.world_size, dtype=torch.float64, device=dist.device)
        one_hot[dist.rank] = sampler.position
        positions = [int(p) for p in dist.all_reduce_sum(one_hot).tolist()]
        extra = {"scheduler": scheduler.state_dict(), "sampler_position": positions}
        if lora.enabled:
            from models.lora import save_lora_checkpoint
            save_lora_checkpoint(run_dir / "checkpoints" / f"step_{step}", model, tokenizer, optimizer, step,
                                 extra=extra, merged_export=lora.merged_export)
        else:
            save_checkpoint(run_dir / "checkpoints" / f"step_{step}", model, tokenizer, optimizer, step, extra=extra)

    import rewards
    return Parts(rows=rows, prompt_ids=prompt_ids, examples=examples, eval_rows=eval_rows,
                 eval_prompt_ids=eval_prompt_ids, tokenizer=tokenizer,
                 pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                 decode_prefixes=lambda ids: tokenizer.batch_decode([ids[:k] for k in range(len(ids) + 1)],
                                                                    skip_special_tokens=True),
                 compute_score=rewards.compute_score, model=model, ref_model=ref_model, optimizer=optimizer,
                 scheduler=scheduler, engine=engine, sync_weights=sync_weights, sampler=sampler,
                 start_step=start_step, run_dir=run_dir, log=log, save=save, loss_scale_hook=_loss_scale_hook(),
                 completed_steps=start_step,
                 reference_from_adapters=lora.enabled and cfg.stage == "rl" and cfg.algorithm.kl_coef > 0)


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
        engine_sync = lambda: sync_weights(model, engine, bucket_bytes=bucket)
        engine_sync()  # the policy may hold resumed/initial weights the directory does not
        return engine, engine_sync
    from rollout.hf_engine import HFEngine
    if dist.world_size == 1:
        # One process: the engine generates with the policy module itself; nothing to sync.
        return HFEngine(model, tokenizer, shared=True, num_threads=cfg.rollout.num_threads), (lambda: {})
    # Under FSDP every forward is a collective, and ranks stop generating at different times: the engine
    # needs its own full copy, refreshed from the shards after every update.
    engine = HFEngine(load_model_copy(source, load), tokenizer, shared=False, num_threads=cfg.rollout.num_threads)
    engine_sync = lambda: sync_weights(model, engine, bucket_bytes=bucket)
    engine_sync()
    return engine, engine_sync


def load_model_copy(source, load):
    from models import load_model
    return load_model(source, **load).eval().requires_grad_(False)
