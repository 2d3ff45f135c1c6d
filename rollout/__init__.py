"""Rollout: generation engines behind one interface (engine.py: `Completion`, `Engine`), the transformers engine
(hf_engine.py: `HFEngine`, with its CPU fast path in cpu_decode.py), the colocated vLLM engine (vllm_engine.py:
`VLLMEngine`, vLLM being optional) and the bucketed trainer-to-engine weight sync (sync.py: `sync_weights`)."""
