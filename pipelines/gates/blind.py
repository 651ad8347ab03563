"""The blind test of a question: can a text-only model answer it without the video?

A question is asked with the trainer's prompt (:func:`longreel.task.prompting.build_messages`) minus the video
part: no frames, no captions, only the question and its options. ``k`` samples are drawn; with
``rotate_options`` sample ``j`` sees the options rotated by ``j mod n`` positions (its reference letter moved with
them), grouped into one engine request per rotation (``n`` = that rotation's sample count, one seed per rotation
derived from the question's id). Every sample is scored with the trainer's rewards against the reference of the
rotation it saw. Rules and defaults: :mod:`longreel.pipelines.blind_config`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from longreel.engines.base import Completion, EngineRequest, Sampling, item_seed
from longreel.pipelines.blind_config import BlindConfig
from longreel.pipelines.gates.engine import build_engine  # noqa: F401  (the blind answerer's engine)
from longreel.task.prompting import OPTION_LETTERS, SYSTEM_PROMPT, build_messages, question_text
from longreel.task.rewards import score

STAGE = "blind"
TEXT_ANSWERABLE = "text_answerable"
#: Bump when what the blind model sees changes (recorded as the blind prompt hash).
BLIND_PROMPT_VERSION = "blind-v1"


@dataclass
class View:
    """One rotation of a question as the blind model sees it: ``samples`` of the ``k`` are drawn from it."""

    shift: int
    samples: int
    options: list[str] | None
    answer: str
    messages: list[dict]


def problem_type(q: dict) -> str:
    return q.get("problem_type") or ("multiple_choice" if q.get("options") else "open_ended")


def rotate(options: list[str], answer: str, shift: int) -> tuple[list[str], str]:
    """Options rotated left by ``shift`` (option ``shift`` comes first) and the answer letter that follows them."""
    n = len(options)
    s = shift % n
    rotated = options[s:] + options[:s]
    return rotated, OPTION_LETTERS[(OPTION_LETTERS.index(answer) - s) % n]


def blind_messages(question: str, options: list[str] | None, ptype: str) -> list[dict]:
    """The trainer's chat for the question with the video part left out (text content only)."""
    messages = build_messages(question, options, ptype)
    text = "\n".join(p["text"] for p in messages[1]["content"] if p.get("type") == "text")
    return [messages[0], {"role": "user", "content": text}]


def views(q: dict, cfg: BlindConfig) -> list[View]:
    """The rotations of ``q`` that its ``k`` samples see (one view without rotation for open questions)."""
    ptype, options = problem_type(q), list(q["options"]) if q.get("options") is not None else None
    if ptype != "multiple_choice" or not options or not cfg.rotate_options:
        return [View(0, cfg.k, options, q["answer"], blind_messages(q["question"], options, ptype))]
    n = len(options)
    counts = [sum(1 for j in range(cfg.k) if j % n == s) for s in range(n)]
    out = []
    for s, c in enumerate(counts):
        if c:
            opts, ans = rotate(options, q["answer"].strip(), s)
            out.append(View(s, c, opts, ans, blind_messages(q["question"], opts, ptype)))
    return out


def answer_schema(ptype: str, n_options: int, cfg: BlindConfig) -> dict:
    """The constrained output: a short reasoning and the answer (a letter among the options for multiple choice)."""
    answer = ({"type": "string", "enum": list(OPTION_LETTERS[:n_options])} if ptype == "multiple_choice"
              else {"type": "string", "minLength": 1, "maxLength": cfg.answer_chars})
    return {"title": "blind_answer", "type": "object", "additionalProperties": False,
            "required": ["reasoning", "answer"],
            "properties": {"reasoning": {"type": "string", "minLength": 1, "maxLength": cfg.reasoning_chars},
                           "answer": answer}}


def requests_for(q: dict, vs: list[View], cfg: BlindConfig) -> list[EngineRequest]:
    ptype = problem_type(q)
    out = []
    for v in vs:
        sampling = Sampling(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            top_k=0, n=v.samples, seed=item_seed(cfg.seed, f"{q['qra_id']}:{v.shift}"))
        schema = answer_schema(ptype, len(v.options or []), cfg) if cfg.constrained else None
        out.append(EngineRequest(key=f"blind:{q['qra_id']}:{v.shift}", messages=v.messages, sampling=sampling,
                                 schema=schema, max_string_chars=max(cfg.reasoning_chars, cfg.answer_chars)
                                 if cfg.constrained else None))
    return out


def as_tagged(text: str) -> str:
    """A constrained JSON answer written in the trainer's ``<think>..</think><answer>..</answer>`` form; text that
    is not such JSON is returned as is (the rewards then fail its format: the sample does not pass)."""
    try:
        doc = json.loads(text)
        reasoning, answer = str(doc["reasoning"]).strip(), str(doc["answer"]).strip()
    except (ValueError, KeyError, TypeError):
        return text
    return f"<think>{reasoning}</think><answer>{answer}</answer>"


@dataclass
class Scored:
    pass_count: int
    k: int
    rewards: list[float]
    completions: list[str]
    reasons: list[str]


def score_views(q: dict, vs: list[View], completions: list[Completion], cfg: BlindConfig, sample_passes) -> Scored:
    """Every sample scored with the trainer's rewards against the reference of the rotation it saw; a sample
    passes by ``sample_passes(accuracy, reward, cfg.pass_threshold)`` (the pass-rate filter's rule, passed in:
    the stages import the gates, not the other way)."""
    ptype = problem_type(q)
    rewards, texts, reasons, passes = [], [], [], 0
    for v, c in zip(vs, completions):
        for text in c.texts:
            scored_text = as_tagged(text) if cfg.constrained else text
            r = score(scored_text, ptype, v.answer, v.options, **cfg.reward_params)
            passes += sample_passes(r.accuracy, r.reward, cfg.pass_threshold)
            rewards.append(r.reward)
            texts.append(text)
            reasons.append(r.reason)
    return Scored(passes, len(texts), rewards, texts, reasons)


def is_text_answerable(pass_count: int, k: int, cfg: BlindConfig) -> bool:
    return k > 0 and pass_count / k >= cfg.max_pass_rate


def prompt_hash(cfg: BlindConfig) -> str:
    """sha256 of what the blind model is shown and asked for: the trainer's system prompt and question layout,
    the rotation rule and the constrained output (schema of a four-option question)."""
    blob = json.dumps({"version": BLIND_PROMPT_VERSION, "system": SYSTEM_PROMPT,
                       "layout": question_text("{question}", ["{a}", "{b}", "{c}", "{d}"]),
                       "rotate": cfg.rotate_options,
                       "schema": answer_schema("multiple_choice", 4, cfg) if cfg.constrained else None},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
