"""An instruct model's tokens: ``tools/generate.py --chat-template`` (and ``messages`` in a prompt
file) renders prompts as transformers' ``apply_chat_template`` does; ``--eod-token`` chooses the
end-of-document token (by default an HF tokenizer's eos_token, which for an instruct model is its
end of turn) for preprocessing, training and generation alike."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatron_ru.config.tokenizer import TokenizerConfig
from megatron_ru.data.tokenizer import build_tokenizer
from tests.fixtures.tokenizers import make_hf_tokenizer_dir, make_sentencepiece, sample_texts

# SmolLM2-135M-Instruct's template (a system turn when the chat has none)
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}\n")


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """A byte-level BPE HF tokenizer with chat specials, eos_token the end of turn, and a template."""
    from tokenizers import AddedToken, Tokenizer
    d = make_hf_tokenizer_dir(tmp_path_factory.mktemp("chat"), vocab=400)
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
                   "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "model_max_length": 1 << 20}, f)
    with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(TEMPLATE)
    return d


def test_chat_prompts_render_as_transformers_does(chat_tok, tmp_path):
    from transformers import AutoTokenizer

    from megatron_ru.inference.cli import chat_prompts
    from megatron_ru.inference.prompts import collect_prompts
    path = tmp_path / "prompts.jsonl"
    chat = [{"role": "system", "content": "Отвечай по-русски."}, {"role": "user", "content": "Что такое cat?"}]
    path.write_text(json.dumps({"prompt": "Hello"}) + "\n" + json.dumps({"messages": chat}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    cfg = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=chat_tok)
    hf = AutoTokenizer.from_pretrained(chat_tok)
    prompts = collect_prompts(["What is 2+2?"], str(path))
    # a messages line is always rendered; plain prompts only with --chat-template
    rendered = chat_prompts(prompts, None, cfg)
    assert rendered[:2] == ["What is 2+2?", "Hello"]
    assert rendered[2] == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    rendered = chat_prompts(prompts, "model", cfg)
    for p, r in zip(prompts, rendered):
        want = hf.apply_chat_template([{"role": "user", "content": p}] if isinstance(p, str) else p, tokenize=False,
                                      add_generation_prompt=True)
        assert r == want
    tok = build_tokenizer(cfg)
    ids = tok.tokenize(rendered[0])
    assert ids == hf.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=True,
                                         add_generation_prompt=True, return_dict=False)
    assert ids.count(tok.token_to_id("<|im_start|>") if hasattr(tok, "token_to_id") else hf.convert_tokens_to_ids(
        "<|im_start|>")) == 3
    # a template file, and refusals naming the flag
    other = tmp_path / "t.jinja"
    other.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}", encoding="utf-8")
    assert chat_prompts(["x"], str(other), cfg) == ["[x]"]
    with pytest.raises(FileNotFoundError, match="--chat-template nope.jinja: no such file"):
        chat_prompts(["x"], "nope.jinja", cfg)
    sp = TokenizerConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model="x.model")
    with pytest.raises(ValueError, match="has no chat template; give one as --chat-template FILE"):
        chat_prompts(["x"], "model", sp)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match='"messages" must be a non-empty list'):
        collect_prompts(None, str(bad))


def test_eod_token_chooses_the_end_of_document(chat_tok, tmp_path):
    cfg = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=chat_tok)
    default = build_tokenizer(TokenizerConfig(**cfg))
    chosen = build_tokenizer(TokenizerConfig(**cfg, eod_token="<|endoftext|>"))
    assert default.eod == default._fast.token_to_id("<|im_end|>")         # the eos_token: the end of turn
    assert chosen.eod == default._fast.token_to_id("<|endoftext|>") != default.eod
    with pytest.raises(ValueError, match="--eod-token '<nope>': not a single token"):
        build_tokenizer(TokenizerConfig(**cfg, eod_token="<nope>"))
    sp_model = make_sentencepiece(tmp_path, vocab=400)
    sp = build_tokenizer(TokenizerConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp_model,
                                         eod_token="<s>"))
    assert sp.eod == sp.sp.bos_id()
    # preprocess_data.py --append-eod separates documents with the chosen token
    from megatron_ru.data.indexed_dataset import IndexedDataset
    from tools.preprocess_data import main as preprocess
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_texts(5)), encoding="utf-8")
    for name, extra in (("default", []), ("chosen", ["--eod-token", "<|endoftext|>"])):
        preprocess(["--input", str(src), "--output-prefix", str(tmp_path / name), "--append-eod", "--workers", "1",
                    "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", chat_tok, *extra])
        ds = IndexedDataset(str(tmp_path / f"{name}_text_document"))
        last = {int(np.asarray(ds[i])[-1]) for i in range(len(ds))}
        assert last == {default.eod if name == "default" else chosen.eod}
