"""Inference at any TP and PP: the stage runner, sampling, batched generation with a KV cache
(``tools/generate.py``; see docs/inference.md)."""
