"""The command that continues from a checkpoint a conversion wrote, for its layout.

``convert_checkpoint.py`` prints it after ``import-hf`` and ``reshard`` (``continue with:``) and puts
it in its JSON report (``continue_command``). The launcher matches the layout: TP × PP ranks hold one
copy of the model, so a checkpoint at TP × PP > 1 needs at least that many (``torchrun
--nproc-per-node TP·PP``; any multiple of it adds data parallelism). Everything the checkpoint
records (the model's flags, its tokenizer) is left to ``--use-checkpoint-args``; what only the user
knows is one placeholder, ``DATA_PREFIX``.
"""
from __future__ import annotations

import shlex
from typing import Any

#: the one word of a printed command that the user replaces: the dataset prefix to train on
DATA_PLACEHOLDER = "DATA_PREFIX"


def launcher(ranks: int, script: str = "pretrain_gpt.py") -> list[str]:
    """``python SCRIPT`` for one rank, ``torchrun --nproc-per-node N SCRIPT`` for more."""
    return ["python", script] if ranks == 1 else ["torchrun", "--nproc-per-node", str(ranks), script]


def _layout_note(tp: int, pp: int) -> str:
    ranks = tp * pp
    if ranks == 1:
        return "TP 1 x PP 1: one rank holds the model (N ranks under torchrun train with data parallelism N)"
    return (f"TP {tp} x PP {pp}: {ranks} ranks hold one copy of the model; a multiple of {ranks} adds data "
            "parallelism")


def continue_pretraining(save: str, tp: int, pp: int, max_positions: int, has_tokenizer: bool) -> dict[str, Any]:
    """After ``import-hf``: continued pretraining from the imported weights (``--finetune``: iteration
    0, a fresh optimizer), with a short schedule to edit and validation on 1 % of the data."""
    seq = min(int(max_positions), 4096)
    argv = launcher(tp * pp) + [
        "--load", save, "--use-checkpoint-args", "--finetune",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "1000", "--lr", "3e-5", "--min-lr", "3e-6", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "100", "--clip-grad", "1.0",
        "--data-path", DATA_PLACEHOLDER, "--split", "990,10,0", "--eval-interval", "500", "--eval-iters", "10",
        "--save", save.rstrip("/") + "-cpt", "--save-interval", "500"]
    note = (f"{_layout_note(tp, pp)}; the model's flags and tokenizer come from the checkpoint; replace "
            f"{DATA_PLACEHOLDER} with a dataset tokenized by {save.rstrip('/')}/tokenizer")
    if not has_tokenizer:
        argv += ["--tokenizer-type", "TOKENIZER_TYPE", "--tokenizer-model", "TOKENIZER_MODEL"]
        note = (f"{_layout_note(tp, pp)}; the model's flags come from the checkpoint, which has no tokenizer: "
                f"replace {DATA_PLACEHOLDER}, TOKENIZER_TYPE and TOKENIZER_MODEL")
    return {"note": note, "command": shlex.join(argv)}


def resume_resharded(save: str, tp: int, pp: int, optimizer_state: bool) -> dict[str, Any]:
    """After ``reshard``: the run goes on at the new layout, from the checkpoint's iteration."""
    argv = launcher(tp * pp) + ["--load", save, "--use-checkpoint-args", "--tensor-model-parallel-size", str(tp),
                                "--pipeline-model-parallel-size", str(pp)]
    if optimizer_state:
        what = ("with the rest of the run's flags, without --finetune: it resumes at the checkpoint's iteration "
                "with its optimizer state (--finetune would restart at iteration 0 from the weights only)")
    else:
        what = ("with the rest of the run's flags: the checkpoint holds weights only, so the run goes on at its "
                "iteration with a fresh optimizer (with --finetune: from iteration 0)")
    return {"note": f"{_layout_note(tp, pp)}; {what}", "command": shlex.join(argv) + " ..."}
