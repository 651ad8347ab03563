"""QRA generation for one video: context, generation calls, validation, refinement, rows and counts.

:class:`VideoQRAWriter` is the Beam-free core of the ``qra`` stage (the DoFn only wires it to Beam), so
tests drive it directly. For one video it yields *events*:

* ``("qra", row)``: a kept QRA row (record kind ``qra``);
* ``("reject", row)``: a reject row (stages ``qra_context``, ``qra`` and ``qra_refine``);
* ``("count", (stage, metric), n)``: a funnel count.

Accounting (every number lands in ``stats.json``):

* ``qra_context`` (unit: video): ``in`` = videos, ``out`` = videos with a usable context, rejects
  ``no_captions`` / ``context_too_long`` / ``caption_exceeds_budget``; extra ``windows`` (generation
  contexts over all videos) and ``windowed_videos`` (videos split by the long-video fallback).
* ``qra`` (unit: question slot): a call asks for ``n`` questions of one category and problem type; each
  requested slot ends kept (``out``) or rejected with one reason (the validator's codes, plus
  ``not_generated`` when the output or the template generator gave fewer items, ``generation_failed``
  when the backend failed, ``unparseable`` for every slot of an output without JSON). Items beyond the
  requested number are validated too and rejected ``excess_item``; they are added to ``in``. So
  ``in == out + rejected`` always, with ``in = requested + excess``. Extra: ``requested``, ``generated``
  (items in the outputs), ``refined``, ``kept``, and the same per category as ``<category>.requested``,
  ``<category>.generated``, ``<category>.kept``, ``<category>.refined``, ``<category>.rejected.<reason>``.
* ``qra_refine`` (unit: refinement attempt): ``in`` = kept items sent to refinement, ``out`` = accepted
  rewrites, rejects ``refine_changed_answer`` (the answer or the reasoning's conclusion changed),
  ``refine_invalid`` (the rewrite fails validation), ``refine_unparseable``, ``refine_failed``. A
  rejected refinement keeps the unrefined item (it stays in ``qra`` out).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Iterator

from longreel.pipelines.compute import call_pairs
from longreel.pipelines.qra import template_generator as tg
from longreel.pipelines.qra.context import ContextError, Window, plan_context, assign_slots
from longreel.pipelines.qra.json_schema import generation_schema, refinement_schema
from longreel.pipelines.qra.parse import ParseError, extract_json, parse_generation
from longreel.pipelines.qra.prompting import generation_messages, refine_messages
from longreel.pipelines.qra.targets import make_target, normalize_question, qra_id
from longreel.pipelines.qra.validate import validate_item
from longreel.pipelines.qra_config import LLM_BACKENDS, QRAConfig
from longreel.schemas.records import reject

log = logging.getLogger("longreel")

CONTEXT_STAGE, STAGE, REFINE_STAGE = "qra_context", "qra", "qra_refine"
PROBLEM_TYPES = ("multiple_choice", "open_ended")


def item_seed(base: int, key: str) -> int:
    """A per-call seed, the same whatever the batching (as :func:`longreel.pipelines.inference.base.item_seed`)."""
    return (int(base) + int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)) % (2 ** 31 - 1)


def _template_hash() -> str:
    with open(tg.__file__, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


class TokenCounter:
    """Counts prompt tokens of chat messages with a model's tokenizer and chat template.

    ``name``: as :func:`longreel.engines.local_models.resolve_model` takes it, or ``bytes`` (UTF-8 bytes
    of the messages: an upper bound of the token count of any byte-level BPE tokenizer).
    """

    def __init__(self, name: str):
        self.name = name
        self._tok = None
        self._chat = None  # transformers-free counts, where they equal transformers' (longreel.engines.chat_count)
        if name != "bytes":
            from longreel.engines.chat_count import chat_counter
            from longreel.engines.local_models import tokenizer_directory
            self._chat = chat_counter(tokenizer_directory(name))
            if self._chat is None:
                self._tok = self._transformers_tokenizer()

    def _transformers_tokenizer(self):
        from longreel.engines.local_models import load_generic_tokenizer
        return load_generic_tokenizer(self.name)

    def __call__(self, messages: list[dict]) -> int:
        if self._chat is not None:
            n = self._chat.count(messages)
            if n is not None:
                return n
            if self._tok is None:  # messages the fast counter does not take: transformers counts them
                self._tok = self._transformers_tokenizer()
        if self._tok is None:
            return sum(len(m["content"].encode("utf-8")) + 8 for m in messages)
        if getattr(self._tok, "chat_template", None):
            ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return len(ids)
        return len(self._tok.encode("\n\n".join(m["content"] for m in messages)))


@dataclass
class Call:
    """One generation call: ``n`` questions of one category and problem type over one window."""
    category: str
    problem_type: str
    window: Window
    n: int
    seed: int


class VideoQRAWriter:
    """Turns one video's captions (and clip facts) into QRA rows, rejects and counts. ``backend``: a
    :class:`longreel.pipelines.qra.text_backend.TextBackend` for the LLM backends, None for ``template``."""

    def __init__(self, cfg: QRAConfig, backend=None, counter=None):
        if cfg.backend in LLM_BACKENDS and backend is None:
            raise ValueError(f"backend {cfg.backend!r} needs a text backend")
        self.cfg = cfg
        self.backend = backend
        self.counter = counter
        self.template_hash = _template_hash() if cfg.backend == "template" else None

    # ---- context -----------------------------------------------------------------------------------------
    def prompt_tokens(self, duration_s: float):
        cfg = self.cfg
        counter = self.counter or (self.backend.count_tokens if self.backend is not None else None)
        if counter is None:
            raise ValueError("no token counter")

        def count(text: str) -> int:
            best = 0
            for cat in cfg.categories:
                for ptype in PROBLEM_TYPES:
                    msgs, _ = generation_messages(cat, n_questions=cfg.per_category, problem_type=ptype,
                                                  duration_s=duration_s, captions=text,
                                                  window={"start_s": 0.0, "end_s": duration_s})
                    best = max(best, counter(msgs))
            return best
        return count

    def plan(self, video_id: str, duration_s: float, captions: list[dict]):
        c = self.cfg.context
        return plan_context(captions, self.prompt_tokens(duration_s), c.max_tokens, c.long_video,
                            c.window_overlap_clips)

    def calls(self, video_id: str, windows: list[Window]) -> list[Call]:
        cfg = self.cfg
        n_mc = cfg.n_mc()
        out: list[Call] = []
        for ci, cat in enumerate(cfg.categories):
            kinds = ["multiple_choice"] * n_mc + ["open_ended"] * (cfg.per_category - n_mc)
            where = assign_slots(len(kinds), len(windows), offset=ci)
            for w in windows:
                for ptype in PROBLEM_TYPES:
                    n = sum(1 for k, wi in zip(kinds, where) if k == ptype and wi == w.index)
                    if n:
                        key = f"{video_id}:{cat}:{w.index}:{ptype}"
                        out.append(Call(cat, ptype, w, n, item_seed(cfg.sampling.seed, key)))
        return out

    # ---- the whole video ---------------------------------------------------------------------------------
    def process(self, video_id: str, duration_s: float, captions: list[dict],
                facts: dict[str, dict] | None = None) -> Iterator[tuple]:
        yield ("count", (CONTEXT_STAGE, "in"), 1)
        try:
            plan = self.plan(video_id, duration_s, captions)
        except ContextError as e:
            yield ("count", (CONTEXT_STAGE, "rejected:" + e.reason), 1)
            yield ("reject", reject(CONTEXT_STAGE, video_id, e.reason, e.message, video_id=video_id))
            return
        yield ("count", (CONTEXT_STAGE, "out"), 1)
        yield ("count", (CONTEXT_STAGE, "windows"), len(plan.windows))
        if len(plan.windows) > 1:
            yield ("count", (CONTEXT_STAGE, "windowed_videos"), 1)
            log.info("qra: %s: %s", video_id, "; ".join(plan.notes))
        seen: set[str] = set()
        calls = self.calls(video_id, plan.windows)
        if self.cfg.backend == "template":
            results = [self._template_output(video_id, call, facts or {}) for call in calls]
        else:
            results = self._llm_outputs(duration_s, calls)
        kept_rows: list[dict] = []
        for call, (texts_or_items, meta) in zip(calls, results):
            yield from self._account(video_id, duration_s, call, texts_or_items, meta, seen, kept_rows)
        if self.cfg.refine_enabled and self.backend is not None and kept_rows:
            yield from self._refine(video_id, duration_s, plan.windows, kept_rows)
        for row in kept_rows:
            cat = row["category"]
            yield ("count", (STAGE, "kept"), 1)
            yield ("count", (STAGE, f"{cat}.kept"), 1)
            if row["refined"]:
                yield ("count", (STAGE, "refined"), 1)
                yield ("count", (STAGE, f"{cat}.refined"), 1)
            yield ("qra", row)

    # ---- generation --------------------------------------------------------------------------------------
    def _template_output(self, video_id: str, call: Call, facts: dict) -> tuple:
        n_mc = call.n if call.problem_type == "multiple_choice" else 0
        items = tg.template_questions(video_id, call.window.captions, facts, call.category, n_mc=n_mc,
                                      n_open=call.n - n_mc, seed=self.cfg.sampling.seed, window=call.window.index)
        meta = {"generator": tg.GENERATOR, "model": tg.MODEL, "model_revision": tg.VERSION,
                "prompt_hash": self.template_hash, "sampling": json.dumps({"generator": tg.VERSION,
                                                                           "seed": self.cfg.sampling.seed},
                                                                          sort_keys=True),
                "error": None}
        return items, meta

    def _request(self, messages, schema, seed: int):
        from longreel.pipelines.qra.text_backend import TextRequest

        s = self.cfg.sampling
        return TextRequest(messages=messages, schema=schema if self.cfg.guided else None,
                           max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                           repetition_penalty=s.repetition_penalty, seed=seed, max_string_chars=s.max_string_chars)

    def _schema_prefix(self) -> str | None:
        """``qra.reasoning_prefix`` for the schema, where the backend's guided decoding takes a pattern (elsewhere
        the validator alone enforces it)."""
        if not getattr(self.backend, "supports_pattern", False):
            return None
        return self.cfg.reasoning_prefix or None

    def _llm_outputs(self, duration_s: float, calls: list[Call]) -> list[tuple]:
        from longreel.pipelines.qra.text_backend import sampling_json

        reqs, hashes = [], []
        for call in calls:
            w = call.window
            msgs, phash = generation_messages(
                call.category, n_questions=call.n, problem_type=call.problem_type, duration_s=duration_s,
                captions=w.text, window=None if w.n_windows == 1 else {"start_s": w.start_s, "end_s": w.end_s})
            schema = generation_schema([call.problem_type], min_questions=call.n, max_questions=call.n,
                                       reasoning_prefix=self._schema_prefix())
            reqs.append(self._request(msgs, schema, call.seed))
            hashes.append(phash)
        results = self.backend.generate(reqs) if reqs else []
        out = []
        for req, res, phash in zip(reqs, results, hashes):
            meta = {"generator": self.backend.backend, "model": self.backend.model,
                    "model_revision": self.backend.revision or None, "prompt_hash": phash,
                    "sampling": sampling_json(req, guided=bool(res.guided), backend=self.backend.backend),
                    "error": res.error, "finish": res.finish, "new_tokens": res.new_tokens,
                    "prompt_tokens": res.prompt_tokens}
            out.append((res.text, meta))
        return out

    def _account(self, video_id, duration_s, call: Call, output, meta, seen: set, kept_rows: list):
        cat = call.category
        key_base = f"{video_id}:{cat}:w{call.window.index}:{call.problem_type}"
        yield ("count", (STAGE, "requested"), call.n)
        yield ("count", (STAGE, f"{cat}.requested"), call.n)
        if "prompt_tokens" in meta:  # a model call (the template generator makes none)
            for key, n in call_pairs(STAGE, meta["prompt_tokens"], 0, meta["new_tokens"]):
                yield ("count", key, n)

        def rej(slot: int, reason: str, message: str, details=None):
            return [("count", (STAGE, "rejected:" + reason), 1),
                    ("count", (STAGE, f"{cat}.rejected.{reason}"), 1),
                    ("reject", reject(STAGE, f"{key_base}:{slot}", reason, message, video_id=video_id,
                                      details=None if details is None else json.dumps(details, default=str,
                                                                                      ensure_ascii=False)[:4000]))]

        if meta.get("error"):
            yield ("count", (STAGE, "in"), call.n)
            for slot in range(call.n):
                yield from rej(slot, "generation_failed", f"the {meta['generator']} backend failed: {meta['error']}")
            return
        if isinstance(output, str):
            try:
                items = parse_generation(output)
            except ParseError as err:
                yield ("count", (STAGE, "in"), call.n)
                for slot in range(call.n):
                    yield from rej(slot, err.reason, f"{err} (finish: {meta.get('finish')})",
                                   {"output": output[:2000]})
                return
        else:
            items = list(output)
        generated = len(items)
        yield ("count", (STAGE, "generated"), generated)
        yield ("count", (STAGE, f"{cat}.generated"), generated)
        yield ("count", (STAGE, "in"), max(call.n, generated))
        for slot, raw in enumerate(items):
            if slot >= call.n:
                yield from rej(slot, "excess_item", f"the output holds {generated} items; {call.n} were requested",
                               {"item": raw})
                continue
            item, reason, message = validate_item(raw, category=cat, video_span_s=duration_s, seen_questions=seen,
                                                  reasoning_prefix=self.cfg.reasoning_prefix)
            if item is None:
                yield from rej(slot, reason, message, {"item": raw})
                continue
            if item["problem_type"] != call.problem_type:
                yield from rej(slot, "bad_problem_type", f"asked for {call.problem_type}, got {item['problem_type']}",
                               {"item": raw})
                continue
            seen.add(normalize_question(item["question"]))
            kept_rows.append(self._row(video_id, call, item, meta))
            yield ("count", (STAGE, "out"), 1)
        for slot in range(generated, call.n):
            why = ("the template generator found no further distinct verifiable question of this kind here"
                   if meta["generator"] == tg.GENERATOR else f"the output holds {generated} of {call.n} items")
            yield from rej(slot, "not_generated", why)

    def _row(self, video_id: str, call: Call, item: dict, meta: dict) -> dict:
        w = call.window
        return {
            "qra_id": qra_id(video_id, call.category, item["question"]), "video_id": video_id,
            "category": call.category, "problem_type": item["problem_type"], "question": item["question"],
            "options": item["options"], "answer": item["answer"], "reasoning": item["reasoning"],
            "target": make_target(item["reasoning"], item["answer"]), "generator": meta["generator"],
            "model": meta["model"], "model_revision": meta["model_revision"], "prompt_hash": meta["prompt_hash"],
            "sampling": meta["sampling"], "seed": call.seed, "source_caption_ids": w.caption_ids, "refined": False,
            "refine_prompt_hash": None, "draft_reasoning": None, "context": json.dumps(w.describe(), sort_keys=True),
        }

    # ---- refinement --------------------------------------------------------------------------------------
    def _refine(self, video_id: str, duration_s: float, windows: list[Window], rows: list[dict]):
        by_window = {}
        for w in windows:
            by_window[tuple(w.caption_ids)] = w
        reqs, hashes = [], []
        for row in rows:
            w = by_window[tuple(row["source_caption_ids"])]
            item = {"question": row["question"], "options": row["options"], "answer": row["answer"],
                    "reasoning": row["reasoning"]}
            msgs, phash = refine_messages(item, duration_s=duration_s, captions=w.text)
            schema = refinement_schema(row["answer"] if self.cfg.refine_pin_answer else None,
                                       reasoning_prefix=self._schema_prefix())
            reqs.append(self._request(msgs, schema, item_seed(row["seed"] or 0, "refine:" + row["qra_id"])))
            hashes.append(phash)
        results = self.backend.generate(reqs)
        yield ("count", (REFINE_STAGE, "in"), len(rows))
        for res in results:
            for key, n in call_pairs(REFINE_STAGE, res.prompt_tokens, 0, res.new_tokens):
                yield ("count", key, n)
        for row, res, phash in zip(rows, results, hashes):
            reason, message = self._check_refinement(row, res, duration_s, phash)
            if reason is not None:
                yield ("count", (REFINE_STAGE, "rejected:" + reason), 1)
                yield ("reject", reject(REFINE_STAGE, row["qra_id"], reason, message, video_id=video_id,
                                        details=json.dumps({"output": (res.text or "")[:2000]}, ensure_ascii=False)))
                continue
            yield ("count", (REFINE_STAGE, "out"), 1)

    def _check_refinement(self, row: dict, res, duration_s: float, phash: str) -> tuple[str | None, str]:
        """Apply an accepted refinement to ``row`` in place; else return (reason, message)."""
        if res.error:
            return "refine_failed", f"the backend failed: {res.error}"
        try:
            doc = extract_json(parse_text(res.text))
        except ParseError as err:
            return "refine_unparseable", str(err)
        if not isinstance(doc, dict) or not isinstance(doc.get("reasoning"), str) or "answer" not in doc:
            return "refine_unparseable", "the refinement is not an object with reasoning and answer"
        candidate = {"question": row["question"], "problem_type": row["problem_type"], "options": row["options"],
                     "answer": doc["answer"], "reasoning": doc["reasoning"]}
        item, reason, message = validate_item(candidate, category=row["category"], video_span_s=duration_s,
                                              seen_questions=set(), reasoning_prefix=self.cfg.reasoning_prefix)
        if item is None and reason in ("mc_answer_not_in_options", "open_answer_empty", "missing_field"):
            return "refine_changed_answer", f"the refined answer {doc['answer']!r} is not the answer: {message}"
        if item is not None and _answer_key(item["answer"]) != _answer_key(row["answer"]):
            return "refine_changed_answer", f"the answer changed from {row['answer']!r} to {item['answer']!r}"
        if item is None and reason == "reasoning_contradicts_answer":
            return "refine_changed_answer", f"the refined reasoning concludes another answer: {message}"
        if item is None:
            return "refine_invalid", f"{reason}: {message}"
        row["draft_reasoning"] = row["reasoning"]
        row["reasoning"] = item["reasoning"]
        row["target"] = make_target(item["reasoning"], row["answer"])
        row["refined"] = True
        row["refine_prompt_hash"] = phash
        return None, ""


def _answer_key(answer: str) -> str:
    return normalize_question(answer)


def parse_text(text: str) -> str:
    from longreel.pipelines.qra.parse import strip_think
    return strip_think(text or "")

