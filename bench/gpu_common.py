"""Shared pieces of the single-GPU benchmark (bench/gpu.sh): model shapes built from configs (no downloads),
an offline tokenizer, a one-rank process group for FSDP2, peak-memory probes, the FLOP count, and the
results file each part writes as it goes (so a part that dies late keeps what it measured).

    python -m bench.gpu_common merge PART.json ... --out RESULT.json    # what gpu.sh runs last
    python -m bench.gpu_common run LIMIT_S -- COMMAND ...               # COMMAND's whole tree ends at the limit
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

# Qwen3-1.7B's architecture (its config.json); the weights are random, so nothing is downloaded.
QWEN3_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False)
# The same vocabulary at a tiny width, for CPU smoke runs of every code path.
# head_dim 64: vLLM's CPU attention has no kernel for very small heads (16 fails).
TINY = dict(QWEN3_1_7B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, max_position_embeddings=4096)
EOS_ID, PAD_ID = 1, 0


def model_config(tiny: bool):
    from transformers import Qwen3Config
    return Qwen3Config(**(TINY if tiny else QWEN3_1_7B), use_sliding_window=False, bos_token_id=EOS_ID,
                       eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype, attn_implementation: str):
    """A random-weight Qwen3 causal LM created directly on `device` (no CPU copy, no download)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(tiny), dtype=dtype,
                                                 attn_implementation=attn_implementation)
    return model


def attention(device: torch.device) -> tuple[str, str | None]:
    """(implementation, note): flash_attention_2 on CUDA (bf16 compute) when flash-attn imports, else sdpa
    (models.loading.choose_attention)."""
    from models.loading import resolve_attn_implementation
    implementation = resolve_attn_implementation("auto", device, "bfloat16" if device.type == "cuda" else "float32")
    note = None if implementation == "flash_attention_2" or device.type != "cuda" else \
        "flash-attn is not importable: attention runs on sdpa"
    return implementation, note


def offline_tokenizer(vocab_size: int):
    """A word-level tokenizer over the ids "<0>" ... "<V-1>", with a chat template: enough for the engines
    (decode, eos, pad, a template for vLLM's tokenizer load) with nothing to download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {f"<{i}>": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocabulary, unk_token="<0>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=f"<{EOS_ID}>", pad_token=f"<{PAD_ID}>",
                                        unk_token="<0>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


def vllm_engine(model_dir, *overrides: str, world_size: int = 1, dp_rank: int = 0):
    """A VLLMEngine for `model_dir` outside a run (tests, benchmarks): the plan of the default config with
    `overrides` (e.g. "rollout.max_model_len=512") on this machine. Where a process group is already up (even of
    one rank), vLLM joins it through the external launcher instead of making its own."""
    import torch.distributed as dist

    from launch.plan import Target, vllm_arguments
    from launch.recipe import load_config
    from rollout.vllm_engine import VLLMEngine
    cfg = load_config(None, ["rollout.engine=vllm", *overrides])
    arguments = vllm_arguments(cfg, Target.here(world_size), str(model_dir), dp_rank)
    if dist.is_available() and dist.is_initialized():
        arguments["distributed_executor_backend"] = "external_launcher"
    return VLLMEngine(arguments)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def one_rank_mesh(device: torch.device):
    """A world of one process and its 1-D device mesh, for models.fsdp.shard and vLLM's external launcher.

    launch.dist makes a process group only for world size > 1, so the benchmark makes its own, through the
    same environment variables torchrun sets (kept if torchrun already set them).
    """
    import torch.distributed as torch_dist
    from torch.distributed.device_mesh import init_device_mesh

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(key, value)
    if not torch_dist.is_initialized():
        torch_dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return init_device_mesh(device.type, (1,))


def close_process_group() -> None:
    import torch.distributed as torch_dist
    if torch_dist.is_initialized():
        try:
            torch_dist.destroy_process_group()
        except Exception:  # vLLM may have torn it down already
            pass


class PeakMemory:
    """Peak extra memory of a block: CUDA allocated bytes on GPU; resident bytes (VmHWM reset) on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.extra_bytes = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            from bench.step import reset_peak_rss, status_bytes
            reset_peak_rss()
            self.before = status_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.extra_bytes = torch.cuda.max_memory_allocated() - self.before
        else:
            from bench.step import status_bytes
            self.extra_bytes = status_bytes("VmHWM") - self.before
        return False


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def training_flops(config, *, batch: int, seq_len: int, completion_len: int) -> dict:
    """FLOPs of one training step (forward + backward) of a causal LM on [batch, seq_len] tokens whose last
    completion_len positions are projected to the vocabulary (models.logprobs.completion_logprobs).

      6 * N_body * batch * seq_len          every weight matmul outside the vocabulary projection, fwd + bwd
                                            (N_body = parameters minus the V x d embedding, whose lookup is free)
    + 6 * V * d * batch * completion_len    the vocabulary projection, at completion positions only
    + 12 * L * H * Q * seq_len^2 * batch    attention scores and values, fwd + bwd (PaLM's count: the full
                                            S x S square; causal kernels skip about half, see `attention_causal`)
    `six_n`: the common 6 * N_total * tokens + attention figure, for comparison with other reports.
    """
    hidden, vocab, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    heads, head_dim = config.num_attention_heads, config.head_dim
    kv_heads, inter = config.num_key_value_heads, config.intermediate_size
    per_layer = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 3 * hidden * inter
    per_layer += 2 * hidden + 2 * head_dim  # RMSNorm weights (input, post-attention, q_norm, k_norm)
    body = layers * per_layer + hidden  # + final norm
    total = body + vocab * hidden * (1 if config.tie_word_embeddings else 2)
    attention_flops = 12 * layers * heads * head_dim * seq_len**2 * batch
    flops = 6 * body * batch * seq_len + 6 * vocab * hidden * batch * completion_len + attention_flops
    return {"flops": flops, "attention_flops": attention_flops, "attention_causal": attention_flops / 2,
            "body_params": body, "total_params": total,
            "six_n": 6 * total * batch * seq_len + attention_flops}


class Results:
    """A JSON file of results, rewritten after every record (a crash later keeps what was measured)."""

    def __init__(self, path: str | os.PathLike, part: str):
        self.path = Path(path)
        self.data = {"part": part, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "skipped": {}, "errors": {}}
        self.save()

    def record(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    def skip(self, key: str, reason: str) -> None:
        print(f"SKIPPED {key}: {reason}", flush=True)
        self.data["skipped"][key] = reason
        self.save()

    def error(self, key: str, error: BaseException) -> None:
        print(f"FAILED {key}: {type(error).__name__}: {error}", flush=True)
        self.data["errors"][key] = f"{type(error).__name__}: {error}"
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def environment(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "device": str(device), "cpus": os.cpu_count()}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(gpu=properties.name, gpu_memory_bytes=properties.total_memory, cuda=torch.version.cuda)
    for package in ("transformers", "flash_attn", "vllm"):
        try:
            info[package] = __import__(package).__version__
        except Exception:
            info[package] = None
    return info


def merge(parts: list[str], out: str) -> dict:
    """One JSON from the parts' files; a missing or unreadable part is named under "missing_parts"."""
    merged: dict = {"missing_parts": []}
    for part in parts:
        try:
            data = json.loads(Path(part).read_text())
        except (OSError, ValueError) as error:
            merged["missing_parts"].append(f"{part}: {error}")
            continue
        merged[data.get("part", Path(part).stem)] = data
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(merged, indent=1, default=str))
    return merged


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc), whatever session or process group it moved to."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):  # gone meanwhile, or not a process
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        below = children.get(queue.pop(), [])
        found += below
        queue += below
    return found


def run_limited(command: list[str], limit_s: float, **popen_options) -> subprocess.CompletedProcess:
    """subprocess.run with a time limit that ends the whole process tree, then raises subprocess.TimeoutExpired:
    torchrun starts its workers in sessions of their own, so killing its agent alone (subprocess.run's timeout,
    coreutils' timeout) would leave them running and holding the GPU."""
    process = subprocess.Popen(command, **popen_options)
    try:
        stdout, stderr = process.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        for pid in [process.pid, *descendants(process.pid)]:  # all found first: an orphan loses its parent link
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # run LIMIT_S -- COMMAND ...: COMMAND's exit status, or 124 past the limit
        try:
            return run_limited(argv[3:], float(argv[1])).returncode
        except subprocess.TimeoutExpired:
            return 124
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_common")
    parser.add_argument("command", choices=("merge",))
    parser.add_argument("parts", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    merged = merge(args.parts, args.out)
    for missing in merged["missing_parts"]:
        print(f"MISSING part: {missing}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
