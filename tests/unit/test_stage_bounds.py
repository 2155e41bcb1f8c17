"""The pipeline's stage boundaries computed without DeepSpeed (megatron_ru.model.spec.balanced_parts, which
the planner, the converters and the checkpoint readers use) are DeepSpeed's own partition of the same layer
weights, which PipelineModule(partition_method="type:TransformerLayer") uses for training
(tests/distributed/test_model_spec.py checks a live PipelineModule's parts against stage_bounds)."""
import pytest

from megatron_ru.model.spec import balanced_parts


def _deepspeed(num_layers: int, pp: int) -> list[int]:
    from megatron_ru.deepspeed_bridge.pipeline import partition_balanced
    weights = [0] + [1] * num_layers + [0, 0]  # embedding, transformer layers, final norm, output head
    return [int(p) for p in partition_balanced(weights, pp)]


def test_balanced_parts_are_deepspeeds_for_every_stage_count():
    for num_layers in range(1, 33):
        for pp in range(1, num_layers + 4):  # past --num-layers too (refused at validation, still defined)
            assert balanced_parts(num_layers, pp) == _deepspeed(num_layers, pp), (num_layers, pp)


@pytest.mark.parametrize("num_layers,pp", [(40, 8), (48, 16), (80, 8), (126, 16)])
def test_balanced_parts_are_deepspeeds_for_real_depths(num_layers, pp):
    # 13B (40 layers), Llama-3-70B (80), Llama-3.1-405B (126) at the pipeline depths they are trained at
    assert balanced_parts(num_layers, pp) == _deepspeed(num_layers, pp)


@pytest.mark.parametrize("num_layers,pp,parts", [
    (8, 2, [0, 5, 11]),          # the embedding with stage 0, the final norm and head with the last stage
    (7, 2, [0, 5, 10]),          # uneven: the first stage takes 4 layers, the last 3 and the head
    (6, 4, [0, 3, 5, 6, 9]),     # 2, 2, 1, 1 layers
    (1, 5, [0, 1, 2, 3, 4, 4]),  # fewer layers than stages: one each, then empty
])
def test_balanced_parts_examples(num_layers, pp, parts):
    assert balanced_parts(num_layers, pp) == parts
