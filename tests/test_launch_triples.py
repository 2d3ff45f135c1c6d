"""The factqa_corpus reward as the recipe configures it (launch.reward_pool): bad keys named, the default left alone,
the per-document window definition, and the model-based triple extractor on the embedded SmolLM2-135M."""
import json

import pytest

import rewards
from grpo.config import ConfigError, RewardConfig
from launch.reward_pool import factqa_reward_for, model_generate_fn
from rewards.corpus import build_index
from rewards.factqa import factqa_corpus_reward
from rewards.triples import ModelTripleExtractor, parse_triple

COMPLETION = "<think>Alpha founded Beta.</think>\n<answer>Beta</answer>"


@pytest.fixture(scope="module")
def repeated_index(tmp_path_factory):
    directory = tmp_path_factory.mktemp("repeated")
    corpus = directory / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": "Alpha founded Beta."}) + "\n" for _ in range(25)))
    return build_index(corpus, directory / "index")


@pytest.fixture
def restore_registry():
    yield
    rewards.register("factqa_corpus", factqa_corpus_reward, overwrite=True)


@pytest.mark.parametrize("override, key", [({"triple_extractor": "neural"}, "reward.triple_extractor"),
                                           ({"cooccurrence_semantics": "nearby"}, "reward.cooccurrence_semantics"),
                                           ({"triple_extractor_max_new_tokens": 0}, "triple_extractor_max_new_tokens")])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        factqa_reward_for(RewardConfig(**override))


def test_defaults_keep_the_registered_reward(monkeypatch):
    monkeypatch.delenv("NANOGRPO_CORPUS_INDEX", raising=False)
    assert factqa_reward_for(RewardConfig()) is None
    with pytest.raises(ConfigError, match="reward.corpus_index"):
        factqa_reward_for(RewardConfig(cooccurrence_semantics="document"))


def test_document_semantics_from_the_config(repeated_index, restore_registry):
    # 25 three-word documents: the engine's range for every copy but the first reaches the previous copy's
    # "Beta" and crosses a separator (count 1 -> -0.1); per document all 25 count (>= 20 -> +0.1).
    engine = rewards.compute_score("factqa_corpus", COMPLETION, "Beta", {"corpus_index": str(repeated_index)})
    assert engine["sentences"][0][2] == -0.1
    configured = factqa_reward_for(RewardConfig(corpus_index=str(repeated_index), cooccurrence_semantics="document"))
    rewards.register("factqa_corpus", configured, overwrite=True)
    document = rewards.compute_score("factqa_corpus", COMPLETION, "Beta")
    assert document["sentences"][0][2] == 0.1 and document["score"] == engine["score"] == 3.0


def test_model_extractor_on_the_embedded_model(repeated_index, restore_registry):
    generate = model_generate_fn(None, max_new_tokens=16)
    extractor = ModelTripleExtractor(generate)
    prompt = extractor.prompt("Alpha founded Beta.")
    output = generate(prompt)
    assert isinstance(output, str) and extractor.extract("Alpha founded Beta.") == parse_triple(output)  # greedy
    config = RewardConfig(corpus_index=str(repeated_index), triple_extractor="model",
                          triple_extractor_max_new_tokens=16)
    rewards.register("factqa_corpus", factqa_reward_for(config), overwrite=True)
    result = rewards.compute_score("factqa_corpus", COMPLETION, "Beta")
    # two scored sentences (think, answer); each is queried only when the 135M model wrote a valid triple
    assert result["sentence_count"] == 2.0 and 0 <= result["sentences_queried"] <= 2
    assert result["judge"] == 2.0 and result["format"] == 1.0
