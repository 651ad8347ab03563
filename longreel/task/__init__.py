"""The task format shared by the curation pipelines and the trainer: prompt rendering and answer tags
(:mod:`.prompting`), the rewards that score an answer (:mod:`.rewards`), the shard format (:mod:`.shard_format`)
and the filter for Beam's import noise (:mod:`.beam_quiet`).

It is the layer both sides build on: ``longreel.pipelines`` and ``longreel.trainer`` import it and
``longreel.schemas``, never each other (see docs/CONVENTIONS.md); it imports only ``longreel.schemas``.
"""
