"""What a CUDA node gets, tested without one: the plan (launch/plan.py) of every shipped recipe at world sizes 1, 2
and 8 (and tensor parallelism 2 where a recipe uses vLLM) is pinned in tests/golden/plans.json, the veriseek recipe's
GPU plan is checked line by line, --dry-run prints the plan, the run builds from the same functions, and what a
target cannot run is refused naming the key.

Regenerate the golden file after an intended change: NANOGRPO_WRITE_GOLDEN=1 pytest tests/test_launch_plan.py
(then read its diff: every changed line is a change of what users' GPUs will run).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from grpo.config import ConfigError
from launch.memory import read_model_config
from launch.recipe import load_config
from launch.plan import CUDA_VLLM_CYCLE, Target, check_plan, run_plan, tp_groups

CONFIGS = Path(__file__).resolve().parents[1] / "launch" / "configs"
GOLDEN = Path(__file__).resolve().parent / "golden" / "plans.json"
RECIPES = sorted(path.stem for path in CONFIGS.glob("*.yaml"))


def _targets(cfg):
    """(name, target, overrides) of every plan pinned for a recipe."""
    out = [("cpu:1", Target("cpu", 1, False), [])]
    for world in (1, 2, 8):
        out.append((f"cuda:{world}", Target("cuda", world, True), []))
    if cfg.rollout.engine == "vllm":
        tp2 = ["rollout.tensor_parallel_size=2"]
        out += [(f"cuda:{world}:tp2", Target("cuda", world, True), tp2) for world in (2, 8)]
        separate = ["rollout.placement=separate", "rollout.num_ranks=2"]
        out.append(("cuda:8:separate2", Target("cuda", 8, True), separate))
    return out


# The config.json each recipe's model has (tests/data/models, written from the published architectures): the memory
# estimate of every pinned plan, checked against 80 GiB GPUs on CUDA targets.
MODEL_CONFIGS = {None: "smollm2-135m", "Qwen/Qwen3-4B-Thinking-2507": "qwen3-4b", "Qwen/Qwen3-4B-Base": "qwen3-4b",
                 "Qwen/Qwen2.5-3B-Instruct": "qwen2.5-3b"}
MODELS = Path(__file__).resolve().parent / "data" / "models"


def all_plans() -> dict:
    plans = {}
    for recipe in RECIPES:
        for name, target, overrides in _targets(load_config(CONFIGS / f"{recipe}.yaml")):
            cfg = load_config(CONFIGS / f"{recipe}.yaml", overrides)
            model = read_model_config(MODELS / MODEL_CONFIGS[cfg.model.name_or_path])
            plans[f"{recipe}@{name}"] = run_plan(cfg, target, model_config=model,
                                                 gpu_gib=80 if target.device == "cuda" else None)
    return plans


def test_every_recipe_plan_is_pinned():
    plans = all_plans()
    if os.environ.get("NANOGRPO_WRITE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(plans, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert sorted(plans) == sorted(golden)
    for key in plans:
        assert plans[key] == golden[key], key


def test_veriseek_on_two_gpus_gets_the_gpu_plan():
    plan = run_plan(load_config(CONFIGS / "veriseek_grpo.yaml"), Target("cuda", 2, True))
    vllm = plan["vllm"]
    # The KV cache is sized by gpu_memory_utilization: a byte cap would override it (vLLM 0.32) and 256 MiB
    # cannot hold one 2,176-token sequence of Qwen3-4B (144 KiB per token).
    assert "kv_cache_memory_bytes" not in vllm and vllm["gpu_memory_utilization"] == 0.4
    assert vllm["max_model_len"] >= 1664 + 512 and vllm["enforce_eager"] is False  # CUDA graphs on
    assert vllm["enable_sleep_mode"] and vllm["distributed_executor_backend"] == "external_launcher"
    assert vllm["dtype"] == "bfloat16" and vllm["logprobs_mode"] == "processed_logprobs"
    cycle = plan["engine_cycle"]
    assert cycle == list(CUDA_VLLM_CYCLE) and "sleep(level=2)" in cycle
    # The weights come back and are overwritten before the KV cache returns.
    assert cycle.index("wake_up(tags=['weights'])") < cycle.index("update_weights") < cycle.index("empty_cache") \
        < cycle.index("wake_up(tags=['kv_cache'])")
    policy, reference = plan["precision"]["policy"], plan["precision"]["reference"]
    assert (policy["param"], policy["compute"], policy["reduce"]) == ("float32", "bfloat16", "float32")
    assert (reference["param"], reference["compute"]) == ("bfloat16", "bfloat16")  # frozen: no master copy
    assert plan["precision"]["logits"] == "float32" and plan["attention"] == "flash_attention_2"
    # Two ranks: one forward per pass on every rank (whether a micro-batch repeats a prompt differs between them).
    assert plan["logprob_pass"].startswith("packed where rows share a prompt")
    assert plan["tp_groups"] == [[0], [1]]


def test_fp32_never_meets_flash_attention():
    # flash-attn refuses fp32: "auto" picks it only where the model computes in bf16/fp16.
    fp32 = load_config(None, ["model.param_dtype=float32"])
    assert run_plan(fp32, Target("cuda", 1, True))["attention"] == "sdpa"
    bf16 = load_config(None, ["model.param_dtype=bfloat16"])
    assert run_plan(bf16, Target("cuda", 1, True))["attention"] == "flash_attention_2"
    assert run_plan(bf16, Target("cuda", 1, False))["attention"] == "sdpa"
    assert run_plan(bf16, Target("cpu", 1, False))["attention"] == "sdpa"
    with pytest.raises(ConfigError, match=r"model\.attn_implementation=flash_attention_2 computes in bf16/fp16 only, "
                                          r"but model\.param_dtype=float32"):
        check_plan(load_config(None, ["model.attn_implementation=flash_attention_2"]), Target("cuda", 1, True))
    with pytest.raises(ConfigError, match=r"flash_attention_2 needs CUDA with flash-attn installed \(target: cpu"):
        check_plan(load_config(None, ["model.attn_implementation=flash_attention_2", "model.param_dtype=bfloat16"]),
                   Target("cpu", 1, False))


def test_one_process_bf16_is_the_same_policy_by_autocast():
    cfg = load_config(None, ["model.param_dtype=bfloat16", "algorithm.kl_coef=0.01"])
    one, fsdp = run_plan(cfg, Target("cpu", 1)), run_plan(cfg, Target("cpu", 2))
    assert one["precision"]["policy"]["mechanism"] == "torch.autocast"
    assert fsdp["precision"]["policy"]["mechanism"] == "FSDP2 MixedPrecisionPolicy"
    for plan in (one, fsdp):
        policy = plan["precision"]["policy"]
        assert (policy["param"], policy["compute"], policy["reduce"]) == ("float32", "bfloat16", "float32")
        assert plan["precision"]["reference"]["param"] == "bfloat16" and plan["precision"]["engine"] == "bfloat16"
        # The transformers engine samples from its own bf16 copy, synced after every update, as vLLM would.
        assert plan["engine_cycle"] == ["generate", "train", "update_weights"]


def test_tensor_parallel_groups_and_their_refusals():
    assert tp_groups(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]] and tp_groups(2, 1) == [[0], [1]]
    tp = load_config(None, ["rollout.engine=vllm", "rollout.tensor_parallel_size=2"])
    assert run_plan(tp, Target("cuda", 8, True))["vllm"]["tensor_parallel_size"] == 2
    with pytest.raises(ConfigError, match=r"rollout\.tensor_parallel_size=2 does not divide the world size 3"):
        check_plan(tp, Target("cuda", 3, True))
    with pytest.raises(ConfigError, match=r"rollout\.tensor_parallel_size=2 needs rollout\.engine=vllm"):
        check_plan(load_config(None, ["rollout.tensor_parallel_size=2"]), Target("cuda", 2, True))


def test_a_context_that_cannot_hold_a_prompt_and_its_response_is_refused():
    cfg = load_config(None, ["rollout.engine=vllm", "data.max_prompt_tokens=1664", "rollout.max_new_tokens=512",
                             "rollout.max_model_len=2048"])
    with pytest.raises(ConfigError, match=r"rollout\.max_model_len=2048 cannot hold the longest prompt allowed "
                                          r"\(data\.max_prompt_tokens=1664\) plus 512 new tokens: 2176 would fit"):
        check_plan(cfg, Target("cuda", 2, True))
    # Held-out completions may be longer than training ones: the context holds those too.
    cfg = load_config(None, ["rollout.engine=vllm", "data.max_prompt_tokens=100", "rollout.max_new_tokens=50",
                             "trainer.eval_max_new_tokens=300"])
    assert run_plan(cfg, Target("cuda", 1, True))["vllm"]["max_model_len"] == 400
    cpu = run_plan(cfg, Target("cpu", 1))["vllm"]
    assert cpu["kv_cache_memory_bytes"] == 256 << 20 and cpu["enforce_eager"] is True and not cpu["enable_sleep_mode"]


def test_dry_run_prints_the_plan_for_a_target_as_the_last_line(capsys):
    from launch.train import main
    recipe = str(CONFIGS / "veriseek_grpo.yaml")
    # The recipe's data and model are the GPU node's: for another target only its settings are checked.
    assert main(["--config", recipe, "--dry-run", "--device", "cuda", "--world-size", "8"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    plan = json.loads(out[-1])
    assert plan == run_plan(load_config(recipe), Target("cuda", 8, True), "Qwen/Qwen3-4B-Thinking-2507")
    assert set(plan) >= {"vllm", "precision", "attention", "engine_cycle", "tp_groups"}
    assert plan["vllm"]["model"] == "Qwen/Qwen3-4B-Thinking-2507" and len(plan["tp_groups"]) == 8
    assert out[-2].endswith("; a step trains 8 prompts x 4 completions over all ranks "
                            "(trainer.prompts_per_step=1 per data-parallel share x 8 shares)")
    assert main(["--config", recipe, "--dry-run", "--device", "cuda", "--world-size", "3",
                 "rollout.tensor_parallel_size=2"]) == 2
    assert "rollout.tensor_parallel_size=2 does not divide the world size 3" in capsys.readouterr().err


def test_the_run_builds_what_the_plan_says(tmp_path, tiny_model_dir):
    """One process on this CPU with bf16 compute and a KL reference: the policy's products run in bf16 over
    fp32 master weights, the reference is stored in bf16, the engine owns a bf16 copy, attention as planned."""
    import torch

    from launch.build import build
    from launch.dist import DistInfo
    from launch.plan import attention
    from test_loop_semantics import REWARD, _rows
    cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}", f"data.train_files=['{_rows(tmp_path)}']",
                             f"reward.functions={{{REWARD}: 'rewards_for_tests:vowel_fraction'}}",
                             "model.param_dtype=bfloat16", "algorithm.kl_coef=0.01", "rollout.max_new_tokens=4",
                             f"trainer.out_dir={tmp_path / 'runs'}"])
    built = build(cfg, DistInfo())
    try:
        policy, engine = built.parts.policy.model, built.parts.rollout.engine
        assert all(p.dtype == torch.float32 for p in policy.parameters())  # master weights
        outputs = []
        layer = policy.model.layers[0].self_attn.q_proj
        handle = layer.register_forward_hook(lambda module, args, output: outputs.append(output.dtype))
        policy(input_ids=torch.tensor([[1, 2, 3]]))
        handle.remove()
        assert outputs == [torch.bfloat16]  # products in the compute dtype
        assert all(p.dtype == torch.bfloat16 for p in built.parts.reference.parameters())
        assert not engine.shared and engine.model.dtype == torch.bfloat16
        assert policy.config._attn_implementation == attention(cfg, Target.here()) == "sdpa"
    finally:
        built.close()


def test_an_older_torch_or_vllm_is_refused_naming_both_versions():
    import importlib.util

    from launch.preflight import check_versions
    cfg = load_config(None, ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match=r"torch 2\.6\.0\+cu124 is installed; this trainer needs torch >= 2\.8"):
        check_versions(cfg, torch_version="2.6.0+cu124", vllm_version="0.32.0")
    with pytest.raises(ConfigError, match=r"rollout\.engine=vllm: vLLM 0\.10\.1 is installed; this engine needs "
                                          r"vLLM >= 0\.32"):
        check_versions(cfg, torch_version="2.13.0", vllm_version="0.10.1")
    check_versions(load_config(None, []), torch_version="2.8.0")  # the transformers engine needs no vLLM
    if importlib.util.find_spec("vllm") is not None:
        check_versions(cfg)  # what `make test` installs passes


def test_a_bf16_run_trains_with_truncated_is_correcting_a_real_mismatch(tmp_path, tiny_model_dir):
    # This CPU as the GPU's stand-in: fp32 master weights, bf16 products (autocast), the engine sampling from its
    # own bf16 copy. The engine/trainer gap is now real (bf16 vs bf16-from-fp32, other kernels), and truncated IS
    # weighs each token by min(exp(old - rollout), 2).
    from test_loop_semantics import _run_metrics
    metrics = _run_metrics(tmp_path, tiny_model_dir, "model.param_dtype=bfloat16", "algorithm.tis_cap=2.0")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert 1e-4 < m["logprob_gap"] < 0.5, m["logprob_gap"]  # fp32 vs fp32 is ~2e-7 (test_loop_semantics)
        assert 0.5 < m["tis_weight_mean"] < 2.0 and 0.0 <= m["tis_clip_frac"] < 0.5
        assert m["sync/buckets"] >= 1 and m["grad_norm"] > 0


def test_a_separate_placement_is_planned_with_its_own_vllm_world():
    cfg = load_config(CONFIGS / "veriseek_grpo.yaml", ["rollout.placement=separate", "rollout.num_ranks=2",
                                                       "algorithm.max_staleness=1"])
    plan = run_plan(cfg, Target("cuda", 8, True))
    assert plan["placement"] == {"mode": "separate", "trainer_ranks": list(range(6)), "rollout_ranks": [6, 7],
                                 "max_staleness": 1}
    # A rollout rank's vLLM does not join the trainers' torchrun world: its engine core runs in a process of its own
    # and the weights arrive through the worker extension.
    assert "distributed_executor_backend" not in plan["vllm"]
    assert plan["vllm"]["worker_extension_cls"] == "rollout.vllm_engine.WeightReload"


def test_separate_rollout_ranks_get_gpus_groups_and_memory_of_their_own():
    """Issue 32, findings 1, 4, 5: on 8 GPUs with 2 rollout ranks, the engines bind GPUs 6 and 7 (vLLM's engine
    core takes the first visible device, so each sees only its own) with a utilisation for a GPU of their own;
    every process group waits collective_timeout_s; NCCL runs without blocking wait unless asked."""
    from rollout.vllm_engine import visible_device
    cfg = load_config(CONFIGS / "veriseek_grpo.yaml", ["rollout.placement=separate", "rollout.num_ranks=2",
                                                        "rollout.vllm_gpu_memory_utilization=null"])
    plan = run_plan(cfg, Target("cuda", 8, True))
    assert plan["rollout_devices"] == {"6": "6", "7": "7"} and plan["vllm"]["gpu_memory_utilization"] == 0.85
    colocated = run_plan(load_config(None, ["rollout.engine=vllm"]), Target("cuda", 8, True))
    assert colocated["vllm"]["gpu_memory_utilization"] == 0.4 and colocated["rollout_devices"] is None
    assert visible_device(1, "2,3,4,5") == "3" and visible_device(7, None) == "7"
    with pytest.raises(ValueError, match=r"local rank 4 has no GPU among CUDA_VISIBLE_DEVICES='2,3,4,5'"):
        visible_device(4, "2,3,4,5")
    collectives = plan["collectives"]
    assert collectives["timeout_s"] == cfg.trainer.collective_timeout_s and collectives["nccl_blocking_wait"] is False
    assert collectives["groups"] == {"world": {"ranks": list(range(8)), "backend": "nccl"},
                                     "trainers": {"ranks": [0, 1, 2, 3, 4, 5], "backend": "nccl"},
                                     "engines": {"ranks": [6, 7], "backend": "gloo"},
                                     "link": {"ranks": list(range(8)), "backend": "gloo"},
                                     "weights": {"ranks": [0, 6, 7], "backend": "nccl"}}
    assert run_plan(load_config(None, []), Target("cpu", 1))["collectives"] is None


def test_the_plan_prints_the_global_batch():
    """trainer.prompts_per_step is per data-parallel share: the veriseek recipe, sized as the paper's 2 prompts per
    step at 2 ranks, trains 8 at 8 ranks."""
    cfg = load_config(CONFIGS / "veriseek_grpo.yaml")
    assert run_plan(cfg, Target("cuda", 8, True))["batch"] == {"prompts_per_share": 1, "shares": 8, "prompts": 8,
                                                               "completions": 32}
    tp = load_config(CONFIGS / "veriseek_grpo.yaml", ["rollout.tensor_parallel_size=2"])
    assert run_plan(tp, Target("cuda", 8, True))["batch"]["prompts"] == 4  # a TP pair draws one share
    separate = load_config(CONFIGS / "veriseek_grpo.yaml", ["rollout.placement=separate", "rollout.num_ranks=2"])
    assert run_plan(separate, Target("cuda", 8, True))["batch"]["prompts"] == 6  # the 6 trainers' shares
    assert run_plan(load_config(CONFIGS / "veriseek_sft.yaml"), Target("cuda", 8, True))["batch"] is None


def test_every_process_group_gets_the_collective_timeout(monkeypatch):
    """launch.dist creates the groups the plan names, each with trainer.collective_timeout_s (NCCL's default would
    be 10 minutes, shorter than an 8B model's start-up on the rollout ranks): a 4-rank separate world, seen from
    rank 3, with torch.distributed's calls recorded instead of made."""
    import datetime

    import launch.dist as dist_module
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(dist_module.torch_dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist_module.torch_dist, "init_process_group",
                        lambda backend, timeout, **options: calls.append(("world", backend, timeout)))
    monkeypatch.setattr(dist_module.torch_dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist_module.torch_dist, "new_group", lambda ranks, backend, timeout: calls.append(
        (tuple(ranks), backend, timeout)) or f"group{len(calls)}")
    monkeypatch.setattr(dist_module.fsdp, "use_group", lambda group: None)
    cfg = load_config(None, ["rollout.placement=separate", "rollout.num_ranks=1", "trainer.collective_timeout_s=7"])
    info = dist_module.init_distributed(cfg)
    seven = datetime.timedelta(seconds=7)
    assert calls == [("world", "gloo", seven), ((0, 1, 2), "gloo", seven), ((3,), "gloo", seven),
                     ((0, 1, 2, 3), "gloo", seven), ((0, 3), "gloo", seven)]
    assert info.role == "rollout" and info.links.trainer_ranks == (0, 1, 2) and info.links.weights == "group5"


def test_a_flash_attn_that_does_not_import_is_refused_at_start_up(tmp_path, monkeypatch):
    """Issue 32, finding 7: a flash-attn wheel built for another torch passes a package lookup and would fail at
    the first packed update; the start imports it and refuses naming the cause and the install command."""
    import sys

    from models.loading import flash_attn_installed
    package = tmp_path / "flash_attn"
    package.mkdir()
    broken = "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice')\n"
    (package / "__init__.py").write_text(broken)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    with pytest.raises(ImportError, match=r"flash-attn is installed but does not import \(flash_attn_2_cuda\.so: "
                                          r"undefined symbol.*pip install flash-attn --no-build-isolation"):
        flash_attn_installed()
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"pip install flash-attn --no-build-isolation\) or uninstall it"):
        Target.here(8, torchrun=True)
    (package / "__init__.py").write_text("def flash_attn_varlen_func(*args, **kwargs):\n    pass\n")
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert flash_attn_installed() and Target.here(8, torchrun=True) == Target("cuda", 8, True, True)
