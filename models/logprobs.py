"""Per-token logprobs and entropies of the completion tokens under a model, temperature-scaled, in fp32.

`completion_logprobs` keeps the model's final hidden states and projects them to the vocabulary only at real
completion positions, a chunk at a time (`LogprobsFromHidden`), so the [B, Lp+T, V] logits never exist.
B sequences, Lp prompt columns, T completion columns, V vocabulary, H hidden size, M real completion tokens.
The three ways a micro-batch runs (plain, shared prompts, packed) give the same values up to float rounding.

`pad_batch` is the one batch layout of every logprob and training pass: prompts left-padded, completions
right-padded, so that every completion starts at the same column and the logits at column Lp-1+t predict completion
token t. `micro_batches_by_tokens` plans the micro-batches of a token budget."""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from models import fsdp
from models.attention import PACKABLE_IMPLEMENTATIONS, install_dispatch, varlen_layout

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
    attention_dropout = float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0)
    return attention_dropout > 0 or any(isinstance(module, torch.nn.Dropout) and module.p > 0
                                        for module in model.modules())


def pad_batch(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], pad_id: int) -> dict:
    """Lay out B (prompt, completion) token-id lists, prompts non-empty, as one padded batch of CPU tensors:
      input_ids       [B, Lp+T] long: prompt LEFT-padded to Lp (longest prompt), completion RIGHT-padded to T
      attention_mask  [B, Lp+T] long: 1 on real tokens, 0 on padding
      position_ids    [B, Lp+T] long: (cumsum(attention_mask) - 1).clamp(min=0), so each row starts at 0
      completion_mask [B, T] float: 1.0 on real completion tokens, 0.0 on padding
      prompt_len      int: Lp

    >>> batch = pad_batch([[5, 6], [7]], [[8], [9, 10]], pad_id=0)
    >>> batch["input_ids"].tolist()
    [[5, 6, 8, 0], [0, 7, 9, 10]]
    >>> batch["position_ids"].tolist()
    [[0, 1, 2, 2], [0, 0, 1, 2]]
    >>> batch["completion_mask"].tolist(), batch["prompt_len"]
    ([[1.0, 0.0], [1.0, 1.0]], 2)
    """
    if len(prompt_ids) == 0:
        raise ValueError("pad_batch needs at least one sequence; got an empty list of prompts")
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"pad_batch got {len(prompt_ids)} prompts but {len(completion_ids)} completions; "
                         "pass one per prompt")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise ValueError(f"pad_id must be an int token id, got {pad_id!r}")
    for index, prompt in enumerate(prompt_ids):
        if len(prompt) == 0:
            # The first completion token is predicted from the last prompt position, so it must exist.
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
    batch_size = len(prompt_ids)
    prompt_len = max(len(prompt) for prompt in prompt_ids)
    completion_len = max(len(completion) for completion in completion_ids)
    input_ids = torch.full((batch_size, prompt_len + completion_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, prompt_len + completion_len), dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        columns = slice(prompt_len - len(prompt), prompt_len + len(completion))
        input_ids[row, columns] = torch.as_tensor([*prompt, *completion], dtype=torch.long)
        attention_mask[row, columns] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "completion_mask": attention_mask[:, prompt_len:].to(torch.float32), "prompt_len": prompt_len}


def micro_batches_by_tokens(lengths: Sequence[int], max_tokens: int, *, min_count: int = 1) -> list[list[int]]:
    """Split sequences of the given token lengths into as few micro-batches of at most `max_tokens` tokens each
    as the budget allows, the tokens spread evenly over them; returns lists of sequence indices, each ascending,
    ordered by their first index. min_count: the least number of micro-batches (the largest count any rank needs:
    FSDP's collectives pair up across ranks); the extra ones are empty lists, run as zero-weight passes.
    How: k = max(ceil(total / max_tokens), min_count) batches, longest sequence first into the least loaded one
    with room (ties to the lower one: the plan is deterministic); if one fits nowhere, k grows by one.

    >>> micro_batches_by_tokens([5, 1, 4, 3, 2, 9], max_tokens=10)
    [[0, 1, 4], [2, 3], [5]]
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"lengths[{index}] must be a token count >= 0, got {length!r}")
        if length > max_tokens:
            raise ValueError(f"sequence {index} has {length} tokens, more than the micro-batch token budget "
                             f"max_tokens={max_tokens}: raise the budget or shorten the sequence")
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    count = max(-(-sum(lengths) // max_tokens), min_count, 1)
    while True:
        loads, batches = [0] * count, [[] for _ in range(count)]
        for index in order:
            target = loads.index(min(loads))  # the least loaded (the lowest on ties): if it has no room, none has
            if loads[target] + lengths[index] > max_tokens:
                break
            loads[target] += lengths[index]
            batches[target].append(index)
        else:
            filled = sorted((sorted(batch) for batch in batches if batch), key=lambda batch: batch[0])
            return filled + [[] for _ in range(count - len(filled))]
        count += 1


def prompt_groups(input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> tuple[Tensor, Tensor]:
    """The distinct prompts of a pad_batch layout: (unique_rows [U] long, prompt_index [B] long), where
    unique_rows[u] is the first row holding prompt u and row b holds prompt prompt_index[b]."""
    # The mask joins the ids so a real token equal to pad_id is not taken for padding.
    prompts = torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len]], dim=1)
    _, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    first = (inverse[:, None] == inverse[None, :]).int().argmax(dim=1)  # [B]: the first row of each row's prompt
    unique_rows = first.unique()  # ascending: prompts numbered by first appearance, so rows keep their order
    return unique_rows, torch.searchsorted(unique_rows, first)


@dataclass(frozen=True)
class PackedBatch:
    """A pad_batch micro-batch as one packed row of N tokens, for its M real completion tokens."""

    input_ids: Tensor  # [1, N] long
    position_ids: Tensor  # [1, N] long: from 0 for each prompt; a completion continues from its prompt's length
    segments: tuple[tuple[int, int, int, int], ...]  # (start, end, prefix_start, prefix_end) tiling [0, N)
    predict_index: Tensor  # [M] long: the position whose final hidden state predicts each, in completion_mask order
    labels: Tensor  # [M] long: those completion tokens


def pack_batch(batch: dict, prompt_index: Tensor | None = None) -> PackedBatch:
    """Pack a pad_batch dict: a prompt that several rows share (the same prompt_index, from prompt_groups; None:
    every row its own prompt) once, then each of their completions as a segment that attends to all of the
    prompt's keys and causally to itself; a prompt of one row and its completion as one causal segment. The
    forward then covers U*Lp + sum(T_b) tokens (U distinct prompts) instead of B*(Lp+T). The last token of a
    completion is only a label (nothing is predicted from it), so it is not packed."""
    input_ids, attention_mask = batch["input_ids"].cpu(), batch["attention_mask"].cpu()
    completion_mask, prompt_len = batch["completion_mask"].cpu() > 0, int(batch["prompt_len"])
    prompt_lengths = attention_mask[:, :prompt_len].sum(dim=1).tolist()
    completion_lengths = completion_mask.sum(dim=1).tolist()
    for row, length in enumerate(completion_lengths):
        if not bool(completion_mask[row, :length].all()):
            raise ValueError(f"completion_mask row {row} is not {length} ones followed by zeros: "
                             "not a pad_batch layout")
    groups: dict[int, list[int]] = {}
    for row, prompt in enumerate(range(len(input_ids)) if prompt_index is None else prompt_index.tolist()):
        groups.setdefault(prompt, []).append(row)
    ids, positions, segments, predict = [], [], [], [None] * len(input_ids)

    def append(tokens: list[int], first_position: int) -> None:
        ids.extend(tokens)
        positions.extend(range(first_position, first_position + len(tokens)))

    for rows in groups.values():  # prompts in order of first appearance
        prompt_length, start, shared = prompt_lengths[rows[0]], len(ids), len(rows) > 1
        append(input_ids[rows[0], prompt_len - prompt_length : prompt_len].tolist(), 0)
        segments.append((start, len(ids), start, start))
        for row in rows:
            length, completion_start = completion_lengths[row], len(ids)
            append(input_ids[row, prompt_len : prompt_len + length - 1].tolist(), prompt_length)
            if shared and length > 1:
                segments.append((completion_start, len(ids), start, start + prompt_length))
            # Token 0 is predicted from the prompt's last position, token t > 0 from completion token t - 1.
            predict[row] = ([start + prompt_length - 1] + list(range(completion_start, len(ids))))[:length]
        if not shared:  # nothing to share: prompt and completion as one causal segment
            segments[-1] = (start, len(ids), start, start)
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long), position_ids=torch.tensor([positions], dtype=torch.long),
        segments=tuple(segments), predict_index=torch.tensor([p for row in predict for p in row], dtype=torch.long),
        labels=input_ids[:, prompt_len:][completion_mask])


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


def _packed_hidden(model, batch: dict, prompt_index: Tensor | None, captured: dict, device) -> tuple[Tensor, Tensor]:
    """The packed pass (one forward) of _completion_hidden; prompt_index [B] or None as pack_batch takes it."""
    if (reason := unpackable(model)) is not None:
        raise ValueError(reason)
    packed = pack_batch(batch, None if prompt_index is None else prompt_index.cpu())
    attention_kwargs = {"packed_segments": packed.segments}
    if model.config._attn_implementation == "flash_attention_2":  # bf16/fp16 compute (models.loading)
        attention_kwargs["packed_varlen"] = varlen_layout(packed.segments, device)
    # A 4-D mask is passed through by transformers untouched and ignored by packed attention (with none,
    # transformers would build an [N, N] block mask that nothing reads). It is empty so that a layer which
    # did not receive packed_segments fails on it loudly instead of attending across sequences.
    unused_mask = torch.empty(1, 1, 0, 0, dtype=torch.bool, device=device)
    model(input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
          attention_mask=unused_mask, use_cache=False, logits_to_keep=1, **attention_kwargs)
    hidden = captured["hidden"]
    return hidden[0, packed.predict_index.to(hidden.device)], packed.labels.to(hidden.device)


def _shared_prompt_hidden(model, batch: dict, prompt_len: int, unique_rows: Tensor, prompt_index: Tensor,
                          captured: dict, **attention_kwargs) -> Tensor:
    """Final hidden states [B, T, H], column t predicting completion token t, with each distinct prompt run once:
    the U distinct prompts [U, Lp] keep their KV cache, gathered to the B rows (prompt_index), and the
    completions [B, T] run on it (gradients reach the prompt pass through the cache)."""
    prompt = {key: value[unique_rows, :prompt_len] for key, value in batch.items()}
    cache = model(**prompt, use_cache=True, logits_to_keep=1, **attention_kwargs).past_key_values
    last_prompt_hidden = captured["hidden"][:, -1:]
    cache.batch_select_indices(prompt_index)
    model(input_ids=batch["input_ids"][:, prompt_len:], attention_mask=batch["attention_mask"],
          position_ids=batch["position_ids"][:, prompt_len:], past_key_values=cache, use_cache=True,
          logits_to_keep=1, **attention_kwargs)
    return torch.cat([last_prompt_hidden[prompt_index], captured["hidden"][:, :-1]], dim=1)


def _completion_hidden(model, batch: dict, *, share_prompts: bool, packed: bool) -> tuple[Tensor, Tensor]:
    """The final hidden states [M, H] that predict the M real completion tokens (row-major order of
    completion_mask) and those tokens [M], by the pass completion_logprobs chose."""
    completion_mask, prompt_len = batch["completion_mask"], int(batch["prompt_len"])
    # The inputs go to the output projection's device (a sharded model's is a DTensor on its compute device).
    device = model.get_output_embeddings().weight.device
    inputs = {key: batch[key].to(device) for key in ("input_ids", "attention_mask", "position_ids")}
    captured: dict[str, Tensor] = {}

    def keep_final_hidden(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handle = model.get_decoder().register_forward_hook(keep_final_hidden)
    install_dispatch()
    try:
        unique_rows, prompt_index = prompt_groups(inputs["input_ids"], inputs["attention_mask"], prompt_len)
        shared = share_prompts and len(unique_rows) < len(prompt_index)
        # transformers checkpoints layers only in train mode with gradients on.
        checkpointing = (getattr(model, "is_gradient_checkpointing", False) and model.training
                         and torch.is_grad_enabled())
        # The shared-prompt pass runs two forwards on a KV cache, which gradient checkpointing drops inside its
        # layers. Under FSDP every rank must run as many forwards as the others (each all-gathers every layer),
        # while whether a micro-batch repeats a prompt differs by rank, so a model sharded over several ranks never
        # takes it (models.fsdp.shard makes a model's class a subclass of FSDPModule). The packed pass then shares
        # the prompts where the model can pack; elsewhere the plain pass runs.
        on_cache = shared and not checkpointing and not (isinstance(model, FSDPModule) and fsdp.world_size() > 1)
        if packed or (shared and not on_cache and unpackable(model) is None):
            return _packed_hidden(model, batch, prompt_index if shared else None, captured, device)
        # On CPU, grouped-query attention by torch's kernel instead of transformers' copies of the key/value heads
        # (models.attention): faster, with the same logprobs.
        native = model.config._attn_implementation == "sdpa" and device.type == "cpu"
        attention_kwargs = {"native_gqa": True} if native else {}
        if on_cache and completion_mask.shape[1] > 0:
            hidden = _shared_prompt_hidden(model, inputs, prompt_len, unique_rows, prompt_index, captured,
                                           **attention_kwargs)
        else:
            # logits_to_keep=1: the model's own lm_head then runs on one position only ([B, 1, V], unused).
            model(**inputs, use_cache=False, logits_to_keep=1, **attention_kwargs)
            hidden = captured["hidden"][:, prompt_len - 1 : prompt_len - 1 + completion_mask.shape[1]]
        # hidden[:, t] (column Lp-1+t) predicts completion token t; only real completion tokens are projected.
        selected = completion_mask.to(hidden.device) > 0
        return hidden[selected], inputs["input_ids"][:, prompt_len:].to(hidden.device)[selected]
    finally:
        handle.remove()


def fp32_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """hidden [C, H] @ weight [V, H].T (+ bias) -> [C, V] float32, never rounded to a half dtype on the way (a
    bf16 output, as a model's own lm_head gives, rounds logits of ~20 by up to 0.06). Half-precision weights
    on CUDA: products in their dtype, accumulated in fp32 (torch.mm's out_dtype); elsewhere fp32 throughout."""
    with torch.autocast(hidden.device.type, enabled=False):
        if weight.dtype != torch.float32 and hidden.is_cuda:
            logits = torch.mm(hidden.to(weight.dtype), weight.t(), out_dtype=torch.float32)
            return logits if bias is None else logits.add_(bias.float())
        return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


def _log_distribution(logits: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / temperature) of a fresh fp32 [C, V] block, divided in place (x / 1.0 == x exactly)."""
    return torch.log_softmax(logits if temperature == 1.0 else logits.div_(temperature), dim=-1)


class LogprobsFromHidden(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] or None, labels [N], temperature, chunk_size, with_entropy)
    -> (logprobs [N] fp32, entropy [N] fp32, or [0] when not requested), in chunks of C rows, with a hand-written
    backward that recomputes each chunk instead of storing it: neither direction holds more than one [C, V] block
    and the [N, V] logits never exist. For one row with scaled logits z = hidden @ W.T / temperature, p = softmax(z):
        logprob(y) = log p_y = z_y - logsumexp(z)        d/dz = onehot(y) - p
        entropy    = -sum_k p_k log p_k                  d/dz = -p * (log p + entropy)
    Each chunk's statistics are the textbook log_softmax(z).gather and -(p * log p).sum, so the values equal
    the unchunked ones bit for bit; the weight gradient is accumulated in fp32 and cast once at the end."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, with_entropy):
        logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            log_distribution = _log_distribution(fp32_logits(hidden[rows], weight, bias), temperature)
            logprobs[rows] = log_distribution.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                entropy[rows] = -(log_distribution.exp() * log_distribution).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, labels, entropy)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        # An output that the loss does not use then reaches backward as None instead of a zero tensor.
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            # The gradient with respect to the chunk's scaled logits (see the class docstring), then / T.
            log_distribution = _log_distribution(fp32_logits(hidden[rows], weight, bias), ctx.temperature)
            distribution = log_distribution.exp()
            grad = torch.zeros_like(distribution)
            if grad_logprobs is not None:
                grad -= distribution * grad_logprobs[rows].unsqueeze(-1)
                grad.scatter_add_(-1, labels[rows].unsqueeze(-1), grad_logprobs[rows].unsqueeze(-1))
            if grad_entropy is not None and ctx.with_entropy:
                grad -= (distribution * (log_distribution + entropy[rows].unsqueeze(-1))
                         * grad_entropy[rows].unsqueeze(-1))
            grad = grad.div_(ctx.temperature).to(weight.dtype)
            if need_hidden:
                grad_hidden[rows] = (grad @ weight).to(hidden.dtype)
            if need_weight:
                grad_weight += (grad.t() @ hidden[rows].to(weight.dtype)).float()
            if need_bias:
                grad_bias += grad.float().sum(dim=0)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def completion_logprobs(model: torch.nn.Module, batch: dict, *, temperature: float = 1.0,
                        chunk_size: int = DEFAULT_CHUNK_SIZE, with_entropy: bool = False, share_prompts: bool = True,
                        packed: bool = False, vocab_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """(logprobs [B, T], entropy [B, T] or None), float32, of the completion tokens under `model` at `temperature`,
    0 where completion_mask is 0; differentiable for a plain HF model and an FSDP2-sharded one.
    batch: a pad_batch dict (ids and masks [B, Lp+T], completion_mask [B, T], prompt_len Lp).
    share_prompts: when rows repeat a prompt (GRPO's G completions per prompt), run each distinct prompt once
           (on its KV cache; packed under gradient checkpointing or FSDP over ranks). False: the plain pass.
    packed: run the micro-batch as one padding-free packed row (pack_batch), U*Lp + sum(T_b) tokens.
    vocab_size: normalise over the first vocab_size rows of the output projection only (None: all), the ids an
           engine samples (`sampleable_vocab_size`): the engines renormalise without padded rows (Qwen2.5: 151,936
           for 151,665 tokens), so the trainer must too, or each old/rollout ratio is off by log(1 - their mass).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    input_ids, completion_mask, prompt_len = batch["input_ids"], batch["completion_mask"], int(batch["prompt_len"])
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, Lp+T], got shape {tuple(input_ids.shape)}")
    batch_size, completion_len = input_ids.shape[0], input_ids.shape[1] - prompt_len
    if prompt_len < 1 or completion_mask.shape != (batch_size, completion_len):
        raise ValueError(f"completion_mask {tuple(completion_mask.shape)} does not fit input_ids "
                         f"{tuple(input_ids.shape)} with prompt_len {prompt_len} (expected ({batch_size}, "
                         f"{completion_len}))")
    for key, neutral in _UNSUPPORTED_LOGIT_TRANSFORMS.items():
        value = getattr(model.config, key, neutral)
        if value is not None and value != neutral:
            raise ValueError(f"{type(model).__name__} has config.{key}={value}: its logits are not a plain lm_head "
                             "projection, which completion_logprobs assumes")
    hidden, labels = _completion_hidden(model, batch, share_prompts=share_prompts, packed=packed)
    # Read the projection only now: under FSDP2 the root's parameters are gathered (plain tensors swapped in
    # for the shards) from its forward until its backward; models.fsdp.shard keeps the root gathered.
    head = model.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    if vocab_size is not None and vocab_size < weight.shape[0]:
        weight, bias = weight[:vocab_size], None if bias is None else bias[:vocab_size]
    logprobs_m, entropy_m = LogprobsFromHidden.apply(hidden, weight, bias, labels, float(temperature), chunk_size,
                                                     with_entropy)
    selected = completion_mask.to(hidden.device) > 0
    zeros = torch.zeros(batch_size, completion_len, dtype=torch.float32, device=hidden.device)
    entropy = zeros.masked_scatter(selected, entropy_m) if with_entropy else None
    if not torch.is_grad_enabled():
        # No backward will come to release FSDP's gathered parameters (models.fsdp.reshard): release them now,
        # so they cannot go stale if an optimizer step happens before the next forward.
        fsdp.reshard(model)
    return zeros.masked_scatter(selected, logprobs_m), entropy
