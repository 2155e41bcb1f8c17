"""The one package that imports DeepSpeed (checked by the ``import-linter`` contracts in ``.importlinter``).

Everything else asks these modules and never ``import deepspeed``:

* :mod:`~megatron_ru.deepspeed_bridge.engine` — ``deepspeed.comm`` over our process group,
  ``deepspeed.initialize``, DeepSpeed's start-up output, the engine state the loop reports;
* :mod:`~megatron_ru.deepspeed_bridge.pipeline` — our plain layer list as a ``PipelineModule`` over our
  topology, and DeepSpeed's balanced partition of layers into stages;
* :mod:`~megatron_ru.deepspeed_bridge.masters` — the fp32 master weights and optimizer state DeepSpeed keeps
  for each parameter (``_hp_mapping``), the engine's counters and loss scaler, a hook after the inner step;
* :mod:`~megatron_ru.deepspeed_bridge.zero_files` — what DeepSpeed's checkpoint files hold: the classes they
  pickle and the layout of its ZeRO optimizer files;
* :mod:`~megatron_ru.deepspeed_bridge.compat` — every patch of DeepSpeed's internals, with the versions tested.

It sits at the bottom of the layers (it imports only ``megatron_ru.utils``, torch and DeepSpeed), so the
model, parallel state, checkpointing and training code can all ask it. Its name is not ``deepspeed``: a
folder of that name inside ``megatron_ru/`` would be imported instead of DeepSpeed by any process that runs
a file of ``megatron_ru/`` as a script (``python megatron_ru/launch.py`` puts ``megatron_ru/`` first on
``sys.path``). DeepSpeed itself is imported inside the functions that need it, so importing megatron_ru
(the planner, the converters, inference) does not load it.
"""
