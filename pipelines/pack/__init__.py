"""Pack: frame cache (decode once, processor-ready uint8) + deterministic WebDataset shards + wids index.

See docs/SHARDS.md. ``add_pack_stage`` / ``run_pack`` live in :mod:`pipelines.pack.stage`.
"""
from pipelines.pack.config import PackConfig


def add_pack_stage(*args, **kwargs):
    """See :func:`pipelines.pack.stage.add_pack_stage` (imported lazily: Beam and transformers are heavy)."""
    from pipelines.pack.stage import add_pack_stage as _add
    return _add(*args, **kwargs)


__all__ = ["PackConfig", "add_pack_stage"]
