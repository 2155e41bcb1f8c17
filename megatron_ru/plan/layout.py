"""One candidate layout of a training run: the parallel degrees, batch shape and memory-saving
choices the planner predicts memory and time for."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ru.parallel.topology import ParallelLayout, micro_batches_per_step

PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE = ("none", "selective", "full")
CP_COMM = ("p2p", "a2a")


@dataclass(frozen=True)
class Layout:
    """TP x CP x PP x DP ranks, micro/global batch in samples, sequence length in tokens (the whole sample's;
    each of a sample's CP ranks holds 1/CP of its tokens)."""
    tp: int
    pp: int
    dp: int
    micro_batch: int
    global_batch: int
    seq_length: int
    sequence_parallel: bool = False
    recompute: str = "none"
    zero_stage: int = 0
    precision: str = "bf16"
    #: with recompute "full": Megatron's --recompute-method (uniform chunks / block: the first layers of a stage)
    #: and --recompute-num-layers, and --distribute-saved-activations (each chunk's input split over TP)
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    distribute_saved_activations: bool = False
    #: context parallelism: the ranks one sample's sequence is split over, and their exchange (ring or all-to-all)
    cp: int = 1
    cp_comm: str = "p2p"

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        for name in ("tp", "pp", "dp", "micro_batch", "global_batch", "seq_length", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name} must be >= 1, got {getattr(self, name)}")
        if self.cp_comm not in CP_COMM:
            raise ValueError(f"cp_comm must be one of {CP_COMM}, got {self.cp_comm!r}")
        if self.cp > 1:
            from megatron_ru.parallel.context import check_sequence
            check_sequence(self.seq_length, self.cp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def rank_tokens(self) -> int:
        """Tokens of one sample that one rank holds: the sequence / CP."""
        return self.seq_length // self.cp

    @property
    def data_axis(self) -> int:
        """DeepSpeed's data-parallel size: the ranks holding the same weights, DP x CP (gradients reduced and
        ZeRO partitioned over them)."""
        return self.dp * self.cp

    @property
    def grid(self) -> ParallelLayout:
        """The TP x DP x PP grid this run plan is laid on (the role below it: ranks and groups)."""
        return ParallelLayout(self.world_size, self.tp, self.pp, self.cp)

    @classmethod
    def on(cls, grid: ParallelLayout, **run: object) -> "Layout":
        """A run plan on ``grid``: its TP, PP and DP, and the batch, precision and memory choices ``run``."""
        return cls(tp=grid.tp, pp=grid.pp, dp=grid.dp, cp=grid.cp, **run)  # type: ignore[arg-type]

    @property
    def num_micro_batches(self) -> int:
        """Micro batches per data-parallel rank per iteration (gradient accumulation steps)."""
        return micro_batches_per_step(self.global_batch, self.micro_batch, self.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_length

    @property
    def mixed_precision(self) -> bool:
        return self.precision != "fp32"

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the model's parameters, gradients and activations."""
        return 4 if self.precision == "fp32" else 2

    def flags(self) -> list[str]:
        """The pretrain_gpt.py flags of this layout."""
        out = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
               "--micro-batch-size", str(self.micro_batch), "--global-batch-size", str(self.global_batch),
               "--seq-length", str(self.seq_length), "--zero-stage", str(self.zero_stage)]
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp)] + (["--cp-comm-type", "a2a"] if self.cp_comm == "a2a"
                                                                 else [])
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.recompute != "none":
            out += ["--recompute-granularity", self.recompute]
        if self.recompute == "full" and (self.recompute_method, self.recompute_num_layers) != ("uniform", 1):
            out += ["--recompute-method", self.recompute_method, "--recompute-num-layers",
                    str(self.recompute_num_layers)]
        if self.recompute == "full" and self.distribute_saved_activations:
            out.append("--distribute-saved-activations")
        if self.precision != "fp32":
            out.append(f"--{self.precision}")
        return out

    def short(self) -> str:
        """``TP4 PP8 DP1 mb1 SP recompute ZeRO1``-style label."""
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}"]
        if self.cp > 1:
            parts.append(f"CP{self.cp}" + (" a2a" if self.cp_comm == "a2a" else ""))
        parts.append(f"mb{self.micro_batch}")
        if self.sequence_parallel:
            parts.append("SP")
        if self.recompute != "none":
            parts.append("recompute" if self.recompute == "full" else "selective")
        parts.append(f"ZeRO{self.zero_stage}")
        return " ".join(parts)
