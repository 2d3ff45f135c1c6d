"""Full fine-tuning against LoRA on the embedded SmolLM2-135M: trainable parameters, gradient and AdamW-state
bytes, training step time (forward + backward + AdamW step through models.logprobs.completion_logprobs),
and the time to stream the weights an engine receives after a step (full_state_dict vs merged_state_dict).

    python -m bench.lora                         # SmolLM2-135M fp32; full, LoRA r=16 and r=128 (alpha = 2r)
    python -m bench.lora --ranks 8,64 --steps 5  # other ranks, more timed steps
    python -m bench.lora --quick                 # smoke run: tiny random model, 2 timed steps
    python -m bench.lora --threads 1 --steps 5    # steadier times on a machine shared with other jobs
    python -m bench.lora --json bench/results/lora.json

LoRA targets q, k, v, o, gate, up and down projections (models.lora.DEFAULT_TARGETS), as the corpus-grounded
factual-QA runs did (rank 128, alpha 256). Every configuration trains the same random batch (B sequences of
P prompt and T completion tokens) from the same base weights; step time is the median over --steps timed
steps after one warm-up step (which also allocates AdamW's state), the configurations' steps interleaved.
Bytes count tensors, not process memory: optimizer state = every tensor AdamW holds (exp_avg, exp_avg_sq;
the scalar step counters are included).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def tensor_bytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


class Run:
    """One configuration (rank None: full fine-tuning) with its model, optimizer and fixed batch."""

    def __init__(self, model_name: str | None, quick: bool, rank: int | None, batch_shape: tuple[int, int, int]):
        import torch

        from bench.tiny import tiny_model
        from models import load_model
        from models.logprobs import pad_batch
        from models.lora import apply_lora

        self.rank = rank
        self.model = tiny_model("llama", seed=0) if quick else load_model(model_name)
        if rank is not None:
            apply_lora(self.model, rank=rank, alpha=2.0 * rank)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=1e-5, weight_decay=0.0, fused=True)  # as launch/build.py
        sequences, prompt_tokens, completion_tokens = batch_shape
        generator = torch.Generator().manual_seed(0)
        vocab = self.model.get_input_embeddings().weight.shape[0]
        prompts = torch.randint(3, vocab, (sequences, prompt_tokens), generator=generator).tolist()
        completions = torch.randint(3, vocab, (sequences, completion_tokens), generator=generator).tolist()
        self.batch = pad_batch(prompts, completions, pad_id=2)
        self.trained_tokens = sequences * completion_tokens
        self.seconds: list[float] = []
        self.grad_bytes = 0

    def step(self, timed: bool) -> None:
        from models.logprobs import completion_logprobs

        started = time.perf_counter()
        logprobs, _ = completion_logprobs(self.model, self.batch)
        mask = self.batch["completion_mask"]
        (-(logprobs * mask).sum() / mask.sum()).backward()
        self.optimizer.step()
        self.grad_bytes = tensor_bytes(p.grad for p in self.trainable if p.grad is not None)
        self.optimizer.zero_grad(set_to_none=True)
        if timed:
            self.seconds.append(time.perf_counter() - started)

    def report(self) -> dict:
        import torch

        from models.fsdp import full_state_dict
        from models.lora import merged_state_dict

        state = [value for per_parameter in self.optimizer.state.values() for value in per_parameter.values()
                 if isinstance(value, torch.Tensor)]
        stream = merged_state_dict if self.rank is not None else full_state_dict
        started = time.perf_counter()
        streamed = tensor_bytes(tensor for _, tensor in stream(self.model))
        stream_seconds = time.perf_counter() - started
        median = statistics.median(self.seconds)
        return {
            "config": "full" if self.rank is None else f"lora_r{self.rank}",
            "total_parameters": sum(p.numel() for p in self.model.parameters()),
            "trainable_parameters": sum(p.numel() for p in self.trainable),
            "gradient_bytes": self.grad_bytes,
            "optimizer_state_bytes": tensor_bytes(state),
            "step_seconds_median": median,
            "step_seconds": self.seconds,
            "trained_tokens_per_s": self.trained_tokens / median,
            "engine_stream_seconds": stream_seconds,
            "engine_stream_bytes": streamed,
        }


def measure(model_name: str | None, quick: bool, ranks: list[int], batch_shape: tuple[int, int, int], steps: int) -> list[dict]:
    """Full fine-tuning and each LoRA rank, their timed steps interleaved round-robin so that a change in the
    machine's load (other processes) hits every configuration alike."""
    runs = [Run(model_name, quick, rank, batch_shape) for rank in [None, *ranks]]
    for run in runs:
        run.step(timed=False)  # warm-up; allocates AdamW's state
    for _ in range(steps):
        for run in runs:
            run.step(timed=True)
    return [run.report() for run in runs]


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--ranks", default="16,128", help="LoRA ranks to compare with full fine-tuning")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--batch", default="4,64,64", help="sequences, prompt tokens, completion tokens")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="tiny random model, 2 timed steps, rank 4")
    parser.add_argument("--json", help="also write the results to this file")
    arguments = parser.parse_args(argv)
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    ranks = [4] if arguments.quick else [int(r) for r in arguments.ranks.split(",") if r]
    steps = 2 if arguments.quick else arguments.steps
    batch_shape = (2, 8, 8) if arguments.quick else tuple(int(x) for x in arguments.batch.split(","))
    results = measure(arguments.model, arguments.quick, ranks, batch_shape, steps)
    full = results[0]
    mib = 1 << 20
    print(f"model {'tiny random llama' if arguments.quick else arguments.model or 'SmolLM2-135M (embedded)'}, fp32, "
          f"batch {batch_shape[0]} x ({batch_shape[1]} prompt + {batch_shape[2]} completion) tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"{'config':>10} {'trainable':>12} {'% of all':>8} {'grad MiB':>9} {'AdamW MiB':>10} {'x less':>7} "
          f"{'step s':>7} {'tok/s':>7} {'stream s':>9}")
    for row in results:
        print(f"{row['config']:>10} {row['trainable_parameters']:>12,} "
              f"{100 * row['trainable_parameters'] / row['total_parameters']:>7.2f}% "
              f"{row['gradient_bytes'] / mib:>9.2f} {row['optimizer_state_bytes'] / mib:>10.2f} "
              f"{full['optimizer_state_bytes'] / row['optimizer_state_bytes']:>7.1f} "
              f"{row['step_seconds_median']:>7.2f} {row['trained_tokens_per_s']:>7.1f} "
              f"{row['engine_stream_seconds']:>9.3f}")
    if arguments.json:
        with open(arguments.json, "w") as handle:
            json.dump({"batch": batch_shape, "threads": torch.get_num_threads(), "quick": arguments.quick,
                       "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
