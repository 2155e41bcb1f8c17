"""ParallelConfig: Megatron flag names, launcher-compat flags, one-shot validation."""
import pytest

from megatron_ru.config.base import parse_configs, validate_all
from megatron_ru.config.parallel import ParallelConfig


def _parse(argv):
    return parse_configs([ParallelConfig], argv)[ParallelConfig]


def test_defaults_and_megatron_flags():
    cfg = _parse([])
    sizes = (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.sequence_parallel)
    assert sizes == (1, 1, False)
    assert cfg.distributed_backend == "auto" and cfg.backend is None and cfg.distributed_timeout_minutes == 10
    cfg = _parse(["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                  "--distributed-backend", "gloo", "--distributed-timeout-minutes", "0.5"])
    sizes = (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.sequence_parallel)
    assert sizes == (4, 2, True)
    assert cfg.backend == "gloo" and cfg.distributed_timeout_minutes == 0.5
    validate_all([cfg])


@pytest.mark.parametrize("argv,use_mpi,local_rank", [(["--local_rank=3"], False, 3), (["--local-rank", "3"], False, 3),
                                                     (["--use-mpi"], True, None),
                                                     (["--use-mpi", "--local_rank", "0"], True, 0)])
def test_launcher_compat_flags_are_accepted(argv, use_mpi, local_rank):
    """The deepspeed launcher's --local_rank and Megatron-DeepSpeed's --use-mpi parse (both
    spellings) and change nothing else: the same config as no flags at all, and it validates."""
    cfg = _parse(argv)
    assert (cfg.use_mpi, cfg.local_rank) == (use_mpi, local_rank)
    default = _parse([])
    others = {k: v for k, v in vars(cfg).items() if k not in ("use_mpi", "local_rank")}
    assert others == {k: v for k, v in vars(default).items() if k not in ("use_mpi", "local_rank")}
    assert cfg.problems() == []
    validate_all([cfg])


def test_unknown_backend_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        _parse(["--distributed-backend", "mpi"])


def test_all_problems_reported_at_once_naming_flags():
    cfg = ParallelConfig(tensor_model_parallel_size=0, pipeline_model_parallel_size=0, sequence_parallel=True,
                         distributed_timeout_minutes=0)
    with pytest.raises(ValueError) as err:
        validate_all([cfg])
    msg = str(err.value)
    assert "(4 problems)" in msg
    for fragment in ("--tensor-model-parallel-size must be >= 1 (got 0)",
                     "--pipeline-model-parallel-size must be >= 1 (got 0)",
                     "--sequence-parallel needs --tensor-model-parallel-size > 1 (got 0)",
                     "--distributed-timeout-minutes must be > 0 (got 0)"):
        assert fragment in msg


def test_sequence_parallel_at_tp_1_is_not_a_problem_of_the_schema():
    """TP 1 turns it off at parse time (tests/unit/test_config_validation.py)."""
    assert ParallelConfig(sequence_parallel=True).problems() == []
    assert ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True).problems() == []
