"""Prompt templates: Jinja2 files in this package, each identified by the sha256 of its source.

``load_template("caption")`` (or ``"caption.j2"``) returns ``(jinja2.Template, sha256_hex)``.
The hash is of the template file's bytes, so it changes exactly when the prompt text does;
every output row that a template produced records it (``prompt_hash``), and the data card
lists the hashes of the templates a dataset was built with.

Templates render with ``StrictUndefined`` (a missing variable is an error, never an empty
string), no autoescaping (prompts are not HTML), and keep their final newline stripped so
that a trailing newline in the file does not end up in the prompt. Any stage can add its own
``<name>.j2`` beside the caption templates; nothing here is caption specific.
"""
from __future__ import annotations

import functools
import hashlib
import os

import jinja2

PROMPTS_DIR = os.path.dirname(os.path.abspath(__file__))


class PromptError(ValueError):
    pass


def _file_name(name: str) -> str:
    base = name if name.endswith(".j2") else name + ".j2"
    if os.path.basename(base) != base or base.startswith("."):
        raise PromptError(f"bad template name {name!r}: a bare file name in {PROMPTS_DIR} is expected")
    return base


def template_source(name: str, directory: str | None = None) -> str:
    path = os.path.join(directory or PROMPTS_DIR, _file_name(name))
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        known = sorted(f[:-3] for f in os.listdir(directory or PROMPTS_DIR) if f.endswith(".j2"))
        raise PromptError(f"no prompt template {name!r} (known: {known})") from None


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


_ENV = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=False,
                          trim_blocks=True, lstrip_blocks=True)


@functools.lru_cache(maxsize=None)
def load_template(name: str, directory: str | None = None) -> tuple[jinja2.Template, str]:
    """``(template, sha256 of its source)`` for ``<directory or pipelines/prompts>/<name>.j2``."""
    source = template_source(name, directory)
    try:
        template = _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise PromptError(f"template {name!r} line {e.lineno}: {e.message}") from None
    return template, source_hash(source)


def render(name: str, directory: str | None = None, **variables) -> tuple[str, str]:
    """Render template ``name`` with ``variables``; return ``(text, sha256)``. Leading/trailing space is stripped."""
    template, digest = load_template(name, directory)
    try:
        text = template.render(**variables)
    except jinja2.UndefinedError as e:
        raise PromptError(f"template {name!r}: {e.message}") from None
    return text.strip(), digest

