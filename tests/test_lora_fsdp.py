"""2-process FSDP2 with LoRA on CPU (gloo): sharded adapter training equals one process, the disabled adapter
is the base model, merged weights stream from the shards, and LoRA checkpoints reload and resume.

All checks come from ONE torchrun launch of tests/dist_lora.py (each launch costs 10-20 s); the tests below
read its results.json.
"""

import pytest

from tests_support import torchrun_results

CASES = ["llama_tied", "qwen3_untied", "llama_untied_checkpointing"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("dist_lora")
    return torchrun_results("dist_lora.py", out_dir, timeout=300)


def test_two_ranks_ran_every_case(results):
    assert results["world_size"] == 2 and set(CASES) <= set(results)


@pytest.mark.parametrize("case", CASES)
def test_sharded_adapter_training_equals_one_process(results, case):
    measured = results[case]
    assert all(measured["grad_names_match"]) and measured["only_adapters_have_grads"]
    # The two ranks' losses are summed in a different order than one process sums them: a float32 ulp or
    # two at |loss| ~ 9, hence 1e-6 relative. Step 2 follows an AdamW step and a disabled-adapter pass.
    assert max(measured["loss_abs_diffs"]) <= 1e-6 * max(1.0, max(measured["losses"]))
    assert max(measured["grad_max_abs_diffs"]) <= 1e-6, measured  # gradients are ~0.2 at most
    assert measured["grad_max_abs"] > 1e-2


@pytest.mark.parametrize("case", CASES)
def test_disabled_adapters_on_shards_are_the_base_model(results, case):
    measured = results[case]
    # Rank r's half of the batch through the sharded model with adapters off vs the plain base model: the
    # same fp32 weights and the same operations; the FSDP no-grad tests allow 1e-5, here 0 was measured.
    assert measured["disabled_vs_base_max_abs_diff"] <= 1e-5
    assert measured["requires_grad_restored"]


@pytest.mark.parametrize("case", CASES)
def test_merged_weights_stream_from_the_shards(results, case):
    measured = results[case]
    assert measured["merged_names_are_base_names"]
    # W + 2 * B @ A from gathered shards vs one process after the same two steps (AdamW lr 1e-2): the step
    # itself carries ~1e-7 differences from the sharded gradient sums; the merge adds ~0.15 to W.
    assert measured["merged_max_abs_diff"] <= 1e-6
    assert measured["merged_minus_base_max_abs"] > 0.05


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_from_shards_reloads_and_resumes(results, case):
    measured = results[case]
    assert measured["peft_logits_max_abs_diff"] <= 1e-6  # PeftModel.from_pretrained on the plain base
    # The merged export computes x (W + sBA)^T, the LoRA model x W^T + s (x A^T) B^T: float32 rounding.
    assert measured["merged_export_logits_max_abs_diff"] <= 1e-5
    assert measured["resume_step_extra"] == [2, {"position": 5}]
    assert measured["resume_weights_equal"] and measured["resume_optimizer_equal"]
