"""Tokenizers with Megatron-LM's names and id conventions, behind one small interface.

``build_tokenizer(cfg)`` returns a :class:`Tokenizer`: ``vocab_size`` (unpadded), ``eod``,
``bos``/``pad`` (int or None), ``tokenize``, ``tokenize_batch`` (the library's native batch
API), ``tokenize_batch_arrays`` (the same as numpy arrays, what preprocessing writes) and
``detokenize``. This module must not import torch: tools/preprocess_data.py start-up time is
part of its throughput. ``transformers`` is imported lazily, and only when a HuggingFace
directory has no ``tokenizer.json`` that the ``tokenizers`` library can load directly.
"""
from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from typing import Optional, Sequence

import numpy as np

from megatron_ru.config.tokenizer import TOKENIZER_TYPES, TokenizerConfig


class Tokenizer(ABC):
    """Text ↔ token ids. Subclasses set ``vocab_size``, ``eod``, ``bos``, ``pad``."""

    name: str = "Tokenizer"
    vocab_size: int
    eod: int
    bos: Optional[int] = None
    pad: Optional[int] = None
    # True when tokenize_batch_arrays spends its time in native code that releases the GIL, so
    # that threads in one process tokenize in parallel (tools/preprocess_data.py --workers).
    releases_gil: bool = False
    # True when tokenize_batch_arrays also takes UTF-8 ``bytes`` (same ids as for the str).
    accepts_utf8_bytes: bool = False
    # True when it takes them only to decode them itself (the library takes str): a huge document
    # streamed to threads is then decoded by the thread that cuts it (Encoder._encode_stream)
    decodes_utf8: bool = False
    # the pieces of a cut document go to a pool of threads one at a time (Encoder._encode_pieces):
    # for libraries that hand ids out as Python lists (tokenizers), whose conversion otherwise
    # leaves the library's threads idle after every call
    pieces_one_per_task: bool = False
    _cut_mode: object = ...  # computed on first use (see cut_mode)
    # special-token strings no cut may touch (see megatron_ru/data/preprocess/cuts.py)
    cut_guards: tuple[str, ...] = ()
    _tie_runs = None  # a compiled regex: no cut before the end of its last match (cut_start)

    @property
    def has_tie_runs(self) -> bool:
        """Whether :meth:`cut_start` can hold cuts back (it needs the whole text, or its line)."""
        return self.cut_mode is not None and self._tie_runs is not None

    def cut_start(self, text: str | bytes, lo: int = 0, hi: Optional[int] = None) -> int:
        """Position before which ``text[lo:hi]`` must not be cut, as an index into ``text`` (0 when
        nothing holds cuts back; cuts.py: SentencePiece Unigram ties)."""
        if self.cut_mode is None or self._tie_runs is None:
            return 0
        hi = len(text) if hi is None else hi
        raw = not isinstance(text, str)  # (bytes, or a mapped file's line)
        if not _has_other_spaces(text, lo, hi):  # ASCII spaces only: the last run by rfind
            start = text.rfind(b"   " if raw else "   ", lo, hi)
            if start < 0:
                return 0
            end, space = start + 3, (b" " if raw else " ")
            while end < hi and text[end:end + 1] == space:
                end += 1
            return end + 1
        last = -1
        for m in self._tie_runs[raw].finditer(text, lo, hi):
            last = m.end()
        return last + 1 if last >= 0 else 0

    @property
    def cut_mode(self) -> Optional[str]:
        """How a huge document may be cut into pieces whose ids concatenate to the whole text's:
        ``"keep"``, ``"drop"`` or ``None`` (never cut); see megatron_ru/data/preprocess/cuts.py.
        Worked out on first use (it may read the tokenizer's files): ``self.cut_reason`` says why."""
        if self._cut_mode is ...:
            self._cut_mode, self.cut_reason = self._find_cut_mode()
        return self._cut_mode

    def _find_cut_mode(self) -> tuple[Optional[str], str]:
        return None, f"{self.name}: no proof that its ids are unchanged by a cut"

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOD added)."""

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of every text; subclasses use the library's batch call."""
        return [self.tokenize(t) for t in texts]

    def tokenize_batch_arrays(self, texts: Sequence[str], num_threads: Optional[int] = None) -> list[np.ndarray]:
        """Like :meth:`tokenize_batch` but numpy int arrays (avoids Python int lists where the
        library can hand out buffers directly). ``num_threads``: threads for this call where the
        library takes a per-call count (the pieces of one huge document), else ignored."""
        return [np.asarray(ids, dtype=np.int64) for ids in self.tokenize_batch(texts)]

    def tokenize_arrays_here(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:meth:`tokenize_batch_arrays` on the calling thread alone (a task of a thread pool that
        tokenizes the pieces of a huge document)."""
        return self.tokenize_batch_arrays(texts, num_threads=1)

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; for the shipped tokenizers ``detokenize(tokenize(t)) == t`` whenever
        the model itself is lossless on ``t`` (see docs/data_format.md)."""

    def describe(self) -> str:
        return f"{self.name}(vocab_size={self.vocab_size}, eod={self.eod}, bos={self.bos}, pad={self.pad})"


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"0.2.3"`` → ``(0, 2, 3)``; stops at the first part that is not a number (``"0.2.2rc1"``
    → ``(0, 2)``), which errs towards "older"."""
    out = []
    for part in version.split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def _ids(x) -> list[int]:
    return [int(i) for i in x]


class GPTSentencePieceTokenizer(Tokenizer):
    """A SentencePiece model used as-is: ``eod`` is the model's ``</s>`` (eos) id."""

    name = "GPTSentencePieceTokenizer"
    accepts_utf8_bytes = True  # sentencepiece reads str as UTF-8 anyway

    def __init__(self, model_file: str, num_threads: int = 1) -> None:
        self._load(model_file, num_threads)
        self.vocab_size = int(self.sp.vocab_size())
        self.eod = int(self.sp.eos_id())
        if self.eod < 0:
            raise ValueError(f"--tokenizer-model {model_file}: the model has no </s> (eos_id=-1), which "
                             "GPTSentencePieceTokenizer uses as end-of-document; use SentencePieceTokenizer "
                             "(adds <EOD>) or retrain with tools/train_tokenizer.py")
        self.bos = _opt(self.sp.bos_id())
        self.pad = _opt(self.sp.pad_id())

    def _load(self, model_file: str, num_threads: int) -> None:
        import sentencepiece

        _require_file(model_file, "--tokenizer-model")
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"--tokenizer-model {model_file}: not a SentencePiece model ({e})") from e
        self.num_threads = num_threads
        # sentencepiece 0.2.2 moved to pybind11 and encodes batches with the GIL released
        # (0.2.0/0.2.1 hold it: two threads take as long as one, measured).
        self.releases_gil = _version_tuple(sentencepiece.__version__) >= (0, 2, 2)

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), num_threads=self.num_threads)

    def tokenize_batch_arrays(self, texts: Sequence[str | bytes], num_threads: Optional[int] = None) -> list[np.ndarray]:
        return self.sp.encode(list(texts), num_threads=num_threads or self.num_threads, return_type="numpy")

    def tokenize_arrays_here(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        # One call per text: sentencepiece's batch call starts a new OS thread for every call, even
        # for one thread, so a huge document's ~1000 pieces, 4 per call, ran on ~250 short-lived
        # threads. Unigram, the 100 MB document, 1 worker, 6 rotated rounds in one process:
        # batch calls 0.852 of the limit, one call per text 1.029 (medians).
        return [self.sp.encode(t, return_type="numpy") for t in texts]

    def _find_cut_mode(self) -> tuple[Optional[str], str]:
        return sentencepiece_cut_mode(self)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.sp.decode(_ids(ids))


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """Megatron's ``SentencePieceTokenizer``: special tokens <CLS> <SEP> <EOD> <MASK>, pad, bos,
    eos (and ``<extra_id_i>``) are looked up in the model and appended after its pieces when
    absent, in Megatron's order, so ids (and therefore datasets) match Megatron-LM. Their text
    inside the input is tokenized as the special id."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str, vocab_extra_ids: int = 0, num_threads: int = 1) -> None:
        self._load(model_file, num_threads)
        n = int(self.sp.vocab_size())
        pieces = {self.sp.id_to_piece(i): i for i in range(n)}
        specials: dict[str, int] = {}

        def add(tok: str) -> int:
            if tok not in pieces:
                pieces[tok] = len(pieces)
            specials[tok] = pieces[tok]
            return pieces[tok]

        for tok in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            add(tok)
        self.eod = specials["<EOD>"]
        self.pad = add(self._piece_or(self.sp.pad_id(), "<PAD>"))
        self.bos = add(self._piece_or(self.sp.bos_id(), "<BOS>"))
        self.eos = add(self._piece_or(self.sp.eos_id(), "<EOS>"))
        for i in range(vocab_extra_ids):
            add(f"<extra_id_{i}>")
        self.vocab_size = len(pieces)
        self.special_tokens = specials
        self.cut_guards = tuple(specials)  # each text between specials is encoded on its own
        self._special_of_id = {v: k for k, v in specials.items()}
        # Longest first so that a special token that is a prefix of another never wins.
        self._special_re = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))

    def _piece_or(self, piece_id: int, default: str) -> str:
        return self.sp.id_to_piece(piece_id) if piece_id >= 0 else default

    def _has_special(self, text: str) -> bool:
        return "<" in text and self._special_re.search(text) is not None

    def tokenize(self, text: str) -> list[int]:
        if not self._has_special(text):
            return self.sp.encode(text)
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids.extend(self.sp.encode(text[pos:m.start()]))
            ids.append(self.special_tokens[m.group(0)])
            pos = m.end()
        ids.extend(self.sp.encode(text[pos:]))
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        texts = list(texts)
        out = self.sp.encode(texts, num_threads=self.num_threads)
        for i, t in enumerate(texts):
            if self._has_special(t):
                out[i] = self.tokenize(t)
        return out

    def tokenize_batch_arrays(self, texts: Sequence[str | bytes], num_threads: Optional[int] = None) -> list[np.ndarray]:
        texts = list(texts)
        return self._with_specials(texts, super().tokenize_batch_arrays(texts, num_threads))

    def tokenize_arrays_here(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        texts = list(texts)
        return self._with_specials(texts, super().tokenize_arrays_here(texts))

    def _with_specials(self, texts: list, out: list[np.ndarray]) -> list[np.ndarray]:
        """``out`` (the model's ids of ``texts``) with the texts that hold special-token text re-encoded."""
        for i, t in enumerate(texts):
            if isinstance(t, bytes):
                if b"<" not in t:
                    continue
                t = t.decode("utf-8")
            if self._has_special(t):
                out[i] = np.asarray(self.tokenize(t), dtype=np.int64)
        return out

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = _ids(ids)
        parts: list[str] = []
        start = 0
        for i, tok in enumerate(ids):
            if tok in self._special_of_id:
                parts.append(self.sp.decode(ids[start:i]))
                parts.append(self._special_of_id[tok])
                start = i + 1
        parts.append(self.sp.decode(ids[start:]))
        return "".join(parts)


# Three or more spaces (U+0020, or characters that NFKC turns into one), for str and UTF-8 bytes.
# Those characters but U+0020 (when none occurs, cut_start finds the last run with rfind: a regex
# scan of a 100 MB text took ~4 s here).
_OTHER_SPACES_STR = tuple("\u00a0\u202f\u205f\u3000") + tuple(chr(c) for c in range(0x2000, 0x200b))


def _has_other_spaces(text: str | bytes, lo: int = 0, hi: Optional[int] = None) -> bool:
    """``text[lo:hi]`` holds one of ``_OTHER_SPACES_STR`` (as UTF-8 for bytes or a mapped file): fast substring
    searches, and for U+2000-U+200A / U+202F (bytes E2 80 80-8A / AF, a prefix that dashes and
    quotes share) one vectorised pass."""
    hi = len(text) if hi is None else hi
    if isinstance(text, str):
        return any(text.find(c, lo, hi) >= 0 for c in _OTHER_SPACES_STR)
    if any(text.find(c, lo, hi) >= 0 for c in (b"\xc2\xa0", b"\xe2\x81\x9f", b"\xe3\x80\x80")):
        return True
    a = np.frombuffer(text, np.uint8)[lo:hi]
    lead = np.flatnonzero(a[:-2] == 0xE2) if a.size >= 3 else a[:0]
    if not lead.size:
        return False
    third = a[lead + 2]
    return bool(np.any((a[lead + 1] == 0x80) & (((third >= 0x80) & (third <= 0x8A)) | (third == 0xAF))))


_SPACE_RUNS = (re.compile("[ \u00a0\u2000-\u200a\u202f\u205f\u3000]{3,}"),
               re.compile(rb"(?: |\xc2\xa0|\xe2\x80[\x80-\x8a\xaf]|\xe2\x81\x9f|\xe3\x80\x80){3,}"))


def sentencepiece_cut_mode(tok: "GPTSentencePieceTokenizer") -> tuple[Optional[str], str]:
    """Cut mode of a SentencePiece model, from its pieces and what its normalizer does: a
    word-boundary space starts a new piece when no piece holds a ``▁`` after another character (true
    of every model trained with whitespace splitting); the dummy prefix and whitespace collapsing
    decide how the right piece must start (docstring of megatron_ru/data/preprocess/cuts.py).

    The normalizer is asked rather than read from the model's protobuf (whose import and parse cost
    20-30 ms of every run's start-up): ``normalize("a")`` shows the dummy prefix (``▁a`` or ``a▁``),
    ``normalize("a  b")`` whether runs of spaces collapse, and n-best encoding, which SentencePiece
    offers for Unigram models only, the model type; tests/unit/test_preprocess_cuts.py checks this
    against the protobuf's settings for every combination of them."""
    name, sp = tok.name, tok.sp
    pieces = sp.id_to_piece(list(range(sp.get_piece_size())))
    for p in pieces:
        if "\u2581" in p.lstrip("\u2581"):  # a word start after another character
            return None, f"{name}: piece {p!r} spans a word start (model trained without whitespace splitting)"
    dummy_prefix = sp.normalize("a") != "a"
    collapses = "\u2581\u2581" not in sp.normalize("a  b")
    if not collapses and _is_unigram(sp) and any(len(p) > 1 and not p.strip("\u2581") for p in pieces):
        tok._tie_runs = _SPACE_RUNS
    if dummy_prefix:
        return ("keep" if collapses else "drop"), f"{name}: dummy prefix"
    if collapses:
        return None, f"{name}: whitespace collapsing without a dummy prefix drops a piece's leading space"
    return "keep", f"{name}: whitespace kept, no dummy prefix"


def _is_unigram(sp) -> bool:
    """Whether a SentencePiece model is a Unigram model: the only type with n-best encoding. Any
    other failure of the probe counts as Unigram, the safe side: its tie runs only hold cuts back."""
    try:
        sp.nbest_encode_as_ids("a", 1)
    except RuntimeError as e:
        return "NBestEncode is not available" not in str(e)
    return True


class NullTokenizer(Tokenizer):
    """Text is whitespace-separated integer ids (for tests and synthetic data); ``eod`` is
    ``--vocab-size`` and ``vocab_size`` is one more, as in Megatron-LM."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or vocab_size < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1 (got {vocab_size})")
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError as e:
            raise ValueError(f"NullTokenizer reads whitespace-separated integers, got {e}") from None
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"NullTokenizer: token {i} is outside [0, {self.vocab_size}); raise --vocab-size")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def _find_cut_mode(self) -> tuple[Optional[str], str]:
        return "keep", "NullTokenizer: ids are whitespace-separated"


def _opt(i: int) -> Optional[int]:
    return int(i) if i is not None and i >= 0 else None


def _require_file(path: Optional[str], flag: str) -> None:
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file")


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer ``cfg`` describes; every problem with the flags is raised at once, before
    any file is read."""
    problems = cfg.problems()
    if cfg.tokenizer_type is not None and cfg.tokenizer_type not in TOKENIZER_TYPES:
        problems.insert(0, f"--tokenizer-type {cfg.tokenizer_type!r} is unknown; choose one of {', '.join(TOKENIZER_TYPES)}")
    if problems:
        raise ValueError("invalid tokenizer configuration:\n" + "\n".join(f"  - {p}" for p in problems))
    tok = _build(cfg)
    if cfg.eod_token is not None:
        tok.eod = token_id(tok, cfg.eod_token, "--eod-token")
    return tok


def token_id(tok: Tokenizer, text: str, flag: str) -> int:
    """The id of the token whose text is ``text`` (a special token by its string, or any single token)."""
    found: Optional[int] = None
    sp = getattr(tok, "sp", None)
    if sp is not None:
        i = int(sp.piece_to_id(text))
        found = i if i != sp.unk_id() or sp.id_to_piece(i) == text else None
        found = getattr(tok, "special_tokens", {}).get(text, found)
    elif getattr(tok, "_fast", None) is not None:
        found = tok._fast.token_to_id(text)
    elif getattr(tok, "_hf", None) is not None:
        i = tok._hf.convert_tokens_to_ids(text)
        found = i if i != tok._hf.unk_token_id or text == tok._hf.unk_token else None
    elif getattr(tok, "encoder", None) is not None:
        found = tok.encoder.get(text)
    if found is None and not isinstance(tok, NullTokenizer):
        try:
            ids = tok.tokenize(text)
        except ValueError:  # tiktoken refuses special-token text it was not told to allow
            ids = []
        found = ids[0] if len(ids) == 1 else None
    if found is None:
        raise ValueError(f"{flag} {text!r}: not a single token of {tok.name}; give the text of a special token "
                         "of this tokenizer, e.g. '<|endoftext|>' or '</s>'")
    return int(found)


def _build(cfg: TokenizerConfig) -> Tokenizer:
    t = cfg.tokenizer_type
    if t == "SentencePieceTokenizer":
        return SentencePieceTokenizer(cfg.tokenizer_model, cfg.vocab_extra_ids, cfg.tokenizer_num_threads)
    if t == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(cfg.tokenizer_model, cfg.tokenizer_num_threads)
    if t == "GPT2BPETokenizer":
        from megatron_ru.data.tokenizers.gpt2_bpe import GPT2BPETokenizer

        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)
    if t == "HuggingFaceTokenizer":
        from megatron_ru.data.tokenizers.huggingface import HuggingFaceTokenizer

        return HuggingFaceTokenizer(cfg.tokenizer_model, cfg.tokenizer_num_threads)
    if t == "TikTokenizer":
        from megatron_ru.data.tokenizers.tiktoken_file import TikTokenizer

        return TikTokenizer(cfg.tokenizer_model, cfg.tokenizer_num_threads)
    return NullTokenizer(cfg.vocab_size)

