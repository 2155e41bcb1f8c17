#!/usr/bin/env python
"""tools/preprocess_data.py end to end vs each tokenizer's own fastest batch throughput: a matrix.

    python benchmarks/preprocess.py --repeat 3                      # the whole matrix (~30 min on 2 cores)
    python benchmarks/preprocess.py --tokenizers sp-bpe --shapes huge --huge-mb 20 --repeat 1

Rows: tokenizer type (SentencePiece BPE and Unigram 16k, GPT-2 BPE 32k from vocab.json/merges.txt,
Hugging Face byte-level BPE 32k with LLaMA-3's split pattern, and tiktoken with that vocabulary when
tiktoken is installed) × corpus shape (``ordinary``: multi-paragraph documents; ``longtail``: the
same with ~30 % of the words replaced by fresh pseudo-words, so that no word cache helps;
``huge``: one document of --huge-mb MB in one JSON line) × workers (1, 2). Everything is built
in --workdir by the script (tokenizers trained on the first documents of the ordinary corpus).

  limit(k): the tokenizer alone, in a fresh process, on the same texts already in memory as str
            (read untimed): SentencePiece ``encode(batch, num_threads=k, return_type="numpy")``,
            tokenizers ``encode_batch_fast(batch)`` and each encoding's ``ids`` with a Rust pool of
            k threads (RAYON_NUM_THREADS), tiktoken ``encode_to_numpy`` per text on a pool of k
            threads (one ``Encoding`` each); 4 MB batches, and for the huge document the text cut
            into ~100 k-character pieces encoded as one batch.
  tool(k):  ``python tools/preprocess_data.py --workers k --append-eod`` as a subprocess: wall
            clock from launch to exit (start-up, reading, JSON, tokenizing, writing), and its peak
            RSS (the largest process of the tool's tree, from wait4). The package is byte-compiled
            first (``compile_tool``), as an installed one is.

Peer (``--megatron-lm DIR``): Megatron-LM's own tools/preprocess_data.py, once per cell of
--peer-shapes, on the same corpus and tokenizer flags. It is not vendored; a tree that runs with
this project's environment (torch, numpy, sentencepiece, tokenizers, transformers) is made from a
Megatron-LM clone with ``git archive 8d18afdec9 tools/preprocess_data.py megatron | tar -x -C DIR``
(the commit of 2025-12-09; newer ones need triton at import). Its GPT2BPETokenizer is its own
Python BPE, its HuggingFaceTokenizer goes through transformers.

Rounds: each runs limit and tool back to back for every cell, the order reversed every other
round; the figure is the median over rounds of the per-round ratio limit_wall / tool_wall (token
counts are equal but for the tool's one end-of-document token per document, which is counted).
The outputs of all tool runs of a tokenizer × shape are checked byte-identical across workers.
With ``--sliced SECONDS`` a round runs its limit and tool as one pair in alternating time slices
instead (the other side's process group stopped; see ``run_pair_sliced``): each side still runs
alone, and both see the machine's slow swings in speed alike, which the sequential rounds cannot
separate from a 5 % difference on this VM. ``--sliced-aa`` checks the method: the tool against
itself.
Each round also times the tool on one short document (its fixed start-up: interpreter, imports,
tokenizer load, writing); a second column gives the ratio with that round's start-up taken off.
The last line of the output is the results JSON; ``--merge LOG...`` prints the tables of several
whole runs merged round by round (this VM swings by ±20 % between runs a minute apart, so cells
near 0.95 need more rounds than one run can hold).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ru.data.tokenizers.huggingface import LLAMA3_PATTERN  # noqa: E402

TOKENIZERS = ("sp-bpe", "sp-unigram", "gpt2-bpe", "hf-bytelevel", "tiktoken")
SHAPES = ("ordinary", "longtail", "huge")
BATCH_CHARS = 4 << 20
SIZE_MB = {"sp-bpe": 100, "sp-unigram": 300, "gpt2-bpe": 80, "hf-bytelevel": 80, "tiktoken": 300}
PIECE_CHARS = 100_000


def corpus_path(workdir: str, shape: str, size_mb: float, huge_mb: float) -> str:
    from megatron_ru.data.preprocess.synthetic import write_corpus

    mb = huge_mb if shape == "huge" else size_mb
    path = os.path.join(workdir, f"corpus_{shape}_{mb:g}mb.jsonl")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        write_corpus(path, int(mb * 1e6), seed={"ordinary": 1, "longtail": 2, "huge": 3}[shape], paragraphs=(10, 60),
                     rare_words=0.3 if shape == "longtail" else 0.0, one_document=shape == "huge")
        print(f"generated {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return path


def startup_corpus(workdir: str) -> str:
    """One short document: the tool's fixed cost (interpreter, imports, tokenizer load, writing)."""
    path = os.path.join(workdir, "corpus_startup.jsonl")
    if not os.path.exists(path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps({"text": "Один короткий документ. One short document."}, ensure_ascii=False) + "\n")
    return path


def load_texts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def _byte_level_bpe(texts: list[str], vocab: int, special: str, llama3: bool):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if llama3:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[special], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def tokenizer_flags(name: str, workdir: str, train_corpus: str) -> list[str]:
    """Build (once, cached in ``workdir``) tokenizer ``name``; its preprocess_data.py flags."""
    d = os.path.join(workdir, "tokenizers")
    os.makedirs(d, exist_ok=True)
    texts = None
    if name.startswith("sp-"):
        kind = name[3:]
        model = os.path.join(d, f"sp_{kind}_16k.model")
        if not os.path.exists(model):
            from megatron_ru.data.tokenizers.train import train_sentencepiece

            train_sentencepiece(load_texts(train_corpus)[:400], model[:-len(".model")], kind, 16000, num_threads=2,
                                hard_vocab_limit=False)
        return ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model]
    if name == "gpt2-bpe":
        out = os.path.join(d, "gpt2_32k")
        if not os.path.exists(os.path.join(out, "merges.txt")):
            os.makedirs(out, exist_ok=True)
            model = json.loads(_byte_level_bpe(load_texts(train_corpus)[:400], 32000, "<|endoftext|>", False).to_str())
            with open(os.path.join(out, "vocab.json"), "w", encoding="utf-8") as f:
                json.dump(model["model"]["vocab"], f, ensure_ascii=False)
            with open(os.path.join(out, "merges.txt"), "w", encoding="utf-8") as f:
                f.write("#version: 0.2\n")
                f.writelines((m if isinstance(m, str) else " ".join(m)) + "\n" for m in model["model"]["merges"])
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(out, "vocab.json"),
                "--merge-file", os.path.join(out, "merges.txt")]
    out = os.path.join(d, "hf_llama3_32k")
    if not os.path.exists(os.path.join(out, "tokenizer_config.json")):
        os.makedirs(out, exist_ok=True)
        texts = texts or load_texts(train_corpus)[:400]
        _byte_level_bpe(texts, 32000, "<|end_of_text|>", True).save(os.path.join(out, "tokenizer.json"))
        with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token": "<|end_of_text|>"}, f)
    if name == "hf-bytelevel":
        return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", out]
    if name == "tiktoken":  # the same vocabulary as ranks of token bytes (tiktoken's file format)
        ranks = os.path.join(d, "llama3_style_32k.tiktoken")
        if not os.path.exists(ranks):
            _write_tiktoken_ranks(os.path.join(out, "tokenizer.json"), ranks)
        return ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", ranks]
    raise SystemExit(f"unknown tokenizer {name!r}; choose from {', '.join(TOKENIZERS)}")


def _write_tiktoken_ranks(tokenizer_json: str, path: str) -> None:
    from megatron_ru.data.tokenizers.tiktoken_file import ranks_from_tokenizer_json, write_ranks

    with open(tokenizer_json, encoding="utf-8") as f:
        write_ranks(ranks_from_tokenizer_json(json.load(f)), path)


# ---------------------------------------------------------------------------- the limit (subprocess)
def fastest_encode(flags: list[str], threads: int, tokenizer=None):
    """``encode(list of str) -> number of tokens`` with the tokenizer library's fastest batch call
    on ``threads`` threads (RAYON_NUM_THREADS must be set before for ``tokenizers``). ``tokenizer``:
    one of our Tokenizers whose library object to use (so that both sides share, say, a BPE cache);
    else it is loaded from ``flags``."""
    kind = flags[1]
    if kind == "GPTSentencePieceTokenizer":
        import sentencepiece as spm

        sp = tokenizer.sp if tokenizer is not None else spm.SentencePieceProcessor(model_file=flags[3])
        return lambda b: sum(a.size for a in sp.encode(b, num_threads=threads, return_type="numpy"))
    if kind in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):
        if tokenizer is not None:
            fast = tokenizer._fast
        elif kind == "HuggingFaceTokenizer":
            from tokenizers import Tokenizer as Fast

            fast = Fast.from_file(os.path.join(flags[3], "tokenizer.json"))
        else:
            from megatron_ru.data.tokenizers.gpt2_bpe import GPT2BPETokenizer

            fast = GPT2BPETokenizer(flags[3], flags[5])._fast
        return lambda b: sum(len(e.ids) for e in fast.encode_batch_fast(b, add_special_tokens=False))
    if kind == "TikTokenizer":
        from concurrent.futures import ThreadPoolExecutor

        if tokenizer is None:
            from megatron_ru.config.tokenizer import TokenizerConfig
            from megatron_ru.data.tokenizer import build_tokenizer

            tokenizer = build_tokenizer(TokenizerConfig("TikTokenizer", flags[3]))
        import threading

        # tiktoken's fastest: encode_to_numpy (its uint32 buffer) per text on k threads, each thread
        # with its own Encoding, built here, before the clock (a regex's match caches are fast only
        # for the first thread that used them; sharing one Encoding was ~10 % slower on 2 threads);
        # its encode_ordinary_batch builds Python lists and was 15-20 % slower here
        free = [tokenizer.new_encoding() for _ in range(threads)]
        local, lock = threading.local(), threading.Lock()

        def take() -> None:
            with lock:
                local.enc = free.pop()
        pool = ThreadPoolExecutor(threads, initializer=take)
        return lambda b: sum(a.size for a in pool.map(lambda t: local.enc.encode_to_numpy(t, disallowed_special=()), b))
    raise SystemExit(f"no limit for {kind}")


def limit_batches(texts: list[str], shape: str) -> list[list[str]]:
    """The limit's batches: a huge document's ~100 k-character pieces as one batch; other corpora
    in batches of about BATCH_CHARS characters."""
    if shape == "huge":
        from megatron_ru.data.preprocess.cuts import cut_document

        return [[p for t in texts for p in cut_document(t, PIECE_CHARS, "keep")]]
    batches, cur, size = [], [], 0
    for t in texts:
        cur.append(t)
        size += len(t)
        if size >= BATCH_CHARS:
            batches.append(cur)
            cur, size = [], 0
    return batches + ([cur] if cur else [])


def limit_main(flags: list[str], corpus: str, shape: str, threads: int, gated: bool = False) -> None:
    """Runs in a fresh process (RAYON_NUM_THREADS set by the parent); prints one JSON line.
    ``gated``: once ready to start the clock, print "ready" and wait for a line on stdin (the
    time-sliced pairs of :func:`run_pair_sliced` time this process from outside)."""
    texts = load_texts(corpus)
    batches = limit_batches(texts, shape)
    encode = fastest_encode(flags, threads)
    if gated:
        print("ready", flush=True)
        sys.stdin.readline()
    t0 = time.perf_counter()
    tokens = sum(encode(b) for b in batches)
    print(json.dumps({"wall": time.perf_counter() - t0, "tokens": tokens, "texts": len(texts)}), flush=True)
    if gated:
        os._exit(0)  # the 2 GB of a huge batch's results need not be freed


def _limit_cmd(flags: list[str], corpus: str, shape: str, threads: int, gated: bool = False) -> tuple[list[str], dict]:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS="1")
    return [sys.executable, os.path.abspath(__file__), "--_limit", json.dumps([flags, corpus, shape, threads, gated])], env


def run_limit(flags: list[str], corpus: str, shape: str, threads: int) -> dict:
    cmd, env = _limit_cmd(flags, corpus, shape, threads)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"limit run failed:\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _tool_cmd(flags: list[str], corpus: str, out: str, workers: int, root: str = ROOT) -> tuple[list[str], dict]:
    cmd = [sys.executable, os.path.join(root, "tools", "preprocess_data.py"), "--input", corpus, "--output-prefix", out,
           *flags, "--append-eod", "--workers", str(workers), "--log-interval", "100000000"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAYON_NUM_THREADS", None)
    return cmd, env


def run_pair_sliced(flags: list[str], corpus: str, shape: str, out: str, k: int, slice_s: float,
                    tool_first: bool, aa: bool = False, aa_root: str = ROOT) -> tuple[dict, dict]:
    """The limit and the tool run as one paired round in alternating time slices of ``slice_s``
    seconds: while one runs, the other's process group is stopped (SIGSTOP, waited for), so each runs
    alone on the machine at any moment, and both see the machine's slow swings in speed (±20 % over
    tens of seconds on this VM) in equal measure. Each side's time is the sum of its slices, timed
    here: the tool's from the moment it is let go (a shell waiting on stdin then exec's it: start-up
    counted) to its exit; the limit's from the end of its untimed preparation (texts read, batches
    made, encoder built, alone, before the tool is let go) to its result line. Once one side is
    done the other runs to its end alone. ``aa``: the method's check, a second run of the tool (to
    ``out``_aa) in the limit's place, timed as the tool is; from the checkout ``aa_root`` for an A/B
    comparison of two versions of the tool (``--sliced-ab``)."""
    import select
    import signal

    tcmd, tenv = _tool_cmd(flags, corpus, out, k)
    if aa:
        lcmd, lenv = _tool_cmd(flags, corpus, out + "_aa", k, aa_root)
    else:
        lcmd, lenv = _limit_cmd(flags, corpus, shape, k, gated=True)
    gate = ["/bin/sh", "-c", 'read _ && exec "$0" "$@"']  # let go by a line on stdin: its start-up is timed
    procs = {"tool": subprocess.Popen(gate + tcmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, env=tenv, start_new_session=True),
             "limit": subprocess.Popen((gate if aa else []) + lcmd, stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL if aa else subprocess.PIPE, stderr=subprocess.PIPE,
                                       env=lenv, start_new_session=True)}
    by_exit = {"tool": True, "limit": aa}  # timed to its exit, else to its result line
    try:
        limit = procs["limit"]
        if not aa:
            if limit.stdout.readline().strip() != b"ready":
                raise SystemExit(f"limit run failed:\n{limit.stderr.read().decode()}")
            limit.stdin.write(b"go\n")  # read when it is first let run
            limit.stdin.close()
            os.killpg(limit.pid, signal.SIGSTOP)
            os.waitpid(limit.pid, os.WUNTRACED)
        fds = {s: os.pidfd_open(p.pid) if by_exit[s] else p.stdout.fileno() for s, p in procs.items()}
        spent = {"limit": 0.0, "tool": 0.0}
        result: dict = {}
        line = b""

        def finish(side: str, status: int, usage) -> None:
            proc = procs[side]
            proc.returncode = os.waitstatus_to_exitcode(status)
            rest = b"" if by_exit[side] else line + proc.stdout.read()
            if proc.returncode != 0 or not (by_exit[side] or rest.endswith(b"\n")):
                raise SystemExit(f"{side} run failed ({' '.join(proc.args)}):\n{proc.stderr.read().decode()}")
            if by_exit[side]:
                result[side] = {"wall": spent[side], "rss_mb": usage.ru_maxrss / 1024}
            else:
                res = json.loads(rest)
                result[side] = dict(res, wall=spent[side])  # its own clock also ran while it was stopped

        side = "tool" if tool_first else "limit"
        while True:
            proc, fd = procs[side], fds[side]
            if not proc.stdin.closed:
                proc.stdin.write(b"go\n")
                proc.stdin.close()
            os.killpg(proc.pid, signal.SIGCONT)
            t0 = time.perf_counter()
            end = t0 + slice_s if not result else float("inf")
            done = False
            while not done and time.perf_counter() < end:
                if select.select([fd], [], [], max(0.0, min(end - time.perf_counter(), 3600)))[0]:
                    if by_exit[side]:
                        done = True
                    else:
                        line += os.read(fd, 1 << 16)
                        done = line.endswith(b"\n")  # the result line: the limit's clock has stopped
            spent[side] += time.perf_counter() - t0
            if not done:
                try:
                    os.killpg(proc.pid, signal.SIGSTOP)
                except ProcessLookupError:  # it exited as its slice ended: wait4 below says so
                    pass
            _, status, usage = os.wait4(proc.pid, os.WUNTRACED)  # stopped, or exited (the limit exits at once)
            if not os.WIFSTOPPED(status):
                finish(side, status, usage)
                if len(result) == 2:
                    break
            side = "limit" if side == "tool" else "tool"
        for s in procs:
            if by_exit[s]:
                os.close(fds[s])
        if aa and not _same_files(out + "_text_document", out + "_aa_text_document"):
            raise SystemExit(f"the two tool runs of an A/A round wrote different files ({out}, {out}_aa)")
        return result["limit"], result["tool"]
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None and not f.closed:
                    f.close()


def run_tool(flags: list[str], corpus: str, out: str, workers: int) -> dict:
    """Wall seconds and peak RSS (MB) of one tools/preprocess_data.py run."""
    cmd, env = _tool_cmd(flags, corpus, out, workers)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode()
    p.stderr.close()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"preprocess_data.py failed ({' '.join(cmd)}):\n{err}")
    return {"wall": wall, "rss_mb": usage.ru_maxrss / 1024}


def run_megatron_lm(tree: str, flags: list[str], corpus: str, out: str, workers: int) -> float:
    """Wall seconds of Megatron-LM's own tools/preprocess_data.py (worker processes, one document
    per task) on the same corpus with the same tokenizer flags."""
    cmd = [sys.executable, os.path.join(tree, "tools", "preprocess_data.py"), "--input", corpus, "--output-prefix", out,
           *flags, "--append-eod", "--workers", str(workers), "--log-interval", "100000000"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=tree, PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"Megatron-LM's preprocess_data.py failed ({' '.join(cmd)}):\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0


def peer_table(args, cells, data, flags, corpora, documents) -> None:
    """One Megatron-LM run per cell of --peer-shapes (TikTokenizer: Megatron reads another file format)."""
    print("\n| tokenizer | corpus | workers | Megatron-LM (s) | ours (median s) | ours / Megatron-LM speed | "
          "Megatron-LM vs limit |\n|---|---|---|---|---|---|---|")
    for t, s, k in cells:
        if s not in args.peer_shapes or k not in args.peer_workers or t == "tiktoken":
            continue
        out = os.path.join(args.workdir, f"megatron_{t}_{s}_w{k}")
        wall = run_megatron_lm(os.path.abspath(args.megatron_lm), flags[t], corpora[(t, s)], out, k)
        c = data[(t, s, k)]
        eod = (c["tokens"] + documents[(t, s)]) / c["tokens"]
        ours = statistics.median(c["tool"])
        print(f"| {t} | {s} | {k} | {wall:.2f} | {ours:.2f} | {wall / ours:.2f}x | "
              f"{statistics.median(c['limit']) / wall * eod:.3f} |", flush=True)


def _same_files(a: str, b: str) -> bool:
    """Compared in small blocks: this process must stay small, because a child started with vfork
    (as subprocess does) inherits this process's peak RSS and would report it as its own."""
    import filecmp

    return all(filecmp.cmp(a + e, b + e, shallow=False) for e in (".bin", ".idx"))


def setup_main(workdir: str, tokenizers: list[str], shapes: list[str], size_mb: float | None, huge_mb: float) -> None:
    """Build corpora and tokenizers (in a child process: see :func:`setup`); prints them as JSON."""
    train = corpus_path(workdir, "ordinary", 20, huge_mb)
    flags = {t: tokenizer_flags(t, workdir, train) for t in tokenizers}
    corpora = [[t, s, corpus_path(workdir, s, size_mb or SIZE_MB[t], huge_mb)] for t in tokenizers for s in shapes]
    print(json.dumps({"flags": flags, "corpora": corpora}))


def available(tokenizers: list[str]) -> list[str]:
    """``tokenizers`` without tiktoken when the package (or TikTokenizer) is missing, said once."""
    if "tiktoken" not in tokenizers:
        return tokenizers
    try:
        import tiktoken  # noqa: F401
        from megatron_ru.config.tokenizer import TOKENIZER_TYPES
        assert "TikTokenizer" in TOKENIZER_TYPES
    except (ImportError, AssertionError):
        print("tiktoken (or TikTokenizer) not available: row skipped", file=sys.stderr)
        return [t for t in tokenizers if t != "tiktoken"]
    return tokenizers


def setup(args: argparse.Namespace) -> tuple[dict, dict]:
    """Corpora and tokenizers, built in a child process so that this process stays small: Linux
    carries a process's peak RSS across fork and exec, so every tool run started from a process
    that once held a 100 MB corpus in memory would report that process's peak as its own."""
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--_setup",
                        json.dumps([args.workdir, args.tokenizers, args.shapes, args.size_mb, args.huge_mb])],
                       stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit("building the corpora and tokenizers failed")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return out["flags"], {(t, s): path for t, s, path in out["corpora"]}


def compile_tool(root: str = ROOT) -> None:
    """The package's and the tool's bytecode in the checkout ``root``, as a pip install (not
    editable) leaves it: without it (PYTHONDONTWRITEBYTECODE=1, or sources newer than their .pyc)
    every run of the tool compiles its modules again, 25-40 ms of a 0.2 s start-up here."""
    import compileall

    for d in ("megatron_ru", "tools"):
        if not compileall.compile_dir(os.path.join(root, d), quiet=1):
            raise SystemExit(f"compiling {os.path.join(root, d)} failed")


def print_tables(results: dict) -> None:
    """The matrix and start-up tables of ``results`` (this run's, or several runs' merged): per cell
    the median over rounds of limit / tool (the tool's one end-of-document token per document
    counted as work), its spread, the same with that round's start-up taken off, peak RSS; fills
    in each cell's ``ratios``, ``median_ratio`` and ``median_ratio_after_startup``."""
    startup = results["startup_s"]
    print("\n| tokenizer | corpus (MB) | workers | rounds | limit (median s) | tool (median s) | "
          "**median paired ratio** | min-max | ratio after the tool's start-up | tool peak RSS (MB) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for c in results["cells"]:
        t = c["tokenizer"]
        eod = (c["tokens"] + c["documents"]) / c["tokens"] if c["tokens"] else 1.0  # 1 in an A/A run
        ratios = [lim / tool * eod for lim, tool in zip(c["limit_s"], c["tool_s"])]
        # the same, with the tool's fixed start-up of that round taken off (the limit has none: it is
        # timed after its process started and loaded the tokenizer)
        steady = [(lim - up * bool(results.get("sliced_aa"))) / (tool - up) * eod
                  for lim, tool, up in zip(c["limit_s"], c["tool_s"], startup[t])]
        c["ratios"] = [round(x, 4) for x in ratios]
        c["median_ratio"] = round(statistics.median(ratios), 4)
        c["median_ratio_after_startup"] = round(statistics.median(steady), 4)
        c["peak_rss_mb"] = max(c["rss_mb"])
        print(f"| {t} | {c['shape']} ({c['corpus_mb']:.0f}) | {c['workers']} | {len(ratios)} | "
              f"{statistics.median(c['limit_s']):.2f} | {statistics.median(c['tool_s']):.2f} | "
              f"**{c['median_ratio']:.3f}** | {min(ratios):.3f}-{max(ratios):.3f} | "
              f"{c['median_ratio_after_startup']:.3f} | {c['peak_rss_mb']} |")
    print("\n| tokenizer | tool start-up, one short document (median s) |\n|---|---|")
    for t, v in startup.items():
        print(f"| {t} | {statistics.median(v):.2f} |")


def merge_results(paths: list[str]) -> dict:
    """Whole runs of this script merged round by round: each file holds a run's output (its last
    line starting with '{' is the results JSON). A cell's rounds, and a tokenizer's start-up
    rounds, are those of every run that has them, in the order given."""
    merged: dict = {"merged_from": paths, "startup_s": {}, "cells": []}
    by_cell: dict = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            run = json.loads([line for line in f if line.startswith("{")][-1])
        method = (run.get("sliced_s", 0.0), run.get("sliced_aa", False), run.get("sliced_ab"))
        merged.setdefault("sliced_s", method[0])
        merged.setdefault("sliced_aa", method[1])
        merged.setdefault("sliced_ab", method[2])
        if method != (merged["sliced_s"], merged["sliced_aa"], merged["sliced_ab"]):
            raise SystemExit(f"{path}: --sliced {method[0]} (A/A: {method[1]}, A/B against: {method[2]}), not "
                             f"{merged['sliced_s']} (A/A: {merged['sliced_aa']}, A/B against: {merged['sliced_ab']}) "
                             "as the runs before: runs of one method only merge")
        for t, v in run["startup_s"].items():
            merged["startup_s"].setdefault(t, []).extend(v)
        for c in run["cells"]:
            c.setdefault("rss_mb", [c.get("peak_rss_mb", 0)] * len(c["limit_s"]))  # (runs before this option)
            key = (c["tokenizer"], c["shape"], c["workers"])
            if key not in by_cell:
                by_cell[key] = {k: c[k] for k in ("tokenizer", "shape", "corpus_mb", "workers", "tokens", "documents")}
                by_cell[key].update(limit_s=[], tool_s=[], rss_mb=[])
                merged["cells"].append(by_cell[key])
            elif (c["tokens"], c["documents"]) != (by_cell[key]["tokens"], by_cell[key]["documents"]):
                raise SystemExit(f"{path}: {key} ran on another corpus or tokenizer ({c['tokens']} tokens, not "
                                 f"{by_cell[key]['tokens']}); only runs on the same workdir merge")
            for k in ("limit_s", "tool_s", "rss_mb"):
                by_cell[key][k].extend(c[k])
    for c in merged["cells"]:
        if len(merged["startup_s"][c["tokenizer"]]) != len(c["limit_s"]):
            raise SystemExit(f"{c['tokenizer']} {c['shape']} w{c['workers']}: {len(c['limit_s'])} rounds but "
                             f"{len(merged['startup_s'][c['tokenizer']])} start-up rounds; merge whole runs")
    return merged


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("--_limit", "--_setup"):
        (limit_main if sys.argv[1] == "--_limit" else setup_main)(*json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizers", nargs="+", default=list(TOKENIZERS), choices=TOKENIZERS)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--size-mb", type=float, default=None,
                    help="ordinary and longtail corpora (default per tokenizer: SIZE_MB, 6-12 s of the "
                         "tokenizer alone on 2 threads here, so that the tool's fixed start-up of 0.15-0.25 s is "
                         "a few per cent)")
    ap.add_argument("--huge-mb", type=float, default=100.0, help="the one-document corpus")
    ap.add_argument("--repeat", type=int, default=3, help="paired rounds")
    ap.add_argument("--workdir", default="/tmp/bench_preprocess_matrix")
    ap.add_argument("--sliced", type=float, default=0.0, metavar="SECONDS",
                    help="run each round's limit and tool in alternating time slices of SECONDS (each alone on the "
                         "machine at any moment; see run_pair_sliced) instead of one after the other")
    ap.add_argument("--sliced-aa", action="store_true",
                    help="the sliced method's own check: a second run of the tool in the limit's place (ratios "
                         "should be 1 within the method's error)")
    ap.add_argument("--sliced-ab", default=None, metavar="DIR",
                    help="as --sliced-aa, but the second tool is DIR's (another checkout, e.g. `git worktree add "
                         "DIR COMMIT` with its C++ extension built): ratios are DIR's time over this tree's, so "
                         "above 1 means this tree's tool is faster")
    ap.add_argument("--megatron-lm", default=None, metavar="DIR",
                    help="a Megatron-LM source tree (tools/ and megatron/; see the module docstring): its "
                         "tools/preprocess_data.py runs once per cell of --peer-shapes as a peer")
    ap.add_argument("--peer-shapes", nargs="+", default=["ordinary"], choices=SHAPES)
    ap.add_argument("--peer-workers", type=int, nargs="+", default=[2])
    ap.add_argument("--merge", nargs="+", default=None, metavar="LOG",
                    help="run nothing: print the tables of earlier runs' outputs (stdout, or stdout and stderr "
                         "together) merged round by round, e.g. two runs of 5 rounds as 10")
    args = ap.parse_args()
    if (args.sliced_aa or args.sliced_ab) and not args.sliced:
        ap.error("--sliced-aa and --sliced-ab need --sliced SECONDS")
    if args.sliced_ab:
        if not os.path.isfile(os.path.join(args.sliced_ab, "tools", "preprocess_data.py")):
            ap.error(f"--sliced-ab {args.sliced_ab}: no tools/preprocess_data.py there (a checkout of this repository)")
        args.sliced_ab = os.path.abspath(args.sliced_ab)
        args.sliced_aa = True
    if args.merge:
        results = merge_results(args.merge)
        print_tables(results)
        print(json.dumps(results))
        return
    os.makedirs(args.workdir, exist_ok=True)
    args.tokenizers = available(args.tokenizers)
    flags, corpora = setup(args)
    compile_tool()
    if args.sliced_ab:
        compile_tool(args.sliced_ab)
    cells = [(t, s, k) for t in args.tokenizers for s in args.shapes for k in args.workers]
    data: dict = {c: {"ratios": [], "limit": [], "tool": [], "rss": []} for c in cells}
    startup: dict = {t: [] for t in args.tokenizers}
    tiny = startup_corpus(args.workdir)
    load_before = os.getloadavg()[0]
    for r in range(args.repeat):
        for t in args.tokenizers:
            startup[t].append(run_tool(flags[t], tiny, os.path.join(args.workdir, f"out_startup_{t}"), 1)["wall"])
            print(f"round {r + 1} {t:13s} start-up (one short document): {startup[t][-1]:.2f} s", file=sys.stderr,
                  flush=True)
        for t, s, k in cells:
            out = os.path.join(args.workdir, f"out_{t}_{s}_w{k}")
            steps = ["limit", "tool"] if r % 2 == 0 else ["tool", "limit"]
            res = {}
            if args.sliced:
                res["limit"], res["tool"] = run_pair_sliced(flags[t], corpora[(t, s)], s, out, k, args.sliced,
                                                            steps[0] == "tool", args.sliced_aa,
                                                            args.sliced_ab or ROOT)
            else:
                for step in steps:
                    res[step] = (run_limit(flags[t], corpora[(t, s)], s, k) if step == "limit"
                                 else run_tool(flags[t], corpora[(t, s)], out, k))
            cell = data[(t, s, k)]
            cell["tokens"] = res["limit"].get("tokens", 0)  # (none in an A/A run)
            cell["limit"].append(res["limit"]["wall"])
            cell["tool"].append(res["tool"]["wall"])
            cell["rss"].append(res["tool"]["rss_mb"])
            print(f"round {r + 1} {t:13s} {s:9s} workers {k}: limit {res['limit']['wall']:7.2f} s, tool "
                  f"{res['tool']['wall']:7.2f} s ({res['tool']['rss_mb']:.0f} MB), ratio "
                  f"{res['limit']['wall'] / res['tool']['wall']:.3f}", file=sys.stderr, flush=True)
    results = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "python": platform.python_version(), "sliced_s": args.sliced, "sliced_aa": args.sliced_aa, "sliced_ab": args.sliced_ab, "load_before": load_before, "load_after": os.getloadavg()[0],
               "startup_s": {t: [round(x, 3) for x in v] for t, v in startup.items()}, "cells": []}
    documents = {c: sum(1 for _ in open(p, "rb")) for c, p in corpora.items()}
    for t, s, k in cells:
        c = data[(t, s, k)]
        results["cells"].append({"tokenizer": t, "shape": s, "corpus_mb": round(os.path.getsize(corpora[(t, s)]) / 1e6, 2),
                                 "workers": k, "tokens": c["tokens"], "documents": documents[(t, s)],
                                 "limit_s": [round(x, 3) for x in c["limit"]], "tool_s": [round(x, 3) for x in c["tool"]],
                                 "rss_mb": [round(x) for x in c["rss"]]})
    print_tables(results)
    if args.megatron_lm:
        peer_table(args, cells, data, flags, corpora, documents)
    identical = {}
    for t in args.tokenizers:
        for s in args.shapes:
            outs = [os.path.join(args.workdir, f"out_{t}_{s}_w{k}_text_document") for k in args.workers]
            identical[f"{t}/{s}"] = all(_same_files(outs[0], o) for o in outs[1:])
    results["outputs_identical_across_workers"] = identical
    print(json.dumps(results))


if __name__ == "__main__":
    main()
