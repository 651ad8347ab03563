"""Counting a chat's prompt tokens from a tokenizer's own files, without importing transformers.

:class:`ChatTokenCounter` gives ``len(tok.apply_chat_template(messages, add_generation_prompt=True,
tokenize=True))`` for the fast (``tokenizer.json``) tokenizer of a local directory: it renders the directory's chat
template with jinja2 in the sandbox transformers uses, then encodes the text with the `tokenizers` library (the
library behind transformers' fast tokenizers) without adding special tokens, as ``apply_chat_template`` does.

Why not transformers itself: the QRA stage counts every prompt it builds, in every worker, and importing
transformers for that cost each worker about 0.6 s of CPU (``import transformers`` alone 0.46 s) against 0.1 s
for this module and the tokenizer. A local run on two workers paid it in both at once, on the serial end of the run,
after their shares of the decoding: the demo config on the 14 sample videos, 2 workers, took 0.33 s less with this
counter (mean of 5 alternating pairs, 0.05-0.72 s each).

It reproduces only what those calls do for plain chats, and says so instead of guessing otherwise:
:meth:`ChatTokenCounter.from_directory` returns None for a directory outside that (another tokenizer class, a
special token transformers would add to the vocabulary, a template that reads special tokens other than the
standard ones, a named-template set, a template jinja2 cannot compile without transformers' own extension), and
:meth:`ChatTokenCounter.count` returns None for messages other than ``role``/``content`` strings. The caller then
counts with transformers (:class:`longreel.pipelines.qra.generate.TokenCounter`). tests/test_chat_count.py
checks equal counts against transformers.
"""
from __future__ import annotations

import functools
import json
import os
import re
import threading
from datetime import datetime

from longreel.engines.local_models import GENERIC_TOKENIZER_CLASSES

#: the special tokens transformers passes to a chat template (``special_tokens_map``) when they are set
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: what a template may read that this module does not pass the way transformers does (the special token lists)
_UNSUPPORTED_NAMES = re.compile(r"special_tokens")
#: config keys that make transformers change the tokenizer it reads from ``tokenizer.json``
_RETOKENIZING_KEYS = ("add_prefix_space", "split_special_tokens", "do_lower_case")
#: jinja2 before 3.1.6 has sandbox escapes; transformers refuses it for the same reason
_MIN_JINJA = (3, 1, 6)


class ChatTokenCounter:
    """Prompt-token counts of chats for one tokenizer directory (see the module docstring). Thread-safe."""

    def __init__(self, tokenizer, template, special_tokens: dict[str, str]):
        self._tokenizer = tokenizer
        self._template = template
        self._special = dict(special_tokens)

    @classmethod
    def from_directory(cls, directory: str) -> "ChatTokenCounter | None":
        """The counter for ``directory``'s tokenizer, or None where it would not count as transformers does."""
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        tokenizer_file = os.path.join(directory, "tokenizer.json")
        if not isinstance(config, dict) or not os.path.isfile(tokenizer_file):
            return None
        if config.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES:
            return None
        if any(k in config for k in _RETOKENIZING_KEYS):
            return None
        source = _template_source(directory, config)
        if source is None or _UNSUPPORTED_NAMES.search(source):
            return None
        special = _special_tokens(config)
        if special is None:
            return None
        template = _compile(source)
        if template is None:
            return None
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(tokenizer_file)
        added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        if not set(special.values()) | _config_added_tokens(config) <= added:
            return None  # transformers would add these to the vocabulary, which changes how text splits
        tokenizer.no_truncation()  # as transformers' call without truncation or padding leaves it
        tokenizer.no_padding()
        return cls(tokenizer, template, special)

    def count(self, messages: list[dict]) -> int | None:
        """Tokens of ``messages`` with the generation prompt, or None for messages this counter does not take
        (anything but a non-empty list of dicts of ``role`` and ``content`` strings)."""
        if not messages or not all(_plain_message(m) for m in messages):
            return None
        import jinja2

        try:
            text = self._template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                         add_generation_prompt=True, **self._special)
        except jinja2.TemplateError:
            return None  # e.g. the template's raise_exception: transformers raises it, the caller's fallback will
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


_LOCK = threading.Lock()


def chat_counter(directory: str) -> ChatTokenCounter | None:
    """:meth:`ChatTokenCounter.from_directory`, once per directory and process (thread-safe). A directory without a
    tokenizer config is not remembered: a GGUF model's is written by the first transformers load."""
    if not os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        return None
    with _LOCK:
        return _cached_counter(os.path.abspath(directory))


@functools.lru_cache(maxsize=8)
def _cached_counter(directory: str) -> ChatTokenCounter | None:
    return ChatTokenCounter.from_directory(directory)


def _plain_message(message) -> bool:
    return type(message) is dict and set(message) <= {"role", "content"} and "role" in message and all(
        type(v) is str for v in message.values())


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _template_source(directory: str, config: dict) -> str | None:
    """The chat template transformers would use with no tools: ``chat_template.jinja`` (where transformers saves it
    now), else the config's string. A set of named templates is left to transformers."""
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        if os.path.isdir(os.path.join(directory, "additional_chat_templates")):
            return None
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    source = config.get("chat_template")
    return source if isinstance(source, str) else None


def _token_text(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(config: dict) -> dict[str, str] | None:
    """The standard special tokens the config sets, as the strings transformers passes to the template."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        if config.get(name) is None:
            continue
        text = _token_text(config[name])
        if text is None:
            return None
        out[name] = text
    return out


def _config_added_tokens(config: dict) -> set[str]:
    decoder = config.get("added_tokens_decoder") or {}
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    if isinstance(extra, dict):
        extra = list(extra.values())
    texts = [_token_text(v) for v in list(decoder.values()) + list(extra)]
    return {t for t in texts if t is not None}


def _compile(source: str):
    """``source`` compiled in the sandbox transformers renders chat templates in (immutable sandbox, trimmed
    blocks, loop controls, its ``tojson``, ``raise_exception``, ``strftime_now``, and ``dict`` and ``namespace``
    that cannot reach private attributes); None if it does not compile here."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3]) < _MIN_JINJA:
        return None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    try:
        return env.from_string(source)
    except jinja2.TemplateError:
        return None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters; chat templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # a template's dict(...) builds a plain dict, without exposing the dict type itself
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=1)
def _namespace_class():
    import jinja2.exceptions
    import jinja2.utils

    class TemplateNamespace(jinja2.utils.Namespace):
        # a namespace that refuses underscore names, so a template cannot reach interpreter internals through it
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    return TemplateNamespace
