"""``tools/generate.py``: text generation from a megatron_ru checkpoint at any TP and PP.

    torchrun --nproc-per-node 4 tools/generate.py --load CKPT --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --prompt "Hello" --prompt "Once upon a time" --greedy

Launch like training (torchrun, mpirun, srun or one plain process); WORLD_SIZE = TP x PP x DP, the
prompts being split over the DP replicas. The model's shape, its vocabulary rows and (unless
tokenizer flags are given) its tokenizer come from the checkpoint. Rank 0 prints each prompt with
its completion and writes ``--output-file`` (JSONL: prompt, completion, token ids, finish reason).
Exit status as ``pretrain_gpt.py``: 0 done, 2 a bad flag or input, 1 a failure.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_ru.config.base import accept_negative_numbers, add_config_arguments, explicit_dests
from megatron_ru.config.tokenizer import TokenizerConfig
from megatron_ru.convert.hf_mapping import FAMILIES
from megatron_ru.inference.prompts import collect_prompts, result_record, write_jsonl
from megatron_ru.inference.sampling import SamplingParams
from megatron_ru.parallel.failure import distributed_tool_main
from megatron_ru.utils import cli
from megatron_ru.utils.logging import get_logger, log_rank0
from megatron_ru.utils.dtypes import DTYPES

log = get_logger(__name__)

_TOKENIZER_FIELDS = {f.name for f in dataclasses.fields(TokenizerConfig)} - {"tokenizer_num_threads", "eod_token"}
_PATH_FIELDS = ("tokenizer_model", "vocab_file", "merge_file")


def shown_text(text: str) -> str:
    """A generation as printed: trailing line breaks are counted, not printed (a small model's
    completion of 24 newlines would be 24 blank lines); ``--output-file`` has the exact text."""
    body = text.rstrip("\n")
    breaks = len(text) - len(body)
    return body + (f"\n[{breaks} trailing line break{'s' if breaks > 1 else ''}]" if breaks > 1 else "")


def build_parser() -> argparse.ArgumentParser:
    p = accept_negative_numbers(cli.ArgumentParser(
        prog="tools/generate.py", description="Generate text from a megatron_ru checkpoint (any TP/PP).",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    g = p.add_argument_group("Checkpoint and layout")
    g.add_argument("--load", help="checkpoint directory (written by pretrain_gpt.py --save or "
                   "tools/convert_checkpoint.py; the model's arguments come from it), or a Hugging Face "
                   f"{FAMILIES} directory (config.json, safetensors and its tokenizer)")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="iteration to load (default: the one latest_checkpointed_iteration.txt names)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP degree")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP degree")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter and activation dtype")
    g.add_argument("--distributed-backend", default="auto", choices=("auto", "nccl", "gloo"),
                   help="torch.distributed backend (auto: nccl with CUDA, else gloo)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="timeout of every collective")
    g = p.add_argument_group("Prompts and output")
    g.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    g.add_argument("--prompt-file", default=None, help="prompts: a .jsonl file with a \"prompt\" field per "
                   "line, or any other text file with one prompt per line")
    g.add_argument("--add-bos", action="store_true", help="start every prompt with the tokenizer's BOS token")
    g.add_argument("--chat-template", nargs="?", const="model", default=None, metavar="FILE",
                   help="render every prompt as a user message with a chat template, the assistant's turn opened: "
                        "the tokenizer's own (chat_template.jinja or tokenizer_config.json), or a Jinja FILE. "
                        "A --prompt-file JSONL line with a \"messages\" list is always rendered so. Generation "
                        "stops at the end-of-document token (--eod-token; default the tokenizer's eos_token, "
                        "an instruct model's end of turn)")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="prompts generated together per replica (default: all of them in one batch)")
    g.add_argument("--output-file", default=None, help="write JSONL results here (rank 0)")
    g = p.add_argument_group("Decoding")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate after each prompt at most")
    g.add_argument("--greedy", action="store_true", help="argmax decoding (no sampling flags allowed)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1: off)")
    g.add_argument("--seed", type=int, default=1234, help="sampling seed (with the prompt's index)")
    g.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    add_config_arguments(p, TokenizerConfig)
    for action in p._actions:  # tokenizer flags default to the checkpoint's tokenizer
        if action.dest == "tokenizer_type":
            action.help = "tokenizer kind (default: the tokenizer recorded with the checkpoint)"
    return p


def sampling_params(ns: argparse.Namespace, argv: Sequence[str]) -> SamplingParams:
    if ns.greedy:
        given = [f for f in ("--temperature", "--top-k", "--top-p") if any(a.split("=")[0] == f for a in argv)]
        if given:
            raise ValueError(f"--greedy picks the most likely token; it cannot be combined with "
                             f"{', '.join(given)} (drop --greedy to sample)")
    params = SamplingParams(greedy=ns.greedy, temperature=ns.temperature, top_k=ns.top_k, top_p=ns.top_p)
    return params


def check_arguments(ns: argparse.Namespace, argv: Sequence[str]) -> tuple[SamplingParams, list[str]]:
    """Everything that can be checked before the process group exists: one ValueError listing
    every problem. Returns the sampling parameters and the prompts."""
    from megatron_ru.inference.model_io import is_hf_model_dir
    from megatron_ru.checkpointing.meta import read_latest_iteration
    problems: list[str] = []
    if not ns.load:
        problems.append("--load is required: the checkpoint directory to generate from")
    elif not os.path.isdir(ns.load):
        problems.append(f"--load {ns.load}: no such directory")
    elif ns.ckpt_step is None and read_latest_iteration(ns.load) is None and not is_hf_model_dir(ns.load):
        problems.append(f"--load {ns.load} holds no checkpoint (no latest_checkpointed_iteration.txt) and no Hugging "
                        "Face model (no config.json); point it at a directory written by pretrain_gpt.py --save or "
                        "tools/convert_checkpoint.py, or at a Hugging Face model directory")
    for flag, value in (("--tensor-model-parallel-size", ns.tensor_model_parallel_size),
                        ("--pipeline-model-parallel-size", ns.pipeline_model_parallel_size),
                        ("--max-new-tokens", ns.max_new_tokens)):
        if value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
    if ns.tensor_model_parallel_size >= 1 and ns.pipeline_model_parallel_size >= 1:
        from megatron_ru.parallel.env import discover_environment
        from megatron_ru.parallel.topology import layout_problems
        try:
            world = discover_environment(os.environ).world_size
            problems += layout_problems(world, ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size)
        except ValueError as e:
            problems.append(str(e))
    if ns.micro_batch_size is not None and ns.micro_batch_size < 1:
        problems.append(f"--micro-batch-size must be >= 1, got {ns.micro_batch_size}")
    params = SamplingParams()
    try:
        params = sampling_params(ns, argv)
        problems += params.problems()
    except ValueError as e:
        problems.append(str(e))
    prompts: list[str] = []
    try:
        prompts = collect_prompts(ns.prompt, ns.prompt_file)
    except (ValueError, FileNotFoundError) as e:
        problems.append(str(e))
    if ns.output_file and not os.path.isdir(os.path.dirname(os.path.abspath(ns.output_file))):
        problems.append(f"--output-file {ns.output_file}: its directory does not exist")
    if problems:
        raise ValueError("tools/generate.py: " + "\n  ".join(problems) if len(problems) == 1 else
                         "tools/generate.py: invalid arguments:\n" + "\n".join(f"  - {p}" for p in problems))
    return params, prompts


def tokenizer_config(ns: argparse.Namespace, argv: Sequence[str], meta: Any, load: str) -> TokenizerConfig:
    """The tokenizer flags given, else the tokenizer recorded with the checkpoint (paths relative to
    the checkpoint directory are resolved against it)."""
    given = explicit_dests([TokenizerConfig], argv)
    explicit = given & _TOKENIZER_FIELDS
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(TokenizerConfig)}
    if not explicit:
        recorded = getattr(meta, "tokenizer", None) or (getattr(meta, "args", None) or {}).get("tokenizer")
        if not recorded or not recorded.get("tokenizer_type"):
            raise ValueError(f"the checkpoint in --load {load} records no tokenizer: give the tokenizer flags "
                             f"(--tokenizer-type, --tokenizer-model, ...)")
        for name, value in recorded.items():
            if name in values and name != "tokenizer_num_threads" and name not in given:
                if name in _PATH_FIELDS and value and not os.path.isabs(value):
                    value = os.path.join(load, value)
                values[name] = value
    return TokenizerConfig(**values)


def chat_prompts(prompts: Sequence[Any], template: Optional[str], tok_cfg: TokenizerConfig) -> list[str]:
    """The prompts as text: chats (``messages``), and with ``--chat-template`` every prompt as one user
    message, rendered with the chat template; others as they are."""
    from megatron_ru.inference.prompts import chat_template_text, render_chat
    if template is None and all(isinstance(p, str) for p in prompts):
        return list(prompts)
    text = chat_template_text(template or "model", tok_cfg.tokenizer_type, tok_cfg.tokenizer_model)
    special: dict[str, Optional[str]] = {}
    if tok_cfg.tokenizer_type == "HuggingFaceTokenizer":
        from megatron_ru.data.tokenizers.huggingface import special_token_names
        names = special_token_names(tok_cfg.tokenizer_model)
        special = {"bos_token": names.get("bos_token"), "eos_token": names.get("eos_token")}
    out = []
    for p in prompts:
        if isinstance(p, str) and template is None:
            out.append(p)
        else:
            out.append(render_chat(text, [{"role": "user", "content": p}] if isinstance(p, str) else p, special))
    return out


def completion_text(tokenizer: Any, prompt_ids: Sequence[int], ids: Sequence[int]) -> str:
    """The text the generated ``ids`` add after the prompt: decoded together with the prompt, so
    that the spacing at the seam is the tokenizer's (SentencePiece drops a word-initial space at
    the start of a decode, a word-level tokenizer joins tokens with spaces); alone if the prompt's
    text is not a prefix of the whole."""
    if not ids:
        return ""
    head = tokenizer.detokenize(list(prompt_ids))
    whole = tokenizer.detokenize(list(prompt_ids) + list(ids))
    return whole[len(head):] if whole.startswith(head) else tokenizer.detokenize(list(ids))


def run(ns: argparse.Namespace, argv: Sequence[str]) -> list[dict[str, Any]]:
    """Generate for every prompt; returns the result records (complete on rank 0)."""
    from megatron_ru.inference.model_io import is_hf_model_dir, open_model
    from megatron_ru.checkpointing import read_checkpoint
    from megatron_ru.data.tokenizer import build_tokenizer
    from megatron_ru.inference.generate import generate
    from megatron_ru.inference.runner import start_stage_runner

    params, prompts = check_arguments(ns, argv)
    if ns.ckpt_step is None and is_hf_model_dir(ns.load):
        model = open_model(ns.load, "--load")  # a Hugging Face directory: its own tokenizer
        cfg, vocab, get_tensor = model.cfg, model.vocab_size, model.get
        meta: Any = SimpleNamespace(tokenizer={"tokenizer_type": model.tokenizer.type,
                                               "tokenizer_model": model.tokenizer.path} if model.tokenizer else None)
    else:
        reader = read_checkpoint(ns.load, ns.ckpt_step)
        cfg, vocab, get_tensor, meta = reader.cfg, reader.vocab_size, reader.get, reader.meta
    tokenizer = build_tokenizer(tokenizer_config(ns, argv, meta, ns.load))
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the checkpoint in --load {ns.load} has "
                         f"{vocab} vocabulary rows: use the checkpoint's tokenizer (leave out the tokenizer flags)")
    prompts = chat_prompts(prompts, ns.chat_template, tokenizer_config(ns, argv, meta, ns.load))
    prompt_ids = [tokenizer.tokenize(p) for p in prompts]
    if ns.add_bos:
        if tokenizer.bos is None:
            raise ValueError("--add-bos: the tokenizer has no BOS token")
        prompt_ids = [[tokenizer.bos] + ids for ids in prompt_ids]
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"prompt {i} ({prompts[i][:40]!r}) gives no tokens")

    state, runner = start_stage_runner(ns, cfg, vocab, DTYPES[ns.dtype])
    runner.load(get_tensor)
    log_rank0(log, f"loaded {ns.load} (V={vocab}) at TP={state.tp_size} PP={state.pp_size} DP={state.dp_size}; "
                   f"{len(prompts)} prompts")

    mine = [i for i in range(len(prompts)) if i % state.dp_size == state.dp_rank]
    size = ns.micro_batch_size or max(len(mine), 1)
    pad = tokenizer.pad if tokenizer.pad is not None else tokenizer.eod
    local: list[tuple[int, Any]] = []
    for start in range(0, len(mine), size):
        chunk = mine[start:start + size]
        outs = generate(runner, [prompt_ids[i] for i in chunk], max_new_tokens=ns.max_new_tokens, params=params,
                        eod=tokenizer.eod, pad_id=pad, seed=ns.seed, indices=chunk, use_cache=not ns.no_kv_cache)
        local += list(zip(chunk, outs))
    if state.dp_size > 1:
        gathered: list[Any] = [None] * state.dp_size
        dist.all_gather_object(gathered, local, group=state.dp_group)
        local = [item for part in gathered for item in part]
    records = []
    for i, out in sorted(local, key=lambda item: item[0]):
        text_ids = out.token_ids[:-1] if out.finish_reason == "eod" else out.token_ids
        records.append(result_record(prompts[i], completion_text(tokenizer, out.prompt_ids, text_ids),
                                     out.prompt_ids, out.token_ids, out.finish_reason))
    if state.rank == 0:
        for i, r in enumerate(records):
            cli.emit(f"--- prompt {i} ({len(r['token_ids'])} tokens, {r['finish_reason']}) ---\n"
                     + shown_text(r["prompt"] + r["completion"]))
        if ns.output_file:
            write_jsonl(ns.output_file, records)
            log_rank0(log, f"wrote {len(records)} results to {ns.output_file}")
    return records


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The whole program; returns the exit status (0 done, 2 a bad flag or input, 1 a failure)."""
    return distributed_tool_main(argv, build_parser, run, what="generation")
