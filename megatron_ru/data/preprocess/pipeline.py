"""Run preprocessing: stream batches to workers, write results in input order, report.

Memory is bounded: at most ``2 × workers`` batches are in flight (a plain ``Pool.imap`` would
read the whole input ahead), so memory is a few batches plus the largest document. Outputs
are written under temporary names and only renamed into place once the whole input has been
read without error. Any ``--workers``/``--partitions`` gives the same bytes: batches are cut
from the input independently of them and their results are written in input order.
"""
from __future__ import annotations

import os
import time
import traceback
from collections import Counter, deque
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from megatron_ru.config.tokenizer import TokenizerConfig
from megatron_ru.data.indexed_dataset import IndexedDatasetBuilder, best_fitting_dtype
from megatron_ru.data.preprocess.config import PreprocessConfig
from megatron_ru.data.preprocess import encode as encode_module
from megatron_ru.data.preprocess.encode import BatchResult, EncodeOptions, Encoder
from megatron_ru.data.preprocess.interrupts import DeferredInterrupt, Interrupted, stop_signals_raise
from megatron_ru.data.preprocess.reader import Batch, Segment, expand_inputs, plan_partitions, read_batches
from megatron_ru.data.preprocess.text import sanitize_name
from megatron_ru.data.tokenizer import Tokenizer, build_tokenizer
from megatron_ru.utils.logging import get_logger

log = get_logger(__name__)

def output_prefix(prefix: str, key: str, group: Optional[str], level: str = "document") -> str:
    """``<prefix>_<key>_<level>`` or, grouped, ``<prefix>_<group>_<key>_<level>``; the level is
    ``sentence`` with --split-sentences (Megatron-LM's naming), else ``document``."""
    return f"{prefix}_{key}_{level}" if group is None else f"{prefix}_{group}_{key}_{level}"


@dataclass
class Summary:
    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    lines: int = 0
    bytes: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_skipped: dict = field(default_factory=dict)
    seconds: float = 0.0
    outputs: dict = field(default_factory=dict)  # final prefix -> {"documents":, "sequences":, "tokens":}
    groups: dict = field(default_factory=dict)  # raw group value -> sanitized name
    origin: dict = field(default_factory=dict)  # final prefix -> (raw group value or None, json key)

    def add(self, r: BatchResult) -> None:
        self.documents += r.documents
        self.tokens += r.tokens
        self.lines += r.lines
        self.bytes += r.bytes
        self.skipped.update(r.skipped)
        for k, v in r.first_skipped.items():
            self.first_skipped.setdefault(k, v)


class _Writers:
    """One builder per (group, key), created on first use, all finalized or all aborted."""

    def __init__(self, prefix: str, dtype: type, summary: Summary, level: str) -> None:
        self.prefix = prefix
        self.level = level
        self.dtype = dtype
        self.summary = summary
        self.builders: dict[tuple[Optional[str], str], IndexedDatasetBuilder] = {}
        self._owner: dict[str, str] = {}  # sanitized name -> first raw value

    def group_name(self, value: Optional[str]) -> Optional[str]:
        if value is None:
            return None
        name = self.summary.groups.get(value)
        if name is None:
            name = sanitize_name(value)
            other = self._owner.setdefault(name, value)
            if other != value:
                raise ValueError(f"--group-by-key values {other!r} and {value!r} both map to the file name part "
                                 f"{name!r}; rename one of them in the input")
            self.summary.groups[value] = name
        return name

    def builder(self, group: Optional[str], key: str) -> IndexedDatasetBuilder:
        b = self.builders.get((group, key))
        if b is None:
            path = output_prefix(self.prefix, key, self.group_name(group), self.level) + ".bin"
            b = self.builders[(group, key)] = IndexedDatasetBuilder(path, self.dtype)
        return b

    def write(self, r: BatchResult) -> None:
        for (group, key), out in r.outputs.items():
            self.builder(group, key).add_documents(out.tokens, out.sequence_lengths, out.sequences_per_document)

    def finalize(self) -> None:
        for (group, key), b in self.builders.items():
            final = output_prefix(self.prefix, key, self.group_name(group), self.level)
            b.finalize(final + ".idx")
            self.summary.origin[final] = (group, key)
            self.summary.outputs[final] = {"documents": len(b.document_indices) - 1,
                                           "sequences": len(b.sequence_lengths),
                                           "tokens": int(sum(b.sequence_lengths))}
        self.summary.sequences = sum(o["sequences"] for o in self.summary.outputs.values())

    def abort(self) -> None:
        for b in self.builders.values():
            b.abort()


def _level(opts: EncodeOptions) -> str:
    return "sentence" if opts.split_sentences else "document"


class _Progress:
    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.start = time.perf_counter()
        self.next_at = interval

    def update(self, s: Summary) -> None:
        if s.documents < self.next_at:
            return
        self.next_at = (s.documents // self.interval + 1) * self.interval
        dt = max(time.perf_counter() - self.start, 1e-9)
        log.info(f"processed {s.documents} documents ({s.documents / dt:.1f} docs/s), {s.tokens} tokens "
                 f"({s.tokens / dt:.0f} tokens/s), {s.bytes / 1e6:.1f} MB ({s.bytes / 1e6 / dt:.2f} MB/s)")


MAX_AUTO_THREADS = 8


def choose_worker_type(requested: str, workers: int, tokenizer: Tokenizer) -> str:
    """``thread`` or ``process`` for ``--worker-type`` (``auto`` decides here).

    Threads cost nothing to start and share the batches and results without copying, but the
    work around the tokenizer call (splitting lines, assembling arrays; the JSON itself is parsed
    in C++ without the GIL) holds the GIL: about 2 % of the CPU time with SentencePiece on the
    benchmark corpus (cProfile), and every hand-over of the GIL costs more with more threads.
    ``MAX_AUTO_THREADS`` keeps ``auto`` to counts where that is clearly small; above it, and for
    tokenizers that hold the GIL, processes (measured here on 2 cores only). ``thread`` with a
    tokenizer that holds the GIL falls back to processes, and says so (once)."""
    if requested == "thread" and not tokenizer.releases_gil:
        if workers > 1:
            log.warning(f"--worker-type thread: {tokenizer.describe()} holds the GIL while tokenizing, so threads "
                        "would run one at a time; using worker processes instead (SentencePiece releases it "
                        "from sentencepiece 0.2.2 on; Hugging Face tokenizers with a tokenizer.json always do)")
        return "process"
    if requested != "auto":
        return requested
    return "thread" if tokenizer.releases_gil and workers <= MAX_AUTO_THREADS else "process"


def _results(batches: Iterable[Batch], encoder: Encoder, workers: int, worker_type: str) -> Iterable[BatchResult]:
    """Encoded batches in input order; at most 2 × workers in flight. ``--workers 1``: in the main
    process, or, with threads, one worker thread beside the main thread that reads and parses.
    A stop signal (Ctrl-C, SIGTERM) is looked at between batches and while waiting for one."""
    if workers == 1 and worker_type != "thread":
        for b in batches:
            yield encoder.encode(b)
        return
    if worker_type == "thread":
        from concurrent.futures import ThreadPoolExecutor

        # The main thread reads and parses the JSON of the next batches (C++, the GIL released)
        # while the workers tokenize: with one worker that takes the parsing off the tokenizing
        # core (the tokenizer calls release the GIL too).
        threads = ThreadPoolExecutor(workers, thread_name_prefix="encode")
        submit = lambda b: threads.submit(encoder.encode, encoder.parse(b))  # noqa: E731
        get = _future_result
        end = abort = lambda: threads.shutdown(wait=True, cancel_futures=True)  # noqa: E731
    else:
        from megatron_ru.data.preprocess.workers import ProcessWorkers

        procs = ProcessWorkers(encoder.encode, workers)  # forked: they inherit the loaded tokenizer
        submit, get, end, abort = procs.submit, procs.result, procs.close, procs.kill
    try:
        with DeferredInterrupt() as interrupt:
            pending: deque = deque()
            for b in batches:
                interrupt.check()
                pending.append(submit(b))
                if len(pending) >= 2 * workers:
                    yield get(pending.popleft(), interrupt)
            while pending:
                yield get(pending.popleft(), interrupt)
    except BaseException:  # a stop signal, an error here or in the consumer (GeneratorExit)
        abort()
        raise
    end()


def _future_result(future, interrupt: "DeferredInterrupt"):
    while True:
        interrupt.check()
        try:
            return future.result(timeout=interrupt.POLL_SECONDS)
        except TimeoutError:
            pass


def _check_all_keys(writers: _Writers, keys: Iterable[str], s: Summary) -> None:
    missing = [k for k in keys if not any(k == key for _, key in writers.builders)]
    if missing:
        raise ValueError(f"no documents for key(s) {missing} (skipped: {dict(s.skipped) or 'nothing'}); nothing "
                         "was written. Check --json-keys and the input")


def process_segments(segments: list[Segment], prefix: str, tokenizer: Tokenizer, opts: EncodeOptions,
                     workers: int, batch_bytes: int, log_interval: int, require_all_keys: bool = True,
                     worker_type: str = "process") -> Summary:
    """Tokenize ``segments`` into datasets at ``prefix`` (all-or-nothing)."""
    summary = Summary()
    writers = _Writers(prefix, np.dtype(opts.dtype).type, summary, _level(opts))
    progress = _Progress(log_interval)
    encoder = Encoder(tokenizer, opts)
    t0 = time.perf_counter()
    try:
        warned_uncut = False
        # batches stay in the mapped file where they are parsed in this process
        mapped = encode_module.extract_strings_lines is not None and (worker_type == "thread" or workers == 1)
        # closed here, not when the traceback is freed: an error stops the workers at once
        batches = read_batches(segments, batch_bytes, mapped)
        with closing(_results(batches, encoder, workers, worker_type)) as results:
            for r in results:
                if r.error is not None:
                    raise ValueError(r.error)
                if r.uncut and not warned_uncut:
                    warned_uncut = True
                    log.warning(f"texts over --tokenize-chunk-chars {opts.chunk_chars} are tokenized whole, on one "
                                f"thread (no cut is proven to keep the ids for {tokenizer.cut_reason})")
                summary.add(r)
                writers.write(r)
                progress.update(summary)
        if require_all_keys:
            _check_all_keys(writers, opts.json_keys, summary)
        writers.finalize()
    except BaseException:
        writers.abort()
        raise
    summary.seconds = time.perf_counter() - t0
    return summary


def _partition_main(index, segments, prefix, tokenizer, opts, workers, worker_type, batch_bytes, log_interval,
                    queue) -> None:
    try:
        summary = process_segments(segments, prefix, tokenizer, opts, workers, batch_bytes, log_interval,
                                   require_all_keys=False, worker_type=worker_type)
        queue.put((index, "ok", summary))
    except Interrupted as e:  # a signal to the whole group (a terminal's Ctrl-C): the parent stops too
        queue.put((index, "interrupted", e.signum))
    except BaseException as e:  # reported to the parent, which raises it
        queue.put((index, "error", str(e) if isinstance(e, (ValueError, OSError)) else traceback.format_exc()))


def _run_partitions(parts: list[list[Segment]], cfg: PreprocessConfig, tokenizer: Tokenizer,
                    opts: EncodeOptions, worker_type: str) -> list[tuple[str, Optional[Summary]]]:
    """Each part in its own process, into temporary shard datasets; returns (shard prefix, summary)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    per_part = max(1, cfg.workers // len(parts))
    shard_prefixes = [f"{cfg.output_prefix}.part{i}.tmp-{os.getpid()}" for i in range(len(parts))]
    procs = [ctx.Process(target=_partition_main, args=(i, segs, shard_prefixes[i], tokenizer, opts, per_part,
                                                       worker_type, cfg.batch_bytes, cfg.log_interval, queue))
             for i, segs in enumerate(parts)]
    summaries: list[Optional[Summary]] = [None] * len(parts)
    errors: dict[int, str] = {}
    try:
        for p in procs:
            p.start()
        _collect(queue, procs, parts, summaries, errors)
    except BaseException:  # a stop signal here: the partitions stop too, and leave nothing
        _stop(procs)
        _remove_shards(shard_prefixes)
        raise
    for p in procs:
        p.join()
    if errors:
        _remove_shards(shard_prefixes)
        raise ValueError(errors[min(errors)])  # the first error in input order
    return list(zip(shard_prefixes, summaries))


def _collect(queue, procs, parts, summaries: list, errors: dict) -> None:
    import queue as queue_module

    reported: set[int] = set()
    while len(reported) < len(procs):
        try:
            index, status, payload = queue.get(timeout=1.0)
        except queue_module.Empty:
            # A partition killed from outside (e.g. out of memory) never reports: do not wait forever.
            for i, p in enumerate(procs):
                if i not in reported and p.exitcode is not None and p.exitcode != 0 and queue.empty():
                    reported.add(i)
                    errors[i] = f"partition {i} ({parts[i][0].path} ...) died with exit code {p.exitcode}"
            continue
        reported.add(index)
        if status == "interrupted":
            raise Interrupted(payload)
        if status == "error":
            errors[index] = payload
        else:
            summaries[index] = payload


def _stop(procs, grace: float = 30.0) -> None:
    """SIGTERM: each partition stops its workers and removes what it wrote; killed if it takes
    longer than ``grace`` seconds (it may be blocked on its report to the queue nobody reads)."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        if p.pid is None:
            continue
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


def _remove_shards(shard_prefixes: list[str]) -> None:
    """Every file of the shards, finished or not (a partition's unfinished ``*.tmp-<pid>`` too)."""
    import glob

    for prefix in shard_prefixes:
        for path in glob.glob(glob.escape(prefix) + "_*"):
            os.remove(path)


def _merge(shards, cfg: PreprocessConfig, dtype: type) -> Summary:
    """Concatenate the shard datasets in partition order into the final outputs."""
    total = Summary()
    for _, s in shards:
        if s is not None:
            for field_ in ("documents", "tokens", "lines", "bytes"):
                setattr(total, field_, getattr(total, field_) + getattr(s, field_))
            total.skipped.update(s.skipped)
            for k, v in s.first_skipped.items():
                total.first_skipped.setdefault(k, v)
    writers = _Writers(cfg.output_prefix, dtype, total, "sentence" if cfg.split_sentences else "document")
    try:
        for shard_prefix, s in shards:
            if s is None:
                continue
            for pre in s.outputs:  # insertion order: first appearance in the shard
                group, key = s.origin[pre]
                writers.builder(group, key).add_index(pre)
        _check_all_keys(writers, cfg.json_keys, total)
        writers.finalize()
    except BaseException:
        writers.abort()
        raise
    finally:
        _remove_shards([prefix for prefix, _ in shards])
    return total


def run(cfg: PreprocessConfig, tok_cfg: TokenizerConfig) -> Summary:
    """Validate everything, build the tokenizer, then process the input (the whole tool)."""
    problems = cfg.problems() + tok_cfg.problems()
    if problems:
        raise ValueError("invalid arguments:\n" + "\n".join(f"  - {p}" for p in problems))
    files = expand_inputs(cfg.input)
    with _serial_library_calls(), stop_signals_raise():
        return _run(cfg, tok_cfg, files)


@contextmanager
def _serial_library_calls():
    """The workers are the tool's parallelism: each tokenizer call stays on the thread that makes
    it. The ``tokenizers`` library (GPT-2 BPE, Hugging Face) would also spread every batch call
    over its own Rust pool, and worker threads that each drive a pool oversubscribe the cores:
    GPT-2 BPE, 80 MB, 2 worker threads on 2 cores took 10.1 s with a pool of 2 and 8.1 s without
    (4 rounds in one process). The library reads ``TOKENIZERS_PARALLELISM`` at every call; it is
    set for the run and restored after (a user's ``true`` included: it only slows the tool)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _run(cfg: PreprocessConfig, tok_cfg: TokenizerConfig, files: list[str]) -> Summary:
    tokenizer = build_tokenizer(tok_cfg)
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    opts = EncodeOptions(json_keys=tuple(cfg.json_keys), group_by_key=cfg.group_by_key,
                         split_sentences=cfg.split_sentences, keep_newlines=cfg.keep_newlines,
                         split_paragraphs=cfg.split_paragraphs, append_eod=cfg.append_eod,
                         skip_invalid=cfg.skip_invalid, chunk_chars=cfg.tokenize_chunk_chars,
                         dtype=np.dtype(dtype).name, spread_threads=max(cfg.workers, tok_cfg.tokenizer_num_threads))
    worker_type = choose_worker_type(cfg.worker_type, cfg.workers, tokenizer)
    if encode_module.extract_strings_lines is None:
        log.warning("the C++ JSONL fast path (megatron_ru.data.preprocess._jsonl, csrc/jsonl.cpp) is not built: "
                    "every line goes through Python's json module (same output, slower). Build it with "
                    "'pip install --no-build-isolation -e .' or 'python setup.py build_ext --inplace'")
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    log.info(f"{_count(len(files), 'input file')}; tokenizer {tokenizer.describe()}; token dtype "
             f"{np.dtype(dtype).name}; {_workers_phrase(cfg.workers, worker_type)}, {_count(cfg.partitions, 'partition')}")
    t0 = time.perf_counter()
    parts = plan_partitions(files, cfg.partitions)
    if len(parts) == 1:
        summary = process_segments(parts[0], cfg.output_prefix, tokenizer, opts, cfg.workers, cfg.batch_bytes,
                                   cfg.log_interval, worker_type=worker_type)
    else:
        summary = _merge(_run_partitions(parts, cfg, tokenizer, opts, worker_type), cfg, dtype)
    summary.seconds = time.perf_counter() - t0
    return summary


def _count(n: int, noun: str) -> str:
    """``1 partition``, ``2 partitions``, ``3 processes``."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun}es" if noun.endswith(("s", "sh", "ch", "x")) else f"{n} {noun}s"


def _workers_phrase(workers: int, worker_type: str) -> str:
    if workers == 1:
        return "1 worker thread" if worker_type == "thread" else "1 worker (the main process)"
    return f"{workers} worker {_count(workers, worker_type).split(' ', 1)[1]}"


def format_summary(s: Summary) -> str:
    lines = [f"done in {s.seconds:.2f} s: {_count(s.documents, 'document')}, {_count(s.sequences, 'sequence')}, "
             f"{_count(s.tokens, 'token')} from {_count(s.lines, 'line')} ({s.bytes / 1e6:.2f} MB; "
             f"{s.tokens / max(s.seconds, 1e-9):.0f} tokens/s)"]
    if s.skipped:
        for reason, n in sorted(s.skipped.items()):
            where = s.first_skipped.get(reason)
            lines.append(f"  skipped {n} × {reason}" + (f" (first at {where})" if where else ""))
    else:
        lines.append("  skipped nothing")
    for pre, o in s.outputs.items():
        lines.append(f"  wrote {pre}.bin/.idx: {_count(o['documents'], 'document')}, "
                     f"{_count(o['sequences'], 'sequence')}, {_count(o['tokens'], 'token')}")
    return "\n".join(lines)
