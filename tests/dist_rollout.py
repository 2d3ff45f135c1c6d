"""2-rank colocated rollout check, run by tests/test_rollout_dist.py as
`torchrun --nproc_per_node=2 tests/dist_rollout.py OUT_DIR ENGINES` (ENGINES: "hf,vllm" or "hf").

Each rank shards the embedded SmolLM2-135M with FSDP2 (gloo, CPU mesh) and owns one engine replica per name
(vLLM through its external launcher, joining the process group made here first). After one SGD step on the
sharded policy and a bucketed sync, each replica's rollout logprobs for its own samples must equal the
sharded trainer's recomputation, while before the sync they did not. Rank 0 writes OUT_DIR/results.json.
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from models import fsdp, load_model, load_tokenizer, render_prompt, resolve_model_dir
from models.logprobs import completion_logprobs, pad_batch
from rollout.sync import sync_weights

QUESTIONS = ["Name three fruits.", "What is the capital of France? Answer in one sentence."]
OPTIONS = dict(n=2, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, stop=None, seed=4)


def recompute(model, completions) -> list[list[float]]:
    """The trainer's logprobs (a collective forward on the sharded model: every rank calls it together)."""
    batch = pad_batch([c.prompt_ids for c in completions], [c.completion_ids for c in completions], pad_id=2)
    with torch.no_grad():
        logprobs, _ = completion_logprobs(model, batch, temperature=1.0)
    return [logprobs[row, : len(c.completion_ids)].tolist() for row, c in enumerate(completions)]


def gaps(completions, recomputed) -> list[float]:
    return [abs(a - b) for c, r in zip(completions, recomputed) for a, b in zip(c.logprobs, r)]


def sgd_step(model, completions, learning_rate: float = 3e-3) -> None:
    """One large step lowering the logprob of this rank's completions (gradients summed over ranks)."""
    batch = pad_batch([c.prompt_ids for c in completions], [c.completion_ids for c in completions], pad_id=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    logprobs, _ = completion_logprobs(model, batch, temperature=1.0)
    loss = (logprobs * batch["completion_mask"]).sum() / batch["completion_mask"].sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def build_engines(names: list[str], model_dir: Path, tokenizer) -> dict:
    engines = {}
    if "vllm" in names:
        import torch.distributed as dist

        from bench.gpu_common import vllm_engine

        engines["vllm"] = vllm_engine(model_dir, "rollout.max_model_len=512", world_size=dist.get_world_size(),
                                      dp_rank=dist.get_rank())  # each rank its own replica
    if "hf" in names:
        from rollout.hf_engine import HFEngine

        engines["hf"] = HFEngine(load_model(model_dir), tokenizer, shared=False)
    return engines


def main() -> None:
    out_dir, names = Path(sys.argv[1]), sys.argv[2].split(",")
    dist.init_process_group("gloo")  # before vLLM, which then joins this world instead of making its own
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    if rank == 0:
        resolve_model_dir(None)  # convert the embedded model once, before the other rank looks for it
    dist.barrier()
    model_dir = resolve_model_dir(None)
    tokenizer = load_tokenizer(model_dir)
    engines = build_engines(names, model_dir, tokenizer)
    policy = fsdp.shard(load_model(model_dir), mesh, param_dtype=None)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": QUESTIONS[rank % len(QUESTIONS)]}])]

    sgd_step(policy, engines[names[0]].generate(prompts, **OPTIONS))
    results = {}
    for name in names:  # the same order on every rank: recompute and sync are collectives
        engine = engines[name]
        stale = engine.generate(prompts, **OPTIONS)
        stale_gaps = gaps(stale, recompute(policy, stale))
        metrics = sync_weights(policy, engine, bucket_bytes=64 << 20)
        fresh = engine.generate(prompts, **OPTIONS)
        fresh_gaps = gaps(fresh, recompute(policy, fresh))
        results[name] = {
            "stale_mean_gap": sum(stale_gaps) / len(stale_gaps), "fresh_max_gap": max(fresh_gaps),
            "sync": metrics, "completions": [c.completion_ids for c in fresh],
        }
    parameter_bytes = sum(tensor.numel() * tensor.element_size() for _, tensor in fsdp.named_weights(policy))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {"rank": rank, "results": results})
    if rank == 0:
        summary = {"world_size": world_size, "parameter_bytes": parameter_bytes, "ranks": gathered}
        (out_dir / "results.json").write_text(json.dumps(summary))
    dist.barrier()
    # vLLM first: destroying the process group under a live external-launcher engine raises.
    del engines
    gc.collect()
    try:
        dist.destroy_process_group()
    except (AssertionError, RuntimeError, ValueError):
        pass  # vLLM may already have torn the default group down with its own state


if __name__ == "__main__":
    main()
