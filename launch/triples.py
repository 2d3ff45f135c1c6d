"""The factqa_corpus reward as a recipe's `reward` section configures it: the triple extractor (the rule one, or a
local causal LM) and the co-occurrence window definition.

Rewards know no model (docs/conventions.md, "Where code lives"), so the model-based extractor is assembled
here: the LM is loaded through models/, decoded greedily by rollout.hf_engine.HFEngine, and handed to
rewards.triples.ModelTripleExtractor as a plain `generate_fn(prompt) -> str`, which takes the first valid
triple of the output (as the corpus paper's fine-tuned 0.5B extractor does). The start-up code calls
`install_factqa_reward(cfg.reward)` once the corpus index is known; with the defaults (rule extractor, the
engine's counts) the registered `factqa_corpus` already is that reward and nothing is replaced.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from launch.schema import RewardConfig
from launch.config import ConfigError

EXTRACTORS = ("rule", "model")


def model_generate_fn(name_or_path: str | None, *, max_new_tokens: int = 48, device: str = "cpu",
                      dtype: str = "float32") -> Callable[[str], str]:
    """Greedy continuation of a plain-text prompt (no chat template: the extraction prompt is few-shot text)
    by a local causal LM; decoding stops at the next few-shot example ("\\nSentence:") or max_new_tokens."""
    import torch

    from models import load_model, load_tokenizer
    from rollout.hf_engine import HFEngine

    tokenizer = load_tokenizer(name_or_path)
    model = load_model(name_or_path, dtype=getattr(torch, dtype), device=device).eval().requires_grad_(False)
    # one torch thread: token-by-token decoding of one sequence gains nothing from more (rollout.engine.torch_threads)
    engine = HFEngine(model, tokenizer, shared=False, num_threads=1)

    def generate(prompt: str) -> str:
        ids = tokenizer(prompt)["input_ids"]
        completion = engine.generate([ids], n=1, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0,
                                     top_k=0, stop=["\nSentence:"], seed=0)[0]
        return completion.text

    return generate


def check_reward_config(reward: RewardConfig) -> None:
    """ConfigError naming the key for a triple extractor or window definition that does not exist."""
    from rewards.cooccurrence import SEMANTICS

    if reward.triple_extractor not in EXTRACTORS:
        raise ConfigError(f"reward.triple_extractor: {reward.triple_extractor!r} is not one of {', '.join(EXTRACTORS)}")
    if reward.cooccurrence_semantics not in SEMANTICS:
        raise ConfigError(f"reward.cooccurrence_semantics: {reward.cooccurrence_semantics!r} is not one of "
                          f"{', '.join(SEMANTICS)}")
    if reward.triple_extractor_max_new_tokens < 1:
        raise ConfigError(f"reward.triple_extractor_max_new_tokens must be at least 1, got "
                          f"{reward.triple_extractor_max_new_tokens}")


def factqa_reward_for(reward: RewardConfig, *, device: str = "cpu") -> Callable[..., dict] | None:
    """The factqa_corpus reward the config asks for, or None when it is the registered default (rule
    extractor, engine counts). Needs reward.corpus_index (or $NANOGRPO_CORPUS_INDEX) for anything else."""
    from rewards.factqa import INDEX_ENV, make_factqa_reward
    from rewards.triples import ModelTripleExtractor

    check_reward_config(reward)
    if reward.triple_extractor == "rule" and reward.cooccurrence_semantics == "engine":
        return None
    index_path = reward.corpus_index or os.environ.get(INDEX_ENV)
    if not index_path:
        raise ConfigError("reward.triple_extractor / reward.cooccurrence_semantics need reward.corpus_index "
                          "(build one with: python -m rewards.corpus build --input corpus.jsonl --out DIR)")
    from rewards.corpus import CorpusIndex

    extractor = None
    if reward.triple_extractor == "model":
        extractor = ModelTripleExtractor(model_generate_fn(
            reward.triple_extractor_model, max_new_tokens=reward.triple_extractor_max_new_tokens, device=device))
    return make_factqa_reward(CorpusIndex(index_path, semantics=reward.cooccurrence_semantics), extractor)


def install_factqa_reward(reward: RewardConfig, *, device: str = "cpu") -> bool:
    """Register the configured factqa_corpus reward in place of the default; True when one was installed."""
    import rewards

    configured = factqa_reward_for(reward, device=device)
    if configured is None:
        return False
    rewards.register("factqa_corpus", configured, overwrite=True)
    return True
