"""What a run gets on a target machine (device, world size, flash-attn), as pure functions of the config and the
target: precisions, attention, vLLM's arguments, one step's engine calls, which ranks share prompts and seeds.
`launch.train --dry-run --device cuda --world-size 8` prints them (`run_plan`); launch/build.py builds from the
same functions, so the printed plan is what runs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.config import Config, ConfigError, check
from launch.memory import estimate
from models.loading import choose_attention, flash_attn_installed
from rollout.vllm_engine import SLEEP_LEVEL, WORKER_EXTENSION, visible_device

# vLLM's engine calls for one RL step, colocated on GPUs (vLLM's documented order for weight updates): level 2
# sleep drops weights and KV cache (the sync overwrites every weight, so nothing is copied to host and back);
# the weights come back first, the sync fills them, the trainer's cached blocks and the gathered buckets are
# released, and only then does the KV cache return.
CUDA_VLLM_CYCLE = ("generate", f"sleep(level={SLEEP_LEVEL})", "train", "wake_up(tags=['weights'])", "update_weights",
                   "reset_prefix_cache", "empty_cache", "wake_up(tags=['kv_cache'])")
CPU_VLLM_CYCLE = ("generate", "train", "update_weights", "reset_prefix_cache")  # no sleep mode off CUDA


@dataclass(frozen=True)
class Target:
    """The machine a plan is for: device type ("cpu" or "cuda"), torchrun world size, whether flash-attn imports
    there, and whether torchrun launches it (then even one rank is sharded with FSDP2)."""
    device: str = "cpu"
    world_size: int = 1
    flash_attn: bool = False
    torchrun: bool = False

    @property
    def sharded(self) -> bool:
        return self.world_size > 1 or self.torchrun

    @classmethod
    def here(cls, world_size: int = 1, torchrun: bool = False) -> Target:
        cuda = torch.cuda.is_available()
        try:
            return cls("cuda" if cuda else "cpu", world_size, cuda and flash_attn_installed(), torchrun)
        except ImportError as error:
            raise ConfigError(str(error)) from None


def tp_groups(world_size: int, tensor_parallel_size: int) -> list[list[int]]:
    """Consecutive ranks per replica (as vLLM's external launcher groups them): [[0, 1], [2, 3], ...] at TP 2.
    A group's ranks submit the same prompts and seeds, get the same completions, and each trains on its share."""
    return [list(range(start, start + tensor_parallel_size)) for start in range(0, world_size, tensor_parallel_size)]


def model_len(cfg: Config) -> int:
    """vLLM's max_model_len: rollout.max_model_len, else the longest prompt allowed plus the longest completion."""
    if cfg.rollout.max_model_len is not None:
        return cfg.rollout.max_model_len
    return cfg.data.max_prompt_tokens + max(cfg.rollout.max_new_tokens, cfg.eval_max_new_tokens)


def precision(cfg: Config, target: Target) -> dict:
    """The dtypes of every path: the policy's master weights (model.dtype), compute (model.param_dtype) and float32
    gradients; a frozen reference or distillation teacher needs no master copy (stored in the compute dtype);
    logits are float32."""
    compute = cfg.model.param_dtype
    mechanism = ("FSDP2 MixedPrecisionPolicy" if target.sharded else "torch.autocast" if compute != cfg.model.dtype
                 else "none")
    policy = {"param": cfg.model.dtype, "compute": compute, "reduce": "float32", "mechanism": mechanism}
    frozen, reference = {"param": compute, "compute": compute, "reduce": None, "mechanism": "none"}, None
    if cfg.stage == "rl" and cfg.algorithm.kl_coef > 0:
        reference = (dict(policy, shares="the policy with its LoRA adapters disabled") if cfg.model.lora.enabled
                     else frozen)
    teacher = frozen if cfg.stage == "rl" and cfg.algorithm.teacher is not None else None
    return {"policy": policy, "reference": reference, "teacher": teacher, "logits": "float32", "engine": compute}


def attention(cfg: Config, target: Target) -> str:
    """The attention implementation the trainer's model loads with (models.loading.choose_attention)."""
    return choose_attention(cfg.model.attn_implementation, target.device, cfg.model.param_dtype, target.flash_attn)


def vllm_arguments(cfg: Config, target: Target, model_path: str = "<model directory>", dp_rank: int = 0) -> dict:
    """The keyword arguments of vllm.LLM on a rank of data-parallel group dp_rank (rollout.vllm_engine adds
    nothing to them). On GPUs the KV cache is sized by gpu_memory_utilization (a byte cap would override
    it); on CPU it is bounded in bytes, since vLLM would otherwise reserve most of the machine's memory."""
    cuda = target.device == "cuda"
    eager = cfg.rollout.enforce_eager if cfg.rollout.enforce_eager is not None else not cuda
    arguments = dict(
        model=model_path, dtype=cfg.model.param_dtype, max_model_len=model_len(cfg), seed=dp_rank,
        tensor_parallel_size=cfg.rollout.tp_size, enforce_eager=eager, enable_prefix_caching=True,
        max_num_batched_tokens=max(4096, model_len(cfg)), logprobs_mode="processed_logprobs",
        generation_config="vllm",  # never take sampling defaults from the model's generation_config.json
        enable_sleep_mode=cuda,  # a CUDA allocator feature
    )
    if cfg.rollout.placement == "separate":
        # A rollout rank of a separate placement: vLLM's engine core runs in a process (and a world) of its own, and
        # the weights reach it through a worker extension (rollout.vllm_engine.WeightReload).
        arguments["worker_extension_cls"] = WORKER_EXTENSION
    elif target.sharded:  # a process group exists: vLLM joins it instead of making a world of its own
        arguments["distributed_executor_backend"] = "external_launcher"
    if cuda:
        utilization = cfg.rollout.vllm_gpu_memory_utilization
        arguments["gpu_memory_utilization"] = utilization or (0.85 if cfg.rollout.placement == "separate" else 0.4)
    else:
        arguments["kv_cache_memory_bytes"] = cfg.rollout.vllm_kv_cache_mb << 20
    return arguments


def engine_cycle(cfg: Config, target: Target) -> list[str]:
    """One RL step's engine calls in order ("train" is the trainer's logprob passes and update)."""
    if cfg.rollout.engine == "vllm":
        return list(CUDA_VLLM_CYCLE if target.device == "cuda" else CPU_VLLM_CYCLE)
    # Without a model of its own, the engine generates with the policy module itself: nothing to update.
    return ["generate", "train", "update_weights"] if own_engine_copy(cfg, target) else ["generate", "train"]


def own_engine_copy(cfg: Config, target: Target) -> bool:
    """Whether the transformers engine needs a model of its own (synced after every update) rather than the policy
    module: under FSDP2 (a sharded forward is a collective, and ranks stop generating at different steps), or to
    sample in the compute dtype beside master weights in another (bf16 beside fp32, as vLLM does)."""
    return target.sharded or cfg.model.param_dtype != cfg.model.dtype


def check_plan(cfg: Config, target: Target) -> None:
    """What the target cannot run, refused naming the key, the value and what would fit; the settings' own rules
    first (grpo.config.check, at the target's world size)."""
    world = target.world_size - (cfg.rollout.num_ranks if cfg.rollout.placement == "separate" else 0)
    check(cfg, world, whole_world=target.world_size)
    if cfg.model.attn_implementation == "flash_attention_2" and (target.device != "cuda" or not target.flash_attn):
        raise ConfigError(f"model.attn_implementation=flash_attention_2 needs CUDA with flash-attn installed "
                          f"(target: {target.device}, flash-attn {'present' if target.flash_attn else 'missing'}); "
                          f"use auto or sdpa")


def logprob_pass(cfg: Config, target: Target) -> str:
    """How the trainer's logprob passes run the model (models.logprobs.completion_logprobs): packed; or each
    distinct prompt once with the completions on its KV cache, except where gradient checkpointing drops the cache
    or FSDP over several ranks needs one forward on every rank: there the packed pass shares the prompts."""
    packs = attention(cfg, target) != "eager"
    if cfg.model.packed_logprobs:
        return "packed"
    if target.world_size > 1:
        return ("packed where rows share a prompt (FSDP over several ranks: one forward per pass on every rank)"
                if packs else "plain (FSDP over several ranks: one forward per pass on every rank)")
    if cfg.model.gradient_checkpointing and packs:
        return "update: packed, prompts shared (gradient checkpointing drops the KV cache); no-grad: shared prompts"
    return "shared prompts"


def placement(cfg: Config, target: Target) -> dict:
    """Which ranks train and which generate (launch/separate.py), and how stale a batch may be."""
    world, separate = target.world_size, cfg.rollout.placement == "separate"
    trainers = world - cfg.rollout.num_ranks if separate else world
    return {"mode": cfg.rollout.placement, "trainer_ranks": list(range(trainers)),
            "rollout_ranks": list(range(trainers if separate else 0, world)),
            "max_staleness": cfg.algorithm.max_staleness if separate else 0}


def step_batch(cfg: Config, shares: int) -> dict:
    """An RL step's batch over the whole world: trainer.prompts_per_step is per data-parallel share (a trainer rank,
    or a tensor-parallel group, which draws one share), so the global batch grows with the world size."""
    prompts = cfg.trainer.prompts_per_step * shares
    return {"prompts_per_share": cfg.trainer.prompts_per_step, "shares": shares, "prompts": prompts,
            "completions": prompts * cfg.rollout.n}


def describe_batch(batch: dict) -> str:
    """step_batch's figures as the line a start prints."""
    return (f"a step trains {batch['prompts']} prompts x {batch['completions'] // batch['prompts']} completions over "
            f"all ranks (trainer.prompts_per_step={batch['prompts_per_share']} per data-parallel share x "
            f"{batch['shares']} shares)")


def process_groups(cfg: Config, target: Target) -> dict[str, dict]:
    """The process groups of a torchrun world in the order every rank creates them (launch.dist), each with its
    ranks and backend; every group waits at most trainer.collective_timeout_s. Colocated: the world. Separate: the
    trainers (FSDP2), the engine ranks, `link` (every rank: batches and held-out results, pickled objects) and
    `weights` (trainer 0 and the engine ranks: the weight broadcast, on the device's backend)."""
    backend, world = "nccl" if target.device == "cuda" else "gloo", list(range(target.world_size))
    groups = {"world": {"ranks": world, "backend": backend}}
    if cfg.stage == "rl" and cfg.rollout.placement == "separate":
        trainers, engines = placement(cfg, target)["trainer_ranks"], placement(cfg, target)["rollout_ranks"]
        groups |= {"trainers": {"ranks": trainers, "backend": backend},
                   "engines": {"ranks": engines, "backend": "gloo"}, "link": {"ranks": world, "backend": "gloo"},
                   "weights": {"ranks": [trainers[0], *engines], "backend": backend}}
    return groups


def run_plan(cfg: Config, target: Target, model_path: str = "<model directory>", model_config: dict | None = None,
             gpu_gib: float | None = None, teacher_config: dict | None = None) -> dict:
    """The whole plan as one JSON-able object (what --dry-run prints); checked first (check_plan). With the model's
    config.json, the per-GPU memory estimate (launch.memory), checked against gpu_gib where given; the teacher's
    config.json sizes the distillation teacher (default: the student's)."""
    check_plan(cfg, target)
    plan = {"target": {"device": target.device, "world_size": target.world_size, "flash_attn": target.flash_attn,
                       "torchrun": target.sharded},
            "precision": precision(cfg, target), "attention": attention(cfg, target),
            "logprob_pass": logprob_pass(cfg, target), "engine": cfg.rollout.engine,
            "engine_cycle": engine_cycle(cfg, target), "tp_groups": tp_groups(target.world_size, cfg.rollout.tp_size),
            "placement": placement(cfg, target), "batch": None, "collectives": None, "rollout_devices": None,
            "vllm": None}
    if target.sharded:  # a torchrun world: what its collectives wait and how
        blocking = cfg.trainer.nccl_blocking_wait if target.device == "cuda" else None
        plan["collectives"] = {"timeout_s": cfg.trainer.collective_timeout_s, "groups": process_groups(cfg, target),
                               "nccl_blocking_wait": blocking}
    if target.device == "cuda" and cfg.stage == "rl" and cfg.rollout.placement == "separate":
        # the GPU each rollout rank's engine core binds on one node (its CUDA_VISIBLE_DEVICES): the rank's own
        plan["rollout_devices"] = {str(rank): visible_device(rank, None) for rank in plan["placement"]["rollout_ranks"]}
    if cfg.stage == "rl":
        trainers = len(plan["placement"]["trainer_ranks"])  # a separate placement's trainers: one share each
        shares = trainers if cfg.rollout.placement == "separate" else trainers // cfg.rollout.tp_size
        plan["batch"] = step_batch(cfg, shares)
    if cfg.rollout.engine == "vllm":
        plan["vllm"] = vllm_arguments(cfg, target, model_path)
    plan["memory"] = estimate(cfg, plan, model_config, gpu_gib, teacher_config) if model_config is not None else None
    return plan
