"""Per-token logprobs and entropies of the temperature-scaled distribution, in fp32, chunk by chunk.

`completion_logprobs` is the pass the trainer uses: it runs the model, keeps only the final hidden states,
and projects them to the vocabulary only at real completion positions, a chunk at a time, so the
[B, Lp+T, V] logits (and even the [B, T, V] ones) never exist. B sequences, Lp prompt columns,
T completion columns, V vocabulary, H hidden size.
"""
from __future__ import annotations

import torch
from torch import Tensor

from models.chunked_softmax import LogprobsFromHidden, LogprobsFromLogits

# Rows (tokens) per chunk: one fp32 [C, V] block is 100 MB at V = 49,152 and 311 MB at V = 151,936.
DEFAULT_CHUNK_SIZE = 512

# Config keys of HF models whose logits are not a plain lm_head projection; the fused path would silently
# compute a different distribution for them, so it refuses.
_UNSUPPORTED_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


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


def token_entropy(logits: Tensor, *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Entropy of softmax(logits.float() / temperature) per position: logits [B, T, V] -> [B, T] float32."""
    _check_common(temperature, chunk_size)
    if logits.ndim != 3:
        raise ValueError(f"expected logits [B, T, V]; got {tuple(logits.shape)}")
    batch, length, vocab = logits.shape
    labels = torch.zeros(batch * length, dtype=torch.long, device=logits.device)
    _, entropy = LogprobsFromLogits.apply(logits.reshape(batch * length, vocab), labels, float(temperature), chunk_size, True)
    return entropy.view(batch, length)


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


def completion_logprobs(
    model: torch.nn.Module,
    batch: dict,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    share_prompts: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs (and optionally entropies) of the completion tokens under `model`, scaled by temperature.

    batch: the dict of models.batching.pad_batch (input_ids, attention_mask, position_ids [B, Lp+T],
           completion_mask [B, T], prompt_len Lp).
    Returns (logprobs [B, T] float32, entropy [B, T] float32 or None); both are 0 where completion_mask is 0.
    Differentiable with respect to the model's parameters, for a plain HF model and an FSDP2-sharded one.
    share_prompts: when rows repeat a prompt (GRPO's G completions per prompt), run each distinct prompt once
           and the completions on its KV cache (`_shared_prompt_hidden`): the same values up to float
           rounding, with a forward over U*Lp + B*T tokens instead of B*(Lp+T).
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
    batch = {key: batch[key].to(input_device) for key in ("input_ids", "attention_mask", "position_ids")}
    input_ids = batch["input_ids"]

    captured: dict[str, Tensor] = {}

    def keep_final_hidden(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handle = _final_hidden_module(model).register_forward_hook(keep_final_hidden)
    try:
        unique_rows, prompt_index = prompt_groups(input_ids, batch["attention_mask"], prompt_len)
        # Gradient checkpointing drops the KV cache inside transformers' checkpointed layers, so it takes the
        # plain pass.
        if (share_prompts and len(unique_rows) < batch_size and completion_len > 0
                and not getattr(model, "is_gradient_checkpointing", False)):
            hidden = _shared_prompt_hidden(model, batch, prompt_len, unique_rows, prompt_index, captured)
        else:
            # logits_to_keep=1: the model's own lm_head then runs on one position only ([B, 1, V], unused).
            model(**batch, use_cache=False, logits_to_keep=1)
            hidden = captured["hidden"][:, prompt_len - 1 : prompt_len - 1 + completion_len]
    finally:
        handle.remove()
    # Read the projection only now: under FSDP2 the root's parameters are gathered (plain tensors swapped in
    # for the shards) from its forward until its backward.
    weight, bias = _output_projection(model)

    # hidden[:, t] (column Lp-1+t) predicts completion token t; only real completion tokens are projected.
    device = hidden.device
    labels = input_ids[:, prompt_len:].to(device)
    selected = completion_mask.to(device) > 0
    logprobs_n, entropy_n = LogprobsFromHidden.apply(
        hidden[selected], weight, bias, labels[selected], float(temperature), chunk_size, with_entropy
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
