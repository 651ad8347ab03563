"""Pack's building blocks: the frame cache (decode once, processor-ready uint8), deterministic WebDataset shards
and their wids index, and the pack config. The stage that wires them into a pipeline is
:mod:`longreel.pipelines.stages.pack` (``add_pack_stage`` / ``run_pack``). See docs/SHARDS.md.
"""
from longreel.pipelines.pack.config import PackConfig

__all__ = ["PackConfig"]
