"""A SIGTERM (raised as ``Terminated`` by ``cli.sigterm_raises``) delivered right after an output's temporary
directory is created, before the code that removes it on failure is in force, used to leave
``<save>.tmp-<host>-<pid>`` behind: the writer created it outside its try block, and a converter descheduled
between the two on a loaded machine got the test's SIGTERM there (test_convert_signals.py failed beside a CPU
hog). Here the signal is delivered at exactly that point: the directory is created, then Terminated raised."""
from __future__ import annotations

import os

import pytest
import torch

from megatron_ru.utils.cli import Terminated


def _raise_after(real, calls: list[str]):
    """``os.makedirs``/``os.mkdir`` that creates a ``.tmp-`` directory, then raises Terminated (once)."""
    def make(path, *args, **kwargs):
        real(path, *args, **kwargs)
        if ".tmp-" in os.path.basename(str(path)) and not calls:
            calls.append(str(path))
            raise Terminated()
    return make


def test_checkpoint_writer_leaves_nothing_when_terminated_right_after_creating_its_temporary(tmp_path,
                                                                                               monkeypatch):
    from megatron_ru.checkpointing import writer
    from megatron_ru.config.model import ModelConfig
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                      max_position_embeddings=8, make_vocab_size_divisible_by=4)
    calls: list[str] = []
    monkeypatch.setattr(writer.os, "makedirs", _raise_after(os.makedirs, calls))
    with pytest.raises(Terminated):
        writer.write_checkpoint(str(tmp_path / "out"), cfg=cfg, vocab_size=12, tp=1, pp=1,
                                get_tensor=lambda name: torch.zeros(1))
    assert calls and os.path.basename(calls[0]).startswith("out.tmp-"), calls
    assert os.listdir(tmp_path) == []


def test_staged_directory_leaves_nothing_when_terminated_right_after_creating_its_temporary(tmp_path,
                                                                                            monkeypatch):
    from megatron_ru.utils import staging
    calls: list[str] = []
    monkeypatch.setattr(staging.os, "mkdir", _raise_after(os.mkdir, calls))
    with pytest.raises(Terminated):
        with staging.staged_directory(str(tmp_path / "out"), force=False):
            raise AssertionError("the block is not reached: the signal came first")
    assert calls and os.path.basename(calls[0]).startswith("out.tmp-"), calls
    assert os.listdir(tmp_path) == []
