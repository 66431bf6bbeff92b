"""Chat prompts: a checkpoint's own chat template rendered for a conversation.

The template is `chat_template` in tokenizer_config.json, a Jinja template, as DeepSeek-V3/R1 and
Kimi K2 checkpoints ship it. It is rendered with jinja2's sandboxed environment and the
conventions templates are written for: trim_blocks and lstrip_blocks, the loop-control extension,
`raise_exception(msg)`, a `tojson` filter, and the variables messages, add_generation_prompt,
bos_token and eos_token.
"""

from __future__ import annotations

import json
import os

from jaxmtp.errors import ConfigError


FILE = "tokenizer_config.json"


def _token_text(value) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


def read_template(directory: str) -> tuple[str, dict[str, str]] | None:
    """(the chat template, {"bos_token": ..., "eos_token": ...}) from directory/tokenizer_config.json,
    or None when there is no file or no template. A list of named templates gives "default"."""
    path = os.path.join(directory, FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    template = raw.get("chat_template") if isinstance(raw, dict) else None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        return None
    if not isinstance(template, str):
        raise ConfigError(f"{path}: chat_template: expected a Jinja template string, found {type(template).__name__}")
    return template, {name: _token_text(raw.get(name)) for name in ("bos_token", "eos_token")}


def render(template: str, messages: list[dict], add_generation_prompt: bool = True, **tokens: str) -> str:
    """The conversation (a list of {"role": ..., "content": ...}) as the template writes it; with
    add_generation_prompt, ending where the assistant's reply begins. tokens: bos_token, eos_token."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **tokens)
    except jinja2.exceptions.TemplateError as e:
        raise ConfigError(f"chat_template: {e}") from None


def chat_prompt(directory: str, question: str) -> str:
    """One user question as the checkpoint's chat template writes it (ready for the reply)."""
    found = read_template(directory)
    if found is None:
        raise ConfigError(f"{os.path.join(directory, FILE)}: no chat_template to apply (the model directory needs "
                          "a tokenizer_config.json with one)")
    template, tokens = found
    return render(template, [{"role": "user", "content": question}], **tokens)
