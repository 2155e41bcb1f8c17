"""Prompts in, completions out: reading ``--prompt``/``--prompt-file`` and writing the JSONL and
text results of ``tools/generate.py``."""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional, Sequence, Union

from megatron_ru.utils.jsonl import json_objects

JSONL_SUFFIXES = (".jsonl", ".json")


#: a chat: [{"role": "user", "content": "..."}, ...]
Messages = list[dict[str, str]]
Prompt = Union[str, Messages]


def _messages(obj: Any) -> Optional[Messages]:
    ok = isinstance(obj, list) and obj and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                               and isinstance(m.get("content"), str) for m in obj)
    return obj if ok else None


def read_prompt_file(path: str) -> list[Prompt]:
    """Prompts from ``path``: a ``.jsonl``/``.json`` file holds one JSON object per line with a
    ``"prompt"`` string or a ``"messages"`` chat (a list of ``{"role", "content"}``, rendered with the
    chat template); any other file holds one prompt per line (blank lines are skipped)."""
    if path.lower().endswith(JSONL_SUFFIXES):
        prompts: list[Prompt] = []
        for n, obj in json_objects(path, "--prompt-file", example='{"prompt": "..."}'):
            if "messages" in obj:
                chat = _messages(obj["messages"])
                if chat is None:
                    raise ValueError(f"--prompt-file {path}, line {n}: \"messages\" must be a non-empty list of "
                                     f"{{\"role\": ..., \"content\": ...}} objects, got {json.dumps(obj)[:80]!r}")
                prompts.append(chat)
                continue
            if not isinstance(obj.get("prompt"), str):
                raise ValueError(f"--prompt-file {path}, line {n}: expected an object with a \"prompt\" string "
                                 f"(or a \"messages\" list), got {json.dumps(obj)[:80]!r}")
            prompts.append(obj["prompt"])
        return prompts
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--prompt-file {path}: no such file")
    with open(path, encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line.strip()]


def collect_prompts(prompts: Optional[Sequence[str]], prompt_file: Optional[str]) -> list[Prompt]:
    """``--prompt`` values then ``--prompt-file``'s prompts; none at all, or an empty one, is an error."""
    found: list[Prompt] = list(prompts or [])
    if prompt_file:
        found += read_prompt_file(prompt_file)
    if not found:
        raise ValueError("no prompts: give --prompt TEXT (repeatable) or --prompt-file FILE")
    for i, p in enumerate(found):
        if isinstance(p, str) and not p.strip():
            raise ValueError(f"prompt {i} is empty; every prompt needs text to continue from")
    return found


def chat_template_text(template: str, tokenizer_type: Optional[str], tokenizer_model: Optional[str]) -> str:
    """``--chat-template``'s Jinja text: a file's, or (``model``) the tokenizer directory's own
    (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``)."""
    if template != "model":
        if not os.path.isfile(template):
            raise FileNotFoundError(f"--chat-template {template}: no such file (a Jinja chat template; "
                                    "--chat-template alone uses the tokenizer's own)")
        with open(template, encoding="utf-8") as f:
            return f.read()
    if tokenizer_type == "HuggingFaceTokenizer" and tokenizer_model and os.path.isdir(tokenizer_model):
        jinja = os.path.join(tokenizer_model, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                return f.read()
        config = os.path.join(tokenizer_model, "tokenizer_config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                text = json.load(f).get("chat_template")
            if isinstance(text, str):
                return text
    raise ValueError(f"--chat-template: the tokenizer ({tokenizer_type} {tokenizer_model}) has no chat template; "
                     "give one as --chat-template FILE")


def render_chat(template: str, messages: Messages, special: dict[str, Optional[str]]) -> str:
    """The chat as the model reads it, ending with the assistant's turn opened (add_generation_prompt),
    rendered as transformers' apply_chat_template does (sandboxed Jinja, trimmed blocks)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"--chat-template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            **{k: v for k, v in special.items() if v is not None})


def result_record(prompt: str, completion: str, prompt_ids: Sequence[int], token_ids: Sequence[int],
                  finish_reason: str) -> dict[str, Any]:
    """One line of ``--output-file``."""
    return {"prompt": prompt, "completion": completion, "prompt_token_ids": list(prompt_ids),
            "token_ids": list(token_ids), "finish_reason": finish_reason}


def write_jsonl(path: str, records: Iterable[dict[str, Any]]) -> None:
    """Write ``records`` to ``path`` under a temporary name, renamed when complete."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--output-file {path}: directory {directory} does not exist")
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
