"""Every recipe under launch/configs runs one step on CPU with a tiny random model and the transformers
engine: its algorithm settings (KL, dual clip, dynamic sampling, overlong shaping, TIS, sentence rewards,
gradient checkpointing, a distillation teacher, tools) all execute. Model, data paths, lengths and batch sizes
are overridden to fit."""
import json
from pathlib import Path

import pytest

from launch.recipe import load_config
from launch.dist import DistInfo
from launch.train import run

CONFIGS = Path(__file__).resolve().parents[1] / "launch" / "configs"
RECIPES = sorted(p.name for p in CONFIGS.glob("*.yaml"))


@pytest.fixture(scope="module")
def recipe_data(tmp_path_factory, shared_data):
    from data.factqa import convert_factqa
    from data.rows import write_rows
    from data.synthetic import generate_rows
    from data.verifier import convert_verifier
    from rewards.corpus import build_index

    root = tmp_path_factory.mktemp("recipe_data")
    files = {"scifact_evidence": root / "evidence.jsonl", "verifier": root / "verifier.jsonl",
             "factqa_corpus": root / "factqa.jsonl"}
    write_rows(generate_rows(4, seed=0), files["scifact_evidence"])
    fixture = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "verifier_sample.jsonl"
    write_rows(convert_verifier(fixture)[:4], files["verifier"])
    write_rows(convert_factqa(shared_data / "factqa" / "nq_open_validation.json")[:4], files["factqa_corpus"])
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Paris is the capital of France. Line {i}."}) + "\n"
                              for i in range(50)))
    index = build_index(corpus, root / "index")
    from data.arithmetic import generate_rows as arithmetic_rows
    from rollout.search import build_index as build_search_index
    files["arithmetic"] = root / "arithmetic.jsonl"
    write_rows(arithmetic_rows(4, seed=0), files["arithmetic"])
    documents = root / "scifact_corpus.jsonl"
    documents.write_text("".join(json.dumps({"doc_id": i, "title": "T", "abstract": [f"Claim {i} holds.", "Not so."]})
                                 + "\n" for i in range(5)))
    build_search_index(documents, root / "search_index")
    return files, index, root / "search_index"


def _data_source(recipe: str) -> str:
    return {"verifier_dapo.yaml": "verifier", "verifier_sft.yaml": "verifier",
            "corpus_grpo.yaml": "factqa_corpus", "tools_sft.yaml": "arithmetic",
            "tools_grpo.yaml": "arithmetic"}.get(recipe, "scifact_evidence")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_one_step(recipe, recipe_data, tiny_model_dir, tmp_path):
    files, index, search_index = recipe_data
    rows = files[_data_source(recipe)]
    base = load_config(CONFIGS / recipe)
    overrides = [f"model.name_or_path={tiny_model_dir}", "init_from=null", f"data.train_files=['{rows}']",
                 "data.eval_files=[]", "trainer.eval_every=0", "rollout.engine=hf", "rollout.max_new_tokens=8",
                 "trainer.steps=1",
                 "trainer.save_every=0", f"trainer.out_dir={tmp_path}", "trainer.run_name=r",
                 "model.param_dtype=float32", "trainer.sft_max_len=2048", "data.max_prompt_tokens=2048"]
    if base.reward.corpus_index is not None:
        overrides.append(f"reward.corpus_index={index}")
    if base.rollout.search_index is not None:
        overrides.append(f"rollout.search_index={search_index}")
    if base.algorithm.teacher is not None:  # the tiny model teaches itself: the teacher pass runs, its signal is 0
        overrides.append(f"algorithm.teacher={tiny_model_dir}")
    if base.stage == "rl":
        overrides += ["trainer.prompts_per_step=1", f"trainer.micro_batch_size={base.rollout.n}"]
        if base.algorithm.overlong_cache_len:
            overrides.append("algorithm.overlong_cache_len=4")
    else:
        overrides += ["trainer.sft_batch_size=2", "trainer.micro_batch_size=2"]
    cfg = load_config(CONFIGS / recipe, overrides)
    run(cfg, DistInfo())
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["grad_norm"] == metrics[0]["grad_norm"]
    assert (tmp_path / "r" / "checkpoints" / "step_1" / "COMPLETE").exists()
