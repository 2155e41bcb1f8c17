"""JSONL → Megatron ``.bin/.idx`` preprocessing (the engine behind tools/preprocess_data.py).

``text`` splits documents into sequences, ``reader`` streams input lines in byte batches,
``encode`` turns a batch into token arrays (in worker processes), ``pipeline`` orders the
results and writes the datasets. Nothing here imports torch.
"""
