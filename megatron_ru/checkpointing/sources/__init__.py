"""The parts of :class:`~megatron_ru.checkpointing.reader.CheckpointReader`, one per source of tensors.

* :mod:`.common`: one checkpoint directory's files (loaded, memory-mapped one layer at a time, checked
  against ``metadata.json``), the shape check of a TP shard, what every optimizer source shares;
* :mod:`.weights`: the weights by file format (``layer_*-model_*`` files: ours and DeepSpeed's at PP > 1;
  ``mp_rank_*`` files: DeepSpeed's at PP = 1);
* :mod:`.optim_layers`: the layer format's optimizer state (per-layer files, or training's data-parallel
  fragments);
* :mod:`.optim_zero`: DeepSpeed's optimizer state (ZeRO 0 in the ``mp_rank`` files, ZeRO 1's flat partitions).
"""
