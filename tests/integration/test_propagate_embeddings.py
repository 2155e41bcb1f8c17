"""tools/propagate_embeddings.py (acceptance 3 of the adaptation issue). The "instruct" model is the
base with its input embedding multiplied by a random invertible matrix M1 and its output layer by M2,
plus two chat tokens of its own: ``conversion`` (and ``union``) recover ``adapted @ M`` to 1e-6,
``direct`` copies the adapted rows, the chat tokens keep their instruct rows, ``--layer-delta``
adds exactly alpha x (adapted - base), and mismatched families are refused by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_ru.inference.model_io import open_model, save_model
from tests.fixtures.models import tiny_llama
from tests.fixtures.tokenizers import adaptation_tokenizers

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "propagate_embeddings.py")
EMB, OUT = "embedding.word_embeddings.weight", "output_layer.weight"
CHAT = ["<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _instruct(base: str, path: str, maps: dict[str, torch.Tensor], layer_shift: float) -> None:
    """base x M per matrix, every other weight shifted, two chat tokens with rows of their own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_((model.get_input_embeddings().weight.double() @ maps[EMB]).float())
        if OUT in maps:
            model.lm_head.weight.copy_((model.lm_head.weight.double() @ maps[OUT]).float())
        for name, p in model.named_parameters():
            if "embed_tokens" not in name and "lm_head" not in name:
                p.add_(layer_shift)
    tok.add_special_tokens({"additional_special_tokens": CHAT})
    tok.chat_template = TEMPLATE
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[-2:] = torch.randn(2, model.config.hidden_size)
    tok.save_pretrained(path)
    model.save_pretrained(path)


def _invertible(h: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.eye(h, dtype=torch.float64) + 0.3 * torch.randn(h, h, generator=g, dtype=torch.float64) / h ** 0.5


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def family(request, tmp_path_factory):
    tied = request.param
    d = tmp_path_factory.mktemp("lep_tied" if tied else "lep")
    _, new_sp, tok_dir = adaptation_tokenizers(str(d))
    base = tiny_llama(str(d / "base"), vocab_size=600, tied=tied, tokenizer_dir=tok_dir)
    # the adapted base: adapt_vocab's output, then "trained" (embeddings and layers moved)
    first = str(d / "adapted0")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "adapt_vocab.py"), "--model", base,
                           "--new-tokenizer", new_sp, "--save", first], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a0 = open_model(first)
    g = torch.Generator().manual_seed(1)
    moved = {n: a0.get(n) + 0.01 * torch.randn(a0.get(n).shape, generator=g) for n in a0.names()}
    adapted = save_model(str(d / "adapted"), kind="hf", cfg=a0.cfg, vocab_size=a0.vocab_size,
                         get_tensor=moved.__getitem__, tokenizer=a0.tokenizer, hf_config=a0.hf_config)
    maps = {EMB: _invertible(32, 2)} if tied else {EMB: _invertible(32, 2), OUT: _invertible(32, 3)}
    instruct = str(d / "instruct")
    _instruct(base, instruct, maps, layer_shift=0.05)
    return {"dir": d, "base": base, "adapted": adapted, "instruct": instruct, "maps": maps, "tied": tied}


def _run(family, name: str, *flags: str) -> tuple[dict, str]:
    out = str(family["dir"] / name)
    proc = subprocess.run([sys.executable, TOOL, "--base", family["base"], "--adapted", family["adapted"],
                           "--instruct", family["instruct"], "--save", out, *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), out


def test_modes_recover_the_map_and_keep_chat_tokens(family):
    from transformers import AutoTokenizer
    adapted, instruct, base = open_model(family["adapted"]), open_model(family["instruct"]), open_model(family["base"])
    n_new = adapted.vocab_size
    names = [EMB] if family["tied"] else [EMB, OUT]
    for mode in ("conversion", "union", "direct"):
        report, out = _run(family, mode, "--mode", mode)
        result = open_model(out)
        assert result.vocab_size == n_new + 2 and sorted(report["maps"]) == sorted(names)
        for name in names:
            got = result.get(name)
            if mode == "direct":
                assert torch.equal(got[:n_new], adapted.get(name))
            else:
                want = (adapted.get(name).double() @ family["maps"][name]).float()
                assert (got[:n_new] - want).abs().max() <= 1e-6, (mode, name)
                assert report["maps"][name]["residual"] < 1e-6
            # the instruct model's chat tokens keep their rows
            assert torch.equal(got[n_new:], instruct.get(name)[600:602])
        for name in result.names():
            if name not in names:
                assert torch.equal(result.get(name), instruct.get(name))
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids(CHAT) == [n_new, n_new + 1] and tok.chat_template == TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "мир"}], tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == n_new and ids[-1] == n_new + 1
    assert base.vocab_size == 600


def test_keep_original_rows_and_layer_delta(family):
    from megatron_ru.data.token_text import token_texts
    from megatron_ru.adapt.vocab_map import build_vocab_map
    from megatron_ru.inference.model_io import load_tokenizer
    adapted, instruct, base = open_model(family["adapted"]), open_model(family["instruct"]), open_model(family["base"])
    _, out = _run(family, "keep_delta", "--keep-original-rows", "--layer-delta", "0.5",
                  "--output-format", "megatron", "--target-tensor-parallel-size", "2")
    result = open_model(out)
    assert result.kind == "megatron" and result.meta.tensor_model_parallel_size == 2
    old_tok, new_tok = load_tokenizer(base.tokenizer), load_tokenizer(adapted.tokenizer)
    vmap = build_vocab_map(old_tok, new_tok, token_texts(old_tok), token_texts(new_tok))
    shared = [(j, vmap.pieces[j][0]) for j, k in enumerate(vmap.kind) if k in ("kept", "special")]
    assert len(shared) > 10
    emb = result.get(EMB)
    for j, i in shared:
        assert torch.equal(emb[j], instruct.get(EMB)[i])
    for name in result.names():
        if name in (EMB, OUT):
            continue
        want = (instruct.get(name).double() + 0.5 * (adapted.get(name).double() - base.get(name).double())).float()
        assert torch.equal(result.get(name), want), name


def test_mismatched_families_are_refused(family, tmp_path):
    other = tiny_llama(str(tmp_path / "wide"), vocab_size=600, hidden=48, heads=4, kv_heads=2,
                       tokenizer_dir=family["instruct"])
    proc = subprocess.run([sys.executable, TOOL, "--base", family["base"], "--adapted", family["adapted"],
                           "--instruct", other, "--save", str(tmp_path / "o")], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "--base and --instruct are not the same architecture: hidden_size 32 vs 48" \
        in proc.stderr, proc.stderr[-2000:]
    # an "instruct" model whose vocabulary is the adapted (new) one, not the base's
    proc = subprocess.run([sys.executable, TOOL, "--base", family["base"], "--adapted", family["adapted"],
                           "--instruct", family["adapted"], "--save", str(tmp_path / "o")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--instruct's vocabulary is not --base's" in proc.stderr, proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "o")
