"""A deterministic synthetic corpus (no download) for the demo and the benchmarks.

Documents are made of paragraphs (separated by blank lines) of Russian and English sentences
drawn from a fixed word list with a Zipf-like distribution, so that tokenizers learn
something and documents look like long web/news text.
"""
from __future__ import annotations

import itertools
import json
import os
import random
from typing import Iterator

_WORDS = (
    "и в не на я быть он с что а по это она этот к но они мы как из у который то за свой весь год от так "
    "о для ты же все тот мочь вы человек такой его сказать только или ещё бы себя один как уже до время "
    "если сам когда другой вот говорить наш мой знать стать при чтобы дело жизнь кто первый очень два день "
    "её новый рука даже во со раз где там под можно ну какой после их работа без самый потом надо хотеть "
    "ли слово идти большой должен место иметь ничто данные модель обучение текст язык параллельный тензор "
    "the of and to a in is it you that he was for on are with as his they be at one have this from or had "
    "by not word but what some we can out other were all there when up use your how said an each she which "
    "do their time if will way about many then them write would like so these her long make thing see him "
    "two has look more day could go come did number sound no most people my over know water than call first "
    "model data training parallel tensor pipeline token corpus language gradient optimizer checkpoint"
).split()
_TITLES = ("Новости", "Наука", "Wiki", "Sport", "Культура", "Economy")
_SYLLABLES_RU = "ка ло ми ну ре та ве до зо бы ст пр ин ов ен ал ор ск ни ти ра ко ле на ва по ро ли де те".split()
_SYLLABLES_EN = "th er on an re he in ed nd ha at en es of or nt ea ti to it st io le is ou ar as de rt ve".split()


def _vocabulary(n_extra: int = 20000) -> list[str]:
    """The fixed words plus ``n_extra`` pseudo-words (2–5 syllables), most frequent first."""
    rng = random.Random(1234)
    extra = []
    for i in range(n_extra):
        syl = _SYLLABLES_RU if i % 2 else _SYLLABLES_EN
        extra.append("".join(rng.choice(syl) for _ in range(rng.randint(2, 5))))
    return list(_WORDS) + extra


_VOCAB = _vocabulary()
_CUM_WEIGHTS = list(itertools.accumulate(1.0 / (i + 1) for i in range(len(_VOCAB))))
#: "mixed" (both scripts, the default), "ru" (Cyrillic words only) or "en" (Latin words only)
LANGUAGES = ("mixed", "ru", "en")


def _is_cyrillic(word: str) -> bool:
    return "а" <= word[0].lower() <= "я" or word[0] in "ёЁ"


def _language_vocab(language: str, common_only: bool = False) -> tuple[list[str], list[float]]:
    """The words of ``language`` and their cumulative Zipf weights; ``common_only``: the fixed word
    list without the pseudo-words (a small vocabulary a tiny model learns in minutes)."""
    if language == "mixed" and not common_only:
        return _VOCAB, _CUM_WEIGHTS
    if language not in LANGUAGES:
        raise ValueError(f"language {language!r}: choose one of {', '.join(LANGUAGES)}")
    words = _VOCAB[:len(_WORDS)] if common_only else _VOCAB
    if language != "mixed":
        words = [w for w in words if _is_cyrillic(w) == (language == "ru")]
    return words, list(itertools.accumulate(1.0 / (i + 1) for i in range(len(words))))


def _rare_word(rng: random.Random) -> str:
    """A fresh pseudo-word (3-6 syllables and a random letter, ~10^6-10^11 possibilities): almost
    never seen twice."""
    ru = rng.random() < 0.5
    syl = _SYLLABLES_RU if ru else _SYLLABLES_EN
    word = [rng.choice(syl) for _ in range(rng.randint(3, 6))]
    word.insert(rng.randrange(len(word) + 1), rng.choice("бгджзйфхцчшщэюя" if ru else "bcfgjkpqvwxyz"))
    return "".join(word)


def _sentence(rng: random.Random, language: str = "mixed", common_only: bool = False, rare_words: float = 0.0) -> str:
    n = rng.randint(4, 18)
    vocab, weights = _language_vocab(language, common_only)
    words = rng.choices(vocab, cum_weights=weights, k=n)
    if rare_words:
        words = [_rare_word(rng) if rng.random() < rare_words else w for w in words]
    if rng.random() < 0.15:
        words.insert(rng.randrange(n), str(rng.randint(1, 3000)))
    s = " ".join(words)
    return s[0].upper() + s[1:] + rng.choice(".....!?")


def document(rng: random.Random, paragraphs: tuple[int, int] = (3, 30), language: str = "mixed",
             common_only: bool = False, rare_words: float = 0.0) -> str:
    """A title and paragraphs of sentences; ``rare_words``: the fraction of words replaced by fresh
    pseudo-words (a long tail that defeats any word cache)."""
    paras = []
    for _ in range(rng.randint(*paragraphs)):
        paras.append(" ".join(_sentence(rng, language, common_only, rare_words) for _ in range(rng.randint(1, 8))))
    titles = _TITLES if language == "mixed" else [t for t in _TITLES if _is_cyrillic(t) == (language == "ru")]
    return rng.choice(titles) + "\n\n" + "\n\n".join(paras)


def records(n_docs: int, seed: int = 0, paragraphs: tuple[int, int] = (3, 30),
            language: str = "mixed", common_only: bool = False, rare_words: float = 0.0) -> Iterator[dict]:
    rng = random.Random(seed)
    domains = ("news", "wiki", "science")
    for i in range(n_docs):
        yield {"id": i, "text": document(rng, paragraphs, language, common_only, rare_words),
               "domain": domains[rng.randrange(len(domains))]}


def write_corpus(path: str, target_bytes: int, seed: int = 0, paragraphs: tuple[int, int] = (3, 30),
                 language: str = "mixed", common_only: bool = False, rare_words: float = 0.0,
                 one_document: bool = False) -> int:
    """Write JSONL of at least ``target_bytes`` (UTF-8) to ``path`` atomically; returns documents.
    ``one_document``: a single line whose text is all the documents joined by blank lines."""
    if one_document:
        return _write_one_document(path, target_bytes, seed, paragraphs, language, common_only, rare_words)
    tmp = f"{path}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    written = docs = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records(1 << 62, seed, paragraphs, language, common_only, rare_words):
            line = json.dumps(rec, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            docs += 1
            if written >= target_bytes:
                break
    os.replace(tmp, path)
    return docs


def _write_one_document(path: str, target_bytes: int, seed: int, paragraphs: tuple[int, int], language: str,
                        common_only: bool, rare_words: float) -> int:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < target_bytes:
        parts.append(document(rng, paragraphs, language, common_only, rare_words))
        size += len(parts[-1].encode("utf-8")) + 2
    tmp = f"{path}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps({"id": 0, "text": "\n\n".join(parts)}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return 1
