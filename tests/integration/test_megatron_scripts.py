"""The public job scripts of Megatron-LM and Megatron-DeepSpeed, as our users run them: each script's argument
list (our own shrunken copy: every flag as the script writes it, only sizes, paths, the tokenizer files, the
backend and the launcher shrunk to 2 gloo ranks) trains 3 iterations (fp16 scripts: the one refusal that fp16
needs a GPU, then the same in bf16; the Llama-3 one, which continues a checkpoint: Megatron's exit on a missing
one). Before: 6-18 unknown flags each; every feature they ask for is built now.

Scripts (fetched for their flags, none of their text kept):
* Megatron-DeepSpeed ``examples_deepspeed/pretrain_llama2_distributed.sh`` (with its activation-checkpointing
  branch on), ``examples/pretrain_gpt_distributed_with_mp.sh``,
  ``examples_deepspeed/universal_checkpointing/llama/run_llama_bf16.sh``;
* Megatron-LM ``examples/llama/train_llama3_8b_h200_bf16.sh`` (its data-path branch),
  ``examples/llama/train_llama3.sh`` (defaults), ``examples/gpt3/train_gpt3_175b_distributed.sh``;
* the Llama-3 8B H200 script once more with its ``--context-parallel-size`` at 2 (TP 1: the two ranks are one
  CP group);
* a Megatron-DeepSpeed fork's 13B job script for ABCI (V100, TP 4 x PP 8, fp16), its extra flags (a W&B run
  name and id without a project, which its fork leaves to W&B).
"""
from __future__ import annotations

import json

import pytest

from megatron_ru.flags.arguments import CONFIG_CLASSES
from megatron_ru.config.base import build_parser
from megatron_ru.flags.megatron_flags import add_to_parser
from tests.dist_utils import run_distributed
from tests.fixtures.wandb_files import offline_run
from tests.fixtures.tokenizers import make_gpt2_bpe_files, make_hf_tokenizer_dir, make_sentencepiece
from tests.integration._train_helpers import make_corpus, train_body

pytestmark = pytest.mark.slow

# the model every script is shrunk to: 2 layers, hidden 64, 4 heads (2 KV heads where the script has GQA)
SIZES = {"layers": "2", "hidden": "64", "ffn": "128", "heads": "4", "kv": "2", "seq": "32", "micro": "1",
         "global": "4", "iters": "3"}


def _ds_config(path, bf16: bool) -> str:
    with open(path, "w") as f:  # what the Megatron-DeepSpeed scripts write with `cat <<EOT`
        json.dump({"train_batch_size": int(SIZES["global"]), "train_micro_batch_size_per_gpu": int(SIZES["micro"]),
                   "steps_per_print": 1, "zero_optimization": {"stage": 0}, "bf16": {"enabled": bf16}}, f)
    return str(path)


def scripts(d, data: str, cache: str, sp: str, vocab: str, merges: str, hf: str) -> dict[str, list[str]]:
    s = SIZES
    save = str(d / "ckpt")
    common_mds_llama = [
        "--num-layers", s["layers"], "--hidden-size", s["hidden"], "--ffn-hidden-size", s["ffn"],
        "--num-attention-heads", s["heads"], "--micro-batch-size", s["micro"], "--global-batch-size", s["global"],
        "--seq-length", s["seq"], "--max-position-embeddings", s["seq"], "--train-iters", s["iters"],
        "--data-path", data, "--data-impl", "mmap", "--tokenizer-type", "GPTSentencePieceTokenizer",
        "--tokenizer-model", sp, "--split", "949,50,1", "--distributed-backend", "gloo", "--lr", "3e-4",
        "--lr-decay-style", "cosine", "--min-lr", "3e-5", "--weight-decay", "0.1", "--clip-grad", "1",
        "--lr-warmup-iters", "1", "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--bf16",
        "--no-query-key-layer-scaling", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--swiglu",
        "--normalization", "rmsnorm", "--disable-bias-linear"]
    return {
        "mds_pretrain_llama2_distributed": [
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", *common_mds_llama,
            "--save", save + "_llama2", "--load", save + "_llama2", "--save-interval", "10000",
            "--num-key-value-heads", s["kv"],
            "--deepspeed-activation-checkpointing", "--recompute-granularity", "full", "--recompute-method", "uniform",
            f"--zero-stage=0", f"--deepspeed_config={_ds_config(d / 'ds_llama2.json', True)}", "--deepspeed",
            "--data-cache-path", cache],
        "mds_pretrain_gpt_distributed_with_mp": [
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--sequence-parallel",
            "--num-layers", s["layers"], "--hidden-size", s["hidden"], "--num-attention-heads", s["heads"],
            "--seq-length", s["seq"], "--max-position-embeddings", s["seq"], "--micro-batch-size", s["micro"],
            "--global-batch-size", s["global"], "--lr", "0.00015", "--train-iters", s["iters"],
            "--lr-decay-iters", "3", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "1e-2",
            "--lr-warmup-fraction", ".01", "--clip-grad", "1.0", "--fp16",
            "--data-path", data, "--vocab-file", vocab, "--merge-file", merges, "--data-impl", "mmap",
            "--split", "949,50,1", "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
            "--eval-iters", "10", "--distributed-backend", "gloo", "--save", save + "_mp", "--load", save + "_mp",
            "--data-cache-path", cache],
        "mds_universal_checkpointing_run_llama_bf16": [
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--ds-sequence-parallel-size", "1", *common_mds_llama, "--save", save + "_uc", "--load", save + "_uc",
            "--save-interval", "100", "--exit-interval", "3", "--tensorboard-dir", str(d / "tb_uc"),
            "--deepspeed", f"--deepspeed_config={_ds_config(d / 'ds_uc.json', True)}", "--zero-stage=0",
            "--deepspeed-activation-checkpointing", "--checkpoint-activations", "--no-pipeline-parallel",
            "--data-cache-path", cache],
        "lm_train_llama3_8b_h200_bf16": [
            "--use-mcore-models", "--num-layers", s["layers"], "--hidden-size", s["hidden"], "--ffn-hidden-size",
            s["ffn"], "--num-attention-heads", s["heads"], "--group-query-attention", "--num-query-groups", s["kv"],
            "--kv-channels", "16", "--seq-length", s["seq"], "--max-position-embeddings", s["seq"],
            "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
            "--attention-backend", "fused", "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--micro-batch-size", s["micro"], "--global-batch-size", s["global"],
            "--train-samples", "12", "--lr-decay-samples", "12", "--lr-warmup-samples", "4", "--lr", "0.00015",
            "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
            "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
            "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
            "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
            "--exit-duration-in-mins", "235", "--tensor-model-parallel-size", "2", "--context-parallel-size", "1",
            "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--data-path", data, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf,
            "--data-cache-path", cache, "--split", "99,1,0", "--no-create-attention-mask-in-dataloader",
            "--no-mmap-bin-files", "--num-workers", "1", "--vocab-size", "500", "--log-interval", "1",
            "--save-interval", "1000", "--log-throughput", "--profile", "--profile-step-start", "4",
            "--profile-step-end", "6", "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60",
            "--save", save + "_l3h200", "--load", save + "_l3h200", "--tensorboard-dir", str(d / "tb_l3"),
            "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard", "--eval-iters", "1"],
        "lm_train_llama3": [
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
            "--num-layers", s["layers"], "--hidden-size", s["hidden"], "--ffn-hidden-size", s["ffn"],
            "--num-attention-heads", s["heads"], "--seq-length", s["seq"], "--max-position-embeddings", s["seq"],
            "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--no-position-embedding",
            "--swiglu", "--disable-bias-linear", "--init-method-std", "0.02", "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0", "--normalization", "RMSNorm", "--micro-batch-size", s["micro"],
            "--global-batch-size", s["global"], "--train-iters", s["iters"],
            "--no-async-tensor-model-parallel-allreduce", "--bf16", "--no-masked-softmax-fusion",
            "--group-query-attention", "--num-query-groups", s["kv"], "--sequence-parallel", "--use-flash-attn",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-iters", "320000", "--lr-decay-style", "cosine",
            "--weight-decay", "1.0e-1", "--clip-grad", "1.0", "--optimizer", "adam",
            "--data-path", data, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf,
            "--dataloader-type", "single", "--num-workers", "1", "--data-cache-path", cache,
            "--log-interval", "1", "--eval-iters", "1", "--log-throughput", "--ckpt-format", "torch",
            "--no-load-optim", "--no-load-rng", "--save-interval", "5000", "--eval-interval", "5000",
            "--save", save + "_l3", "--load", save + "_l3", "--exit-on-missing-checkpoint"],
        "lm_train_gpt3_175b_distributed": [
            "--num-layers", s["layers"], "--hidden-size", s["hidden"], "--num-attention-heads", s["heads"],
            "--seq-length", s["seq"], "--max-position-embeddings", s["seq"], "--micro-batch-size", s["micro"],
            "--global-batch-size", s["global"], "--train-iters", s["iters"], "--weight-decay", "0.1",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0",
            "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
            "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "1", "--attention-backend", "auto",
            "--data-path", data, "--vocab-file", vocab, "--merge-file", merges, "--split", "949,50,1",
            "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
            "--save", save + "_175b", "--load", save + "_175b", "--eval-iters", "10",
            "--tensorboard-dir", str(d / "tb_175b"), "--data-cache-path", cache],
        "abci_mds_fork_13b": [
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", *common_mds_llama,
            "--rampup-batch-size", "2", "2", "8", "--distribute-checkpointed-activations",
            "--no-scatter-gather-tensors-in-pipeline", "--wandb-name", "run13b", "--wandb-id", "abc123",
            "--wandb-save-dir", str(d / "wandb_13b"),
            "--log-timers-to-tensorboard", "--checkpoint-activations", "--data-cache-path", cache],
    }


FP16 = ("mds_pretrain_gpt_distributed_with_mp", "lm_train_gpt3_175b_distributed")


def _context_parallel(argv: list[str]) -> list[str]:
    """The Llama-3 8B H200 script with its CP knob at 2 instead of 1 (and its TP at 1, so that the 2 ranks are
    one CP group): the layout sizes change, every other flag stays; its own checkpoint directory."""
    out = list(argv)
    out[out.index("--tensor-model-parallel-size") + 1] = "1"
    out[out.index("--context-parallel-size") + 1] = "2"
    for flag in ("--save", "--load"):
        out[out.index(flag) + 1] += "_cp2"
    return out


def test_every_script_flag_is_known(tmp_path):
    prefix = make_corpus(str(tmp_path))
    parser = build_parser(CONFIG_CLASSES)
    add_to_parser(parser)
    for name, argv in scripts(tmp_path, prefix, str(tmp_path / "c"), "sp", "v", "m", "hf").items():
        unknown = [a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0] not in
                   parser._option_string_actions]
        assert unknown == [], (name, unknown)


@pytest.mark.timeout(900)
def test_megatron_job_scripts_run_unchanged(tmp_path):
    prefix = make_corpus(str(tmp_path))
    sp = make_sentencepiece(tmp_path)
    vocab, merges = make_gpt2_bpe_files(tmp_path)
    hf = make_hf_tokenizer_dir(tmp_path)
    runs = scripts(tmp_path, prefix, str(tmp_path / "cache"), sp, vocab, merges, hf)
    runs["lm_train_llama3_8b_h200_bf16 at CP 2"] = _context_parallel(runs["lm_train_llama3_8b_h200_bf16"])
    argvs, names = [], []
    for name, argv in runs.items():
        if name == "lm_train_llama3":
            argvs.append(["expect-error", *argv])
        elif name in FP16:  # fp16 needs a GPU: its refusal here is the only problem, then it runs in bf16
            argvs.append(["expect-error", *argv])
            names.append(name + " (fp16)")
            argvs.append(["--bf16" if a == "--fp16" else a for a in argv])
        else:
            argvs.append(argv)
        names.append(name)
    results = run_distributed(train_body, 2, args=(argvs,), timeout=900, env={"DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline",
                                                                   "WANDB_PROJECT": ""},
                              daemon=False)[0]  # the scripts' --num-workers start DataLoader workers
    for name, result in zip(names, results):
        base = name.split(" ")[0]
        if name.endswith("(fp16)"):
            assert result["error"].startswith("invalid configuration (1 problem):") and "--fp16 needs a GPU" in \
                result["error"], (name, result)
        elif base == "lm_train_llama3":  # it continues a checkpoint: with none in --load, Megatron's exit
            assert "holds no latest_checkpointed_iteration.txt: --exit-on-missing-checkpoint asks for one" in \
                result["error"], result
        else:
            assert sorted(result["losses"]) == [1, 2, 3], (name, result)
            assert all(v == v and v < 20 for v in result["losses"].values()), (name, result["losses"])
    # the ABCI script gives a W&B run name and id but no project, as its fork allows: the (offline) run has
    # that name and id (a resubmitted job continues it), in W&B's default project (WANDB_PROJECT is unset)
    assert offline_run(tmp_path / "wandb_13b") == ("uncategorized", "run13b", "abc123")
