"""Per-token logprobs and entropies of the temperature-scaled distribution, in fp32, chunk by chunk.

`completion_logprobs` is the pass the trainer uses: it runs the model, keeps only the final hidden states,
and projects them to the vocabulary only at real completion positions, a chunk at a time, so the
[B, Lp+T, V] logits (and even the [B, T, V] ones) never exist. B sequences, Lp prompt columns,
T completion columns, V vocabulary, H hidden size. Three ways to run the model over a pad_batch micro-batch:
plain (B x (Lp+T)), shared prompts (each distinct prompt once, completions on its KV cache) and packed
(one padding-free row, models.packing); all give the same values up to float rounding.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

from models.attention import SDPA_NATIVE_GQA, attention_implementation
from models.chunked_softmax import LogprobsFromHidden, LogprobsFromLogits
from models.packing import PACKABLE_IMPLEMENTATIONS, install_packed_dispatch, pack_batch, varlen_layout

# Rows (tokens) per chunk: one fp32 [C, V] block is 100 MB at V = 49,152 and 311 MB at V = 151,936.
DEFAULT_CHUNK_SIZE = 512

# Config keys of HF models whose logits are not a plain lm_head projection; the fused path would silently
# compute a different distribution for them, so it refuses.
_UNSUPPORTED_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def sampleable_vocab_size(model: torch.nn.Module, tokenizer) -> int:
    """The ids an engine may sample: the tokenizer's, capped by the output projection's rows (the engines never
    sample a padded row, which has no text)."""
    return min(len(tokenizer), model.get_output_embeddings().weight.shape[0])


@contextmanager
def evaluating(model: torch.nn.Module):
    """Run `model` in eval mode (no dropout) and restore its mode after: the no-grad passes (old and reference
    logprobs) must score the tokens under the distribution the engines sampled from, which has no dropout."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def dropout_active(model: torch.nn.Module) -> bool:
    """Whether a forward of `model` in train mode drops units: a torch Dropout with p > 0 (LoRA's
    lora_dropout, a model's own) or a config attention dropout > 0 (HF attention applies it while training)."""
    config = getattr(model, "config", None)
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(module, torch.nn.Dropout) and module.p > 0 for module in model.modules())


def _check_common(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def token_logprobs(logits: Tensor, labels: Tensor, *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """log_softmax(logits.float() / temperature).gather(labels), without a full fp32 copy of the logits.

    logits: [B, T, V] any float dtype; labels: [B, T] long. Returns [B, T] float32 (differentiable).
    """
    _check_common(temperature, chunk_size)
    if logits.ndim != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"expected logits [B, T, V] and labels [B, T]; got {tuple(logits.shape)} and {tuple(labels.shape)}")
    batch, length, vocab = logits.shape
    logprobs, _ = LogprobsFromLogits.apply(
        logits.reshape(batch * length, vocab), labels.reshape(-1).long(), float(temperature), chunk_size, False
    )
    return logprobs.view(batch, length)


def _final_hidden_module(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack whose output is the final (post-norm) hidden state that lm_head projects."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        raise ValueError(f"{type(model).__name__} exposes no decoder module (model.get_decoder()); cannot fuse its lm_head")
    return decoder


def logit_transform(model: torch.nn.Module) -> str | None:
    """The config setting that makes `model`'s logits more than its output projection (e.g.
    "final_logit_softcapping=30.0"), or None when the logits are exactly hidden @ lm_head.weight.T (+ bias)."""
    config = getattr(model, "config", None)
    for key, neutral in _UNSUPPORTED_LOGIT_TRANSFORMS.items():
        value = getattr(config, key, neutral)
        if value is not None and value != neutral:
            return f"{key}={value}"
    return None


def _check_plain_projection(model: torch.nn.Module) -> None:
    transform = logit_transform(model)
    if transform is not None:
        raise ValueError(
            f"{type(model).__name__} has config.{transform}: its logits are not a plain lm_head projection, "
            "which completion_logprobs assumes"
        )


def _output_projection(model: torch.nn.Module) -> tuple[Tensor, Tensor | None]:
    head = model.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    # A sharded weight (a DTensor, which has full_tensor) here means FSDP resharded the root module after
    # forward; models.fsdp.shard keeps the root gathered until backward, which this projection relies on.
    if hasattr(weight, "full_tensor"):
        raise ValueError(
            "the output projection is still sharded after forward; shard the model with models.fsdp.shard "
            "(the root module must use reshard_after_forward=False)"
        )
    return weight, bias


def prompt_groups(input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> tuple[Tensor, Tensor]:
    """The distinct prompts of a pad_batch layout: (unique_rows [U] long, prompt_index [B] long), where
    unique_rows[u] is the first row holding prompt u and row b holds prompt prompt_index[b].

    >>> ids = torch.tensor([[0, 5, 9], [0, 5, 8], [4, 5, 7]])
    >>> rows, index = prompt_groups(ids, (ids != 0).long(), prompt_len=2)
    >>> rows.tolist(), index.tolist()
    ([0, 2], [0, 0, 1])
    """
    # The mask joins the ids so a real token equal to pad_id is not taken for padding.
    prompts = torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len]], dim=1)
    _, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    rows = torch.arange(len(prompts), device=prompts.device)
    first = torch.full((int(inverse.max()) + 1,), len(prompts), device=prompts.device).scatter_reduce(
        0, inverse, rows, reduce="amin")
    order = first.argsort()  # number prompts by first appearance, so rows keep their order
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)
    return first[order], rank[inverse]


def _shared_prompt_hidden(model, batch: dict, prompt_len: int, unique_rows: Tensor, prompt_index: Tensor,
                          captured: dict) -> Tensor:
    """Final hidden states [B, T, H] predicting each completion token, with each distinct prompt run once.

    Pass 1 runs the U distinct prompts ([U, Lp]) and keeps their KV cache; the cache is then gathered to the
    B rows (prompt_index) and pass 2 runs the completions ([B, T]) on it. Gradients reach the prompt pass
    through the cache. Column t of the result predicts completion token t: the prompt's last hidden state
    for t = 0, completion column t-1 after.
    """
    prompt = {key: value[unique_rows, :prompt_len] for key, value in batch.items()}
    cache = model(**prompt, use_cache=True, logits_to_keep=1).past_key_values
    last_prompt_hidden = captured["hidden"][:, -1:]
    cache.batch_select_indices(prompt_index)
    model(input_ids=batch["input_ids"][:, prompt_len:], attention_mask=batch["attention_mask"],
          position_ids=batch["position_ids"][:, prompt_len:], past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    return torch.cat([last_prompt_hidden[prompt_index], captured["hidden"][:, :-1]], dim=1)


def unpackable(model) -> str | None:
    """Why `model` cannot run a packed pass, or None when it can."""
    config = model.config
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return (f"packed passes do not implement sliding-window attention (config.sliding_window="
                f"{config.sliding_window}); use packed=False")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return (f"packed passes do not implement attention soft-capping (config.attn_logit_softcapping="
                f"{config.attn_logit_softcapping}); use packed=False")
    implementation = config._attn_implementation
    if implementation not in PACKABLE_IMPLEMENTATIONS:
        return (f"packed passes run on attention implementations {list(PACKABLE_IMPLEMENTATIONS)}; the model uses "
                f"{implementation!r} (model.attn_implementation=sdpa), or use packed=False")
    return None


def _packed_hidden(model, batch: dict, prompt_index: Tensor | None, captured: dict) -> tuple[Tensor, Tensor]:
    """Final hidden states [M, H] predicting the M real completion tokens (row-major), and those tokens [M],
    from one packed forward (models.packing). prompt_index: [B] rows sharing a packed prompt, or None."""
    reason = unpackable(model)
    if reason is not None:
        raise ValueError(reason)
    implementation = model.config._attn_implementation
    install_packed_dispatch()
    device = model.get_output_embeddings().weight.device
    packed = pack_batch(batch, None if prompt_index is None else prompt_index.cpu())
    attention_kwargs = {"packed_segments": packed.segments}
    if implementation == "flash_attention_2":  # the model computes in bf16/fp16 (models.loading.choose_attention)
        attention_kwargs["packed_varlen"] = varlen_layout(packed.segments, device)
    # A 4-D mask is passed through by transformers untouched and ignored by packed attention (with none,
    # transformers would build an [N, N] block mask that nothing reads). It is empty so that a layer which
    # did not receive packed_segments fails on it loudly instead of attending across sequences.
    unused_mask = torch.empty(1, 1, 0, 0, dtype=torch.bool, device=device)
    model(input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
          attention_mask=unused_mask, use_cache=False, logits_to_keep=1, **attention_kwargs)
    hidden = captured["hidden"]
    return hidden[0, packed.predict_index.to(hidden.device)], packed.labels.to(hidden.device)


def _completion_hidden(model, batch: dict, original: dict, *, share_prompts: bool, packed: bool):
    """The final hidden states [M, H] that predict the M real completion tokens (row-major order of
    completion_mask) and those tokens [M], by the pass completion_logprobs chose.

    batch: input_ids, attention_mask, position_ids on the model's input device; original: the caller's
    pad_batch dict (completion_mask, prompt_len)."""
    input_ids, completion_mask, prompt_len = batch["input_ids"], original["completion_mask"], int(original["prompt_len"])
    batch_size, completion_len = completion_mask.shape
    captured: dict[str, Tensor] = {}

    def keep_final_hidden(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handle = _final_hidden_module(model).register_forward_hook(keep_final_hidden)
    try:
        unique_rows, prompt_index = prompt_groups(input_ids, batch["attention_mask"], prompt_len)
        shared = share_prompts and len(unique_rows) < batch_size
        # transformers checkpoints layers only in train mode with gradients on.
        checkpointing = getattr(model, "is_gradient_checkpointing", False) and model.training and torch.is_grad_enabled()
        # Gradient checkpointing drops the KV cache inside transformers' checkpointed layers, so the shared-prompt
        # pass cannot run under it; the packed pass shares prompts without a cache and is recomputed packed.
        if packed or (shared and checkpointing and unpackable(model) is None):
            return _packed_hidden(model, original, prompt_index if shared else None, captured)
        # On CPU, transformers' sdpa copies every key/value head num_key_value_groups times whenever a mask is
        # passed (and its backward sums the copies back); torch's kernel takes grouped-query attention natively
        # (models.attention): faster, with the same logprobs (bench/README.md). The graph records the function,
        # so the backward needs no switch; gradient checkpointing's recomputation would run outside the switch,
        # so it keeps the model's own function.
        native = (getattr(model.config, "_attn_implementation", None) == "sdpa" and input_ids.device.type == "cpu"
                  and not checkpointing)
        with attention_implementation(model, SDPA_NATIVE_GQA if native else None):
            # Gradient checkpointing drops the KV cache inside transformers' checkpointed layers (see above).
            if shared and completion_len > 0 and not checkpointing:
                hidden = _shared_prompt_hidden(model, batch, prompt_len, unique_rows, prompt_index, captured)
            else:
                # logits_to_keep=1: the model's own lm_head then runs on one position only ([B, 1, V], unused).
                model(**batch, use_cache=False, logits_to_keep=1)
                hidden = captured["hidden"][:, prompt_len - 1 : prompt_len - 1 + completion_len]
        # hidden[:, t] (column Lp-1+t) predicts completion token t; only real completion tokens are projected.
        selected = completion_mask.to(hidden.device) > 0
        return hidden[selected], input_ids[:, prompt_len:].to(hidden.device)[selected]
    finally:
        handle.remove()


def completion_logprobs(
    model: torch.nn.Module,
    batch: dict,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    share_prompts: bool = True,
    packed: bool = False,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs (and optionally entropies) of the completion tokens under `model`, scaled by temperature.

    batch: the dict of models.batching.pad_batch (input_ids, attention_mask, position_ids [B, Lp+T],
           completion_mask [B, T], prompt_len Lp).
    Returns (logprobs [B, T] float32, entropy [B, T] float32 or None); both are 0 where completion_mask is 0.
    Differentiable with respect to the model's parameters, for a plain HF model and an FSDP2-sharded one.
    share_prompts: when rows repeat a prompt (GRPO's G completions per prompt), run each distinct prompt once
           and the completions on its KV cache (`_shared_prompt_hidden`): the same values up to float
           rounding, with a forward over U*Lp + B*T tokens instead of B*(Lp+T). Under gradient checkpointing
           (which drops that cache) the packed pass shares them instead, where the model can pack.
    packed: run the micro-batch as one padding-free packed row (models.packing): each distinct prompt once
           (with share_prompts) and every completion at its own length, U*Lp + sum(T_b) tokens. The same values
           up to float rounding; also under gradient checkpointing.
    vocab_size: normalise over the first vocab_size rows of the output projection only: the ids an engine can
           sample (`sampleable_vocab_size`). A model whose embedding is padded beyond its tokenizer (Qwen2.5:
           151,936 rows for 151,665 tokens) gives the padded rows some probability mass; the engines never
           sample them and renormalise over the rest, so the trainer must too, or every token's old/rollout
           ratio is off by log(1 - that mass). None: every row.
    """
    _check_common(temperature, chunk_size)
    input_ids, completion_mask, prompt_len = batch["input_ids"], batch["completion_mask"], int(batch["prompt_len"])
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, Lp+T], got shape {tuple(input_ids.shape)}")
    batch_size, total_len = input_ids.shape
    completion_len = total_len - prompt_len
    if prompt_len < 1 or completion_mask.shape != (batch_size, completion_len):
        raise ValueError(
            f"completion_mask {tuple(completion_mask.shape)} does not fit input_ids {tuple(input_ids.shape)} "
            f"with prompt_len {prompt_len} (expected ({batch_size}, {completion_len}))"
        )
    _check_plain_projection(model)
    # FSDP2 moves a sharded model's inputs to its compute device itself (also under CPU offload, where the
    # parameters' own device is the CPU); a plain model gets them on its parameters' device.
    input_device = model.get_output_embeddings().weight.device
    original = batch
    batch = {key: batch[key].to(input_device) for key in ("input_ids", "attention_mask", "position_ids")}

    hidden, labels = _completion_hidden(model, batch, original, share_prompts=share_prompts, packed=packed)
    # Read the projection only now: under FSDP2 the root's parameters are gathered (plain tensors swapped in
    # for the shards) from its forward until its backward.
    weight, bias = _output_projection(model)
    if vocab_size is not None and vocab_size < weight.shape[0]:
        weight, bias = weight[:vocab_size], None if bias is None else bias[:vocab_size]
    device = hidden.device
    selected = completion_mask.to(device) > 0
    logprobs_n, entropy_n = LogprobsFromHidden.apply(
        hidden, weight, bias, labels, float(temperature), chunk_size, with_entropy
    )
    logprobs = torch.zeros(batch_size, completion_len, dtype=torch.float32, device=device)
    logprobs = logprobs.masked_scatter(selected, logprobs_n)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(batch_size, completion_len, dtype=torch.float32, device=device).masked_scatter(selected, entropy_n)
    if not torch.is_grad_enabled():
        # No backward will come to release FSDP's gathered parameters (the root's, and any unit's that does
        # not reshard after forward); release them now, so they cannot go stale if an optimizer step
        # happens before the next forward. FSDP modules are recognised by their reshard/unshard methods.
        for module in model.modules():
            if hasattr(module, "reshard") and hasattr(module, "unshard"):
                module.reshard()
    return logprobs, entropy
