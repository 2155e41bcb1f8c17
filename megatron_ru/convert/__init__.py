"""Checkpoint conversion: Hugging Face import/export, LoRA export, tokenizer files, staged output directories."""
