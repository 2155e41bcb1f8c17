"""The analytic communication volume (megatron_ru/plan/comm.py) at a real model size agrees with the
closed forms of the Megatron papers where those apply (the audit against counted bytes is
tests/integration/test_comm_audit.py): GPT 13B, TP 4 x PP 8 x DP 4, micro batch 1, bf16 and fp32."""
from megatron_ru.config.model import ModelConfig
from megatron_ru.plan.comm import rank_comm_bytes, stage_comm_ops, step_comm_bytes
from megatron_ru.plan.layout import Layout

V = 50257


def gpt13b(**kw) -> ModelConfig:
    return ModelConfig(num_layers=40, hidden_size=5120, num_attention_heads=40, max_position_embeddings=2048, **kw)


def layout(**kw) -> Layout:
    base = dict(tp=4, pp=8, dp=4, micro_batch=1, global_batch=512, seq_length=2048, zero_stage=1, precision="bf16")
    return Layout(**{**base, **kw})


def test_tensor_parallel_layers_are_four_all_reduces_of_the_activation_per_layer():
    lay = layout()
    m, sbh = lay.num_micro_batches, 2048 * 1 * 5120 * 2        # bf16 activation of one micro batch
    ops = {op.name: op for op in stage_comm_ops(gpt13b(), V, lay, stage=3)}  # a middle stage: 5 layers
    assert ops["tp.layers"].count == m * 5 * 4 and ops["tp.layers"].payload == sbh
    assert ops["tp.layers"].bytes == m * 5 * 4 * 2 * 3 * sbh // 4   # ring all-reduce: 2(t-1)/t
    assert "tp.embedding" not in ops and "tp.cross_entropy" not in ops


def test_sequence_parallelism_moves_the_same_wire_bytes_in_the_layers():
    plain = {op.name: op.bytes for op in stage_comm_ops(gpt13b(), V, layout(), 3)}
    sp = {op.name: op.bytes for op in stage_comm_ops(gpt13b(), V, layout(sequence_parallel=True), 3)}
    # all-reduce = reduce-scatter + all-gather on the wire; SP adds the norm-weight gradient sums
    assert sp["sp.layers.all_gather"] + sp["sp.layers.reduce_scatter"] == plain["tp.layers"]
    assert sp["sp.norm_grads"] == layout().num_micro_batches * 10 * (2 * 5120 * 2) * 2 * 3 // 4


def test_pipeline_sends_one_activation_per_micro_batch_each_way_split_over_tp():
    lay = layout()
    m, act = lay.num_micro_batches, 2048 * 5120 * 2
    ops = {op.name: op for op in stage_comm_ops(gpt13b(), V, lay, 3)}
    assert ops["pp.activations.send"].bytes == ops["pp.gradients.recv"].bytes == m * act // 4
    assert ops["pp.activations.recv"].bytes == ops["pp.gradients.send"].bytes == m * act // 4
    # without sequence parallelism DeepSpeed rebuilds the split activation with TP all-gathers
    assert ops["pp.partition_gather.input"].dim == "tp"
    assert "pp.tied_embedding_grad" not in ops
    first = {op.name: op for op in stage_comm_ops(gpt13b(), V, lay, 0)}
    assert first["pp.tied_embedding_grad"].payload == 50688 // 4 * 5120 * 4  # rows padded to 128 x TP, / TP, fp32


def test_data_parallel_gradients_and_zero1_parameters_match_the_planners_parameter_counts():
    from megatron_ru.plan.params import stage_params
    trainable = stage_params(gpt13b(), V, 4, 8)[3].trainable
    z0 = {op.name: op for op in stage_comm_ops(gpt13b(), V, layout(precision="fp32", zero_stage=0), 3)}
    assert (z0["dp.grads"].kind, z0["dp.grads"].payload) == ("all_reduce", trainable * 4)
    z1 = {op.name: op for op in stage_comm_ops(gpt13b(), V, layout(precision="fp32"), 3)}
    gathered = sum(op.payload for name, op in z1.items() if name.startswith("dp.params"))
    assert z1["dp.grads"].payload == trainable * 4                  # DeepSpeed 0.19: all-reduce, not reduce-scatter
    assert trainable * 4 <= gathered < (trainable + 2 * 2 * 4) * 4  # flat groups padded to 2 x DP elements
    bf16 = {op.name: op for op in stage_comm_ops(gpt13b(), V, layout(), 3)}
    assert bf16["dp.grads"].payload == sum(op.payload for n, op in bf16.items() if n.startswith("dp.params"))


def test_step_bytes_are_the_busiest_stage_per_dimension():
    lay = layout()
    per_stage = [rank_comm_bytes(gpt13b(), V, lay, k) for k in range(lay.pp)]
    total = step_comm_bytes(gpt13b(), V, lay)
    assert set(total) == {"tp", "pp", "dp", "mp", "cp"} and total["cp"] == 0  # CP 1: no exchange
    assert all(total[k] == max(r[k] for r in per_stage) for k in total)
    assert total["tp"] > total["pp"] > 0 and total["dp"] > 0


def test_context_parallel_ring_passes_key_value_blocks_and_their_gradients():
    """CP 4 ring, 40 heads (no GQA): per layer and micro batch, the forward sends this rank's K and V block
    (1/CP of the tokens, 1/TP of the heads) on 3 times, the backward 3 times more and its fp32 gradient 4 times;
    full recomputation adds a forward. The gradient reduction runs over DP x CP (DeepSpeed's data axis)."""
    lay = layout(cp=4, dp=1, seq_length=8192)
    m = lay.num_micro_batches
    block = 2 * (8192 // 4) * (5120 // 4)                    # K and V of 2048 tokens, 10 of 40 heads
    ops = {op.name: op for op in stage_comm_ops(gpt13b(), V, lay, 3)}
    assert ops["cp.ring.kv.send"].payload == block * 2 and ops["cp.ring.kv.send"].count == m * 5 * 3 * 2
    assert ops["cp.ring.grads.recv"].payload == block * 4 and ops["cp.ring.grads.recv"].count == m * 5 * 4
    assert ops["dp.grads"].group_size == 4 and ops["cp.ring.kv.send"].dim == "cp"
    rc = {op.name: op for op in stage_comm_ops(gpt13b(), V,
                                               layout(cp=4, dp=1, seq_length=8192, recompute="full"), 3)}
    assert rc["cp.ring.kv.send"].count == m * 5 * 3 * 3
    a2a = {op.name: op for op in stage_comm_ops(gpt13b(), V,
                                                layout(cp=2, dp=2, seq_length=8192, cp_comm="a2a"), 3)}
    assert a2a["cp.all_to_all"].payload == (8192 // 2) * 4 * (5120 // 4) * 2  # q, k, v, output of its tokens


def test_context_parallel_positions_travel_with_the_pipelines_activations():
    """Under CP a rank's tokens are two chunks of the sample, so a pipeline stage passes their positions (int64,
    micro batch x s/CP) on with the activations, forward only: the first stage sends, the last receives, a middle
    stage both; none at CP 1."""
    lay = layout(cp=2, dp=2, seq_length=8192)
    m = lay.num_micro_batches
    stages = [{op.name: op for op in stage_comm_ops(gpt13b(), V, lay, k)} for k in (0, 3, 7)]
    first, middle, last = stages
    assert first["pp.positions.send"].payload == 8192 // 2 * 8 and first["pp.positions.send"].count == m
    assert "pp.positions.recv" not in first and "pp.positions.send" not in last
    assert {"pp.positions.send", "pp.positions.recv"} <= set(middle) and last["pp.positions.recv"].dim == "pp"
    assert not [op for op in stage_comm_ops(gpt13b(), V, layout(), 3) if op.name.startswith("pp.positions")]
