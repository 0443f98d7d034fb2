"""The checkpoint's chat template, rendered as transformers renders it
(`Gemma4Processor.apply_chat_template(add_generation_prompt=True)`): a Jinja2 sandbox with
transformers' settings (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML), the tokenizer's named special tokens
(bos_token, eos_token, …) as variables, and one user message whose content lists the images,
videos and text in the order the prompt gives them.

The rendered text still holds one image or video placeholder per item; `run` expands and
tokenizes it as any prompt (`ref.gemma4.multimodal.prompt_inputs`), without adding the
tokenizer's special tokens when the text already starts with bos_token (transformers' rule).
"""

import json
import os
import re
from datetime import datetime

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_JSON = "chat_template.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# the named special tokens transformers passes to a template (`special_tokens_map`)
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatError(ValueError):
    """The folder's template cannot be read or rendered."""


def _json(path):
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ChatError(f"{path}: {e}") from e
    if not isinstance(value, dict):
        raise ChatError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _default_of(template, path):
    """A template entry: a string, or transformers' list of {name, template} (its "default")."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ChatError(f"{path}: chat_template is {type(template).__name__}, expected a string")
    return template


def read_template(folder):
    """The folder's chat template: chat_template.jinja, else chat_template.json's, else
    tokenizer_config.json's `chat_template` → str, or None when it has none."""
    path = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    for name in (TEMPLATE_JSON, TOKENIZER_CONFIG):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            template = _default_of(_json(path).get("chat_template"), path)
            if template is not None:
                return template
    return None


def special_tokens(folder):
    """tokenizer_config.json's named special tokens as strings ({} without the file)."""
    path = os.path.join(folder, TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return {}
    config = _json(path)
    found = {}
    for name in NAMED:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def user_message(prompt, images, videos, tokens, audios=0):
    """One user message from a prompt: its content items in the prompt's order (text split at
    the image, video and audio placeholders), or, with no placeholder in the text, the images,
    then the videos, then the audio clips, then the text (as transformers' examples write
    them).

    prompt: str; images, videos, audios: counts; tokens: `ref.gemma4.prompts.PromptTokens`."""
    kinds = {tokens.image_token: "image", tokens.video_token: "video", tokens.audio_token: "audio"}
    given = {"image": images, "video": videos, "audio": audios}
    pieces = re.split(f"({'|'.join(map(re.escape, kinds))})", prompt)
    if len(pieces) == 1:
        pieces = [mark for mark, kind in kinds.items() for _ in range(given[kind])] + [prompt]
    content = []
    for piece in pieces:
        if piece in kinds:
            content.append({"type": kinds[piece]})
        elif piece.strip():
            content.append({"type": "text", "text": piece})
    found = [c["type"] for c in content]
    if any(found.count(kind) != n for kind, n in given.items()):
        placed = ", ".join(f"{found.count(k)} {k}s" for k in given)
        raise ChatError(
            f"the prompt places {placed} but {', '.join(map(str, given.values()))} are given"
        )
    return {"role": "user", "content": content}


def _environment():
    from jinja2 import TemplateError, ext, sandbox

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render(template, messages, specials, add_generation_prompt=True):
    """The template rendered on `messages` with the named special tokens → str."""
    from jinja2 import TemplateError

    try:
        compiled = _environment().from_string(template)
        return compiled.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **specials,
        )
    except TemplateError as e:
        raise ChatError(f"the chat template failed: {e}") from e
