"""2-process FSDP2 checks on CPU, run by tests/test_models_fsdp.py as
`torchrun --nproc_per_node=2 tests/dist_models.py OUT_DIR`; rank 0 writes OUT_DIR/results.json.

One launch covers: sharded forward/backward == one process (Llama and Qwen3, tied and untied; fp32 and bf16
mixed precision), per-rank parameter + gradient + optimizer bytes, checkpoint export that plain transformers
reloads to identical logits, distributed resume, rank-0 loading with meta initialisation, the packed
(padding-free) pass on the sharded model against the padded pass of one process, and passes where one rank's
micro-batch repeats a prompt and the other's does not.
"""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from models import fsdp
from models.checkpoint import load_checkpoint, save_checkpoint
from models.logprobs import completion_logprobs, pad_batch
from tiny import tiny_model
from tests_support import resume_check, run_under_torchrun

ENTROPY_COEFFICIENT = 0.01


def make_batch(seed: int = 3, grouped: bool = False):
    """8 sequences of uneven prompt and completion lengths (some completions end early). grouped: 4 prompts
    x 2 completions (GRPO's layout), so each rank's pass runs its 2 distinct prompts once (share_prompts)."""
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths, completion_lengths = [3, 7, 5, 2, 6, 4, 8, 5], [5, 2, 6, 4, 1, 6, 3, 6]
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in prompt_lengths]
    if grouped:
        prompts = [prompts[2 * (row // 2)] for row in range(len(prompts))]
    completions = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in completion_lengths]
    return prompts, completions


def loss_of(model, prompts, completions, global_tokens: float, temperature: float = 0.8,
            share_prompts: bool = True, packed: bool = False) -> torch.Tensor:
    """Token-mean policy-gradient-like loss over the GLOBAL token count, plus an entropy bonus."""
    batch = pad_batch(prompts, completions, pad_id=2)
    logprobs, entropy = completion_logprobs(model, batch, temperature=temperature, chunk_size=5, with_entropy=True,
                                            share_prompts=share_prompts, packed=packed)
    mask = batch["completion_mask"]
    return -((logprobs + ENTROPY_COEFFICIENT * entropy) * mask).sum() / global_tokens


def local_bytes(tensors) -> int:
    """Bytes of the storage each rank holds (FSDP padding included), counted once per storage."""
    seen, total = set(), 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def training_bytes(model, optimizer) -> int:
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return local_bytes(params) + local_bytes(grads) + local_bytes(states)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-30)).item()


def uneven_sharing_case() -> dict:
    """Rank 0's micro-batch repeats a prompt, rank 1's does not: a no-grad pass (old or reference logprobs, as
    with kl_coef > 0 or ppo_epochs > 1) and an update pass on a sharded Qwen3, against one process. FSDP pairs
    every layer's all-gather across ranks, so a pass that ran more forwards on one rank than on the other would
    hang; the mesh's group times out after 30 s, so that fails here instead of waiting for gloo's 30 minutes."""
    rank = dist.get_rank()
    mesh = DeviceMesh.from_group(dist.new_group(timeout=timedelta(seconds=30)), "cpu")
    prompts, completions = make_batch(seed=7)
    prompts[1] = prompts[0]
    rows = slice(2 * rank, 2 * rank + 2)
    global_tokens = float(sum(len(c) for c in completions[:4]))
    reference = tiny_model("qwen3", seed=17)
    reference_loss = loss_of(reference, prompts[:4], completions[:4], global_tokens, share_prompts=False)
    reference_loss.backward()
    model = fsdp.shard(tiny_model("qwen3", seed=17), mesh, param_dtype=None)
    local = pad_batch(prompts[rows], completions[rows], pad_id=2)
    with torch.no_grad():
        old_logprobs, _ = completion_logprobs(model, local, temperature=0.8)
        expected_old, _ = completion_logprobs(reference, local, temperature=0.8, share_prompts=False)
    no_grad_diff = torch.tensor((old_logprobs - expected_old).abs().max().item())
    dist.all_reduce(no_grad_diff, op=dist.ReduceOp.MAX)
    loss = loss_of(model, prompts[rows], completions[rows], global_tokens)
    loss.backward()
    total_loss = loss.detach().clone()
    dist.all_reduce(total_loss)
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for name, p in model.named_parameters()}
    return {"no_grad_logprobs_max_abs_diff": no_grad_diff.item(), "loss": reference_loss.item(),
            "loss_abs_diff": abs(total_loss.item() - reference_loss.item()),
            "grad_max_abs_diff": max((grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())}


def compare_case(arch: str, tie: bool, param_dtype, mesh, results: dict, out_dir: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    # Qwen3 cases: repeated prompts, which a sharded model shares by the packed pass (one forward, as every
    # rank must run the same forwards); the reference runs the plain single pass.
    prompts, completions = make_batch(grouped=arch == "qwen3")
    global_tokens = float(sum(len(c) for c in completions))
    # One process: the whole batch through an unsharded fp32 copy.
    reference = tiny_model(arch, tie_word_embeddings=tie, seed=11)
    reference_copy = tiny_model(arch, tie_word_embeddings=tie, seed=11)
    reference_loss = loss_of(reference, prompts, completions, global_tokens, share_prompts=False)
    reference_loss.backward()
    reference_grads = {name: p.grad for name, p in reference.named_parameters()}
    # eps 1e-3: Adam's first step is lr * g / (|g| + eps); the default eps (1e-8) turns float32 noise on a
    # near-zero gradient entry into a whole-lr difference, which says nothing about the sharded optimizer.
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-3)
    reference_optimizer.step()
    bytes_one_process = training_bytes(reference, reference_optimizer)

    # Sharded: each rank its contiguous half of the sequences.
    model = fsdp.shard(tiny_model(arch, tie_word_embeddings=tie, seed=11), mesh, param_dtype=param_dtype)
    share = len(prompts) // world
    rows = slice(rank * share, (rank + 1) * share)
    # A no-grad pass first (old logprobs): equal to one process, and the root's weights are released after.
    probe_batch = pad_batch(prompts[rows], completions[rows], pad_id=2)
    with torch.no_grad():
        old_logprobs, _ = completion_logprobs(model, probe_batch, temperature=0.8)
        expected_old, _ = completion_logprobs(reference_copy, probe_batch, temperature=0.8)
    no_grad_diff = (old_logprobs - expected_old).abs().max().item()
    root_released = isinstance(model.lm_head.weight, DTensor)
    streamed_dtypes = sorted({str(tensor.dtype) for _, tensor in fsdp.full_state_dict(model)})
    loss = loss_of(model, prompts[rows], completions[rows], global_tokens)
    loss.backward()
    total_loss = loss.detach().clone()
    dist.all_reduce(total_loss)
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    optimizer.step()
    bytes_sharded = training_bytes(model, optimizer)
    stepped = dict(fsdp.full_state_dict(model))
    in_bf16 = list(fsdp.full_state_dict(model, torch.bfloat16))  # each shard cast, then gathered (the weight sync)

    key = f"{arch}_{'tied' if tie else 'untied'}_{'fp32' if param_dtype is None else 'bf16'}"
    case = {
        "loss_abs_diff": abs(total_loss.item() - reference_loss.item()),
        "loss": reference_loss.item(),
        "grad_max_abs_diff": max((grads[n] - reference_grads[n]).abs().max().item() for n in reference_grads),
        "grad_max_abs": max(g.abs().max().item() for g in reference_grads.values()),
        "grad_worst_relative_error": max(relative_error(grads[n], reference_grads[n]) for n in reference_grads),
        "grad_names_match": sorted(grads) == sorted(reference_grads),
        "step_max_abs_diff": max((stepped[n] - p).abs().max().item() for n, p in reference.named_parameters()),
        "bytes_ratio": bytes_sharded / bytes_one_process,
        "no_grad_logprobs_max_abs_diff": no_grad_diff,
        "root_released_after_no_grad": root_released,
        "streamed_dtypes": streamed_dtypes,
        "bf16_stream_is_the_cast_master": [name for name, _ in in_bf16] == list(stepped) and all(
            tensor.dtype == torch.bfloat16 and torch.equal(tensor, stepped[name].to(torch.bfloat16))
            for name, tensor in in_bf16),
        "tying_kept": (model.lm_head.weight is model.model.embed_tokens.weight) == tie,
    }
    if param_dtype is None:
        case.update(export_and_resume(model, optimizer, mesh, out_dir / key))
    results[key] = case


def export_and_resume(model, optimizer, mesh, directory: Path) -> dict:
    """Save the sharded model; reload it with plain transformers, with load_sharded_model and with
    load_checkpoint after scrambling the weights and optimizer."""
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    save_checkpoint(directory, model, None, optimizer, step=1, extra={"position": 17})
    probe = torch.tensor([[1, 500, 77, 3000, 12, 9, 45000, 2]])
    with torch.no_grad():
        sharded_logits = model(input_ids=probe).logits
    out = {}
    if rank == 0:
        exported = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
        with torch.no_grad():
            out["export_logits_max_abs_diff"] = (exported(input_ids=probe).logits - sharded_logits).abs().max().item()
        out["export_architectures"] = exported.config.architectures
    # Rank-0 loading with meta initialisation on the other ranks: rotary buffers must be recomputed.
    loaded = fsdp.load_sharded_model(directory, mesh, param_dtype=None)
    with torch.no_grad():
        loaded_logits = loaded(input_ids=probe).logits
    out["rank0_load_logits_max_abs_diff"] = (loaded_logits - sharded_logits).abs().max().item()
    # Resume: scramble, then load_checkpoint must restore weights and optimizer state exactly.
    out.update(resume_check(model, optimizer, lambda: load_checkpoint(directory, model, optimizer)))
    return out


def packed_case(arch: str, tie: bool, mesh) -> dict:
    """The packed pass (models.logprobs.pack_batch) on the sharded model against the padded pass of one process:
    each rank packs its half of the batch (Qwen3: repeated prompts, packed once each; Llama: distinct prompts)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    prompts, completions = make_batch(seed=5, grouped=arch == "qwen3")
    global_tokens = float(sum(len(c) for c in completions))
    reference = tiny_model(arch, tie_word_embeddings=tie, seed=13)
    reference_loss = loss_of(reference, prompts, completions, global_tokens, share_prompts=False)
    reference_loss.backward()
    model = fsdp.shard(tiny_model(arch, tie_word_embeddings=tie, seed=13), mesh, param_dtype=None)
    share = len(prompts) // world
    rows = slice(rank * share, (rank + 1) * share)
    local = pad_batch(prompts[rows], completions[rows], pad_id=2)
    with torch.no_grad():
        old_logprobs, _ = completion_logprobs(model, local, temperature=0.8, packed=True)
        expected_old, _ = completion_logprobs(reference, local, temperature=0.8, share_prompts=False)
    no_grad_diff = torch.tensor((old_logprobs - expected_old).abs().max().item())
    dist.all_reduce(no_grad_diff, op=dist.ReduceOp.MAX)
    loss = loss_of(model, prompts[rows], completions[rows], global_tokens, packed=True)
    loss.backward()
    total_loss = loss.detach().clone()
    dist.all_reduce(total_loss)
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for name, p in model.named_parameters()}
    reference_grads = {name: p.grad for name, p in reference.named_parameters()}
    return {"loss_abs_diff": abs(total_loss.item() - reference_loss.item()), "loss": reference_loss.item(),
            "grad_max_abs_diff": max((grads[n] - reference_grads[n]).abs().max().item() for n in reference_grads),
            "grad_names_match": sorted(grads) == sorted(reference_grads),
            "no_grad_logprobs_max_abs_diff": no_grad_diff.item()}


def run_cases(mesh, shared: Path) -> dict:
    """Every case's measurements, keyed by case name; fp32 cases also export and resume under `shared`."""
    results: dict = {"uneven_prompt_sharing": uneven_sharing_case()}
    for arch, tie in [("llama", True), ("llama", False), ("qwen3", True), ("qwen3", False)]:
        compare_case(arch, tie, None, mesh, results, shared)
    for arch, tie in [("llama", True), ("qwen3", False)]:
        compare_case(arch, tie, torch.bfloat16, mesh, results, shared)
    for arch, tie in [("llama", True), ("qwen3", False)]:
        results[f"{arch}_{'tied' if tie else 'untied'}_packed"] = packed_case(arch, tie, mesh)
    return results


if __name__ == "__main__":
    run_under_torchrun(run_cases)
