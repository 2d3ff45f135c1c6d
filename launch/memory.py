"""Per-GPU memory of a run, estimated from the model's config.json (no weights) and the recipe: each term in GiB for
each role (trainer ranks; rollout ranks of a separate placement) and phase (generating, training, syncing).
launch/plan.py puts it in the plan; check_fit refuses a plan that does not fit before any weights load."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from grpo.config import Config, ConfigError

GIB = 1 << 30
BYTES = {"float32": 4, "bfloat16": 2}
# A CUDA context with lazy module loading (~0.5 GiB) plus NCCL's communicator buffers and streams (~0.5 GiB at 8
# ranks); the caching allocator's fragmentation is not counted. Zero on CPU.
CUDA_CONTEXT_GIB = 1.0
ORDER = ("weights", "gradients", "optimizer", "reference", "teacher", "gathered", "activations", "logits", "vllm",
         "engine_copy", "kv_cache", "sync_bucket", "cuda_context", "total")
LOGITS_FACTOR = 3  # one fp32 [C, V] block: the logits, log_softmax's output and, in backward, its gradient
ADVICE = {"activations": "lower trainer.micro_batch_size (or set trainer.max_tokens_per_micro_batch)",
          "vllm": "lower rollout.vllm_gpu_memory_utilization", "kv_cache": "lower trainer.prompts_per_step",
          "logits": "lower model.logprob_chunk_size", "sync_bucket": "lower rollout.sync_bucket_mb",
          "reference": "enable model.lora (the reference is then the policy) or set algorithm.kl_coef=0",
          "teacher": "train on more ranks (FSDP2 shards the teacher too) or use a smaller algorithm.teacher"}
SHARDED_ADVICE = "train on more ranks (FSDP2 shards weights, gradients and optimizer state) or enable model.lora"


def this_gpu_gib() -> float:
    """The memory of the GPU this process uses (torch's current device), in GiB: what a plan must fit here."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB


def read_model_config(path: str | Path | None) -> dict | None:
    """A model's config.json (a file or the directory holding it); None where there is none here."""
    if path is None:
        return None
    path = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    return json.loads(path.read_text()) if path.is_file() else None


def shapes(model: dict) -> dict:
    """The sizes a decoder-only config.json states (Llama / Qwen2 / Qwen3 field names)."""
    heads = model["num_attention_heads"]
    return {"vocab": model["vocab_size"], "hidden": model["hidden_size"], "mlp": model["intermediate_size"],
            "layers": model["num_hidden_layers"], "heads": heads, "kv_heads": model.get("num_key_value_heads", heads),
            "head_dim": model.get("head_dim") or model["hidden_size"] // heads,
            "qk_norm": model.get("model_type") == "qwen3", "tied": model.get("tie_word_embeddings", False)}


def param_counts(model: dict) -> dict:
    """Parameters of the embedding, one decoder layer, the final norm and lm_head (none when tied), and in all:
    a layer is q/k/v/o (+ q/k/v biases where the config has them: Qwen2), the SwiGLU MLP (3 matrices) and 2 RMSNorms
    (+ Qwen3's per-head q/k norms)."""
    s = shapes(model)
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    layer = 2 * s["hidden"] * (q + kv) + 3 * s["hidden"] * s["mlp"] + 2 * s["hidden"] + 2 * s["head_dim"] * s["qk_norm"]
    if model.get("attention_bias", model.get("model_type") == "qwen2"):
        layer += q + 2 * kv
    embedding, head = s["vocab"] * s["hidden"], 0 if s["tied"] else s["vocab"] * s["hidden"]
    return {"embedding": embedding, "layer": layer, "head": head + s["hidden"],
            "total": embedding + s["layers"] * layer + head + s["hidden"]}


def lora_params(model: dict, rank: int, targets: list[str]) -> int:
    """Trainable adapter parameters: rank x (inputs + outputs) of every targeted projection of every layer."""
    s = shapes(model)
    q, kv, h, m = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["hidden"], s["mlp"]
    sides = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h, "gate_proj": h + m,
             "up_proj": h + m, "down_proj": m + h}
    return s["layers"] * rank * sum(sides[name] for name in targets if name in sides)


def activation_bytes(model: dict, compute: int) -> int:
    """Bytes one token saves for backward in one decoder layer (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", sec. 4.1, adapted): each RMSNorm keeps its input in fp32 and its
    output in the compute dtype (4h + ch); attention keeps q, k, v and its output, c(a + 2k + a)d for a query and
    k key/value heads of size d, and no s^2 scores (sdpa / flash attention); Qwen3's q/k norms keep (4 + c)(a + k)d;
    the SwiGLU MLP keeps gate, up, silu(gate) and their product, 4ci; no dropout masks (dropout is 0)."""
    s = shapes(model)
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    norms = 2 * (4 + compute) * s["hidden"] + (4 + compute) * (q + kv) * s["qk_norm"]
    return norms + compute * (2 * q + 2 * kv) + 4 * compute * s["mlp"]


def tokens_per_micro_batch(cfg: Config) -> int:
    """The longest micro-batch a forward with gradients sees: the token budget, else whole padded sequences."""
    if cfg.stage == "sft":
        return cfg.trainer.micro_batch_size * cfg.trainer.sft_max_len
    return cfg.trainer.max_tokens_per_micro_batch or cfg.trainer.micro_batch_size * (
        cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)


def activations(model: dict, compute: int, tokens: int, checkpointing: bool) -> int:
    """Saved activations in bytes: every layer's (activation_bytes), or with checkpointing each layer's input only
    plus one layer recomputed in backward."""
    s, per_layer = shapes(model), activation_bytes(model, compute) * tokens
    return s["layers"] * compute * s["hidden"] * tokens + per_layer if checkpointing else s["layers"] * per_layer


def engine_terms(cfg: Config, plan: dict, model: dict, gpu_gib: float | None, role: str, phase: str) -> dict:
    """The rollout engine's bytes on a rank of `role` in `phase`. vLLM on a GPU holds gpu_memory_utilization x the
    GPU (weights, KV cache, CUDA-graph pool) while awake; colocated, it sleeps at level 2 through training (nothing
    held) and has its weights (not its KV cache) back while syncing. The transformers engine holds its own copy
    where the plan gives it one, and a KV cache for the rank's rollout batch while generating."""
    separate = cfg.rollout.placement == "separate"
    if cfg.stage != "rl" or (role == "trainer") == separate:
        return {}
    s, engine = shapes(model), BYTES[plan["precision"]["engine"]]
    weights = param_counts(model)["total"] * engine / cfg.rollout.tp_size
    if cfg.rollout.engine == "vllm" and plan["target"]["device"] != "cuda":
        return {"vllm": weights + (cfg.rollout.vllm_kv_cache_mb << 20)}  # no sleep mode off CUDA
    if cfg.rollout.engine == "vllm":
        share = plan["vllm"]["gpu_memory_utilization"] * gpu_gib * GIB if gpu_gib else weights  # unknown GPU: weights
        return {"vllm": share} if separate or phase == "generating" else {"vllm": weights} if phase == "syncing" else {}
    terms = {"engine_copy": weights} if "update_weights" in plan["engine_cycle"] else {}
    if phase == "generating":
        sequences = cfg.trainer.prompts_per_step * cfg.rollout.n
        length = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
        terms["kv_cache"] = sequences * length * 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * engine
    return terms


def estimate(cfg: Config, plan: dict, model: dict, gpu_gib: float | None = None, teacher: dict | None = None) -> dict:
    """Every term in GiB per role and phase, from the plan's own decisions (precision, placement, engine cycle, vLLM's
    arguments) and the model's config.json (and the distillation teacher's, default the model's); with gpu_gib,
    whether each fits and, where one does not, why."""
    sharded, lora, counts, s = plan["target"]["torchrun"], cfg.model.lora, param_counts(model), shapes(model)
    master, compute = (BYTES[plan["precision"]["policy"][key]] for key in ("param", "compute"))
    shards = len(plan["placement"]["trainer_ranks"]) if sharded else 1
    reference, taught = plan["precision"]["reference"], plan["precision"]["teacher"]
    trainable = lora_params(model, lora.rank, lora.target_modules) if lora.enabled else counts["total"]
    tokens, ckpt = tokens_per_micro_batch(cfg), cfg.model.gradient_checkpointing
    state = {"weights": (counts["total"] + trainable * lora.enabled) * master / shards,
             "gradients": trainable * master / shards, "optimizer": 2 * trainable * master / shards,  # AdamW: 2 moments
             "reference": counts["total"] * compute / shards if reference and "shares" not in reference else 0,
             "teacher": param_counts(teacher or model)["total"] * compute / shards if taught else 0,
             # FSDP2: a layer in use, one prefetched and the root (embedding, lm_head); autocast caches every cast
             "gathered": (2 * counts["layer"] + counts["embedding"] + counts["head"]) * compute if sharded
             else counts["total"] * compute * (compute != master),
             "activations": activations(model, compute, tokens, ckpt),
             # one chunk's fp32 blocks (at most a micro-batch's positions), and lm_head's fp32 gradient (not LoRA)
             "logits": min(cfg.model.logprob_chunk_size, tokens) * s["vocab"] * 4 * LOGITS_FACTOR
             + s["vocab"] * s["hidden"] * 4 * (not lora.enabled)}
    roles = {}
    for role in ["trainer"] + ["rollout"] * (cfg.rollout.placement == "separate"):
        roles[role] = {}
        for phase in ("generating", "training", "syncing") if cfg.stage == "rl" else ("training",):
            kept = tuple(state) if phase == "training" else ("weights", "optimizer", "reference", "teacher")
            terms = {name: state[name] for name in kept if role == "trainer" and name in state and state[name]}
            terms.update(engine_terms(cfg, plan, model, gpu_gib, role, phase))
            terms["sync_bucket"] = (cfg.rollout.sync_bucket_mb << 20) * (phase == "syncing")  # in the engine dtype
            terms["cuda_context"] = CUDA_CONTEXT_GIB * GIB * (plan["target"]["device"] == "cuda")
            roles[role][phase] = {name: round(value / GIB, 3) for name, value in terms.items() if value}
            roles[role][phase]["total"] = round(sum(terms.values()) / GIB, 3)
    memory = {"gpu_gib": gpu_gib, "params": counts["total"], "trainable_params": trainable,
              "tokens_per_micro_batch": tokens, "roles": roles, "fits": None, "refusal": None,
              "activations_gib": {f"{'with' if on else 'without'}_checkpointing":
                                  round(activations(model, compute, tokens, on) / GIB, 3) for on in (True, False)}}
    over = [(terms["total"], phase, role, terms) for role in roles for phase, terms in roles[role].items()
            if gpu_gib and terms["total"] > gpu_gib]
    memory["fits"] = not over if gpu_gib else None
    if over:
        total, phase, role, terms = max(over, key=lambda item: item[0])
        largest = max((name for name in terms if name != "total"), key=terms.get)
        advice = ADVICE.get(largest, SHARDED_ADVICE)
        if largest == "activations" and not ckpt:
            advice = f"set model.gradient_checkpointing=true or {advice}"
        memory["refusal"] = (f"{phase} on {role} ranks needs {total:.1f} GiB of {gpu_gib:g}: {largest} "
                             f"{terms[largest]:.1f} GiB is the largest term; {advice}")
    return memory


def check_fit(memory: dict | None) -> None:
    """Refuse a plan whose estimate does not fit the GPU, naming the phase, role and largest term."""
    if memory is not None and memory["refusal"]:
        raise ConfigError(memory["refusal"])


def describe(memory: dict) -> str:
    """The estimate as a table: one row per role and term, one column per phase, GiB."""
    phases = list(next(iter(memory["roles"].values())))
    of = f" of {memory['gpu_gib']:g}" if memory["gpu_gib"] else " (no GPU size given: no fit check; vllm: weights only)"
    lines = [f"{'memory per GPU (GiB' + of + ')':<44}" + "".join(f"{phase:>12}" for phase in phases)]
    for role, terms_of in memory["roles"].items():
        for name in sorted({name for terms in terms_of.values() for name in terms}, key=ORDER.index):
            cells = "".join(f"{terms_of[phase][name]:>12.2f}" if name in terms_of[phase] else f"{'-':>12}"
                            for phase in phases)
            lines.append(f"  {role + ' ranks: ' + name:<42}{cells}")
    return "\n".join(lines)
