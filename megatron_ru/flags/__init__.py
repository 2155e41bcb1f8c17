"""The command line of ``pretrain_gpt.py``: the flags parsed into the config schema (:mod:`megatron_ru.config`),
validated against the data files, the layout and a checkpoint (``arguments``, ``checkpoint_args``), Megatron's
flag vocabulary (``megatron_flags``, ``megatron_flags_rest``) and the DeepSpeed config they make
(``deepspeed``). It sits above what it reads (checkpointing, data, parallel) and below what reads it (plan,
training): .importlinter's layers contract.
"""
