"""Running hand-written layer computations as FSDP2 forwards (MR-SP's sequence-parallel prefill under FSDP).

The sequence-parallel prefill (:mod:`longreel.trainer.mrsp.sp_prefill`) does not call a decoder layer's ``forward``:
it runs the layer's norms, projections and MLP itself around an all-gather of K/V. FSDP2 (``fully_shard``) gathers
a unit's weights in the pre-forward hook of the unit's ``forward`` and, through hooks that hook registers,
gathers them again before the backward and reduce-scatters the gradient after it. Called submodule by submodule, a
sharded layer would compute on its DTensor shards (an error) and its gradient would never be reduced.

:func:`run_as_forward` runs ``fn(*args)`` as a forward of ``module`` through
``torch.distributed.fsdp.register_fsdp_forward_method`` (the public way to give FSDP another forward method), so
the layer's all-gather / reshard / reduce-scatter happen around ``fn`` as around the layer's own forward. Without
FSDP it is ``fn(*args)``. Every rank must then run the same layers in the same order, which the SP prefill does
(every rank runs every layer on its slice of the sequence).
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch

__all__ = ["is_fsdp", "run_as_forward"]

_METHOD = "_longreel_fsdp_call"


def is_fsdp(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard`` applied to it)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def run_as_forward(module: torch.nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` as a forward of the FSDP unit ``module`` (weights gathered for it; under grad, gathered again
    for its backward and the gradient reduce-scattered after); ``fn(*args)`` when ``module`` is not a unit.

    The tensors among ``args`` that need a gradient are the unit's inputs for FSDP's post-backward hook (pass the
    hidden states as arguments, not through a closure); ``fn`` returns a tensor or a tuple of tensors (or None).
    """
    if not is_fsdp(module):
        return fn(*args)
    if _METHOD not in module.__dict__:
        from torch.distributed.fsdp import register_fsdp_forward_method

        setattr(module, _METHOD, types.MethodType(_call, module))
        register_fsdp_forward_method(module, _METHOD)
    return getattr(module, _METHOD)(fn, *args)
