"""Smoke runs of the benchmarks at their smallest sizes (bench/), each checked for figures that must hold:
token counts that are known in advance, phases that must or must not run, logprob values that must agree,
and the FLOP formula against a parameter count."""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_step_quick_all_phases(tmp_path):
    """Tiny model, 2 prompts x G=4, 8 tokens, no EOS: every step generates and trains exactly 64 tokens; a KL
    term brings the reference logprob pass in and the engine copy brings a real weight sync."""
    from bench.step import main

    out = tmp_path / "step.json"
    assert main(["--quick", "--no-eos", "--sync", "copy", "--out", str(out), "algorithm.kl_coef=0.01"]) == 0
    result = json.loads(out.read_text())
    assert len(result["steps"]) == 2 and result["peak_reset"] is True
    for step in result["steps"]:
        assert step["generated_tokens"] == step["trained_tokens"] == 2 * 4 * 8
        assert step["completions"] == 8
        for phase in ("rollout", "reward", "logprob", "update", "sync"):
            entry = step["phases"][phase]
            assert entry["ran"], phase
            assert entry["seconds"] >= 0 and entry["peak_rss_bytes"] > 0
        assert step["phases"]["rollout"]["rate"] == pytest.approx(64 / step["phases"]["rollout"]["seconds"])
        assert step["phases"]["sync"]["rate"] > 0  # MB/s: the copy engine really received tensors
    assert result["summary"]["measured_steps"] == 1
    # MFU: a measured peak, FLOPs for every phase that ran (the KL term adds one reference pass), and the
    # decode count is the formula's for the 8 completions of exactly 8 tokens.
    from bench.flops import DecoderShape, decode_flops

    mfu = result["mfu"]
    assert mfu["peak_flops_per_s"] > 1e8 and len(mfu["peaks"]) == 2
    call = result["steps"][1]["calls"][0]
    prompt_lengths = [len(prompt) for prompt in call["prompts"] for _ in range(call["group"])]
    assert mfu["summary"]["decode"]["flops"] == decode_flops(DecoderShape(**result["shape"]), prompt_lengths, [8] * 8)
    for phase in ("prefill", "decode", "logprob", "update", "step"):
        assert mfu["summary"][phase]["flops"] > 0 and 0 < mfu["summary"][phase]["mfu"] < 1, phase
    # forward + backward is 3 forwards; the one reference pass is 1.
    assert mfu["summary"]["update"]["flops"] == 3 * mfu["summary"]["logprob"]["flops"]


def test_step_default_path_skips_logprob_and_sync(tmp_path):
    """One process, ppo_epochs=1, no KL: no logprob pass and nothing to sync, and the table says so."""
    from bench.step import main

    out = tmp_path / "step.json"
    assert main(["--quick", "--steps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    phases = result["steps"][0]["phases"]
    assert not phases["logprob"]["ran"] and phases["logprob"]["rate"] is None
    assert phases["sync"]["rate"] is None and phases["update"]["ran"]
    assert any(note.startswith("logprob: no pass runs") for note in result["notes"])


def test_step_uneven_lengths_runs_padded_and_packed_on_the_same_batches(tmp_path):
    """--lengths uneven: completions cut to seeded lengths in --min-len..--new-tokens, the same in the padded and
    the packed run, and every step of both trains exactly those tokens."""
    from bench.step import main

    out = tmp_path / "uneven.json"
    assert main(["--quick", "--lengths", "uneven", "--min-len", "4", "--new-tokens", "24", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    padded, packed = result["runs"]["padded"][0]["steps"], result["runs"]["packed"][0]["steps"]
    lengths = [call["completion_lengths"] for step in padded for call in step["calls"]]
    assert lengths == [call["completion_lengths"] for step in packed for call in step["calls"]]
    flat = [n for row in lengths for n in row]
    assert min(flat) >= 4 and max(flat) <= 24 and len(set(flat)) > 3  # uneven, within the bounds
    assert [s["trained_tokens"] for s in padded] == [s["trained_tokens"] for s in packed] == [sum(r) for r in lengths]
    assert result["summary"]["ratio_packed_over_padded"]["pairs"] == 1
    assert result["summary"]["update_seconds"]["packed"] > 0


def test_rewards_quick(tmp_path):
    import rewards
    from bench.rewards import evidence_cases, main

    out = tmp_path / "rewards.json"
    assert main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    counts = {"scifact_evidence": 16 * 8, "verifier": 20 * 8, "factqa judge": 16 * 8}
    for name, count in counts.items():
        assert result["rewards"][name]["completions"] == count
        assert result["rewards"][name]["completions_per_s"] > 0
    assert result["cooccurrence"]["index"]["documents"] == 300
    assert result["cooccurrence"]["uncached"]["queries"] == 40
    assert result["cooccurrence"]["as_in_training"]["queries"] == 40 * 8
    assert 0 < result["cooccurrence"]["uncached"]["median_ms"] < 1000
    # The timed completions are the intended ones: the SFT target scores 1, an empty completion 0.
    target, empty = evidence_cases(1)[0], evidence_cases(1)[7]
    assert rewards.compute_score(*target)["score"] == 1.0 and rewards.compute_score(*empty)["score"] == 0.0


def test_cooccurrence_quick(tmp_path):
    from bench.cooccurrence import main

    out = tmp_path / "cooccurrence.json"
    assert main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    # the engine definition is infini-gram's count_cnf on every query; the per-document one is never lower here
    assert result["queries"] == result["engine_equals_count_cnf"] == 40
    assert result["document_lower"] == 0 and 0 <= result["sentence_reward_changed"] <= result["document_differs"]


def test_vs_trl_settings_match_on_both_sides(tmp_path):
    from bench.vs_trl import fairness_settings
    from launch.recipe import load_config

    settings = fairness_settings(prompts=2, group=4, new_tokens=32, lr=1e-6, steps=3, seed=0, threads=2)
    trl = settings["trl"]
    cfg = load_config(None, settings["ours"] + [f"data.train_files=['{tmp_path / 'rows.jsonl'}']"])
    assert (cfg.rollout.n, cfg.rollout.max_new_tokens, cfg.trainer.steps) == (trl["num_generations"],
                                                                             trl["max_completion_length"], trl["max_steps"])
    assert trl["generation_kwargs"] == {"min_new_tokens": 32}
    assert cfg.trainer.prompts_per_step * cfg.rollout.n == cfg.trainer.micro_batch_size == trl["per_device_train_batch_size"]
    assert (cfg.optim.lr, cfg.optim.grad_clip, cfg.optim.weight_decay) == (trl["learning_rate"], trl["max_grad_norm"],
                                                                          trl["weight_decay"])
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k) == (trl["temperature"], trl["top_p"], trl["top_k"])
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (trl["epsilon"], trl["epsilon_high"])
    assert cfg.algorithm.kl_coef == trl["beta"] == 0 and cfg.algorithm.ppo_epochs == trl["num_iterations"] == 1
    assert cfg.optim.schedule == trl["lr_scheduler_type"] == "constant" and cfg.data.shuffle is trl["shuffle_dataset"] is False
    assert trl["bf16"] is False and trl["gradient_checkpointing"] is False and cfg.model.dtype == "float32"
    with pytest.raises(ValueError, match="group >= 2"):
        fairness_settings(prompts=2, group=1, new_tokens=32, lr=1e-6, steps=3, seed=0, threads=2)


def test_vs_trl_bf16_is_bf16_over_fp32_master_weights_on_both_sides(tmp_path):
    from bench.vs_trl import fairness_settings
    from launch.recipe import load_config

    settings = fairness_settings(prompts=2, group=4, new_tokens=32, lr=1e-6, steps=3, seed=0, threads=2,
                                 precision="bf16")
    cfg = load_config(None, settings["ours"] + [f"data.train_files=['{tmp_path / 'rows.jsonl'}']"])
    assert (cfg.model.dtype, cfg.model.param_dtype) == ("float32", "bfloat16") and settings["trl"]["bf16"] is True
    assert settings["precision"] == "bf16" and any("bf16 on both sides" in d for d in settings["differences"])
    with pytest.raises(ValueError, match="precision must be one of"):
        fairness_settings(prompts=2, group=4, new_tokens=32, lr=1e-6, steps=3, seed=0, threads=2, precision="fp8")


@pytest.mark.parametrize("allocator, ours_keeps, trl_keeps", [("shipped", True, False), ("cached", True, True),
                                                              ("system", False, False)])
def test_vs_trl_allocator_settings(tmp_path, allocator, ours_keeps, trl_keeps):
    """--allocator decides which side keeps freed memory: ours through its config, TRL through glibc's
    environment variables (the same two settings launch/dist.py makes with mallopt)."""
    from bench.vs_trl import fairness_settings
    from launch.recipe import load_config

    settings = fairness_settings(prompts=2, group=4, new_tokens=32, lr=1e-6, steps=3, seed=0, threads=2,
                                 allocator=allocator)
    cfg = load_config(None, settings["ours"] + [f"data.train_files=['{tmp_path / 'rows.jsonl'}']"])
    assert cfg.trainer.keep_freed_memory is ours_keeps
    assert settings["trl_environment"] == ({"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}
                                           if trl_keeps else {})
    with pytest.raises(ValueError, match="allocator must be one of"):
        fairness_settings(prompts=2, group=4, new_tokens=32, lr=1e-6, steps=3, seed=0, threads=2, allocator="jemalloc")


def test_vs_trl_compare_drops_warmup_and_pairs_steps():
    from bench.vs_trl import compare

    def side(seconds, peak, cpu_factor=1.0):
        return {"step_seconds": seconds, "step_cpu_seconds": [cpu_factor * s for s in seconds],
                "generated_tokens": [64] * len(seconds), "setup_peak_rss_bytes": peak,
                "train_peak_rss_bytes": peak + 1, "phases": {"update": seconds}}
    runs = [{"ours": side([9.0, 2.0, 3.0], 10), "trl": side([1.0, 4.0, 4.0], 20, cpu_factor=2.0)},
            {"ours": side([9.0, 1.0, 6.0], 10), "trl": side([1.0, 4.0, 3.0], 30, cpu_factor=2.0)}]
    summary = compare(runs)
    # ratios 2/4, 3/4, 1/4, 6/3 (the first step of every run is warm-up)
    assert summary["ratio"]["all"] == [0.5, 0.75, 0.25, 2.0]
    assert summary["ratio"]["median"] == pytest.approx(0.625) and summary["ratio"]["min"] == 0.25
    assert summary["cpu_ratio"]["all"] == [0.25, 0.375, 0.125, 1.0]  # TRL's CPU seconds are twice its wall time
    assert summary["trl"]["peak_rss_bytes"] == 31 and summary["ours"]["median_step_seconds"] == 2.5


def test_training_flops_formula_counts_qwen3_parameters():
    from transformers import AutoModelForCausalLM

    from bench.gpu_common import model_config, training_flops

    config = model_config(tiny=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    counts = training_flops(config, batch=1, seq_len=2048, completion_len=1792)
    assert counts["total_params"] == sum(p.numel() for p in model.parameters()) == 1_720_574_976
    # 6 * 1,409,410,048 * 2048 + 6 * 151,936 * 2048 * 1792 + 12 * 28 * 16 * 128 * 2048^2
    assert counts["flops"] == 6 * 1_409_410_048 * 2048 + 6 * 151_936 * 2048 * 1792 + 12 * 28 * 16 * 128 * 2048**2


def test_gpu_script_on_cpu_tiny(tmp_path):
    """bench/gpu.sh end to end on CPU with tiny shapes (vLLM's CPU start-up is too slow for the smoke run)."""
    out = tmp_path / "gpu.json"
    # The parts' time limits are sized for a GPU; a CPU shared with another test worker needs more.
    environment = {**os.environ, "PYTHON": sys.executable, "TRAIN_LIMIT_S": "150", "ROLLOUT_LIMIT_S": "150",
                   "RL_LIMIT_S": "400"}
    finished = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), str(out), "--device", "cpu", "--tiny",
                               "--no-vllm"], capture_output=True, text=True, env=environment, timeout=590)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "SKIPPED vllm_rollout: --no-vllm" in finished.stdout
    result = json.loads(out.read_text())
    assert result["missing_parts"] == [] and result["train"]["errors"] == {} and result["rollout"]["errors"] == {}
    mfu = result["train"]["mfu"]
    assert mfu["counted_params"] == mfu["total_params"] and mfu["mfu"] > 0
    memory = result["train"]["logprob_memory"]
    assert memory["vocab"] == 151_936 and memory["max_abs_diff"] < 1e-4
    # A smoke run checks that the memory figure is reported, not the target: at [2, 48, V] the RSS-based
    # ratio moved between 0.0 and 0.71 from run to run (allocator reuse; the target lives in bench.logprobs).
    assert math.isfinite(memory["peak_ratio_no_grad"]) and memory["peak_ratio_no_grad"] >= 0
    assert result["rollout"]["hf_rollout"]["generated_tokens"] == 2 * 2 * 4
    # The trainer itself, three steps in bf16 over fp32 master weights: one process, then torchrun with one rank.
    assert result["rl"]["errors"] == {} and "vllm_run" in result["rl"]["skipped"]
    for name in ("one_process", "torchrun_1_rank"):
        run = result["rl"][name]
        assert run["returncode"] == 0 and [step["step"] for step in run["steps"]] == [1, 2, 3], run["stderr_tail"]
        assert all(step["tis_weight_mean"] > 0 and step["logprob_gap"] > 0 for step in run["steps"])


def test_separate_quick(capsys):
    """bench.separate end to end on the tiny model: the three arms run and report their staleness."""
    from bench.separate import main
    assert main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "colocated     median step" in out and "separate S=1  median step" in out
    assert "staleness [1.0]" in out and out.count("staleness [0.0]") == 2


@pytest.mark.parametrize("arch, tie", [("llama", False), ("qwen3", True)])
def test_phase_flops_equal_torch_flop_counter_plus_attention(arch, tie):
    """bench.flops against torch's FlopCounterMode, which counts every matmul of a real pass (and not the CPU
    attention kernel): prefill, one decode step and a packed logprob pass; the attention terms by hand."""
    from torch.utils.flop_counter import FlopCounterMode

    from bench.flops import DecoderShape, decode_flops, logprob_pass_flops, prefill_flops
    from models.logprobs import completion_logprobs, pad_batch
    from tiny import tiny_model

    model = tiny_model(arch, tie_word_embeddings=tie)
    shape = DecoderShape.of(model)
    # hidden 64, MLP 128, 4 heads x 16, 2 key/value heads, 2 layers: q, o 64x64; k, v 32x64; 3 MLP 128x64.
    assert shape.body_params == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)
    attention = lambda positions: 4 * 2 * 4 * 16 * sum(positions)  # 4 L h d_h p per token at position p

    def counted(run) -> int:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            run()
        return counter.get_total_flops()

    prompt = torch.randint(3, 1000, (1, 7))
    assert prefill_flops(shape, [7]) == counted(lambda: model(input_ids=prompt, logits_to_keep=1)) + attention(range(1, 8))
    cache = model(input_ids=prompt, use_cache=True).past_key_values
    # Completions of 2 tokens after a 7-token prompt: one decode pass, feeding token 1 at position 8.
    one_step = counted(lambda: model(input_ids=prompt[:, :1], past_key_values=cache, use_cache=True, logits_to_keep=1))
    assert decode_flops(shape, [7, 7], [2, 1]) == one_step + attention([8])
    batch = pad_batch([[5, 6, 7, 8, 9]] * 2, [[10, 11, 12], [13, 14]], pad_id=2)
    packed_pass = counted(lambda: completion_logprobs(model, batch, packed=True))
    # The packed pass feeds 5 + 2 + 1 tokens and projects 5 completion positions, plus the model's own head on
    # one position (logits_to_keep=1, unused): 2 V d more than the formula counts.
    expected = logprob_pass_flops(shape, [5], [5, 5], [3, 2])
    assert expected == packed_pass - 2 * shape.vocab * 64 + attention(range(1, 6)) + attention([6, 7]) + attention([6])


def test_generate_quick_counts_every_token(tmp_path):
    """HFEngine and model.generate on the embedded model, 2 task prompts x G=2 x 8 tokens, no EOS: both sides
    produce exactly 32 tokens."""
    from bench.generate import main

    out = tmp_path / "generate.json"
    assert main(["--quick", "--task-prompts", "--group", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["hf_engine"]["tokens"] == result["model_generate"]["tokens"] == 2 * 2 * 8
    assert result["hf_engine"]["tokens_per_s"] > 0 and result["model_generate"]["tokens_per_s"] > 0
    assert min(result["settings"]["prompt_lengths"]) > 100  # the ~200-token task prompts


def test_packed_quick_passes_agree(tmp_path):
    """The four update passes on a tiny model: same logprobs as the padded pass (1e-5), and the packed row
    holds each distinct prompt once plus every completion but its last token."""
    from bench.packed import PASSES, main

    out = tmp_path / "packed.json"
    assert main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    passes, settings = result["passes"], result["settings"]
    lengths = settings["completion_lengths"]
    assert len(lengths) == 2 * 4 and min(lengths) >= 8 and max(lengths) <= 32
    for name in PASSES:
        assert passes[name]["max_abs_logprob_diff_vs_padded"] < 1e-5 and len(passes[name]["seconds"]) == 1
    assert passes["padded"]["tokens"] == 8 * (settings["prompt_len"] + max(lengths))
    assert passes["packed"]["tokens"] == passes["block mask"]["tokens"] < passes["shared"]["tokens"]
    # Each distinct prompt at its own length once, each completion without its last token.
    assert passes["packed"]["tokens"] == sum(settings["prompt_lengths"]) + sum(lengths) - 8
    assert passes["shared"]["tokens"] == 2 * settings["prompt_len"] + 8 * max(lengths)


def test_a_part_past_its_limit_ends_with_its_whole_process_tree(tmp_path):
    """Issue 32, finding 8: torchrun starts its workers in sessions of their own, which coreutils' timeout (and
    subprocess.run's) leaves running on the GPU; bench/gpu.sh's limit ends every descendant."""
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time\n"
              "worker = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(worker.pid))\n"
              "time.sleep(300)\n")
    started = time.monotonic()
    finished = subprocess.run([sys.executable, "-m", "bench.gpu_common", "run", "3", "--", sys.executable, "-c",
                               script], cwd=ROOT, timeout=120)
    assert finished.returncode == 124 and time.monotonic() - started < 60
    worker = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; the zombie is reaped by init shortly after
        if not os.path.exists(f"/proc/{worker}") or " Z " in open(f"/proc/{worker}/stat").read():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the worker {worker} in its own session is still running")
