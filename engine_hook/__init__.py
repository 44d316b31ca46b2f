"""Engine integrations (vLLM v1 KV connector and an engine-agnostic API).

torch and vllm are imported only inside the submodules that need them.
"""
