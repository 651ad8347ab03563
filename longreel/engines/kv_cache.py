"""The keyword a transformers model takes its key/value cache by, under the transformers the environment holds.

transformers 5.24 renamed ``past_key_values`` to ``cache``, as the keyword of ``forward`` and ``generate`` and as the
field of the outputs; the old name still works until 5.40 (``generate``: 6.0) but logs a deprecation warning at
every run. The vLLM and GPU locks hold transformers 5.19, which knows only the old name, and ``setup.cfg`` allows
both, so the call sites that pass or read a cache ask here instead of naming either.
"""
from __future__ import annotations

import functools
from typing import Any


@functools.cache
def cache_keyword() -> str:
    """``"cache"`` where transformers' model outputs carry the cache under that name (5.24 on), else
    ``"past_key_values"``. Read from ``CausalLMOutputWithPast``'s fields: the release that renamed the keyword
    renamed the field with it."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model(...)`` or ``model.generate(...)``."""
    return {cache_keyword(): cache}


def output_cache(output: Any) -> Any:
    """The key/value cache a forward returned (``output.cache`` or ``output.past_key_values``)."""
    return getattr(output, cache_keyword())
