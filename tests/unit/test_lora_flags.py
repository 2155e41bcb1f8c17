"""Adapter flags that would train something else than asked are refused by name: an alpha of 0
(the update scaled to nothing: grad norm 0 every step), and any --lora-* flag without a positive
--lora-rank (which otherwise became a full fine-tune of every parameter)."""
import pytest

from megatron_ru.config.lora import LoraConfig


def _problems(**flags) -> str:
    return "; ".join(LoraConfig(**flags).problems())


@pytest.mark.parametrize("alpha", [0.0, -2.0, float("nan"), float("inf")])
def test_non_positive_alpha_is_refused(alpha):
    assert "--lora-alpha must be a positive number" in _problems(lora_rank=4, lora_alpha=alpha)


@pytest.mark.parametrize("flags, flag", [
    (dict(lora_alpha=16.0), "--lora-alpha"),
    (dict(lora_dropout=0.1), "--lora-dropout"),
    (dict(lora_init="gaussian"), "--lora-init"),
    (dict(use_rslora=True), "--use-rslora"),
])
def test_adapter_flags_without_a_rank_are_refused(flags, flag):
    message = _problems(lora_rank=0, **flags)
    assert f"{flag} need adapters: add --lora-rank R" in message and "--lora-rank 0" in message


def test_all_problems_come_together():
    message = _problems(lora_rank=0, lora_alpha=0.0, lora_dropout=0.5)
    assert "--lora-alpha must be a positive number" in message
    assert "--lora-alpha, --lora-dropout need adapters" in message


def test_valid_adapter_flags_pass():
    assert _problems(lora_rank=4, lora_alpha=8.0, lora_dropout=0.1, lora_init="gaussian") == ""
    assert _problems() == ""


def test_parse_arguments_refuses_alpha_zero(tmp_path):
    from megatron_ru.flags.arguments import parse_arguments
    from tests.integration._train_helpers import tiny_argv
    argv = tiny_argv(str(tmp_path / "corpus"), str(tmp_path / "cache"), iters=1,
                     extra=["--lora-rank", "4", "--lora-alpha", "0"])
    with pytest.raises(ValueError, match="--lora-alpha must be a positive number"):
        parse_arguments(argv, world_size=1, device_type="cpu")
