"""2-process FSDP2 checks of LoRA on CPU, run by tests/test_lora_fsdp.py as
`torchrun --nproc_per_node=2 tests/dist_lora.py OUT_DIR`; rank 0 writes OUT_DIR/results.json.

Per case (Llama tied, Qwen3 untied, Llama with gradient checkpointing): sharded loss and adapter gradients
== one process over two optimizer steps, with a disabled-adapter reference pass between them; the merged
weights streamed from the shards == the one-process merged weights; a LoRA checkpoint written by the
shards loads in plain peft / transformers and resumes adapter and optimizer state exactly.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from models import fsdp
from models.logprobs import completion_logprobs, pad_batch
from models.checkpoint import load_checkpoint, save_checkpoint
from models.lora import apply_lora, disabled_adapters, merged_state_dict
from tiny import tiny_model
from tests_support import full_tensor, resume_check, run_under_torchrun

VOCAB = 4096
RANK, ALPHA = 4, 8.0


def make_batch(step: int):
    """8 sequences of uneven prompt and completion lengths; a different batch per step."""
    generator = torch.Generator().manual_seed(100 + step)
    prompt_lengths, completion_lengths = [3, 7, 5, 2, 6, 4, 8, 5], [5, 2, 6, 4, 1, 6, 3, 6]
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in prompt_lengths]
    completions = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in completion_lengths]
    return prompts, completions


def lora_model(arch: str, tie: bool, checkpointing: bool):
    """The same base weights and the same nonzero adapter on every rank and in the one-process reference."""
    model = tiny_model(arch, tie_word_embeddings=tie, seed=11, vocab_size=VOCAB)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()  # HF checkpoints only in train mode
    apply_lora(model, rank=RANK, alpha=ALPHA)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # B starts at 0 in peft; a nonzero B makes the merge and A's gradients non-trivial
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def loss_of(model, prompts, completions, global_tokens: float) -> torch.Tensor:
    batch = pad_batch(prompts, completions, pad_id=2)
    logprobs, _ = completion_logprobs(model, batch, temperature=0.8, chunk_size=5)
    return -(logprobs * batch["completion_mask"]).sum() / global_tokens


def train_two_steps(model, rows: slice, sharded: bool) -> dict:
    """Two AdamW steps with a disabled-adapter (reference) pass before the second; losses, adapter grads."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    out = {"losses": [], "grads": []}
    for step in range(2):
        prompts, completions = make_batch(step)
        global_tokens = float(sum(len(c) for c in completions))
        if step == 1:
            with torch.no_grad(), disabled_adapters(model):
                batch = pad_batch(prompts[rows], completions[rows], pad_id=2)
                out["reference_logprobs"] = completion_logprobs(model, batch, temperature=0.8)[0]
        loss = loss_of(model, prompts[rows], completions[rows], global_tokens)
        loss.backward()
        total = loss.detach().clone()
        if sharded:
            dist.all_reduce(total)
        out["losses"].append(total.item())
        out["grads"].append({name: full_tensor(p.grad).clone() for name, p in model.named_parameters()
                             if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out["optimizer"] = optimizer
    return out


def run_case(arch: str, tie: bool, checkpointing: bool, mesh, shared_dir: Path) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    every_row = slice(0, 8)
    reference_model = lora_model(arch, tie, checkpointing)
    reference = train_two_steps(reference_model, every_row, sharded=False)
    model = fsdp.shard(lora_model(arch, tie, checkpointing), mesh, param_dtype=None)
    share = 8 // world
    rows = slice(rank * share, (rank + 1) * share)
    sharded = train_two_steps(model, rows, sharded=True)
    base = tiny_model(arch, tie_word_embeddings=tie, seed=11, vocab_size=VOCAB)
    prompts, completions = make_batch(1)
    with torch.no_grad():
        base_logprobs = completion_logprobs(base, pad_batch(prompts[rows], completions[rows], pad_id=2), temperature=0.8)[0]
    disabled_diff = (sharded["reference_logprobs"] - base_logprobs).abs().max()
    dist.all_reduce(disabled_diff, op=dist.ReduceOp.MAX)  # both ranks' halves of the batch
    grad_diffs = [max((s[name] - r[name]).abs().max().item() for name in r)
                  for s, r in zip(sharded["grads"], reference["grads"])]
    merged = list(merged_state_dict(model))
    expected = dict(merged_state_dict(reference_model))
    case = {
        "loss_abs_diffs": [abs(s - r) for s, r in zip(sharded["losses"], reference["losses"])],
        "losses": reference["losses"],
        "grad_max_abs_diffs": grad_diffs,
        "grad_max_abs": max(g.abs().max().item() for g in reference["grads"][1].values()),
        "grad_names_match": [sorted(s) == sorted(r) for s, r in zip(sharded["grads"], reference["grads"])],
        "only_adapters_have_grads": all("lora_" in name for name in sharded["grads"][0]) and bool(sharded["grads"][0]),
        "disabled_vs_base_max_abs_diff": disabled_diff.item(),
        "requires_grad_restored": all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters()),
        "merged_names_are_base_names": [n for n, _ in merged] == [n for n, _ in fsdp.full_state_dict(base)],
        "merged_max_abs_diff": max((tensor - expected[name]).abs().max().item() for name, tensor in merged),
        "merged_minus_base_max_abs": max((tensor - base_tensor).abs().max().item()
                                         for (_, tensor), (_, base_tensor) in zip(merged, fsdp.full_state_dict(base))),
    }
    case.update(checkpoint_round_trip(arch, tie, model, sharded["optimizer"], shared_dir))
    return case


def checkpoint_round_trip(arch, tie, model, optimizer, directory: Path) -> dict:
    """Save from the shards; reload in plain peft and transformers; scramble, then resume exactly."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    out = {}
    save_checkpoint(directory, model, None, optimizer, step=2, extra={"position": 5}, merged_export=True)
    probe = torch.tensor([[1, 500, 77, 3000, 12, 9, 4000, 2]])
    model.eval()
    with torch.no_grad():
        sharded_logits = model(input_ids=probe).logits
    if rank == 0:
        peft_model = PeftModel.from_pretrained(tiny_model(arch, tie_word_embeddings=tie, seed=11, vocab_size=VOCAB), directory)
        exported = AutoModelForCausalLM.from_pretrained(directory / "merged", local_files_only=True)
        with torch.no_grad():
            out["peft_logits_max_abs_diff"] = (peft_model(input_ids=probe).logits - sharded_logits).abs().max().item()
            out["merged_export_logits_max_abs_diff"] = (exported(input_ids=probe).logits - sharded_logits).abs().max().item()
    out.update(resume_check(model, optimizer, lambda: load_checkpoint(directory, model, optimizer)))
    return out


def run_cases(mesh, shared: Path) -> dict:
    """Every case's measurements, keyed by case name; each in its own checkpoint directory under `shared`."""
    results = {}
    for arch, tie, checkpointing in [("llama", True, False), ("qwen3", False, False), ("llama", False, True)]:
        key = f"{arch}_{'tied' if tie else 'untied'}{'_checkpointing' if checkpointing else ''}"
        results[key] = run_case(arch, tie, checkpointing, mesh, shared / key)
    return results


if __name__ == "__main__":
    run_under_torchrun(run_cases)
