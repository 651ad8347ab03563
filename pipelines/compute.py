"""The compute bill: what the model calls of a stage consumed, counted the same way in every model stage.

Per call: one model call (a clip's caption, a QRA generation or refinement call, a question's k pass-rate samples),
its prompt tokens split into text and vision tokens (the vision tower's placeholders), and its output tokens (all
samples, end-of-sequence tokens excluded). These counts depend only on the inputs, the config and the model, so
they go into the stage's funnel ``extra`` in ``stats.json`` as ``compute.<metric>`` (and into each row where a row
is one call); wall-clock seconds are not deterministic and stay in ``stats.json["run"][stage]``. ``longreel cost``
(:mod:`longreel.pipelines.cost`) projects GPU-hours from them.
"""
from __future__ import annotations

PREFIX = "compute."
METRICS = ("calls", "input_text_tokens", "input_vision_tokens", "output_tokens", "vision_tokens_unknown")


def call_pairs(stage: str, prompt_tokens: int | None, vision_tokens: int | None, output_tokens: int | None,
               calls: int = 1) -> list[tuple]:
    """``((stage, "compute.<metric>"), n)`` pairs of ``calls`` model calls. ``vision_tokens`` None: the engine
    could not tell (an OpenAI-compatible server counts image tokens inside the prompt): the prompt counts as text
    and the call is counted under ``vision_tokens_unknown``."""
    prompt, vision = int(prompt_tokens or 0), vision_tokens
    pairs = [((stage, PREFIX + "calls"), calls), ((stage, PREFIX + "output_tokens"), int(output_tokens or 0))]
    if vision is None:
        pairs += [((stage, PREFIX + "input_text_tokens"), prompt), ((stage, PREFIX + "vision_tokens_unknown"), calls)]
    else:
        pairs += [((stage, PREFIX + "input_text_tokens"), prompt - int(vision)),
                  ((stage, PREFIX + "input_vision_tokens"), int(vision))]
    return pairs


def stage_compute(stage_doc: dict) -> dict[str, int]:
    """The ``compute.*`` counts of one ``stats.json`` stage entry, without the prefix (every metric present)."""
    extra = stage_doc.get("extra") or {}
    return {m: int(extra.get(PREFIX + m, 0)) for m in METRICS}


def compute_table(stats_doc: dict) -> list[dict]:
    """One row per stage that made model calls: its compute counts, per-call means and the wall seconds the run
    spent in model calls (``stats.json["run"][stage]["latency_total_s"]``, when recorded)."""
    rows = []
    run = stats_doc.get("run") or {}
    for st in stats_doc.get("stages", []):
        c = stage_compute(st)
        if not c["calls"]:
            continue
        n = c["calls"]
        rows.append({"stage": st["stage"], **c,
                     "input_tokens_per_call": round((c["input_text_tokens"] + c["input_vision_tokens"]) / n, 1),
                     "output_tokens_per_call": round(c["output_tokens"] / n, 1),
                     "model_seconds": (run.get(st["stage"]) or {}).get("latency_total_s")})
    return rows
