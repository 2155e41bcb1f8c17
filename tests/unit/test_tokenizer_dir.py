"""Item 3 of issue 33: a HuggingFaceTokenizer directory without a tokenizer is named as such, and a
checkpoint directory points at its tokenizer/ (instead of transformers' "install sentencepiece")."""
from megatron_ru.config.tokenizer import TokenizerConfig


def _problems(path):
    return TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(path)).problems()


def test_a_checkpoint_directory_points_at_its_tokenizer(tmp_path):
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    (problem,) = _problems(tmp_path)
    assert "holds no Hugging Face tokenizer" in problem
    assert problem.endswith(f"pass --tokenizer-model {tmp_path / 'tokenizer'}")
    assert _problems(tmp_path / "tokenizer") == []


def test_an_empty_directory_says_what_to_give(tmp_path):
    (problem,) = _problems(tmp_path)
    assert problem.endswith("give the directory that tokenizer.save_pretrained(DIR) wrote")
