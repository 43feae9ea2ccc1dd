"""The vLLM server for `generator="vllm"`: its launcher (`vllm_launcher`) and the worker extension it loads into vLLM
(`vllm_worker_ext`, imported by the server's own environment, never by this package)."""
