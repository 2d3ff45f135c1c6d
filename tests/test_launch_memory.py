"""The per-GPU memory estimate (launch/memory.py): parameter counts equal transformers' on the meta device for the
Qwen3 shapes shipped as tests/data/models/*/config.json, terms derived by hand, the veriseek recipe fits 8 x 80 GiB,
a plan that cannot fit is refused naming its largest term, and --dry-run prints the table."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.config import ConfigError
from launch.memory import GIB, activation_bytes, check_fit, estimate, param_counts, read_model_config
from launch.plan import Target, run_plan
from launch.recipe import load_config

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(__file__).resolve().parent / "data" / "models"
VERISEEK = ROOT / "launch" / "configs" / "veriseek_grpo.yaml"
SHAPES = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen2.5-3b", "smollm2-135m"]


def _veriseek(model: str = "qwen3-4b", overrides=(), world: int = 8, gpu_gib: float | None = 80) -> dict:
    cfg = load_config(VERISEEK, list(overrides))
    return run_plan(cfg, Target("cuda", world, True), model_config=read_model_config(MODELS / model),
                    gpu_gib=gpu_gib)["memory"]


@pytest.mark.parametrize("name", SHAPES)
def test_parameter_count_equals_transformers_on_the_meta_device(name):
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(MODELS / name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    # parameters() lists a tied lm_head once, as the count does
    assert param_counts(read_model_config(MODELS / name))["total"] == sum(p.numel() for p in model.parameters())


def test_qwen3_4b_count_by_hand():
    counts = param_counts(read_model_config(MODELS / "qwen3-4b"))
    # layer: q/k/v/o 2 * 2560 * (32 + 8) * 128 = 26,214,400; MLP 3 * 2560 * 9728 = 74,711,040;
    # norms 2 * 2560 + q/k norms 2 * 128 = 5,376 -> 100,930,816; embedding 151,936 * 2560 = 388,956,160 (tied);
    # 36 layers + embedding + final norm 2,560 = 4,022,468,096 (Qwen3-4B's published 4.0B).
    assert counts["layer"] == 100_930_816 and counts["embedding"] == 388_956_160
    assert counts["total"] == 4_022_468_096


def test_distillation_teacher_is_a_frozen_sharded_copy_of_its_own_size():
    student, teacher = read_model_config(MODELS / "qwen3-1.7b"), read_model_config(MODELS / "qwen3-8b")
    cfg = load_config(VERISEEK, ["algorithm.teacher=Qwen/Qwen3-8B"])
    plan = run_plan(cfg, Target("cuda", 8, True), model_config=student, gpu_gib=80, teacher_config=teacher)
    assert plan["precision"]["teacher"] == {"param": "bfloat16", "compute": "bfloat16", "reduce": None,
                                            "mechanism": "none"}
    # bf16 (2 bytes) over 8 ranks, held in every phase like the reference: the 8B's count, not the 1.7B's.
    terms = plan["memory"]["roles"]["trainer"]
    assert all(terms[phase]["teacher"] == round(param_counts(teacher)["total"] * 2 / 8 / GIB, 3)
               for phase in ("generating", "training", "syncing"))
    # Without the teacher's config.json it is sized as the student; without a teacher there is no term.
    assert run_plan(cfg, Target("cuda", 8, True), model_config=student)["memory"]["roles"]["trainer"]["training"][
        "teacher"] == round(param_counts(student)["total"] * 2 / 8 / GIB, 3)
    assert "teacher" not in _veriseek("qwen3-1.7b")["roles"]["trainer"]["training"]


def test_veriseek_terms_derived_by_hand():
    memory = _veriseek()
    training = memory["roles"]["trainer"]["training"]
    # fp32 master weights sharded over 8 ranks: 4,022,468,096 * 4 / 8 bytes = 1.8732 GiB; AdamW's 2 moments: twice that.
    assert training["weights"] == round(4_022_468_096 * 4 / 8 / GIB, 3) == 1.873
    assert training["gradients"] == 1.873 and training["optimizer"] == round(2 * 4_022_468_096 * 4 / 8 / GIB, 3)
    # The KL reference (kl_coef 0.001, no LoRA): a frozen bf16 copy, sharded: 4,022,468,096 * 2 / 8 bytes.
    assert training["reference"] == round(4_022_468_096 * 2 / 8 / GIB, 3) == 0.937
    # Activations per token per layer, bf16 (c = 2): 2 norms (4 + 2) * 2560 = 30,720; q/k norms (4 + 2) * (4096 +
    # 1024) = 30,720; q, k, v and attention output 2 * (2 * 4096 + 2 * 1024) = 20,480; SwiGLU 4 * 2 * 9728 = 77,824
    # -> 159,744 bytes. Checkpointed, 4 x (1664 + 512) = 8,704 tokens: 36 layer inputs 36 * 2 * 2560 = 184,320 plus
    # one layer recomputed 159,744 -> 344,064 bytes a token = 2.789 GiB.
    assert activation_bytes(read_model_config(MODELS / "qwen3-4b"), 2) == 159_744
    assert memory["tokens_per_micro_batch"] == 8704
    assert training["activations"] == round(344_064 * 8704 / GIB, 3) == 2.789
    # Logits: a 1024 x 151,936 fp32 chunk x 3 blocks + lm_head's fp32 gradient 151,936 x 2560 x 4.
    assert training["logits"] == round((1024 * 151_936 * 4 * 3 + 151_936 * 2560 * 4) / GIB, 3) == 3.188
    # vLLM holds 0.4 x 80 GiB while generating, nothing asleep, its bf16 weights while syncing.
    roles = memory["roles"]["trainer"]
    assert roles["generating"]["vllm"] == 32.0 and "vllm" not in training
    assert roles["syncing"]["vllm"] == round(4_022_468_096 * 2 / GIB, 3) and roles["syncing"]["sync_bucket"] == 1.0
    for terms in roles.values():  # each phase's total is the sum of its terms (rounded per term)
        assert terms["total"] == pytest.approx(sum(v for k, v in terms.items() if k != "total"), abs=0.01)


def test_veriseek_fits_eight_80_gib_gpus():
    memory = _veriseek()
    assert memory["fits"] is True and memory["refusal"] is None
    totals = {phase: terms["total"] for phase, terms in memory["roles"]["trainer"].items()}
    assert totals["generating"] < 45 and totals["training"] < 20 and totals["syncing"] < 20
    check_fit(memory)


def test_gradient_checkpointing_lowers_activations_by_the_expected_factor():
    on, off = (_veriseek(overrides=[f"model.gradient_checkpointing={flag}"]) for flag in ("true", "false"))
    # Without: 36 layers x 159,744 bytes a token; with: 344,064 (see above): a factor 5,750,784 / 344,064 = 16.71.
    ratio = off["roles"]["trainer"]["training"]["activations"] / on["roles"]["trainer"]["training"]["activations"]
    assert ratio == pytest.approx(36 * 159_744 / 344_064, rel=1e-3)
    assert on["activations_gib"] == off["activations_gib"] == {"with_checkpointing": 2.789,
                                                               "without_checkpointing": 46.617}


def test_an_8b_model_at_utilization_0_9_is_refused_naming_the_term():
    memory = _veriseek("qwen3-8b", ["rollout.vllm_gpu_memory_utilization=0.9"])
    assert memory["fits"] is False
    with pytest.raises(ConfigError, match=r"^generating on trainer ranks needs 86\.\d GiB of 80: vllm 72\.0 GiB is "
                                          r"the largest term; lower rollout\.vllm_gpu_memory_utilization"):
        check_fit(memory)


def test_activations_overflow_names_checkpointing():
    memory = _veriseek("qwen3-8b", ["model.gradient_checkpointing=false", "trainer.micro_batch_size=8"])
    with pytest.raises(ConfigError, match=r"^training on trainer ranks needs .* activations .* is the largest term; "
                                          r"set model\.gradient_checkpointing=true or lower trainer\.micro_batch_size"):
        check_fit(memory)


def test_without_a_gpu_size_there_are_figures_but_no_fit_check():
    memory = _veriseek(gpu_gib=None)
    assert memory["fits"] is None and memory["refusal"] is None
    assert memory["roles"]["trainer"]["training"]["weights"] == 1.873
    check_fit(memory)


def test_separate_placement_has_rollout_ranks_holding_vllm_in_every_phase():
    memory = _veriseek(overrides=["rollout.placement=separate", "rollout.num_ranks=2"])
    rollout, trainer = memory["roles"]["rollout"], memory["roles"]["trainer"]
    # the recipe sets vllm_gpu_memory_utilization=0.4; the rollout rank holds it through every phase
    assert all(terms["vllm"] == 0.4 * 80 for terms in rollout.values()) and "weights" not in rollout["training"]
    assert all("vllm" not in terms for terms in trainer.values())
    # six trainer ranks shard the fp32 weights
    assert trainer["training"]["weights"] == round(4_022_468_096 * 4 / 6 / GIB, 3)


def test_lora_trains_only_the_adapters():
    cfg = load_config(ROOT / "launch" / "configs" / "demo_lora.yaml")
    model = read_model_config(MODELS / "smollm2-135m")
    memory = estimate(cfg, run_plan(cfg, Target("cpu", 1)), model)
    # r = 16 on every projection of 30 layers: q (576 + 576), k, v (576 + 192 each), o (576 + 576), gate, up, down
    # (576 + 1536 each): 16 * 10,176 * 30 = 4,884,480 adapter parameters, no reference copy (the policy shares it).
    assert memory["trainable_params"] == 16 * (1152 + 768 * 2 + 1152 + 2112 * 3) * 30 == 4_884_480
    training = memory["roles"]["trainer"]["training"]
    assert training["optimizer"] == round(2 * 4_884_480 * 4 / GIB, 3) and "reference" not in training
    assert "cuda_context" not in training


def test_dry_run_prints_the_table_and_refuses_what_cannot_fit(capsys):
    from launch.train import main
    arguments = ["--config", str(VERISEEK), "--dry-run", "--device", "cuda", "--world-size", "8",
                 "--gpu-memory-gib", "80", "--model-config", str(MODELS / "qwen3-4b" / "config.json")]
    assert main(arguments) == 0
    out = capsys.readouterr().out.strip().splitlines()
    plan = json.loads(out[-1])
    assert plan["memory"] == _veriseek() and plan["memory"]["fits"] is True
    table = out.index(next(line for line in out if line.startswith("memory per GPU (GiB of 80)")))
    assert out[table].split()[-3:] == ["generating", "training", "syncing"]
    assert out[table + 1].split()[:3] == ["trainer", "ranks:", "weights"]
    assert any(line.split()[2:] == ["total", "39.56", "16.51", "16.05"] for line in out[table:])
    assert main(arguments[:-1] + [str(MODELS / "qwen3-8b" / "config.json"),
                                  "rollout.vllm_gpu_memory_utilization=0.9"]) == 2
    captured = capsys.readouterr()
    assert "config error: generating on trainer ranks needs 86." in captured.err
    assert "memory per GPU" in captured.out and not captured.out.strip().splitlines()[-1].startswith("{")


def test_every_shipped_recipe_prints_a_table_that_fits_eight_80_gib_gpus():
    from launch.memory import describe
    from test_launch_plan import MODEL_CONFIGS, RECIPES

    for recipe in RECIPES:
        cfg = load_config(ROOT / "launch" / "configs" / f"{recipe}.yaml")
        model = read_model_config(MODELS / MODEL_CONFIGS[cfg.model.name_or_path])
        memory = run_plan(cfg, Target("cuda", 8, True), model_config=model, gpu_gib=80)["memory"]
        assert memory["fits"] is True, (recipe, memory["refusal"])
        table = describe(memory).splitlines()
        assert table[0].startswith("memory per GPU (GiB of 80)") and table[-1].split()[2] == "total", recipe
