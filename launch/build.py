"""Turn a Config into what the loops receive (grpo/parts.py): checked data, tokenizer, model (sharded under
torchrun), KL reference, optimizer, schedule, engine with its weight sync, scorer, held-out evaluation, the run
directory's log and the checkpointer that owns progress.

Everything that can be checked without the model is checked first (launch/preflight.py, which --dry-run runs
alone), so a bad recipe fails in seconds and writes nothing to the run directory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from data.sampler import PromptSampler
from launch.schema import Config
from grpo.evaluate import evaluate
from grpo.losses import AGGREGATION, LossSpec
from grpo.parts import (AdvantageSpec, Batching, Evaluation, LogprobSpec, Policy, RLParts, RLSpec, Sampling, SFTParts,
                        SFTSpec, Watch)
from grpo.prepare import logprob_pass
from grpo.schedule import lr_factor
from grpo.scoring import Scorer
from launch.allocator import keep_freed_memory
from launch.checkpointing import Checkpointer
from launch.config import ConfigError, to_dict
from launch.engines import build_engine
from launch.plan import Target, attention
from launch.preflight import Prepared, prepare
from launch.runlog import RunLog, truncate_metrics_file
from launch.watchdog import with_deadline
from models.precision import compute_in
from rollout.engine import Engine


@dataclass(frozen=True)
class Run:
    """A built run: the loop's parts and what launch.train needs around the loop."""
    parts: RLParts | SFTParts
    run_dir: Path
    log: RunLog
    checkpoints: Checkpointer
    engine: Engine | None
    prepared: Prepared  # what the start-up checks produced
    reward_pool: object | None  # launch.reward_pool.RewardPool, or None (rewards scored in this process)
    remote: object | None = None  # launch.separate.RemoteRollout when the engines run on ranks of their own

    def close(self) -> None:
        """Close the log and stop the reward workers (the engine is closed by launch.train after a full run)."""
        self.log.close()
        if self.reward_pool is not None:
            self.reward_pool.close()


def _start_reward_pool(cfg: Config, rows: list[dict]):
    """The reward workers (reward.num_workers), started, once each data source of `rows` resolves to the same
    function in them as here."""
    import rewards
    from launch.reward_pool import RewardPool, function_identity
    sources = sorted({row["data_source"] for row in rows})
    pool = RewardPool(cfg.reward, sources)
    try:
        theirs = pool.start()
        ours = {source: function_identity(rewards.get_reward(source)) for source in sources}
        for source in sources:
            if theirs.get(source) != ours[source]:
                raise ConfigError(
                    f"reward.num_workers={cfg.reward.num_workers}: data_source {source!r} is {ours[source]} here but "
                    f"{theirs.get(source)} in the reward workers (a reward registered in code does not reach a new "
                    f"process): name it by path in reward.functions, or set reward.num_workers=0")
    except BaseException:
        pool.close()
        raise
    return pool


def _reward_scoring(cfg: Config, dist, rows: list[dict]):
    """(compute_score, compute_scores or None, the worker pool or None) of the run: reward.functions registered by
    path, the corpus index exported to the factqa_corpus reward, and that reward built by its factory when the
    recipe configures it (launch.triples.factqa_reward_for: a model extractor, document counts), dispatched here
    rather than registered over the default."""
    import os

    import rewards
    from launch.triples import factqa_reward_for
    for data_source, dotted in cfg.reward.functions.items():
        rewards.register(data_source, rewards.get_reward(dotted), overwrite=True)
    if cfg.reward.corpus_index is not None:
        os.environ["NANOGRPO_CORPUS_INDEX"] = str(cfg.reward.corpus_index)
    pool = _start_reward_pool(cfg, rows) if cfg.reward.num_workers else None
    if pool is not None:  # every reward call goes through the workers (each builds the configured reward itself)
        return pool.compute_score, pool.compute_scores, pool
    configured = factqa_reward_for(cfg.reward, device=str(dist.device))
    if configured is None:
        return rewards.compute_score, None, None

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == "factqa_corpus":
            return configured(data_source, solution_str, ground_truth, extra_info)
        return rewards.compute_score(data_source, solution_str, ground_truth, extra_info)
    return compute_score, None, None


@dataclass(frozen=True)
class Reference:
    """The KL reference: logprobs of a padded batch under the frozen model the run started from, or, with
    LoRA, under the policy with its adapters disabled; computed as the policy's are (the same LogprobSpec)."""
    model: torch.nn.Module
    adapters_off: bool
    logprobs: LogprobSpec

    def __call__(self, batch: dict) -> torch.Tensor:
        from models.logprobs import evaluating
        from models.lora import disabled_adapters
        with disabled_adapters(self.model) if self.adapters_off else contextlib.nullcontext(), evaluating(self.model):
            return logprob_pass(self.model, self.logprobs, batch)[0]


def _load(cfg: Config, dist, source: str | None, key: str, load: dict, *, gradient_checkpointing: bool = False,
          prepare: Callable[[torch.nn.Module], object] | None = None) -> torch.nn.Module:
    """One model, `prepare`d (LoRA), sharded under torchrun. With several ranks only rank 0 reads the weights;
    the others build the model on the meta device and receive their shards (models.fsdp.load_sharded_model),
    so a node never holds a full copy per rank (8 ranks x 8B in fp32 would be 256 GB of host memory)."""
    from models import load_model
    try:
        if dist.sharded:
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


def _policy(cfg: Config, dist, source: str | None, key: str, load: dict, tokenizer):
    """(Policy, reference-logprob function or None, the sampleable vocabulary size): the model (LoRA adapters
    applied, sharded under torchrun), fused AdamW over its trainable weights, the warmup/decay schedule, and the
    frozen KL reference."""
    from models.logprobs import sampleable_vocab_size
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
    compute = getattr(torch, cfg.model.param_dtype)
    if not dist.sharded:
        compute_in(model, compute)  # fp32 master weights, bf16 products (FSDP2 does this under torchrun)
    model.train()  # gradient checkpointing and dropout only act in train mode; engines restore it after generate
    vocab_size = sampleable_vocab_size(model, tokenizer)
    reference = None
    if cfg.stage == "rl" and cfg.algorithm.kl_coef > 0:
        # LoRA: the policy with its adapters off (no second model); else the frozen starting model, stored in
        # the compute dtype (a frozen model needs no master copy: launch.plan.precision).
        reference_model = model if lora.enabled else _load(cfg, dist, source, key, dict(load, dtype=compute)
                                                           ).eval().requires_grad_(False)
        reference = Reference(reference_model, adapters_off=lora.enabled, logprobs=logprob_spec(cfg, vocab_size))
    # fused: one kernel over all parameters (CPU and CUDA, DTensor shards too), faster than the per-parameter
    # loop on CPU (bench/README.md).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, warmup_steps=cfg.optim.warmup_steps, total_steps=cfg.trainer.steps, schedule=cfg.optim.schedule,
        min_ratio=cfg.optim.min_lr_ratio))
    return Policy(model, optimizer, scheduler), reference, vocab_size


def build(cfg: Config, dist, *, resume: bool = False, stop_requested: Callable[[], bool] = lambda: False,
          rows: list[dict] | None = None, eval_rows: list[dict] | None = None) -> Run:
    """Everything a run needs, checked in order of cost (launch/preflight.py first: nothing is written to the run
    directory before every check passed). resume=True is trainer.resume=always (the --resume flag);
    stop_requested: asked once per step on every rank (Ctrl-C, SIGTERM); rows / eval_rows: in memory instead of
    data.train_files / data.eval_files (launch.api.train)."""
    if resume:
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume="always"))
    prepared = prepare(cfg, dist, rows=rows, eval_rows=eval_rows)
    placement = getattr(dist, "placement", None)
    if placement is not None and placement.is_rollout:  # rollout.placement=separate: this rank only generates
        return _rollout_side(cfg, dist, prepared)
    scoring = _reward_scoring(cfg, dist, prepared.rows + prepared.eval_rows) if placement is None else (None,) * 3
    try:
        return _assemble(cfg, dist, prepared, scoring, stop_requested)
    except BaseException:
        if scoring[2] is not None:
            scoring[2].close()
        raise


@dataclass(frozen=True)
class RolloutRun:
    """A built rollout rank (rollout.placement=separate): what launch.separate.serve runs."""
    side: object  # launch.separate.RolloutSide
    engine: Engine
    reward_pool: object | None

    def close(self) -> None:
        if self.reward_pool is not None:
            self.reward_pool.close()


def _rollout_side(cfg: Config, dist, prepared: Prepared) -> RolloutRun:
    """A rollout rank: its engine (its own weights, which the trainers' first broadcast replaces), the rewards, this
    replica's order over the rows, and the held-out evaluation."""
    from launch.separate import RolloutSide
    from models.chat import prefix_decoder
    from models.loading import resolve_model_dir
    placement, tokenizer = dist.placement, prepared.tokenizer
    torch.manual_seed(cfg.seed)
    compute_score, compute_scores, pool = _reward_scoring(cfg, dist, prepared.rows + prepared.eval_rows)
    try:
        target = Target.here(1)  # one engine of its own per replica, outside the trainers' world
        engine, _ = build_engine(cfg, target, resolve_model_dir(prepared.source), tokenizer, device=dist.device,
                                 dp_rank=dist.dp_rank)
        scorer = Scorer(compute_score, prefix_decoder(tokenizer), sentence_coef=cfg.reward.sentence_coef,
                        correct_threshold=cfg.reward.correct_threshold, compute_scores=compute_scores)
        replicas, trainers = dist.dp_size, len(placement.trainer_ranks)
        per_replica = trainers // replicas
        sampler = PromptSampler(len(prepared.rows), seed=cfg.seed, rank=dist.dp_rank, world_size=replicas,
                                shuffle=cfg.data.shuffle)
        held_out = None
        if prepared.eval_rows:
            score = functools.partial(evaluate, engine, scorer, prepared.eval_rows, prepared.eval_prompt_ids, dist,
                                      max_new_tokens=cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens,
                                      batch_size=cfg.trainer.eval_batch_size)
            held_out = lambda step: score()  # noqa: E731
        side = RolloutSide(spec=rl_spec(cfg, trainers, None), engine=engine, sampler=sampler, rows=prepared.rows,
                           prompt_ids=prepared.prompt_ids, scorer=scorer, evaluate=held_out, placement=placement,
                           replicas=replicas, replica=dist.dp_rank, lead=dist.tp_rank == 0,
                           served=tuple(range(dist.dp_rank * per_replica, (dist.dp_rank + 1) * per_replica)),
                           max_staleness=cfg.algorithm.max_staleness, device=dist.device)
        return RolloutRun(side, engine, pool)
    except BaseException:
        if pool is not None:
            pool.close()
        raise


def _assemble(cfg: Config, dist, prepared: Prepared, scoring, stop_requested: Callable[[], bool]) -> Run:
    rows, eval_rows, tokenizer, source = prepared.rows, prepared.eval_rows, prepared.tokenizer, prepared.source
    run_dir = Path(cfg.trainer.out_dir) / cfg.trainer.run_name
    torch.manual_seed(cfg.seed)
    if cfg.trainer.keep_freed_memory and dist.device.type == "cpu":
        keep_freed_memory()
    target = Target.here(dist.world_size, torchrun=dist.sharded)
    load = dict(dtype=getattr(torch, cfg.model.dtype), device=dist.device, attn_implementation=attention(cfg, target),
                trust_remote_code=cfg.model.trust_remote_code)
    policy, reference, vocab_size = _policy(cfg, dist, source, prepared.source_key, load, tokenizer)
    remote = None
    if dist.placement is not None:  # the batches come from the rollout ranks (launch/separate.py)
        from launch.separate import PositionOf, RemoteRollout
        replicas = cfg.rollout.num_ranks  # one engine per rollout rank (launch.preflight.check_placement)
        remote = RemoteRollout(dist.placement, policy.model, replicas=replicas, steps=cfg.trainer.steps,
                               has_held_out=bool(eval_rows), bucket_bytes=cfg.rollout.sync_bucket_mb << 20,
                               timeout_s=cfg.trainer.collective_timeout_s)
        sampler = PositionOf(remote)
    else:
        # One order over the rows per replica: the ranks of a tensor-parallel replica draw the same prompts.
        sampler = PromptSampler(len(rows), seed=cfg.seed, rank=dist.dp_rank, world_size=dist.dp_size,
                                shuffle=cfg.data.shuffle)
    checkpoints = Checkpointer(run_dir, policy, tokenizer, sampler, dist, lora=cfg.model.lora, steps=cfg.trainer.steps,
                               save_every=cfg.trainer.save_every, keep_last=cfg.trainer.keep_last,
                               stop_requested=stop_requested)
    if prepared.latest is not None:
        try:
            checkpoints.resume(prepared.latest)
        except (OSError, ValueError) as error:
            raise ConfigError(f"resuming from {prepared.latest}: {error}") from None

    engine, sync_weights = None, (lambda: {})
    limit = f"rollout.sync_timeout_s={cfg.rollout.sync_timeout_s:g} s"
    if remote is not None:
        sync_weights = with_deadline(remote.sync, cfg.rollout.sync_timeout_s, limit, lambda: (
            f"weight broadcast (phase: sync) at step {checkpoints.step} on rank {dist.rank}"))
        positions = checkpoints.positions or [0] * dist.world_size
        remote.start(checkpoints.start_step, [positions[r * (dist.world_size // replicas)] for r in range(replicas)])
    elif cfg.stage == "rl" or eval_rows:
        from models.loading import resolve_model_dir
        engine, engine_sync = build_engine(cfg, target, resolve_model_dir(source), tokenizer, device=dist.device,
                                           dp_rank=dist.dp_rank, policy=policy.model)
        if engine_sync is not None:
            sync_weights = with_deadline(engine_sync, cfg.rollout.sync_timeout_s, limit, lambda: (
                f"weight sync (phase: sync) at step {checkpoints.step} on rank {dist.rank}"))
            sync_weights()  # the policy may hold resumed or initial weights the engine does not

    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        # Lines of steps after the checkpoint are redone; a run that starts at step 0 (resume=never, or no
        # checkpoint yet) replaces the logs of any earlier run in the same directory instead of appending to them.
        truncate_metrics_file(run_dir, checkpoints.start_step)
    log = RunLog(run_dir, total_steps=cfg.trainer.steps, start_step=checkpoints.start_step, enabled=dist.is_main,
                 description=cfg.stage, wandb_project=cfg.trainer.wandb_project, config=to_dict(cfg))
    for warning in prepared.warnings:
        log.warn(warning)

    from models.chat import prefix_decoder
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    compute_score, compute_scores, pool = scoring
    scorer = None if remote is not None else Scorer(  # with the engines apart, the rollout ranks score
        compute_score, prefix_decoder(tokenizer), sentence_coef=cfg.reward.sentence_coef,
        correct_threshold=cfg.reward.correct_threshold, compute_scores=compute_scores)
    held_out = None
    if remote is not None:
        held_out = remote.evaluate if eval_rows else None
    elif eval_rows:
        score_held_out = functools.partial(
            evaluate, engine, scorer, eval_rows, prepared.eval_prompt_ids, dist,
            max_new_tokens=cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens,
            batch_size=cfg.trainer.eval_batch_size)
        held_out = lambda step: score_held_out()  # noqa: E731  (the same rows and engine after every step)
    common = dict(policy=policy, sampler=sampler, pad_id=pad_id, log=log, checkpoints=checkpoints, evaluate=held_out)
    if cfg.stage == "sft":
        parts = SFTParts(spec=sft_spec(cfg), examples=prepared.examples, **common)
    else:
        parts = RLParts(spec=rl_spec(cfg, dist.world_size, vocab_size), engine=engine, sync_weights=sync_weights,
                        reference_logprobs=reference, rows=rows, prompt_ids=prepared.prompt_ids, scorer=scorer,
                        remote=remote, **common)
    return Run(parts, run_dir, log, checkpoints, engine, prepared, pool, remote)


def logprob_spec(cfg: Config, vocab_size: int | None) -> LogprobSpec:
    return LogprobSpec(temperature=cfg.rollout.temperature, chunk_size=cfg.model.logprob_chunk_size,
                       packed=cfg.model.packed_logprobs, vocab_size=vocab_size)


def loss_spec(cfg: Config) -> LossSpec:
    """The loss of a micro-batch (grpo.losses.rl_loss), read from algorithm.* once."""
    algo = cfg.algorithm
    sum_norm = AGGREGATION[algo.agg].per_max_len  # Dr. GRPO's constant: the response length limit
    return LossSpec(mode=algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                    ratio_level=algo.ratio_level, agg=algo.agg,
                    max_len=cfg.rollout.max_new_tokens if sum_norm else None,
                    cispo_clip_low=algo.cispo_clip_low, cispo_clip_high=algo.cispo_clip_high,
                    kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef, kl_kind=algo.kl_kind,
                    entropy_coef=algo.entropy_coef, tis_cap=algo.tis_cap, tis_level=algo.tis_level)


def rl_spec(cfg: Config, world_size: int, vocab_size: int | None) -> RLSpec:
    """What the RL loop reads, from the config once (grpo/parts.py). vocab_size: the ids the engines sample."""
    algo, roll, trainer = cfg.algorithm, cfg.rollout, cfg.trainer
    mini = algo.ppo_mini_batch_size
    return RLSpec(
        steps=trainer.steps, seed=cfg.seed,
        sampling=Sampling(max_new_tokens=roll.max_new_tokens, temperature=roll.temperature, top_p=roll.top_p,
                          top_k=roll.top_k, stop=tuple(roll.stop)),
        batching=Batching(prompts_per_step=trainer.prompts_per_step, group_size=roll.n,
                          prompts_per_mini_batch=None if mini is None else mini // world_size,  # verl's: all ranks
                          ppo_epochs=algo.ppo_epochs, micro_batch_size=trainer.micro_batch_size,
                          max_tokens=trainer.max_tokens_per_micro_batch),
        logprobs=logprob_spec(cfg, vocab_size),
        advantage=AdvantageSpec(estimator=algo.adv_estimator, eps=algo.adv_eps,
                                max_len=roll.max_new_tokens, overlong_cache_len=algo.overlong_cache_len,
                                overlong_factor=algo.overlong_factor, kl_in_reward=algo.kl_in_reward,
                                kl_coef=algo.kl_coef if algo.kl_in_reward else 0.0, kl_kind=algo.kl_kind),
        loss=loss_spec(cfg), dynamic_sampling=algo.dynamic_sampling, max_gen_batches=algo.max_gen_batches,
        grad_clip=cfg.optim.grad_clip, max_consecutive_skips=trainer.max_consecutive_skips,
        evaluation=Evaluation(every=trainer.eval_every, before=trainer.eval_before),
        watch=Watch(truncation=trainer.warn_truncation, flat_groups=trainer.warn_flat_groups,
                    after_steps=trainer.warn_after_steps))


def sft_spec(cfg: Config) -> SFTSpec:
    trainer = cfg.trainer
    return SFTSpec(steps=trainer.steps, batch_size=trainer.sft_batch_size, micro_batch_size=trainer.micro_batch_size,
                   chunk_size=cfg.model.logprob_chunk_size, grad_clip=cfg.optim.grad_clip,
                   max_consecutive_skips=trainer.max_consecutive_skips,
                   evaluation=Evaluation(every=trainer.eval_every, before=trainer.eval_before))
