"""The checkpoint's chat template, rendered as transformers renders it
(`Gemma4Processor.apply_chat_template(add_generation_prompt=True)`): a Jinja2 sandbox with
transformers' settings (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML), the tokenizer's named special tokens
(bos_token, eos_token, …) as variables, and either one user message whose content lists the
images, videos and text in the order the prompt gives them (with a system message before it when
asked), or a conversation as transformers takes it (`read_messages`, `parse_messages`: roles
system/user/assistant/tool, content a string or a list of text/image/video/audio items, media by
local path), its keys whose value is null dropped and its reasoning aliased as transformers does;
with tools (JSON schemas, `read_tools`/`parse_tools`) and thinking (`enable_thinking=True`)
passed as transformers passes them, and refused where the template would drop them.

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
ROLES = ("system", "developer", "user", "assistant", "tool")
MEDIA = ("image", "video", "audio")
# the keys transformers reads a media item's file from (`_multimodal_inputs_from_conversations`)
MEDIA_KEYS = ("image", "url", "path")
# the names a message's reasoning goes by; transformers fills `thinking` and `reasoning_content`
REASONING = ("reasoning_content", "thinking", "reasoning")


class ChatError(ValueError):
    """The folder's template cannot be read or rendered."""


def _load(path, expected):
    """A JSON file's value; one that cannot be read or parsed: ChatError "{expected} (why)"."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ChatError(f"{expected} ({e})") from e


def _json(path):
    value = _load(path, f"{path}: expected a JSON object")
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


def render(template, messages, specials, add_generation_prompt=True, tools=None, thinking=False):
    """The template rendered on `messages` with the named special tokens → str: `tools` (JSON
    schemas, `parse_tools`) as its `tools`, and with `thinking` `enable_thinking=True` (left
    undefined otherwise, as transformers leaves a keyword it is not given)."""
    from jinja2 import TemplateError

    extra = {"enable_thinking": True} if thinking else {}
    try:
        compiled = _environment().from_string(template)
        return compiled.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **specials,
            **extra,
        )
    except TemplateError as e:
        raise ChatError(f"the chat template failed: {e}") from e


def check_options(template, tools, thinking, where):
    """Refuse tools or thinking that `template` would drop without a word: a template that never
    names `tools` (or `enable_thinking`), or no template at all. where: (what names the tools,
    what names thinking) in an error."""
    asked = {"tools": (tools is not None, where[0]), "enable_thinking": (thinking, where[1])}
    for name, (given, option) in asked.items():
        if given and (template is None or name not in template):
            reason = "no chat template is used" if template is None else f"it never reads {name}"
            raise ChatError(f"{option}: expected a chat template that reads {name} ({reason})")


def read_tools(path):
    """A JSON file of tools (`run --tools`) → the checked tools (`parse_tools`)."""
    value = _load(path, f"--tools {path}: expected a JSON list of tools")
    return parse_tools(value, f"--tools {path}")


def parse_tools(value, where):
    """Tools as transformers' `apply_chat_template(tools=)` takes JSON schemas: a non-empty list
    of {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
    (name a string, parameters an object where given) → the list, as it is."""
    if not isinstance(value, list) or not value:
        raise ChatError(f"{where}: {_shown(value)}: expected a non-empty list of tools")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatError(
                f'{where}: tool {i}: {_shown(tool)}: expected {{"type": "function", '
                '"function": {"name": ..., "parameters": {...}}}'
            )
        if not isinstance(function.get("parameters", {}), dict):
            raise ChatError(f"{where}: tool {i}: parameters {_shown(function['parameters'])}: "
                            "expected a JSON schema object")  # fmt: skip
    return value


def system_message(text):
    """A system message holding `text` (`run --system`)."""
    return {"role": "system", "content": text}


def read_messages(path):
    """A JSON file of messages (`run --messages`) → the checked messages, media paths relative
    to the file's folder (`parse_messages`)."""
    value = _load(path, f"--messages {path}: expected a JSON list of messages")
    return parse_messages(value, f"--messages {path}", os.path.dirname(os.path.abspath(path)))


def parse_messages(value, where, base):
    """Messages as transformers' `apply_chat_template` takes them, checked, with each media
    item's file resolved against `base` (and existing), keys whose value is null dropped and the
    reasoning aliased (`_normalize_chat_messages`, `_alias_reasoning_fields`) → list of dicts.

    value: the decoded JSON; where: what names it in an error."""
    if not isinstance(value, list) or not value:
        raise ChatError(f"{where}: {_shown(value)}: expected a non-empty list of messages")
    return [_message(m, f"{where}: message {i}", base) for i, m in enumerate(value)]


def _shown(value, width=60):
    """A value as an error shows it: its JSON, cut to `width` characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 1] + "…"


def _message(message, where, base):
    """One checked message (see `parse_messages`)."""
    if not isinstance(message, dict):
        raise ChatError(f"{where}: {_shown(message)}: expected an object with role and content")
    message = {k: v for k, v in message.items() if v is not None}
    if message.get("role") not in ROLES:
        role = _shown(message.get("role"))
        raise ChatError(f"{where}: role {role}: expected one of {', '.join(ROLES)}")
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = [_item(c, f"{where} item {k}", base) for k, c in enumerate(content)]
    elif content is not None and not isinstance(content, str):
        raise ChatError(f"{where}: content {_shown(content)}: expected a string or a list of items")
    if "tool_calls" in message:
        _tool_calls(message["tool_calls"], where)
    reasoning = next((message[k] for k in REASONING if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _tool_calls(calls, where):
    """Refuse tool_calls that are not a list of {"function": {"name": str, "arguments": object
    or string}} (the OpenAI form transformers' templates read)."""
    for call in calls if isinstance(calls, list) else [None]:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", {}), dict | str)):  # fmt: skip
            raise ChatError(
                f"{where}: tool_calls {_shown(calls)}: expected a list of "
                '{"function": {"name": ..., "arguments": {...}}}'
            )


def _item(item, where, base):
    """One checked content item: text with its string, or a media item with one existing file
    under one of MEDIA_KEYS (resolved against `base`)."""
    kind = item.get("type") if isinstance(item, dict) else None
    if kind not in ("text", *MEDIA):
        kinds = ", ".join(("text", *MEDIA))
        raise ChatError(f"{where}: {_shown(item)}: expected an object whose type is one of {kinds}")
    if kind == "text":
        if not isinstance(item.get("text"), str):
            raise ChatError(f'{where}: {_shown(item)}: expected a text item\'s "text" string')
        return item
    keys = [k for k in MEDIA_KEYS if k in item]
    if len(keys) != 1 or not isinstance(item[keys[0]], str):
        names = "/".join(MEDIA_KEYS)
        raise ChatError(f"{where}: {_shown(item)}: expected one {names} key with a file's path")
    if "://" in item[keys[0]]:
        raise ChatError(f"{where}: {item[keys[0]]}: expected a local file's path, not a URL")
    path = os.path.join(base, os.path.expanduser(item[keys[0]]))
    if not os.path.isfile(path) and not (kind == "video" and os.path.isdir(path)):
        raise ChatError(f"{where}: {kind} file {path} does not exist: expected a local file")
    return {**item, keys[0]: path}


def media(messages, kind):
    """The files of the messages' `kind` items ("image", "video" or "audio"), in order of
    appearance (transformers' order of loading them)."""
    found = []
    for message in messages:
        items = message.get("content") if isinstance(message.get("content"), list) else []
        found += [
            item[k] for item in items if item["type"] == kind for k in MEDIA_KEYS if k in item
        ]
    return found
