"""--log-num-zeros-in-grad on a single process: the count the engine's optimizer hook takes before each step
equals a hand count with torch over the same model's gradients, on every optimizer path we count (fp32 at
ZeRO 0/1/2, bf16's BF16_Optimizer at ZeRO 1 and DeepSpeedZeroOptimizer at ZeRO 2). The batch uses only the
first half of the vocabulary, so the embedding rows of the other tokens get exactly zero gradient: at least
(unseen rows x hidden) zeros. The parameters add up to an odd count, so ZeRO's alignment padding (zeros) is
there and must not be counted. DeepSpeed keeps global state: each check runs in its own interpreter."""
import json
import os
import subprocess
import sys

import pytest

from tests.dist_utils import LEAVE_GROUP

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB, HIDDEN, SEEN = 16, 5, 8
#: (precision, ZeRO stage, the DeepSpeed optimizer class that path runs)
PATHS = [("fp32", 0, "AdamW"), ("fp32", 1, "DeepSpeedZeroOptimizer"), ("fp32", 2, "DeepSpeedZeroOptimizer"),
         ("bf16", 1, "BF16_Optimizer"), ("bf16", 2, "DeepSpeedZeroOptimizer")]


def _model():
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
            self.gain = torch.nn.Parameter(torch.ones(3))  # 3 elements: the total is odd
            self.unused = torch.nn.Parameter(torch.ones(2))  # in no forward: no gradient, counted as zeros
            self.out = torch.nn.Linear(HIDDEN, VOCAB)

        def forward(self, x):
            h = self.emb(x) * self.gain.mean()
            return torch.nn.functional.cross_entropy(self.out(h).flatten(0, 1).float(), x.flatten())

    torch.manual_seed(0)
    return Tiny()


def _hand_count(model, batches, dtype) -> int:
    """torch alone: the summed gradient of the micro batches, its zero elements (a parameter without a
    gradient: all zeros)."""
    import torch
    ref = _model().to(dtype)
    ref.load_state_dict(model.state_dict())
    for x in batches:
        ref(x).backward()
    return sum(p.numel() if p.grad is None else int((p.grad == 0).sum()) for p in ref.parameters())


def check_paths(out):
    import deepspeed
    import torch
    import torch.distributed as dist
    from megatron_ru.deepspeed_bridge import compat as dsc
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dsc.disable_cpu_shm_comm()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=False)
    res = {}
    for precision, stage, _ in PATHS:
        model = _model()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
               "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9,
               "zero_allow_untested_optimizer": True}
        if precision == "bf16":
            cfg.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)
        dsc.install_batched_bf16_step(engine)
        counter = dsc.install_grad_zero_count(engine, lambda p: True)
        g = torch.Generator().manual_seed(1)
        counts, hand = [], []
        for _ in range(2):
            batches = [torch.randint(0, SEEN, (2, 6), generator=g) for _ in range(2)]
            hand.append(_hand_count(engine.module, batches, dtype))
            for x in batches:
                engine.backward(engine(x))
                engine.step()
            counts.append(int(counter.last()))
        res[f"{precision}-{stage}"] = {"type": type(engine.optimizer).__name__, "counts": counts, "hand": hand,
                                       "partitioned": counter.partitioned}
    json.dump(res, open(out, "w"))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("zeros") / "paths.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    code = f"from tests.unit.test_num_zeros_in_grad import check_paths; check_paths({out!r}); " + LEAVE_GROUP
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.load(open(out))


@pytest.mark.parametrize("precision,stage,kind", PATHS)
def test_count_equals_hand_count(paths, precision, stage, kind):
    r = paths[f"{precision}-{stage}"]
    assert r["type"] == kind
    assert r["partitioned"] == (kind == "DeepSpeedZeroOptimizer")
    assert r["counts"] == r["hand"]
    assert all(c >= (VOCAB - SEEN) * HIDDEN + 2 for c in r["counts"])  # unseen rows, the unused parameter


_MINIMAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "1",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--mock-data", "--log-num-zeros-in-grad"]


@pytest.mark.parametrize("extra,named", [(["--zero-stage", "3"], "--zero-stage 3"),
                                         (["--fp16", "--zero-stage", "0"], "--fp16 at --zero-stage 0")])
def test_refused_where_it_cannot_count(extra, named):
    from megatron_ru.flags.arguments import parse_arguments
    with pytest.raises((ValueError, SystemExit)) as e:
        parse_arguments(_MINIMAL + extra, world_size=1, device_type="cuda")
    assert f"--log-num-zeros-in-grad cannot be combined with {named}" in str(e.value)


def test_accepted_elsewhere():
    from megatron_ru.flags.arguments import parse_arguments
    for extra in ([], ["--zero-stage", "1"], ["--bf16", "--zero-stage", "2"]):
        assert parse_arguments(_MINIMAL + extra, world_size=1, device_type="cpu").logging.log_num_zeros_in_grad


def test_tag_names():
    from megatron_ru.training.metrics import train_scalars
    s = train_scalars(dict(iteration=3, consumed_samples=24, lm_loss=1.5, num_zeros=42))
    assert s.values["num-zeros"] == s.values["num-zeros vs samples"] == 42.0
    assert s.step_of("num-zeros vs samples") == 24 and s.step_of("num-zeros") == 3
