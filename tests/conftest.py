"""Shared test fixtures: where the read-only reference data lives, and torch settings for exact CPU math."""
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The public reference data (SciFact, factual QA) in a "shared/data" directory beside the checkout, where CI lays
# a copy; NANOGRPO_SHARED_DATA points elsewhere.
SHARED_DATA = Path(os.environ.get("NANOGRPO_SHARED_DATA", ROOT.parent / "shared" / "data"))

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "scifact" / "corpus.jsonl").exists():
        raise FileNotFoundError(f"reference data not found at {SHARED_DATA}; set NANOGRPO_SHARED_DATA")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved as an HF directory with the embedded SmolLM2 tokenizer (its chat template)."""
    from models import load_tokenizer
    from tiny import tiny_model

    directory = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama", seed=0).save_pretrained(directory)
    load_tokenizer(None).save_pretrained(directory)
    return directory
