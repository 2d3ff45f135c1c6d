"""CPU speed work for the transformers engine: the prefill and the decode step of a Llama-family decoder
(Llama, Mistral, Qwen2, Qwen3) written out as tensor operations on the model's own modules, over key/value
buffers of its own, without transformers' forward plumbing (mask building, output capture, its cache protocol).
rollout.hf_engine runs it where `supported` says so; it gives the model's logits up to float rounding. What each
part gains: bench/README.md, "Decode-step profile"."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # transformers' classes: the modules _layers reads


def supported(model: torch.nn.Module) -> bool:
    """True when `CPUDecoding` computes what `model`'s forward computes and can run here (another attention
    implementation than sdpa is the caller's choice and is kept; torch's CPU flash attention is always built)."""
    config, weight = model.config, model.get_input_embeddings().weight
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return (getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES and config._attn_implementation == "sdpa"
            and not sliding and all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or [])
            and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available())


class Projection:
    """nn.Linear modules applied to one input, as ONE product on their weights stacked and reordered once into
    oneDNN's blocked layout (`rows`: the expected row count, a hint), faster than MKL on nn.Linear's layout for
    few-row products (~1e-6 relative apart); or as the modules themselves when one of them is not a plain
    nn.Linear (a LoRA-wrapped layer computes more than its weight). Returns each module's output, in order."""

    def __init__(self, modules: list[torch.nn.Module], rows: int):
        self.modules, self.weight, self.bias = modules, None, None
        if all(type(module) is torch.nn.Linear for module in modules):
            self.sizes = [module.out_features for module in modules]
            weight = torch.cat([module.weight.detach() for module in modules])
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
            if any(module.bias is not None for module in modules):
                self.bias = torch.cat([module.bias.detach() if module.bias is not None
                                       else weight.new_zeros(module.out_features) for module in modules])

    def __call__(self, inputs: Tensor) -> tuple[Tensor, ...]:
        if self.weight is None:
            return tuple(module(inputs) for module in self.modules)
        output = torch.ops.mkldnn._linear_pointwise(inputs.reshape(-1, inputs.shape[-1]), self.weight, self.bias,
                                                    "none", [], "")
        return output.view(*inputs.shape[:-1], -1).split(self.sizes, dim=-1)


class KVBuffer:
    """Keys and values as plain tensors, [rows, kv_heads, capacity, head_dim] each, allocated once (not grown per
    token) and filled left to right (all rows share one length): one layer's completion tokens."""

    def __init__(self, capacity: int):
        self.capacity, self.length, self.keys, self.values = capacity, 0, None, None

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Write key/value [rows, kv_heads, Q, head_dim] after the filled columns; return views of all of them."""
        if self.keys is None:
            self.keys = key.new_empty(*key.shape[:2], self.capacity, key.shape[-1])
            self.values = value.new_empty(*value.shape[:2], self.capacity, value.shape[-1])
        end = self.length + key.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} tokens in a cache allocated for {self.capacity}")
        self.keys[:, :, self.length:end], self.values[:, :, self.length:end] = key, value
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def keep(self, rows: Tensor) -> None:
        """Keep rows `rows`, in that order (repeats allowed)."""
        if self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]


def _rotate(states: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, as transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin."""
    half = states.shape[-1] // 2
    return states * cos + torch.cat((-states[..., half:], states[..., :half]), dim=-1) * sin


class CPUDecoding:
    """One generate call's forward passes: `prefill` the P prompts once, then `step` one token per live row and
    `keep` the rows that go on. Rows are laid out as the engine numbers them, prompt i's n rows at i*n .. i*n+n-1;
    per layer the prompts' keys and values are kept once ([P, kv_heads, Lp, head_dim]), each row's in a KVBuffer."""

    def __init__(self, model: torch.nn.Module, prompts: int, n: int, capacity: int):
        self.decoder, self.n = model.get_decoder(), n
        rows = prompts * n
        self.projections = [(Projection([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], rows),
                             Projection([layer.self_attn.o_proj], rows),
                             Projection([layer.mlp.gate_proj, layer.mlp.up_proj], rows),
                             Projection([layer.mlp.down_proj], rows)) for layer in self.decoder.layers]
        self.head = Projection([model.get_output_embeddings()], rows)
        self.completions = [KVBuffer(capacity) for _ in self.decoder.layers]
        self.rows = torch.arange(rows, device=model.get_input_embeddings().weight.device)  # live row -> layout row

    def prefill(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """The prompts [P, Lp], left-padded (attention_mask 0 on padding), through every layer with causal
        attention; keeps their keys and values and returns the next-token logits of the P * n rows, [P * n, V]."""
        length, dtype = input_ids.shape[1], self.decoder.embed_tokens.weight.dtype
        real = attention_mask.bool()
        # Causal over the real columns; a padding position attends to itself alone, so its keys stay finite.
        own = torch.eye(length, dtype=torch.bool, device=real.device)
        allowed = torch.ones_like(own).tril() & (real[:, None, :] | own)  # [P, Lp, Lp]
        self.prompt_mask = torch.zeros(real.shape, dtype=dtype, device=real.device).masked_fill_(
            ~real, float("-inf"))[:, None, None, :]
        self.prompt_keys, self.prompt_values = [], []

        def attend(index: int, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
            self.prompt_keys.append(key.contiguous())
            self.prompt_values.append(value.contiguous())
            output = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed[:, None], scale=scale,
                                                    enable_gqa=True)
            return output.transpose(1, 2).reshape(*input_ids.shape, -1)

        (logits,) = self.head(self._layers(input_ids, position_ids, attend))
        return logits.repeat_interleave(self.n, dim=0)

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        return self.head(self._layers(tokens[:, None], positions, self._attend))[0]

    def keep(self, rows: Tensor) -> None:
        """Keep live rows `rows` (finished rows leave; their prompt's keys stay while any of its rows needs them)."""
        self.rows = self.rows[rows]
        for buffer in self.completions:
            buffer.keep(rows)

    def _layers(self, input_ids: Tensor, position_ids: Tensor, attend) -> Tensor:
        """input_ids, position_ids [rows, L] through every layer; `attend(index, query [rows, heads, L, d], key,
        value [rows, kv_heads, L, d], scale)` -> [rows, L, heads * d] is the prefill's or a decode step's attention.
        Returns the normed final hidden state of each row's last position, [rows, H]."""
        rows, length = input_ids.shape
        hidden = self.decoder.embed_tokens(input_ids)  # [rows, L, H]
        cos, sin = self.decoder.rotary_emb(hidden, position_ids)
        cos, sin = cos[:, None], sin[:, None]  # [rows, 1 (heads), L, head_dim]
        for index, (layer, (qkv, o, gate_up, down)) in enumerate(zip(self.decoder.layers, self.projections)):
            attention = layer.self_attn
            query, key, value = (part.reshape(rows, length, -1, attention.head_dim)
                                 for part in qkv(layer.input_layernorm(hidden)))
            if hasattr(attention, "q_norm"):  # Qwen3 normalises each head before the rotation
                query, key = attention.q_norm(query), attention.k_norm(key)
                query, key = _rotate(query.transpose(1, 2), cos, sin), _rotate(key.transpose(1, 2), cos, sin)
            else:  # one rotation of the query and key heads together
                query, key = _rotate(torch.cat([query, key], dim=2).transpose(1, 2), cos, sin).split(
                    [query.shape[2], key.shape[2]], dim=1)
            hidden = hidden + o(attend(index, query, key, value.transpose(1, 2), attention.scaling))[0]
            gate, up = gate_up(layer.post_attention_layernorm(hidden))
            hidden = hidden + down(layer.mlp.act_fn(gate) * up)[0]
        return self.decoder.norm(hidden[:, -1])

    def _attend(self, index: int, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        """A decode step's attention in layer `index`: the new key/value [A, kv_heads, 1, d] join the row's
        buffer; the query [A, heads, 1, d] attends to its prompt's keys and to its row's, in two flash-attention
        calls whose outputs are weighted by their share of the softmax mass (from their log-sum-exp). Query head
        h reads key/value head h // (heads / kv_heads) as in repeat_kv, without copies. Returns [A, 1, heads * d]."""
        keys, values = self.completions[index].append(key, value)
        rows, kv_heads, head_dim = query.shape[0], key.shape[1], query.shape[-1]
        group = query.shape[1] // kv_heads
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        # A kv head's query heads act as `group` query positions: [A, kv_heads, group, head_dim].
        query = query.reshape(rows, kv_heads, group, head_dim)
        own, own_lse = flash(query, keys, values, scale=scale)
        # The prompt part: each prompt's n rows (finished rows as zeros) as n * group query positions.
        prompts, n = self.prompt_mask.shape[0], self.n
        laid_out = query.new_zeros(prompts * n, kv_heads, group, head_dim).index_copy_(0, self.rows, query)
        laid_out = laid_out.view(prompts, n, kv_heads, group, head_dim).transpose(1, 2).reshape(
            prompts, kv_heads, n * group, head_dim)
        prefix, prefix_lse = flash(laid_out, self.prompt_keys[index], self.prompt_values[index],
                                   attn_mask=self.prompt_mask, scale=scale)
        prefix = prefix.view(prompts, kv_heads, n, group, head_dim).transpose(1, 2).reshape(
            prompts * n, kv_heads, group, head_dim)
        prefix_lse = prefix_lse.view(prompts, kv_heads, n, group).transpose(1, 2).reshape(prompts * n, kv_heads, group)
        prefix, prefix_lse = prefix[self.rows], prefix_lse[self.rows]
        # The prompt part's share of the softmax mass: exp(prefix_lse) / (exp(prefix_lse) + exp(own_lse)).
        share = torch.sigmoid(prefix_lse - own_lse)[..., None].to(query.dtype)
        return torch.lerp(own, prefix, share).reshape(rows, 1, -1)
