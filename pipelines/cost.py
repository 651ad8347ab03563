"""``longreel cost``: project the GPU-hours of a curation run of a given size, stage by stage.

Pure functions over a cost config (:file:`pipelines/configs/cost.yaml`: model throughput, tokens per call of each
stage, the scale to project). A call's GPU-seconds are ``gpus * (input / prefill_tokens_per_s + output /
decode_tokens_per_s)`` for the replica that serves the stage's model; a stage's hours are that times its calls.
:func:`workload_from_stats` replaces the assumed tokens per call with the per-call means a real run measured (its
``stats.json`` compute counts, :mod:`longreel.pipelines.compute`). :func:`levers` re-projects with one change at a
time, so a reader sees what each lever is worth.
"""
from __future__ import annotations

import copy
import math
import os

import yaml

from longreel.pipelines.compute import stage_compute
from longreel.schemas.config import ConfigError

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "cost.yaml")
STAGE_MODEL = {"caption": "captioner", "qra": "generator", "refine": "generator", "blind": "blind",
               "passrate": "answerer"}
#: stats.json stage -> the workload section its measured per-call means replace
MEASURED = {"caption": "caption", "qra": "qra", "qra_refine": "refine", "passrate": "passrate", "blind": "blind"}
MODEL_KEYS = ("gpus", "decode_tokens_per_s", "prefill_tokens_per_s")


def load(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The cost config: ``path`` (default: the shipped one) with ``key.sub=value`` overrides (YAML scalars)."""
    try:
        fh = open(path or DEFAULT_CONFIG, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    with fh:
        try:
            cfg = yaml.safe_load(fh) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        node, parts = cfg, key.strip().split(".")
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section of the cost config")
        if parts[-1] not in node:
            raise ConfigError(f"--set {key}: unknown key; known: {sorted(node)}")
        node[parts[-1]] = yaml.safe_load(raw)
    check(cfg)
    return cfg


def rescale(cfg: dict, *, videos: int | None = None, questions: int | None = None) -> dict:
    """``cfg`` at another corpus size, keeping the config's ratios for what is not given: ``videos`` alone scales
    the questions generated and released with it (per video as configured), ``questions`` (generated) scales the
    released ones (the same share kept). Set one by one, the projection mixed scales: ``--videos 500`` made 4,000
    QRA calls refine 208,000 questions, and ``--questions 4000`` said "(104,000 released)"."""
    s = dict(cfg["scale"])
    if videos is not None:
        per_video = s["questions_generated"] / s["videos"]
        s["videos"] = videos
        if questions is None:
            s["questions_released"] = round(s["questions_released"] * videos * per_video / s["questions_generated"])
            s["questions_generated"] = round(videos * per_video)
    if questions is not None:
        s["questions_released"] = round(s["questions_released"] * questions / s["questions_generated"])
        s["questions_generated"] = questions
    return {**cfg, "scale": s}


def check(cfg: dict) -> None:
    """Every model has positive throughput; every workload and scale number is a non-negative number."""
    for section in ("models", "workload", "scale"):
        if not isinstance(cfg.get(section), dict):
            raise ConfigError(f"cost config: missing section {section!r}")
    for role in sorted(set(STAGE_MODEL.values())):
        m = cfg["models"].get(role)
        if not isinstance(m, dict):
            raise ConfigError(f"cost config: models.{role} is missing")
        for k in MODEL_KEYS:
            if not _number(m.get(k)) or m[k] <= 0:
                raise ConfigError(f"cost config: models.{role}.{k} must be a number > 0, got {m.get(k)!r}")
    for section in ("workload", "scale"):
        for path, v in _leaves(cfg[section], section):
            if not _number(v) or v < 0:
                raise ConfigError(f"cost config: {path} must be a number >= 0, got {v!r}")
    if not 0 <= cfg["workload"]["blind"]["text_answerable_share"] <= 1:
        raise ConfigError("cost config: workload.blind.text_answerable_share must be in [0, 1]")
    if cfg["scale"]["clip_s"] <= 0:
        raise ConfigError("cost config: scale.clip_s must be > 0")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _leaves(node: dict, prefix: str):
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}.{k}")
        else:
            yield f"{prefix}.{k}", v


def workload_from_stats(cfg: dict, stats: dict) -> tuple[dict, list[str]]:
    """``cfg`` with the tokens per call of each stage a run measured (its stats.json compute counts) in place of
    the assumed ones; returns it and the stages replaced. A stage the run did not call a model for keeps the
    assumption."""
    out = copy.deepcopy(cfg)
    w, replaced = out["workload"], []
    for st in stats.get("stages", []):
        section = MEASURED.get(st["stage"])
        c = stage_compute(st)
        if section is None or not c["calls"]:
            continue
        n = c["calls"]
        text, vision, output = c["input_text_tokens"] / n, c["input_vision_tokens"] / n, c["output_tokens"] / n
        if section in ("caption", "passrate"):
            w[section]["frames"] = 1
            w[section]["vision_tokens_per_frame"] = vision
            w[section]["text_tokens"] = text
            if section == "caption":
                w[section]["output_tokens"] = output
            else:
                w[section]["output_tokens_per_sample"] = output / max(w[section]["k"], 1)
        elif section == "blind":  # one call per sample (each option rotation its own prompt): a sample's tokens
            w[section]["text_tokens"] = text
            w[section]["output_tokens_per_sample"] = output
        else:  # text calls: the measured prompt replaces the fixed part; the per-clip part stays
            w[section]["prompt_tokens"] = text
            w[section]["tokens_per_clip"] = 0
            w[section]["output_tokens"] = output
        replaced.append(st["stage"])
    return out, replaced


def _call_seconds(model: dict, input_tokens: float, output_tokens: float) -> float:
    return model["gpus"] * (input_tokens / model["prefill_tokens_per_s"] + output_tokens / model["decode_tokens_per_s"])


def stage_rows(cfg: dict, *, blind_filter: bool = False, batched_k: bool = True, prefix_cache: bool = False,
               single_stream: bool = False) -> list[dict]:
    """One row per model stage: calls, input and output tokens, GPU-hours.

    ``batched_k``: the k pass-rate samples of a question share one prefill (one call with ``n=k``, as longreel
    does); False prefills the prompt k times. ``prefix_cache``: the QRA and refinement calls of a video share their
    captions' prefill (the engine's prefix caching), so a video's context is prefilled once per stage, not once per
    call. ``single_stream``: every model decodes one request at a time (its ``single_stream_decode_tokens_per_s``),
    as an unbatched loop of ``generate`` calls does.
    ``blind_filter``: the text-only filter runs before the pass-rate filter and removes the text-answerable share,
    so the VLM answers only the rest."""
    w, s, m = cfg["workload"], cfg["scale"], cfg["models"]
    if single_stream:
        m = {role: dict(spec, decode_tokens_per_s=spec.get("single_stream_decode_tokens_per_s",
                                                           spec["decode_tokens_per_s"])) for role, spec in m.items()}
    clips = s["videos"] * math.ceil(s["mean_duration_s"] / s["clip_s"])
    clips_per_video = math.ceil(s["mean_duration_s"] / s["clip_s"])
    rows = []

    def add(stage: str, calls: float, input_per_call: float, output_per_call: float, shared_input: float = 0.0):
        model = m[STAGE_MODEL[stage]]
        seconds = calls * _call_seconds(model, input_per_call, output_per_call) + _call_seconds(model, shared_input, 0)
        rows.append({"stage": stage, "model": model.get("name", STAGE_MODEL[stage]), "calls": round(calls),
                     "input_tokens": round(calls * input_per_call + shared_input),
                     "output_tokens": round(calls * output_per_call), "gpu_hours": seconds / 3600})

    c = w["caption"]
    add("caption", clips, c["frames"] * c["vision_tokens_per_frame"] + c["text_tokens"], c["output_tokens"])
    q = w["qra"]
    context = clips_per_video * q["tokens_per_clip"]
    qra_calls = s["videos"] * q["calls_per_video"]
    if prefix_cache:  # the context once per video, the instructions per call
        add("qra", qra_calls, q["prompt_tokens"], q["output_tokens"], shared_input=s["videos"] * context)
    else:
        add("qra", qra_calls, q["prompt_tokens"] + context, q["output_tokens"])
    r = w["refine"]
    if prefix_cache:
        add("refine", s["questions_generated"], r["prompt_tokens"], r["output_tokens"],
            shared_input=s["videos"] * clips_per_video * r["tokens_per_clip"])
    else:
        add("refine", s["questions_generated"], r["prompt_tokens"] + clips_per_video * r["tokens_per_clip"],
            r["output_tokens"])
    answered = s["questions_generated"]
    if blind_filter:
        b = w["blind"]
        add("blind", answered, b["text_tokens"], b["k"] * b["output_tokens_per_sample"])
        answered *= 1 - b["text_answerable_share"]
    p = w["passrate"]
    prompt = p["frames"] * p["vision_tokens_per_frame"] + p["text_tokens"]
    add("passrate", answered, prompt * (1 if batched_k else p["k"]), p["k"] * p["output_tokens_per_sample"])
    return rows


LEVERS = {
    "as configured": {},
    "pass-rate k samples prefilled k times (no batched answering)": {"batched_k": False},
    "QRA and refinement context prefilled once per video (prefix caching)": {"prefix_cache": True},
    "blind text-only filter before the pass-rate filter": {"blind_filter": True},
    "all three levers": {"prefix_cache": True, "blind_filter": True},
    "every model decoding one request at a time (unbatched generate)": {"single_stream": True},
}


def levers(cfg: dict) -> list[dict]:
    """Total GPU-hours with each lever, and the change against the configured run."""
    base = sum(r["gpu_hours"] for r in stage_rows(cfg))
    out = []
    for name, kw in LEVERS.items():
        total = sum(r["gpu_hours"] for r in stage_rows(cfg, **kw))
        out.append({"lever": name, "gpu_hours": total, "change": total / base - 1 if base else 0.0})
    return out


def format_report(cfg: dict, rows: list[dict], lever_rows: list[dict], measured: list[str]) -> str:
    s, total = cfg["scale"], sum(r["gpu_hours"] for r in rows)
    lines = [f"scale: {s['videos']:,} videos x {s['mean_duration_s']:g} s, {s['clip_s']:g} s clips, "
             f"{s['questions_generated']:,} questions generated ({s['questions_released']:,} released); "
             f"GPU: {cfg.get('gpu', '?')}",
             "tokens per call: " + (f"measured by the run for {', '.join(measured)}; assumed elsewhere" if measured
                                    else "assumed (cost config workload)"), "",
             f"{'stage':<10} {'model':<34} {'calls':>12} {'input tokens':>16} {'output tokens':>16} "
             f"{'GPU-hours':>10} {'share':>6}"]
    for r in rows:
        share = r["gpu_hours"] / total if total else 0.0
        lines.append(f"{r['stage']:<10} {r['model'][:34]:<34} {r['calls']:>12,} {r['input_tokens']:>16,} "
                     f"{r['output_tokens']:>16,} {r['gpu_hours']:>10,.1f} {share:>6.1%}")
    lines.append(f"{'total':<10} {'':<34} {'':>12} {'':>16} {'':>16} {total:>10,.1f}")
    ref = cfg.get("reference_gpu_hours")
    if ref:
        lines.append(f"reference: {ref:,} GPU-hours reported; this projection is {total / ref:.2%} of it")
    lines += ["", "levers (whole run):"]
    for lv in lever_rows:
        lines.append(f"  {lv['lever']:<62} {lv['gpu_hours']:>10,.1f} GPU-hours ({lv['change']:+.1%})")
    lines.append("  keyframe-snapped caption frames: decoding is CPU work; GPU-hours unchanged")
    return "\n".join(lines)
