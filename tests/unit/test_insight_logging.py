"""Run insight, single process: the ETA, the progress line's new fields, one scalar set for every sink,
wandb refused by name when missing, the banner's parameter arithmetic, and the routing of other
libraries' output (prints, a library logger, warnings) into our logger."""
import logging
import sys
import warnings

import pytest

from megatron_ru.config.training import LoggingConfig
from megatron_ru.parallel.topology import ParallelLayout
from megatron_ru.training.banner import combine_counts
from megatron_ru.training.metrics import (EtaClock, MetricsWriter, eval_scalars, format_train_line,
                                          train_scalars)
from megatron_ru.utils.logging import forward_logger, route_warnings, stdout_to_log


def _rec(it, **kw):
    rec = dict(iteration=it, train_iters=100, consumed_samples=8 * it, consumed_tokens=8 * 64 * it,
               elapsed_ms=12.5, lr=3e-4, global_batch_size=8, lm_loss=1.0 / it, loss_scale=1.0, grad_norm=0.75,
               skipped_iterations=0, tokens_per_sec=1234.5, tflops_per_device=0.01, mfu=None,
               memory_label="peak RSS", peak_memory_mib=100.0, eta_seconds=None)
    rec.update(kw)
    return rec


def test_eta_leaves_out_the_first_interval_and_counts_to_train_iters():
    eta = EtaClock(train_iters=100)
    assert eta.update(10, now=1000.0) is None  # first logged interval: warm-up, no estimate
    assert eta.update(20, now=1020.0) == pytest.approx(2.0 * 80)  # 20 s / 10 iterations, 80 left
    assert eta.update(30, now=1030.0) == pytest.approx(30.0 / 20 * 70)  # mean since iteration 10
    assert eta.update(100, now=1100.0) == 0.0


def test_progress_line_has_consumed_tokens_and_eta():
    line = format_train_line(_rec(20, eta_seconds=3725.4))
    assert "consumed tokens:          10240" in line and line.endswith("| ETA: 1:02:05 |")
    first = format_train_line(_rec(10))
    assert "ETA" not in first and "consumed tokens:" in first


def test_scalars_are_computed_once_for_every_sink(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Recorder:
        def __init__(self):
            self.got = []

        def write(self, scalars):
            self.got.append(scalars)

        def close(self):
            pass

    cfg = LoggingConfig(metrics_file=None, tensorboard_dir=str(tmp_path / "tb"))
    w = MetricsWriter(cfg, active=True)
    rec = Recorder()
    w._sinks.append(rec)
    w.log_train(_rec(5, mfu=0.25))
    w.log_eval(5, 0.5, text={"val_bits_per_byte": 1.5, "val_bits_per_char": 2.5})
    w.close()
    train, ev = rec.got
    assert train == train_scalars(_rec(5, mfu=0.25))
    assert train.values["train/consumed_tokens"] == 8 * 64 * 5 and train.values["train/mfu"] == 0.25
    assert "train/eta_seconds" not in train.values  # not a scalar; None values are left out too
    assert train.step_of("train/lm_loss_vs_samples") == 40 and train.step_of("train/lm_loss") == 5
    assert set(ev.values) == {"validation/loss", "validation/ppl", "validation/bits_per_byte",
                              "validation/bits_per_char"}
    acc = EventAccumulator(cfg.tensorboard_dir)
    acc.Reload()
    tb = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    expected = {tag: [(s.step_of(tag), pytest.approx(v, rel=1e-6))] for s in (train, ev) for tag, v in s.values.items()}
    assert tb == expected


def test_eval_scalars_without_text():
    s = eval_scalars({"split": "validation", "iteration": 3, "val_loss": 2.0, "val_ppl": 7.39})
    assert s.values == {"validation/loss": 2.0, "validation/ppl": 7.39} and s.iteration == 3


def test_wandb_refused_by_name_when_not_installed(monkeypatch, tmp_path):
    from megatron_ru.flags.arguments import parse_arguments
    from tests.integration._train_helpers import make_corpus, tiny_argv
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    problems = LoggingConfig(wandb_project="ru-gpt").problems()
    assert problems == ["--wandb-project ru-gpt needs the wandb package: pip install wandb "
                        "(or leave out that flag)"]
    argv = tiny_argv(make_corpus(str(tmp_path)), str(tmp_path / "cache"), extra=["--wandb-project", "ru-gpt"])
    with pytest.raises(ValueError, match="--wandb-project ru-gpt needs the wandb package: pip install wandb"):
        parse_arguments(argv, world_size=1, device_type="cpu")
    cfg = LoggingConfig(wandb_exp_name="run13b")  # any W&B flag, not only --wandb-project, imports wandb
    with pytest.raises(ValueError, match="pip install wandb"):
        MetricsWriter(cfg, active=True)
    MetricsWriter(cfg, active=False)  # ranks that do not log never import it
    # a fork's job script gives a run name and id but no project: the same refusal names what it gave
    assert LoggingConfig(wandb_exp_name="run13b", wandb_id="abc123").problems() == [
        "--wandb-exp-name run13b --wandb-id abc123 needs the wandb package: pip install wandb "
        "(or leave out those flags)"]


def test_wandb_project_from_the_flag_then_the_environment_then_the_default():
    from megatron_ru.training.wandb_writer import wandb_project
    assert wandb_project("ru-gpt", {"WANDB_PROJECT": "env"}) == ("ru-gpt", "--wandb-project")
    assert wandb_project(None, {"WANDB_PROJECT": "env"}) == ("env", "WANDB_PROJECT")
    assert wandb_project(None, {"WANDB_PROJECT": ""}) == (
        "uncategorized", "no --wandb-project nor WANDB_PROJECT: W&B's default")
    assert wandb_project(None, {}) == ("uncategorized", "no --wandb-project nor WANDB_PROJECT: W&B's default")


@pytest.mark.parametrize("flags", [{"wandb_exp_name": "run13b"}, {"wandb_id": "abc123"},
                                   {"wandb_save_dir": "wb"}, {"wandb_project": "p"}])
def test_any_wandb_flag_starts_the_run(flags, monkeypatch):
    monkeypatch.setattr("megatron_ru.config.training.wandb_installed", lambda: True)
    cfg = LoggingConfig(**flags)
    assert cfg.wandb_requested and cfg.problems() == []
    assert not LoggingConfig().wandb_requested


def test_parameter_counts_sum_one_replica_in_megatron_rank_order():
    tp, dp, pp = 2, 2, 2
    grid = ParallelLayout(tp * dp * pp, tp, pp)  # rank order: tests/unit/test_state_topology.py
    # (held, counted once, counted trainable): stage 0 holds 100 per rank (TP rank 1 counts only its
    # shard, 90), stage 1 holds 120 (of which a tied copy of 20 it does not count)
    rows = []
    for r in range(8):
        t, p = grid.coord(r).tp, grid.coord(r).pp
        rows.append((100, 100 if t == 0 else 90, 50) if p == 0 else (120, 100 if t == 0 else 90, 60))
    counts = combine_counts(rows, tp, dp, pp)
    assert counts.total == (100 + 90) + (100 + 90)  # DP replicas not added
    assert counts.trainable == 4 * 50 + 0 + 2 * 60 - 2 * 50
    assert counts.per_rank == (100, 120)


@pytest.fixture
def records(monkeypatch):
    """Records reaching the package logger at any level (it does not propagate to the root)."""
    monkeypatch.setenv("MEGATRON_RU_LOG_LEVEL", "DEBUG")  # get_logger re-reads it
    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append((record.name, record.levelno, record.getMessage()))

    root = logging.getLogger("megatron_ru")
    handler, level = Keep(), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield got
    root.removeHandler(handler)
    root.setLevel(level)


def test_prints_inside_the_block_become_debug_records(records, capsys):
    log = logging.getLogger("megatron_ru.deepspeed")
    with stdout_to_log(log):
        print("SEED_LAYERS=False BASE_SEED=1234 SEED_FN=None")
        print("stage=0 layers=3\n     0: EmbeddingLayer", end="")  # the last line has no newline yet
    print("after the block")
    assert capsys.readouterr().out == "after the block\n"
    assert records == [("megatron_ru.deepspeed", logging.DEBUG, "SEED_LAYERS=False BASE_SEED=1234 SEED_FN=None"),
                       ("megatron_ru.deepspeed", logging.DEBUG, "stage=0 layers=3"),
                       ("megatron_ru.deepspeed", logging.DEBUG, "     0: EmbeddingLayer")]


def test_a_library_logger_goes_through_ours(records, capsys, monkeypatch):
    lib = logging.getLogger("FakeSpeed")
    lib.addHandler(logging.StreamHandler(sys.stdout))  # what DeepSpeed's logger does
    lib.setLevel(logging.WARNING)
    lib.propagate = False
    monkeypatch.setenv("RANK", "0")
    forward_logger("FakeSpeed")
    forward_logger("FakeSpeed")  # idempotent: one handler
    assert len(lib.handlers) == 1 and lib.level == logging.DEBUG
    lib.info("config dump")
    lib.warning("a warning")
    lib.error("an error")
    monkeypatch.setenv("RANK", "3")
    lib.warning("a warning")
    assert capsys.readouterr().out == ""
    assert records == [("megatron_ru.fakespeed", logging.DEBUG, "config dump"),
                       ("megatron_ru.fakespeed", logging.WARNING, "a warning"),
                       ("megatron_ru.fakespeed", logging.ERROR, "an error"),
                       ("megatron_ru.fakespeed", logging.DEBUG, "a warning")]  # rank 3: the same warning
    monkeypatch.setenv("MEGATRON_RU_LOG_LEVEL", "INFO")
    forward_logger("FakeSpeed")
    assert lib.level == logging.WARNING  # its info lines are not even made at our default level
    lib.handlers.clear()


def test_warnings_become_records_deprecations_at_debug_once(records, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "warnoptions", [])
    with warnings.catch_warnings():
        route_warnings()
        for _ in range(3):
            warnings.warn("`all_gather_into_tensor` is deprecated", FutureWarning)
            warnings.warn("something odd", UserWarning)
    out = capsys.readouterr()
    assert "Warning" not in out.out + out.err
    got = [(level, msg.split(" (")[0]) for name, level, msg in records if name == "megatron_ru.warnings"]
    assert got == [(logging.DEBUG, "FutureWarning: `all_gather_into_tensor` is deprecated"),
                   (logging.WARNING, "UserWarning: something odd")]


def test_wandb_id_continues_that_run(tmp_path, monkeypatch):
    """--wandb-id (Megatron-DeepSpeed's flag): a resumed job logs into the W&B run of the earlier one."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    from megatron_ru.training.wandb_writer import WandbSink
    ids = []
    for _ in range(2):
        sink = WandbSink("ru-gpt", "run13b", str(tmp_path / "wandb"), None, {}, "abc123")
        ids.append(sink._run.id)
        sink.close()
    assert ids == ["abc123", "abc123"]


def test_wandb_run_without_a_project_flag(tmp_path, monkeypatch):
    """A fork's script (--wandb-name and --wandb-id, no project): the run goes to WANDB_PROJECT, else to
    W&B's default project, and its log line says which."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    from megatron_ru.training.wandb_writer import WandbSink
    for env, project in (("abci-13b", "abci-13b"), (None, "uncategorized")):
        if env is None:
            monkeypatch.delenv("WANDB_PROJECT", raising=False)
        else:
            monkeypatch.setenv("WANDB_PROJECT", env)
        sink = WandbSink(None, "run13b", str(tmp_path / "wandb"), None, {}, f"id-{project}")
        assert (sink._run.project, sink._run.name, sink._run.id) == (project, "run13b", f"id-{project}")
        sink.close()
