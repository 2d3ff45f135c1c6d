"""Chat formatting: a list of chat messages -> the prompt's token ids, through the tokenizer's chat template.

Prompts are tokenised exactly once, here; the ids then travel unchanged from rollout to loss (re-tokenising
decoded text does not round-trip, and Qwen3's template is not prefix-preserving across turns). A model's
thinking output (`<think>...</think>`) is part of the completion ids and is never touched."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence


def render_prompt(tokenizer, messages: Sequence[Mapping[str, str]], tools: list[dict] | None = None) -> list[int]:
    """The prompt's token ids: the chat template on `messages` (a data row's "prompt") and the generation prompt;
    `tools`: the JSON schemas of the row's tools (rollout/tools.py), for templates that describe them."""
    if isinstance(messages, (str, bytes)) or len(messages) == 0:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.200}")
    for index, message in enumerate(messages):
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"message {index} must be a dict with string 'role' and 'content', got {message!r:.200}")
    encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                            tools=tools or None)
    return [int(token) for token in encoded["input_ids"]]


def prefix_decoder(tokenizer) -> Callable[[Sequence[int]], list[str]]:
    """ids -> [decode(ids[:k]) for k in 0..len(ids)] (special tokens skipped): what grpo.alignment needs to
    find each token's character span by incremental decoding."""
    return lambda ids: tokenizer.batch_decode([ids[:k] for k in range(len(ids) + 1)], skip_special_tokens=True)
