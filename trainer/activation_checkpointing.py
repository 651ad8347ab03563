"""transformers' activation (gradient) checkpointing switched on and off, and read, under either of its names.

transformers 5.24 renamed ``gradient_checkpointing_enable`` / ``gradient_checkpointing_disable`` /
``is_gradient_checkpointing`` to ``activation_checkpointing_*`` and warns at every use of the old names (removed in
v6); the vLLM and GPU locks hold 5.19, which has only the old ones.
"""
from __future__ import annotations


def enable_checkpointing(model) -> None:
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def disable_checkpointing(model) -> None:
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def checkpointing_on(model) -> bool:
    """Whether checkpointing is on in ``model`` (False for an object that has neither property, e.g. a wrapper)."""
    # the class is asked, not the instance: reading the old property is what warns
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))
