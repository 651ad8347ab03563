"""Fixtures for tests, benchmarks and the demo, kept out of the product packages (no module of
``longreel.pipelines``, ``longreel.trainer``, ``longreel.task`` or ``longreel.schemas`` imports them; tests/test_layers.py
checks it): sample videos fetched from public package registries (:mod:`.sample_videos`), a tiny Qwen2-VL-family
policy built offline (:mod:`.tiny_model`, also what ``scripts/demo.sh`` trains) and stage tables with known contents
(:mod:`.pack_tables`)."""
