"""Output paths that cannot be directories are refused with the flags, before anything runs (issue 31,
item 8): --save naming an existing file used to train every iteration and then fail at the save."""
import pytest

from megatron_ru.flags.arguments import parse_arguments
from tests.integration._train_helpers import make_corpus, tiny_argv


@pytest.fixture
def argv(tmp_path):
    return tiny_argv(make_corpus(str(tmp_path)), str(tmp_path / "cache"), iters=4)


def _error(argv):
    with pytest.raises(ValueError) as e:
        parse_arguments(argv, world_size=1, device_type="cpu")
    return str(e.value)


def test_every_output_path_that_is_a_file_is_named_in_one_error(argv, tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    message = _error(argv + ["--save", str(f), "--tensorboard-dir", str(f / "tb"), "--metrics-file",
                             str(f / "sub" / "m.jsonl")])
    assert f"--save {f} is an existing file, not a directory" in message
    assert f"--tensorboard-dir {f / 'tb'} lies under the existing file {f}" in message
    assert f"--metrics-file {f / 'sub' / 'm.jsonl'}: its directory would be under the existing file {f}" in message


def test_metrics_file_that_is_a_directory_is_refused(argv, tmp_path):
    assert f"--metrics-file {tmp_path} is a directory" in _error(argv + ["--metrics-file", str(tmp_path)])


def test_new_and_existing_directories_pass(argv, tmp_path):
    (tmp_path / "tb").mkdir()
    parse_arguments(argv + ["--save", str(tmp_path / "new" / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb"),
                            "--metrics-file", str(tmp_path / "m" / "m.jsonl")], world_size=1, device_type="cpu")
