"""Rollout: generation engines behind one interface (engine.py: `Completion`, `Engine`), the transformers
engine (hf_engine.py: `HFEngine`), the colocated vLLM engine (vllm_engine.py: `VLLMEngine`, imported on
demand since vLLM is optional) and the bucketed trainer-to-engine weight sync (sync.py: `sync_weights`)."""
from rollout.engine import Completion, Engine

__all__ = ["Completion", "Engine"]
