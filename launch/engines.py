"""The one factory of rollout engines, for training (launch/build.py) and for held-out evaluation and
distillation (launch.eval, launch.distill): the engine launch/plan.py decides for the target, built from it.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from launch.schema import Config
from launch.plan import Target, attention, own_engine_copy, precision, vllm_arguments


def build_engine(cfg: Config, target: Target, model_dir: Path, tokenizer, *, device: torch.device, dp_rank: int = 0,
                 policy: torch.nn.Module | None = None):
    """(engine, sync): sync() pushes the policy's weights into the engine (rollout.sync.sync_weights, in
    rollout.sync_bucket_mb buckets) and returns its metrics; None when there is nothing to push (the engine
    generates with the policy module itself, or there is no policy).

    model_dir: the HF directory the engine's own weights load from (vLLM always; the transformers engine when it
               owns a copy). policy: the model being trained, which the transformers engine generates with
               directly when the plan lets it (one process, one dtype); None for an evaluation.
    dp_rank:   the replica this rank belongs to (its vLLM seed: tensor-parallel peers sample identically).
    """
    if cfg.rollout.engine == "vllm":
        from rollout.vllm_engine import VLLMEngine
        engine = VLLMEngine(vllm_arguments(cfg, target, str(model_dir), dp_rank))
    elif policy is not None and not own_engine_copy(cfg, target):
        from rollout.hf_engine import HFEngine
        return HFEngine(policy, tokenizer, shared=True, num_threads=cfg.rollout.num_threads), None
    else:
        from models import load_model
        from rollout.hf_engine import HFEngine
        # The engine's own weights, in the compute dtype (bf16 sampling beside fp32 master weights, as vLLM does).
        model = load_model(model_dir, dtype=getattr(torch, precision(cfg, target)["engine"]), device=device,
                           attn_implementation=attention(cfg, target), trust_remote_code=cfg.model.trust_remote_code)
        engine = HFEngine(model.eval().requires_grad_(False), tokenizer, shared=False,
                          num_threads=cfg.rollout.num_threads)
    if policy is None:
        return engine, None
    from rollout.sync import sync_weights
    return engine, functools.partial(sync_weights, policy, engine, bucket_bytes=cfg.rollout.sync_bucket_mb << 20)


def vllm_engine(model_dir, *overrides: str, world_size: int = 1, dp_rank: int = 0):
    """A VLLMEngine for `model_dir` outside a run (tests, benchmarks, examples): the plan of the default config
    with `overrides` (e.g. "rollout.max_model_len=512") on this machine. Where a process group is already up
    (even of one rank), vLLM joins it through the external launcher instead of making its own."""
    import torch.distributed as dist

    from launch.config import load_config
    from rollout.vllm_engine import VLLMEngine
    cfg = load_config(None, ["rollout.engine=vllm", *overrides])
    arguments = vllm_arguments(cfg, Target.here(world_size), str(model_dir), dp_rank)
    if dist.is_available() and dist.is_initialized():
        arguments["distributed_executor_backend"] = "external_launcher"
    return VLLMEngine(arguments)
