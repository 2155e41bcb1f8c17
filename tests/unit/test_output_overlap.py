"""One overlap rule for every tool that writes an output directory: the output must not be, contain or
lie inside any input. ``reshard --load P/run1 --save P --force`` used to exit 0 having deleted P/run1."""
import os

import pytest

from megatron_ru.checkpointing import reshard
from tests.unit.test_checkpoint_canonical import canonical_tensors, tiny_cfg, write


def test_overlap_problem_names_both_flags_in_every_direction(tmp_path):
    from megatron_ru.utils.staging import overlap_problem
    src = tmp_path / "p" / "run1"
    src.mkdir(parents=True)
    assert "--save" in overlap_problem(str(tmp_path / "p"), [("--load", str(src))]) and \
        "--load lies inside --save" in overlap_problem(str(tmp_path / "p"), [("--load", str(src))])
    assert "--save lies inside --load" in overlap_problem(str(src / "out"), [("--load", str(src))])
    assert "same path" in overlap_problem(str(src), str(src))
    assert overlap_problem(str(tmp_path / "p" / "run2"), [("--load", str(src))]) is None
    assert overlap_problem(str(tmp_path / "p" / "run1x"), [("--load", str(src))]) is None  # a prefix is not inside
    os.symlink(tmp_path / "p", tmp_path / "link")
    assert "--base" in overlap_problem(str(tmp_path / "link"), [("--model", None), ("--base", str(src))])


def test_check_output_refuses_an_output_that_is_a_file(tmp_path):
    from megatron_ru.utils.staging import check_output
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError, match="is not a directory"):
        check_output(str(tmp_path / "f"), [("--load", str(tmp_path / "in"))], force=True)


def _reshard(load, save, *extra):
    return reshard.main(["--load", str(load), "--save", str(save), "--target-tensor-parallel-size", "1",
                         "--target-pipeline-parallel-size", "1", *extra])


def test_reshard_into_the_parent_of_its_input_is_refused_and_keeps_the_input(tmp_path):
    cfg = tiny_cfg()
    parent = tmp_path / "p"
    parent.mkdir()
    write(parent / "run1", cfg, canonical_tensors(cfg), 1, 1)
    before = sorted(os.listdir(parent / "run1"))
    for save in (parent, parent / "run1", parent / "run1" / "sub"):
        with pytest.raises(ValueError, match="overlap|same path"):
            _reshard(parent / "run1", save, "--force")
        assert sorted(os.listdir(parent / "run1")) == before
    _reshard(parent / "run1", parent / "run2")  # a sibling is fine
    assert os.path.isdir(parent / "run2") and sorted(os.listdir(parent / "run1")) == before


def test_export_hf_into_the_parent_of_its_input_is_refused(tmp_path):
    from megatron_ru.convert.export_hf import export_hf
    cfg = tiny_cfg()
    (tmp_path / "p").mkdir()
    write(tmp_path / "p" / "run1", cfg, canonical_tensors(cfg), 1, 1)
    with pytest.raises(ValueError, match="--load lies inside --save"):
        export_hf(str(tmp_path / "p" / "run1"), str(tmp_path / "p"), force=True)
    assert os.path.isdir(tmp_path / "p" / "run1")
