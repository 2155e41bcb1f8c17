"""Training with context parallelism (--context-parallel-size, --cp-comm-type) equals the single-process run of
the same seed and data, iteration by iteration (fp32, 1e-5 relative in the loss and the gradient norm), on 4
gloo ranks: the ring and the all-to-all, with DP and ZeRO 1 and 3 (gradients reduced over DP x CP), with TP and
sequence parallelism, with a pipeline (the stages pass the CP-local chunk with its positions), with packed
documents (--reset-position-ids --reset-attention-mask --eod-mask-loss), with --calculate-per-token-loss, with
full and selective recomputation and with a batch ramp-up;
Megatron-DeepSpeed's --ds-sequence-parallel-size is the all-to-all's spelling. A run saved at CP 2 continues at
TP 2 x CP 1 and at CP 4 on the uninterrupted curve. The flags CP cannot run with are one-line errors."""
import pytest

from tests.dist_utils import run_distributed
from tests.integration._train_helpers import make_corpus, relative_diff, tiny_argv, train_body

pytestmark = pytest.mark.slow

ENV = {"DS_ACCELERATOR": "cpu"}
FP32_RTOL = 1e-5
PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
PER_TOKEN = ["--calculate-per-token-loss"]
#: global batch 2, 4 (micro batch 1 x DP 2 steps): the first 4 iterations ramp, the rest run at 4
RAMP = ["--rampup-batch-size", "2", "2", "8"]


def _layout(tp=1, pp=1, cp=1, zero=0, comm=None, extra=()):
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), "--zero-stage",
             str(zero), "--eval-iters", "0"]
    if cp > 1:
        flags += ["--context-parallel-size", str(cp)]
    if comm:
        flags += ["--cp-comm-type", comm]
    return flags + list(extra)


# (name, layout flags, which reference)
RUNS = [
    ("CP 4 ring", _layout(cp=4), "plain"),
    ("CP 2 x DP 2 all-to-all ZeRO 1", _layout(cp=2, zero=1, comm="a2a"), "plain"),
    ("CP 2 x DP 2 ring ZeRO 3", _layout(cp=2, zero=3), "plain"),
    ("TP 2 x CP 2 SP ring ZeRO 1", _layout(tp=2, cp=2, zero=1, extra=["--sequence-parallel"]), "plain"),
    ("CP 2 x PP 2 ring ZeRO 1", _layout(pp=2, cp=2, zero=1), "plain"),
    ("CP 2 x DP 2 --ds-sequence-parallel-size 2", _layout(zero=1, extra=["--ds-sequence-parallel-size", "2"]), "plain"),
    ("CP 2 x PP 2 packed documents", _layout(pp=2, cp=2, zero=1, extra=PACKED), "packed"),
    ("CP 2 x DP 2 all-to-all packed, per-token loss", _layout(cp=2, zero=1, comm="a2a", extra=PACKED + PER_TOKEN),
     "packed per-token"),
    ("CP 2 x DP 2 ring, full recomputation", _layout(cp=2, zero=1, extra=["--recompute-granularity", "full"]),
     "plain"),
    ("CP 2 x DP 2 all-to-all packed, selective recomputation",
     _layout(cp=2, zero=1, comm="a2a", extra=PACKED + ["--recompute-granularity", "selective"]), "packed"),
    ("CP 2 x DP 2 ring, batch ramp-up", _layout(cp=2, zero=1, extra=RAMP), "ramp"),
]
REFERENCES = {"plain": [], "packed": PACKED, "packed per-token": PACKED + PER_TOKEN, "ramp": RAMP}


def test_context_parallel_training_equals_one_process(tmp_path):
    prefix, cache = make_corpus(str(tmp_path)), str(tmp_path / "cache")
    refs = dict(zip(REFERENCES, run_distributed(
        train_body, 1, args=([tiny_argv(prefix, cache, extra=["--eval-iters", "0", *extra])
                              for extra in REFERENCES.values()],), timeout=300, env=ENV)[0]))
    assert refs["plain"]["losses"][10] < refs["plain"]["losses"][1] - 0.3  # it learns
    assert relative_diff(refs["packed"]["losses"], refs["plain"]["losses"]) > 1e-3  # the documents matter
    # CP shards no weights: a run saved at CP 2 x DP 2 (ZeRO 1 partitioned over DP x CP = 4) continues at TP 2 x DP 2
    # and at CP 4 x DP 1, on the uninterrupted curve, data position included
    saved = str(tmp_path / "cp2")
    resumes = [tiny_argv(prefix, cache, extra=[*_layout(cp=2, zero=1), "--save", saved, "--exit-interval", "5"]),
               tiny_argv(prefix, cache, extra=[*_layout(tp=2, zero=1), "--load", saved]),
               tiny_argv(prefix, cache, extra=[*_layout(cp=4, zero=1), "--load", saved])]
    results = run_distributed(train_body, 4, args=([tiny_argv(prefix, cache, extra=flags) for _, flags, _ in RUNS]
                                                   + resumes,), timeout=900, env=ENV)[0]
    first, *continued = results[len(RUNS):]
    assert sorted(first["losses"]) == [1, 2, 3, 4, 5] and first["saved"] == [5], first
    assert relative_diff(first["losses"], {k: refs["plain"]["losses"][k] for k in range(1, 6)}) < FP32_RTOL
    for name, res in zip(("TP 2 x DP 2", "CP 4"), continued):
        assert sorted(res["losses"]) == list(range(6, 11)), (name, sorted(res["losses"]))
        tail = {k: refs["plain"]["losses"][k] for k in range(6, 11)}
        assert relative_diff(res["losses"], tail) < FP32_RTOL, (name, res["losses"], tail)
    failures = []
    for (name, _, ref), res in zip(RUNS, results):
        assert not res["autograd_warnings"], (name, res["autograd_warnings"])
        d_loss = relative_diff(res["losses"], refs[ref]["losses"])
        d_norm = relative_diff(res["grad_norms"], refs[ref]["grad_norms"])
        if not (d_loss < FP32_RTOL and d_norm < FP32_RTOL):
            failures.append(f"{name}: loss rel diff {d_loss:.2e}, grad-norm rel diff {d_norm:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("extra, message", [
    (["--context-parallel-size", "3"], "WORLD_SIZE=4 is not divisible by TP x CP x PP = 1 x 3 x 1 = 3"),
    (["--context-parallel-size", "2", "--seq-length", "30", "--max-position-embeddings", "32"],
     "--seq-length 30 is not divisible by 2 x --context-parallel-size = 4"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"],
     "--attention-dropout 0.1 cannot be combined with --context-parallel-size 2"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "6", "--kv-channels", "8",
      "--num-query-groups", "2"],
     "--cp-comm-type a2a splits the attention heads over the CP group: 6 heads per tensor-parallel rank are not "
     "divisible by --context-parallel-size 4"),
    (["--context-parallel-size", "2", "--ds-sequence-parallel-size", "2", "--cp-comm-type", "p2p"],
     "--ds-sequence-parallel-size 2 means --cp-comm-type a2a, but --cp-comm-type p2p is given too"),
    (["--hierarchical-context-parallel-sizes", "2", "2"], "--hierarchical-context-parallel-sizes is not supported"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], "--cp-comm-type a2a+p2p is not supported"),
])
def test_context_parallel_flag_errors(extra, message):
    from megatron_ru.flags.arguments import parse_arguments
    with pytest.raises((ValueError, SystemExit)) as err:
        parse_arguments(tiny_argv("/nonexistent/prefix", "/tmp/cache", extra=extra), world_size=4, device_type="cpu")
    assert message in str(err.value), str(err.value)
