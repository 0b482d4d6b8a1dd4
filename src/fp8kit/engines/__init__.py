"""Serving engines as checkers and evaluators of fp8kit's exports: each runs in its own virtual environment
(its pinned torch / transformers / compressed-tensors differ from the project's) in a subprocess.

``engines.vllm``: vLLM loads export folders unmodified, generates, and scores held-out token windows."""
