"""Tokenizer implementations that need more than a few lines (see megatron_ru/data/tokenizer.py)."""
