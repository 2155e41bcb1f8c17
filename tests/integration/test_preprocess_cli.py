"""tools/preprocess_data.py end to end: round trips, an independent reader of the documented
byte layout, determinism across --workers/--partitions, and every kind of bad input."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest

from megatron_ru.config.tokenizer import TokenizerConfig
from megatron_ru.data.tokenizer import build_tokenizer
from tests.fixtures.tokenizers import (make_gpt2_bpe_files, make_hf_tokenizer_dir, make_sentencepiece,
                                      make_tiktoken_file, sample_texts,
                                      tricky_text)

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "preprocess_data.py")
_spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def read_dataset(prefix: str) -> tuple[np.dtype, list[list[np.ndarray]]]:
    """Independent reader written from docs/data_format.md: documents as lists of sequences."""
    codes = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", idx, 9)
    assert version == 1
    off = 34
    lengths = struct.unpack_from(f"<{n_seq}i", idx, off)
    pointers = struct.unpack_from(f"<{n_seq}q", idx, off + 4 * n_seq)
    doc_idx = struct.unpack_from(f"<{n_doc}q", idx, off + 12 * n_seq)
    assert len(idx) == off + 12 * n_seq + 8 * n_doc
    dtype = np.dtype(codes[code])
    data = open(prefix + ".bin", "rb").read()
    assert len(data) == sum(lengths) * dtype.itemsize
    seqs = [np.frombuffer(data, dtype, count=n, offset=p) for n, p in zip(lengths, pointers)]
    assert doc_idx[0] == 0 and doc_idx[-1] == n_seq and list(doc_idx) == sorted(doc_idx)
    return dtype, [seqs[a:b] for a, b in zip(doc_idx[:-1], doc_idx[1:])]


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    vocab, merges = make_gpt2_bpe_files(d)
    return {"sp": ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", make_sentencepiece(d)],
            "gptsp": ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", make_sentencepiece(d)],
            "unigram": ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                        make_sentencepiece(d, "unigram")],
            "gpt2": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges],
            "hf": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", make_hf_tokenizer_dir(d)],
            "tiktoken": ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", make_tiktoken_file(d)]}


def tokenizer_of(args: list[str]):
    flags = dict(zip(args[::2], args[1::2]))
    return build_tokenizer(TokenizerConfig(flags["--tokenizer-type"], flags.get("--tokenizer-model"),
                                           flags.get("--vocab-file"), flags.get("--merge-file")))


TEXTS = sample_texts(60, seed=7) + ["  leading spaces\n\nand a trailing break\n\n", "one", "<EOD> is text here"]


def write_jsonl(path, records, mode="w"):
    with open(path, mode, encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return str(path)


@pytest.fixture
def corpus(tmp_path):
    return write_jsonl(tmp_path / "in.jsonl", [{"text": t, "domain": ("ru/news", "wiki")[i % 2]}
                                               for i, t in enumerate(TEXTS)])


def run(input_, prefix, tok_args, *extra):
    return tool.main(["--input", *([input_] if isinstance(input_, str) else input_), "--output-prefix", str(prefix),
                      *tok_args, *extra])


def outputs(tmp_path, stem="out"):
    return sorted(f for f in os.listdir(tmp_path) if f.startswith(stem))


MODES = {"plain": [], "eod": ["--append-eod"], "sentences": ["--split-sentences", "--keep-newlines"],
         "sentences_no_newlines": ["--split-sentences", "--append-eod"], "paragraphs": ["--split-paragraphs", "--append-eod"]}


@pytest.mark.parametrize("tok_name", ["sp", "gptsp", "gpt2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_round_trip(tmp_path, corpus, tok_files, tok_name, mode):
    args = MODES[mode]
    summary = run(corpus, tmp_path / "out", tok_files[tok_name], *args, "--batch-bytes", "3000")
    tok = tokenizer_of(tok_files[tok_name])
    level = "sentence" if "--split-sentences" in args else "document"  # Megatron-LM's naming
    dtype, docs = read_dataset(str(tmp_path / f"out_text_{level}"))
    assert dtype == np.dtype("<u2") and len(docs) == len(TEXTS) == summary.documents
    for text, seqs in zip(TEXTS, docs):
        seqs = [s.tolist() for s in seqs]
        if "--append-eod" in args:
            assert seqs[-1][-1] == tok.eod
            seqs[-1] = seqs[-1][:-1]
        assert all(tok.eod not in s for s in seqs) or "<EOD>" in text
        decoded = [tok.detokenize(s) for s in seqs]
        if mode == "sentences_no_newlines":  # Megatron semantics: whitespace between sentences dropped
            assert re.sub(r"\s", "", "".join(decoded)) == re.sub(r"\s", "", text)
            assert len(seqs) > 1 or "." not in text.strip()[:-1]
        else:
            assert "".join(decoded) == text
        if mode == "paragraphs":
            assert len(seqs) == len(re.findall(r"\S\n[^\S\n]*\n\s*(?=\S)", text)) + 1
    assert outputs(tmp_path) == [f"out_text_{level}.bin", f"out_text_{level}.idx"]


def test_int32_and_hf_and_two_keys(tmp_path, tok_files):
    """NullTokenizer with a 70,000-id vocabulary → int32; an HF directory; two --json-keys."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 70000, size=int(rng.integers(1, 50))).tolist() for _ in range(40)]
    path = write_jsonl(tmp_path / "n.jsonl", [{"text": " ".join(map(str, d)), "title": f"{i} {i}"} for i, d in enumerate(docs)])
    run(path, tmp_path / "out", ["--tokenizer-type", "NullTokenizer", "--vocab-size", "70000"], "--append-eod",
        "--json-keys", "text", "title")
    dtype, got = read_dataset(str(tmp_path / "out_text_document"))
    assert dtype == np.dtype("<i4")
    assert [s[0].tolist() for s in got] == [d + [70000] for d in docs]
    _, titles = read_dataset(str(tmp_path / "out_title_document"))
    assert [s[0].tolist() for s in titles] == [[i, i, 70000] for i in range(40)]
    run(path, tmp_path / "hf", tok_files["hf"], "--json-keys", "title")
    tok = tokenizer_of(tok_files["hf"])
    _, got = read_dataset(str(tmp_path / "hf_title_document"))
    assert [tok.detokenize(s[0]) for s in got] == [f"{i} {i}" for i in range(40)]


@pytest.mark.parametrize("tok_name", ["sp", "gptsp", "unigram", "gpt2", "hf", "tiktoken"])
def test_workers_partitions_and_chunking_give_identical_bytes(tmp_path, corpus, tok_files, tok_name):
    base = ["--split-paragraphs", "--append-eod", "--group-by-key", "domain", "--batch-bytes", "2000"]
    variants = {"w1": [], "w1proc": ["--worker-type", "process"], "w2": ["--workers", "2"],
                "w2proc": ["--workers", "2", "--worker-type", "process"],
                "w3thread": ["--workers", "3", "--worker-type", "thread"],
                "w2p3": ["--workers", "2", "--partitions", "3"],
                "chunked": ["--tokenize-chunk-chars", "40"], "batch7k": ["--batch-bytes", "7000"],
                "w2chunked": ["--workers", "2", "--tokenize-chunk-chars", "25"],
                "w2procchunked": ["--workers", "2", "--worker-type", "process", "--tokenize-chunk-chars", "60"]}
    for name, extra in variants.items():
        s = run(corpus, tmp_path / name, tok_files[tok_name], *base, *extra)
        assert sorted(s.outputs) == [str(tmp_path / f"{name}_{g}_text_document") for g in ("ru_news", "wiki")]
    for g in ("ru_news", "wiki"):
        for ext in (".bin", ".idx"):
            ref = open(tmp_path / f"w1_{g}_text_document{ext}", "rb").read()
            for name in variants:
                assert open(tmp_path / f"{name}_{g}_text_document{ext}", "rb").read() == ref, (name, g, ext)
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    _, news = read_dataset(str(tmp_path / "w1_ru_news_text_document"))
    assert len(news) == (len(TEXTS) + 1) // 2


@pytest.mark.parametrize("tok_name", ["gpt2", "hf"])
def test_tokenizers_library_calls_stay_on_the_worker_threads(tmp_path, corpus, tok_files, tok_name, monkeypatch):
    """The worker threads are the parallelism: a `tokenizers` batch call made by one of them does
    not also spread over the library's own pool (TOKENIZERS_PARALLELISM=false while the tool runs,
    a user's `true` included), and the user's setting is back afterwards."""
    from megatron_ru.data.tokenizers import huggingface

    seen = []
    original = huggingface.fast_batch_arrays

    def recording(fast, texts):
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        return original(fast, texts)

    monkeypatch.setattr(huggingface, "fast_batch_arrays", recording)  # (GPT-2 BPE imports it at each call)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    run(corpus, tmp_path / "w2", tok_files[tok_name], "--workers", "2", "--batch-bytes", "2000", "--append-eod")
    assert len(seen) > 2 and set(seen) == {"false"}
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    run(corpus, tmp_path / "w1", tok_files[tok_name], "--append-eod")
    assert "TOKENIZERS_PARALLELISM" not in os.environ
    for ext in (".bin", ".idx"):
        assert open(tmp_path / f"w2_text_document{ext}", "rb").read() == \
            open(tmp_path / f"w1_text_document{ext}", "rb").read()


@pytest.mark.parametrize("tok_name", ["sp", "gptsp", "unigram", "gpt2", "hf", "tiktoken"])
def test_huge_documents_equal_the_whole_text_encoding(tmp_path, tok_files, tok_name):
    """Documents of several MB are cut into pieces spread over the workers; their ids are exactly
    the tokenizer's ids of the whole text, for every tokenizer type and worker layout."""
    tok = tokenizer_of(tok_files[tok_name])
    big = "\n\n".join(sample_texts(9000, seed=11))  # ~3 MB, double spaces included
    odd = tricky_text(5, 60000)  # runs of spaces, emoji, special-token text, Unicode spaces
    docs = [big, "a short one", odd]
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in docs])
    expected = [tok.tokenize(t) + [tok.eod] for t in docs]
    for name, extra in {"w1": [], "w2": ["--workers", "2"], "w2proc": ["--workers", "2", "--worker-type", "process"],
                        "w2small": ["--workers", "2", "--tokenize-chunk-chars", "5000", "--partitions", "2"]}.items():
        run(path, tmp_path / name, tok_files[tok_name], "--append-eod", *extra)
        _, got = read_dataset(str(tmp_path / f"{name}_text_document"))
        assert [s[0].tolist() for s in got] == expected, name
    assert len(big) > 3_000_000 and tok.cut_mode is not None


def test_gz_glob_and_several_files_equal_one_file(tmp_path, corpus, tok_files):
    lines = open(corpus, encoding="utf-8").read().splitlines(keepends=True)
    os.makedirs(tmp_path / "parts")
    with gzip.open(tmp_path / "parts" / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(lines[:20])
    (tmp_path / "parts" / "b.jsonl").write_text("".join(lines[20:]), encoding="utf-8")
    run(corpus, tmp_path / "one", tok_files["gpt2"])
    run(str(tmp_path / "parts" / "*"), tmp_path / "glob", tok_files["gpt2"], "--workers", "2", "--partitions", "2")
    for ext in (".bin", ".idx"):
        assert open(tmp_path / f"one_text_document{ext}", "rb").read() == open(tmp_path / f"glob_text_document{ext}", "rb").read()


BAD_LINES = {
    "invalid JSON": ('{"text": "a" "b"}', r"invalid JSON \(Expecting ',' delimiter at column 14\)"),
    "missing key": ('{"body": "x"}', r"no key 'text' \(the object has keys \['body'\]\); choose the key with --json-keys"),
    "non-string": ('{"text": 42}', r"key 'text' is a JSON number, not a string"),
    "not an object": ('["text"]', r"expected a JSON object, got a JSON array"),
    "lone surrogate": ('{"text": "a\\ud800b"}', r"key 'text' contains a lone surrogate escape"),
    "invalid UTF-8": (b'{"text": "caf\xe9"}', r"invalid UTF-8 \(byte 0xe9 at byte 13 of the line\); re-encode"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_input_fails_with_location_and_leaves_nothing(tmp_path, tok_files, case):
    bad, pattern = BAD_LINES[case]
    good = [json.dumps({"text": t}) for t in TEXTS[:40]]
    path = tmp_path / "in.jsonl"
    with open(path, "wb") as f:
        for line in good[:2] + [bad] + good[2:]:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    for workers in ("1", "2"):
        with pytest.raises(ValueError, match=re.escape(f"{path}:3: ") + pattern) as e:
            run(str(path), tmp_path / "out", tok_files["gptsp"], "--workers", workers, "--batch-bytes", "200")
        assert str(path) in str(e.value) and "--skip-invalid" in str(e.value)
        assert outputs(tmp_path) == []
        assert not [f for f in os.listdir(tmp_path) if "tmp" in f]
    summary = run(str(path), tmp_path / "out", tok_files["gptsp"], "--skip-invalid", "--workers", "2")
    assert summary.documents == 40 and sum(summary.skipped.values()) == 1
    assert list(summary.first_skipped.values()) == [f"{path}:3"]


def test_error_in_a_late_partition_leaves_nothing(tmp_path, tok_files):
    lines = [json.dumps({"text": t}) for t in TEXTS] + ["not json"]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    with pytest.raises(ValueError, match=f"{re.escape(path)}:{len(lines)}: invalid JSON"):
        run(path, tmp_path / "out", tok_files["gptsp"], "--workers", "2", "--partitions", "3")
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_empty_and_blank_are_skipped_and_counted(tmp_path, tok_files):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "x y"}, {"text": ""}, {"text": " \n "}, "", {"text": "z"}])
    s = run(path, tmp_path / "out", tok_files["gptsp"])
    assert s.documents == 2 and dict(s.skipped) == {"empty 'text'": 2, "blank line": 1}
    assert "skipped 2 × empty 'text' (first at " in tool.format_summary(s)
    _, docs = read_dataset(str(tmp_path / "out_text_document"))
    assert len(docs) == 2
    empty = write_jsonl(tmp_path / "e.jsonl", [{"text": ""}])
    with pytest.raises(ValueError, match=r"no documents for key\(s\) \['text'\].*nothing was written"):
        run(empty, tmp_path / "none", tok_files["gptsp"])
    assert outputs(tmp_path, "none") == []


def test_group_value_errors(tmp_path, tok_files):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a", "d": "x y"}, {"text": "b", "d": "x/y"}])
    with pytest.raises(ValueError, match="values 'x y' and 'x/y' both map to the file name part 'x_y'"):
        run(path, tmp_path / "out", tok_files["gptsp"], "--group-by-key", "d")
    path = write_jsonl(tmp_path / "in2.jsonl", [{"text": "a", "d": None}])
    with pytest.raises(ValueError, match="in2.jsonl:1: key 'd' is a JSON null; --group-by-key needs a string or integer"):
        run(path, tmp_path / "out", tok_files["gptsp"], "--group-by-key", "d")
    assert outputs(tmp_path) == []


def test_tokenizer_problems_fail_before_any_work(tmp_path, corpus, tok_files):
    with pytest.raises(ValueError, match=r"--tokenizer-model .*nope.model: no such file"):
        run(corpus, tmp_path / "sub" / "out", ["--tokenizer-type", "GPTSentencePieceTokenizer",
                                               "--tokenizer-model", str(tmp_path / "nope.model")])
    with pytest.raises(ValueError, match="--split-sentences and --split-paragraphs exclude each other"):
        run(corpus, tmp_path / "sub" / "out", ["--tokenizer-type", "NullTokenizer", "--vocab-size", "5"],
            "--split-sentences", "--split-paragraphs")
    assert not os.path.exists(tmp_path / "sub")


def test_cli_exit_codes_progress_and_summary(tmp_path, corpus, tok_files):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, TOOL, "--input", corpus, "--output-prefix", str(tmp_path / "out")]
    p = subprocess.run(cmd + tok_files["gptsp"] + ["--log-interval", "10", "--batch-bytes", "4000", "--workers", "2"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert re.search(r"processed \d+ documents \([\d.]+ docs/s\), \d+ tokens \(\d+ tokens/s\), [\d.]+ MB "
                     r"\([\d.]+ MB/s\)", p.stderr)
    assert f"{len(TEXTS)} documents" in p.stderr and "skipped nothing" in p.stderr
    assert re.search(r": 1 input file; tokenizer .*; 2 worker threads, 1 partition\n", p.stderr), p.stderr
    n = len(TEXTS)
    assert re.search(rf"done in [\d.]+ s: {n} documents, {n} sequences, \d+ tokens from {n} lines ", p.stderr), p.stderr
    # one document, one line, and a tokenizer that holds the GIL: threads fall back to processes, said once
    one = write_jsonl(tmp_path / "one.jsonl", [{"text": "1 2 3"}])
    p = subprocess.run([sys.executable, TOOL, "--input", one, "--output-prefix", str(tmp_path / "one"),
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--workers", "3",
                        "--worker-type", "thread", "--partitions", "2"], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("holds the GIL") == 1 and "using worker processes instead" in p.stderr, p.stderr
    assert "3 worker processes, 2 partitions" in p.stderr
    assert re.search(r"done in [\d.]+ s: 1 document, 1 sequence, 3 tokens from 1 line ", p.stderr), p.stderr
    p = subprocess.run(cmd + ["--tokenizer-type", "WordPiece"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "--tokenizer-type: invalid choice: 'WordPiece'" in p.stderr
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{oops"])
    p = subprocess.run([sys.executable, TOOL, "--input", bad, "--output-prefix", str(tmp_path / "bad")]
                       + tok_files["gptsp"], capture_output=True, text=True, env=env)
    assert p.returncode == 1 and f"error: {bad}:1: invalid JSON" in p.stderr
    # one worker: a thread beside the main thread (which reads and parses), or the main process
    # itself for a tokenizer that holds the GIL
    assert "; 1 worker thread, 1 partition\n" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, TOOL, "--input", one, "--output-prefix", str(tmp_path / "one1"),
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"], capture_output=True, text=True, env=env)
    assert p.returncode == 0 and "; 1 worker (the main process), 1 partition\n" in p.stderr, p.stderr
    assert outputs(tmp_path, "bad_") == []


@pytest.mark.parametrize("tok_name", ["sp", "gptsp", "gpt2"])
def test_json_fast_path_changes_no_byte(tmp_path, corpus, tok_files, tok_name, monkeypatch):
    """The C++ JSONL fast path (UTF-8 bytes straight to SentencePiece) against json.loads + str."""
    from megatron_ru.data.preprocess import encode as encode_module

    extra = ["--append-eod", "--group-by-key", "domain", "--workers", "2"]
    run(corpus, tmp_path / "fast", tok_files[tok_name], *extra)
    monkeypatch.setattr(encode_module, "extract_strings_lines", None)
    run(corpus, tmp_path / "slow", tok_files[tok_name], *extra)
    names = [n for n in os.listdir(tmp_path) if n.startswith("fast_")]
    assert len(names) == 4
    for n in names:
        assert open(tmp_path / n, "rb").read() == open(tmp_path / ("slow_" + n[5:]), "rb").read(), n


def _alive_in_group(pgid: int) -> list[int]:
    """Processes of the group that still run (zombies, left for init to reap, do not count)."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(pid))
    return alive


def _rest_of_stderr(p: subprocess.Popen, limit_s: float) -> str:
    """What P still writes to its stderr pipe, read to its end (P and every process of its group gone).
    LIMIT_S s on, the group is killed: a tool that hangs fails the test with what it printed, and
    says so, instead of blocking the read until pytest's guard."""
    fired = threading.Event()

    def kill() -> None:
        fired.set()
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    killer = threading.Timer(limit_s, kill)
    killer.start()
    try:
        rest = p.stderr.read()
    finally:
        killer.cancel()
    return rest + (f"\n[still running {limit_s:.0f} s on: killed]" if fired.is_set() else "")


@pytest.mark.parametrize("extra,signame,to_group", [
    (["--worker-type", "thread"], "SIGINT", False),
    (["--worker-type", "process"], "SIGINT", False),
    (["--worker-type", "process"], "SIGTERM", True),
    (["--worker-type", "thread", "--partitions", "2"], "SIGINT", False),
    (["--worker-type", "process", "--partitions", "2"], "SIGTERM", False),
    (["--worker-type", "process", "--partitions", "2"], "SIGINT", True),
    (["--workers", "1", "--worker-type", "process"], "SIGTERM", False),
], ids=["thread-int", "process-int", "process-term-group", "thread-parts-int", "process-parts-term",
        "process-parts-int-group", "main-process-term"])
def test_stop_signal_mid_run_leaves_nothing(tmp_path, tok_files, extra, signame, to_group):
    """Ctrl-C or SIGTERM (kill, timeout, a scheduler's time limit), sent to the tool alone or to
    its whole process group, while workers and partitions are busy: exit 128 + the signal, the
    message, no file at all in the output dir (no shard of a partition either), no process left."""
    from megatron_ru.data.preprocess.synthetic import write_corpus

    sig = getattr(signal, signame)
    big = str(tmp_path / "big.jsonl")
    write_corpus(big, 24_000_000, seed=3)
    out_dir = tmp_path / "out"
    cmd = [sys.executable, TOOL, "--input", big, "--output-prefix", str(out_dir / "ds"), *tok_files["gptsp"],
           "--workers", "2", "--log-interval", "20", "--batch-bytes", "65536", *extra]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         start_new_session=True)
    try:
        for line in p.stderr:  # wait until documents are being written
            if "processed " in line:
                # hold the tool where it is: on an idle machine it would otherwise finish the
                # corpus before the signal arrives (seen: 24 MB/s on 2 cores)
                os.killpg(p.pid, signal.SIGSTOP)
                break
        assert p.poll() is None, "the tool finished before it could be interrupted"
        assert os.listdir(out_dir), "temporary outputs exist while the tool runs"
        if to_group:
            os.killpg(p.pid, sig)  # delivered when they run again, in the middle of the corpus
        else:
            p.send_signal(sig)
        os.killpg(p.pid, signal.SIGCONT)
        rest = _rest_of_stderr(p, 60)
        assert p.wait(timeout=10) == 128 + sig, rest
    finally:
        p.kill()
    assert f"interrupted by {signame}; nothing was written" in rest, rest
    assert os.listdir(out_dir) == []
    assert _alive_in_group(p.pid) == []


def test_a_worker_killed_mid_run_ends_the_tool_with_its_name(tmp_path, tok_files):
    """A worker process killed from outside (the kernel, out of memory): exit 1 with its pid and
    signal, and no file in the output dir; not a tool that waits forever for the lost batch."""
    from megatron_ru.data.preprocess.synthetic import write_corpus

    big = str(tmp_path / "big.jsonl")
    write_corpus(big, 24_000_000, seed=3)
    out_dir = tmp_path / "out"
    cmd = [sys.executable, TOOL, "--input", big, "--output-prefix", str(out_dir / "ds"), *tok_files["gptsp"],
           "--workers", "2", "--worker-type", "process", "--log-interval", "20", "--batch-bytes", "65536"]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         start_new_session=True)
    try:
        for line in p.stderr:
            if "processed " in line:
                p.send_signal(signal.SIGSTOP)  # keep the corpus from ending before the kill lands
                break
        with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
            workers = [int(pid) for pid in f.read().split()]
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        p.send_signal(signal.SIGCONT)
        rest = _rest_of_stderr(p, 60)
        assert p.wait(timeout=10) == 1, rest
    finally:
        p.kill()
    assert f"error: worker process {workers[0]} was killed by SIGKILL while tokenizing (out of memory? see " \
           "`dmesg`; lower --workers or --batch-bytes); nothing was written" in rest, rest
    assert os.listdir(out_dir) == []
    for pid in workers:  # no worker outlives the tool
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


@pytest.mark.parametrize("fast", [True, False], ids=["cpp_json", "python_json"])
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_utf8_bom_at_file_start_is_accepted(tmp_path, corpus, tok_files, fast, gz, monkeypatch):
    """Files written by Windows tools start with a UTF-8 byte-order mark: the output equals the
    output without it, on the C++ and the Python JSON paths, with several workers and partitions."""
    from megatron_ru.data.preprocess import encode as encode_module

    data = open(corpus, "rb").read()
    bom = str(tmp_path / ("bom.jsonl.gz" if gz else "bom.jsonl"))
    with (gzip.open(bom, "wb") if gz else open(bom, "wb")) as f:
        f.write(b"\xef\xbb\xbf" + data)
    if not fast:
        monkeypatch.setattr(encode_module, "extract_strings_lines", None)
    extra = ["--append-eod", "--workers", "2", "--batch-bytes", "500"]
    run(corpus, tmp_path / "plain", tok_files["gptsp"], *extra)
    run(bom, tmp_path / "bom", tok_files["gptsp"], *extra, "--partitions", "2")
    for ext in (".bin", ".idx"):
        assert open(tmp_path / f"bom_text_document{ext}", "rb").read() == \
            open(tmp_path / f"plain_text_document{ext}", "rb").read()


def test_utf8_bom_inside_a_file_stays_an_error(tmp_path, corpus, tok_files):
    lines = open(corpus, "rb").read().splitlines(keepends=True)
    path = tmp_path / "mid.jsonl"
    path.write_bytes(b"".join(lines[:3]) + b"\xef\xbb\xbf" + b"".join(lines[3:]))
    with pytest.raises(ValueError, match=re.escape(f"{path}:4: ") + "invalid JSON"):
        run(str(path), tmp_path / "out", tok_files["gptsp"])
    assert outputs(tmp_path) == []
