"""The offline ``template`` question writer: verifiable questions from captions and clip facts.

No model: every question is computed from the captions (order in time) and the ``clip_facts`` rows
(motion, brightness, n_cuts, dominant_color per clip), and its answer is correct by construction.
Distractors are other real values of the same video (other intervals, other colours present, other
orderings) chosen with a seeded RNG, and a comparison question is only asked when the correct option
beats every other option by a stated margin (:data:`MOTION_MARGIN`, :data:`BRIGHTNESS_MARGIN`), so
measurement noise cannot make two options equally right. Rows are labelled ``generator="template"``.

Question kinds per category (``MC``: four options, one correct letter; ``open``: a short answer):

* temporal: which of four scenes comes first, which scene comes right before a given interval (MC,
  captions); how many shot cuts between two times
  (open, facts); at which interval the first shot cut happens (open, facts);
* goal_purpose: which interval to play to show the most motion (MC, facts); which interval to jump to
  for the darkest moment (open, facts);
* spatial: the colour dominating the picture in an interval (MC and open, facts); the brightest of four
  intervals (MC, facts);
* plot_narrative: the order of three scenes (MC, captions); whether motion increases or decreases from
  the first to the second half (MC and open, facts); what happens right after a scene (open, captions).

The same items then pass :func:`longreel.pipelines.qra.validate.validate_item`, like an LLM's.
"""
from __future__ import annotations

import hashlib
import itertools
import random
import re
from typing import Callable, Sequence

from longreel.pipelines.qra.context import fmt_span, fmt_ts
from longreel.pipelines.qra.targets import OPTION_LETTERS, normalize_question
from longreel.pipelines.qra.validate import has_time_ref, option_key

GENERATOR = "template"
MODEL = "longreel-template-qra"
# v2: scene options carry a caption's content without its time span (v1's options differed only in their
# timestamps, so "which scene happens first" was answerable from the options text alone)
VERSION = "template-qra-v2"
#: The random choices keep v1's seed: a v2 question differs from v1's only where the options changed.
RNG_SALT = "template-qra-v1"

# A caption's leading time span: "[00:10-00:20] ", "From 0:10.0 to 0:20.0 (10.0 s): " (the facts captioner's).
_LEADING_SPAN_RE = re.compile(r"^\s*(?:\[[^\]]*\]|from\s+\S+\s+to\s+\S+(?:\s*\([^)]*\))?)\s*:?\s*", re.I)

#: The most-motion interval must exceed every other option by this much (0..255 scale) and by 10 %.
MOTION_MARGIN = 1.0
#: The brightest / darkest interval must differ from every other candidate by this much luma (0..255).
BRIGHTNESS_MARGIN = 3.0
#: Motion halves must differ by this share of the larger one to say "increases" / "decreases".
TREND_MARGIN = 0.2

COLORS = ("black", "grey", "white", "red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink", "brown")


def _rng(*parts) -> random.Random:
    seed = int(hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:16], 16)
    return random.Random(seed)


def _span(c: dict) -> str:
    return f"[{fmt_span(c['start_s'], c['end_s'])}]"


def _mc(question: str, options: list[str], correct: int, reasoning: str, kind: str) -> dict:
    return {"question": question, "problem_type": "multiple_choice", "options": options,
            "answer": OPTION_LETTERS[correct], "reasoning": reasoning, "kind": kind}


def _open(question: str, answer: str, reasoning: str, kind: str) -> dict:
    return {"question": question, "problem_type": "open_ended", "options": None, "answer": answer,
            "reasoning": reasoning, "kind": kind}


def _place(correct: str, distractors: list[str], rng: random.Random) -> tuple[list[str], int]:
    options = list(distractors[:3])
    pos = rng.randrange(4)
    options.insert(pos, correct)
    return options, pos


def _caption_text(c: dict) -> str:
    return " ".join(str(c["text"]).split())


def _scene_text(c: dict) -> str | None:
    """What a caption says happens, without when: its leading time span removed, first letter capitalised. None
    when a time reference remains inside: as an option it would give the scene's place in time away."""
    text = _LEADING_SPAN_RE.sub("", _caption_text(c), count=1).strip()
    if not text or has_time_ref(text):
        return None
    return text[0].upper() + text[1:]


def _distinct_scenes(caps) -> list[dict]:
    """The earliest caption of each distinct scene content, in time order (captions without usable content left
    out): options built from these differ in what they show, not in when."""
    distinct: dict[str, dict] = {}
    for c in caps:
        text = _scene_text(c)
        if text is not None:
            distinct.setdefault(option_key(text), c)
    return sorted(distinct.values(), key=lambda c: c["start_s"])


# ---- question kinds: each yields candidate items (possibly none) for a window ----------------------------

def _first_scene(caps, facts, rng):
    pool = _distinct_scenes(caps)
    if len(pool) < 4:
        return
    for _ in range(6):
        chosen = sorted(rng.sample(pool, 4), key=lambda c: c["start_s"])
        shuffled = chosen[:]
        rng.shuffle(shuffled)
        correct = shuffled.index(chosen[0])
        options = [_scene_text(c) for c in shuffled]
        steps = "; ".join(f"option {OPTION_LETTERS[i]} is shown at {_span(c)}" for i, c in enumerate(shuffled))
        reasoning = (f"Checking the video for each scene: {steps}. The earliest of these times is "
                     f"{_span(chosen[0])}, option {OPTION_LETTERS[correct]}. So the answer is {OPTION_LETTERS[correct]}.")
        yield _mc("Which of these scenes happens first in the video?", options, correct, reasoning, "first_scene")


def _scene_before(caps, facts, rng):
    scenes = {id(c): _scene_text(c) for c in caps}
    distinct_next = [(a, b) for a, b in zip(caps, caps[1:])
                     if scenes[id(a)] and scenes[id(b)] and option_key(scenes[id(a)]) != option_key(scenes[id(b)])]
    rng.shuffle(distinct_next)
    for prev, cur in distinct_next:
        taken = {option_key(scenes[id(prev)]), option_key(scenes[id(cur)])}
        pool = [c for c in _distinct_scenes(caps) if option_key(scenes[id(c)]) not in taken]
        if len(pool) < 3:
            continue
        distract = rng.sample(pool, 3)
        options, pos = _place(scenes[id(prev)], [scenes[id(c)] for c in distract], rng)
        others = "; ".join(f"{scenes[id(c)]!r} is at {_span(c)}" for c in distract)
        reasoning = (f"Checking the video just before {_span(cur)}: the interval {_span(prev)} shows "
                     f"{scenes[id(prev)]!r}, while {others}. So the answer is {OPTION_LETTERS[pos]}.")
        yield _mc(f"Which scene comes right before the scene at {_span(cur)}?", options, pos, reasoning,
                  "scene_before")


def _cuts_between(caps, facts, rng):
    fc = [c for c in caps if c["clip_id"] in facts]
    if len(fc) < 2:
        return
    runs = [(i, n) for n in (3, 4, 2, 5) for i in range(0, len(fc) - n + 1)]
    rng.shuffle(runs)
    for i, n in runs:
        run = fc[i:i + n]
        if any(abs(a["end_s"] - b["start_s"]) > 1e-3 for a, b in zip(run, run[1:])):
            continue  # only contiguous clips: a gap would hide cuts
        counts = [int(facts[c["clip_id"]]["n_cuts"]) for c in run]
        total = sum(counts)
        steps = "; ".join(f"at {_span(c)} there {'is 1 cut' if k == 1 else f'are {k} cuts'}"
                          for c, k in zip(run, counts))
        reasoning = f"Checking the video between {fmt_ts(run[0]['start_s'])} and {fmt_ts(run[-1]['end_s'])}: {steps}. In total {total}."
        yield _open(f"How many shot cuts are detected between {fmt_ts(run[0]['start_s'])} and "
                    f"{fmt_ts(run[-1]['end_s'])}?", str(total), reasoning, "cuts_between")


def _first_cut(caps, facts, rng):
    fc = [c for c in caps if c["clip_id"] in facts]
    with_cut = [c for c in fc if int(facts[c["clip_id"]]["n_cuts"]) > 0]
    if not with_cut or len(fc) < 2:
        return
    first = with_cut[0]
    before = [c for c in fc if c["start_s"] < first["start_s"]]
    if any(abs(a["end_s"] - b["start_s"]) > 1e-3 for a, b in zip(fc, fc[1:])):
        return
    checked = "; ".join(f"{_span(c)} has no cut" for c in before[-3:]) or "it is the first interval"
    reasoning = (f"Checking the video from {fmt_ts(fc[0]['start_s'])}: {checked}"
                 f"{' (and none before)' if len(before) > 3 else ''}; at {_span(first)} "
                 f"{facts[first['clip_id']]['n_cuts']} cut(s) are detected, the first of the video.")
    yield _open(f"In which interval of the video between {fmt_ts(fc[0]['start_s'])} and {fmt_ts(fc[-1]['end_s'])} "
                "does the first shot cut happen?", fmt_span(first["start_s"], first["end_s"]), reasoning, "first_cut")


def _extreme_intervals(caps, facts, rng, field: str, largest: bool, margin: float, rel: float):
    """Option sets of 4 intervals whose correct one beats the 3 others on ``field`` by the margins."""
    fc = [c for c in caps if c["clip_id"] in facts]
    if len(fc) < 4:
        return
    val = {c["clip_id"]: float(facts[c["clip_id"]][field]) for c in fc}
    order = sorted(fc, key=lambda c: (-val[c["clip_id"]] if largest else val[c["clip_id"]], c["start_s"]))
    for best in order[: max(1, len(order) // 3)]:
        b = val[best["clip_id"]]

        def clear(c):
            v = val[c["clip_id"]]
            gap = (b - v) if largest else (v - b)
            return gap >= margin and gap >= rel * max(abs(b), abs(v))

        others = [c for c in fc if c is not best and clear(c)]
        if len(others) < 3:
            continue
        yield best, rng.sample(others, 3), val


def _most_motion(caps, facts, rng):
    for best, distract, val in _extreme_intervals(caps, facts, rng, "motion", True, MOTION_MARGIN, 0.1):
        options, pos = _place(fmt_span(best["start_s"], best["end_s"]),
                              [fmt_span(c["start_s"], c["end_s"]) for c in distract], rng)
        spans = [best] + distract
        by_text = {fmt_span(c["start_s"], c["end_s"]): c for c in spans}
        steps = "; ".join(f"at [{o}] the motion score is {val[by_text[o]['clip_id']]:.1f}" for o in options)
        reasoning = (f"Checking the video at each interval: {steps}. The most motion is at [{options[pos]}]. "
                     f"So the answer is {OPTION_LETTERS[pos]}.")
        yield _mc("To show a viewer the most dynamic moment, with the most motion on screen, which of these "
                  "intervals should you play?", options, pos, reasoning, "most_motion")


def _brightest(caps, facts, rng):
    for best, distract, val in _extreme_intervals(caps, facts, rng, "brightness", True, BRIGHTNESS_MARGIN, 0.0):
        options, pos = _place(fmt_span(best["start_s"], best["end_s"]),
                              [fmt_span(c["start_s"], c["end_s"]) for c in distract], rng)
        by_text = {fmt_span(c["start_s"], c["end_s"]): c for c in [best] + distract}
        steps = "; ".join(f"at [{o}] the mean brightness is {val[by_text[o]['clip_id']]:.0f}" for o in options)
        reasoning = (f"Analysing the lighting of the scene at each interval: {steps}. The brightest is [{options[pos]}]. "
                     f"So the answer is {OPTION_LETTERS[pos]}.")
        yield _mc("Which of these intervals shows the brightest picture?", options, pos, reasoning, "brightest")


def _darkest_open(caps, facts, rng):
    fc = [c for c in caps if c["clip_id"] in facts]
    if len(fc) < 3:
        return
    val = {c["clip_id"]: float(facts[c["clip_id"]]["brightness"]) for c in fc}
    order = sorted(fc, key=lambda c: (val[c["clip_id"]], c["start_s"]))
    darkest, second = order[0], order[1]
    if val[second["clip_id"]] - val[darkest["clip_id"]] < BRIGHTNESS_MARGIN:
        return
    reasoning = (f"Checking the brightness of every interval from {fmt_ts(fc[0]['start_s'])} to "
                 f"{fmt_ts(fc[-1]['end_s'])}: the darkest is {_span(darkest)} (mean luma "
                 f"{val[darkest['clip_id']]:.0f}), the next darkest {_span(second)} ({val[second['clip_id']]:.0f}).")
    yield _open(f"To find the darkest moment between {fmt_ts(fc[0]['start_s'])} and {fmt_ts(fc[-1]['end_s'])}, "
                "which interval would you jump to?", fmt_span(darkest["start_s"], darkest["end_s"]), reasoning,
                "darkest")


def _dominant_color(caps, facts, rng, mc: bool):
    fc = [c for c in caps if c["clip_id"] in facts and facts[c["clip_id"]].get("dominant_color") in COLORS]
    if not fc:
        return
    present = sorted({facts[c["clip_id"]]["dominant_color"] for c in fc})
    picks = fc[:]
    rng.shuffle(picks)
    for c in picks:
        color = facts[c["clip_id"]]["dominant_color"]
        others = [x for x in present if x != color]
        rng.shuffle(others)
        rest = [x for x in COLORS if x != color and x not in others]
        rng.shuffle(rest)
        distract = (others + rest)[:3]
        where = "; ".join(f"{_span(o)} is mostly {facts[o['clip_id']]['dominant_color']}"
                          for o in fc if o is not c and abs(o["start_s"] - c["start_s"]) <= 20)[:200]
        context = f" (for comparison, {where})" if where else ""
        if mc:
            options, pos = _place(color, distract, rng)
            reasoning = (f"Analysing the scene at {_span(c)}: most of the picture is {color}{context}. "
                         f"So the answer is {OPTION_LETTERS[pos]}.")
            yield _mc(f"Which colour dominates the picture during {_span(c)}?", options, pos, reasoning, "color_mc")
        else:
            reasoning = f"Analysing the scene at {_span(c)}: most pixels of the sampled frames are {color}{context}."
            yield _open(f"What is the main colour of the picture during {_span(c)}?", color, reasoning, "color_open")


def _scene_order(caps, facts, rng):
    pool = _distinct_scenes(caps)
    if len(pool) < 3:
        return
    for _ in range(6):
        three = rng.sample(pool, 3)  # labelled 1-3 in this (random) order
        order = sorted(range(3), key=lambda i: three[i]["start_s"])
        correct = ", ".join(str(i + 1) for i in order)
        perms = [", ".join(str(i + 1) for i in p) for p in itertools.permutations(range(3))]
        distract = [p for p in perms if p != correct]
        rng.shuffle(distract)
        options, pos = _place(correct, distract, rng)
        listed = " ".join(f"({i + 1}) {_scene_text(c)}" for i, c in enumerate(three))
        steps = "; ".join(f"scene ({i + 1}) is at {_span(three[i])}" for i in order)
        reasoning = (f"Checking the video for each scene: {steps}. In time order that is {correct}. "
                     f"So the answer is {OPTION_LETTERS[pos]}.")
        yield _mc(f"In which order do these scenes appear in the video? {listed}", options, pos, reasoning,
                  "scene_order")


def _motion_trend(caps, facts, rng, mc: bool):
    fc = [c for c in caps if c["clip_id"] in facts]
    if len(fc) < 4:
        return
    half = len(fc) // 2
    first, second = fc[:half], fc[half:]
    m1 = sum(float(facts[c["clip_id"]]["motion"]) for c in first) / len(first)
    m2 = sum(float(facts[c["clip_id"]]["motion"]) for c in second) / len(second)
    if abs(m2 - m1) < TREND_MARGIN * max(m1, m2) or max(m1, m2) <= 0:
        return
    up = m2 > m1
    a, b = f"{fmt_ts(first[0]['start_s'])}-{fmt_ts(first[-1]['end_s'])}", \
        f"{fmt_ts(second[0]['start_s'])}-{fmt_ts(second[-1]['end_s'])}"
    basis = (f"Checking the video, the mean motion over [{a}] is {m1:.1f} and over [{b}] it is {m2:.1f}, "
             f"{'higher' if up else 'lower'} by more than {int(TREND_MARGIN * 100)} %, so the action "
             f"{'picks up' if up else 'calms down'} as the story goes on")
    question = (f"How does the amount of action on screen develop from the first part ({a}) to the second part "
                f"({b}) of the video?")
    if mc:
        correct = "It increases" if up else "It decreases"
        distract = ["It decreases" if up else "It increases", "It stays about the same",
                    "There is no motion at any time"]
        options, pos = _place(correct, distract, rng)
        yield _mc(question, options, pos, f"{basis}. So the answer is {OPTION_LETTERS[pos]}.", "motion_trend_mc")
    else:
        yield _open(f"Does the action on screen increase or decrease from the first part ({a}) to the second part "
                    f"({b}) of the video?", "it increases" if up else "it decreases", basis + ".", "motion_trend_open")


def _what_next(caps, facts, rng):
    scenes = {id(c): _scene_text(c) for c in caps}
    pairs = [(a, b) for a, b in zip(caps, caps[1:])
             if scenes[id(b)] and option_key(_caption_text(a)) != option_key(_caption_text(b))
             and option_key(scenes[id(b)]) != option_key(scenes[id(a)] or "")]
    rng.shuffle(pairs)
    for a, b in pairs:
        reasoning = (f"Checking the video at {_span(a)}: {_caption_text(a)} Right after it, at {_span(b)}, the "
                     f"video shows the next scene.")
        yield _open(f"What does the video show right after the scene at {_span(a)}?", scenes[id(b)], reasoning,
                    "what_next")


KINDS: dict[str, tuple[list[Callable], list[Callable]]] = {
    # category: (multiple-choice kinds, open-ended kinds), tried in turn
    "temporal": ([_first_scene, _scene_before], [_cuts_between, _first_cut]),
    "goal_purpose": ([_most_motion], [_darkest_open]),
    "spatial": ([lambda c, f, r: _dominant_color(c, f, r, True), _brightest],
                [lambda c, f, r: _dominant_color(c, f, r, False)]),
    "plot_narrative": ([_scene_order, lambda c, f, r: _motion_trend(c, f, r, True)],
                       [lambda c, f, r: _motion_trend(c, f, r, False), _what_next]),
}


def _take(kinds: Sequence[Callable], caps, facts, rng, n: int, seen: set) -> list[dict]:
    """Up to ``n`` items, kinds taken in turn, no two with the same normalized question."""
    gens = [k(caps, facts, rng) for k in kinds]
    out: list[dict] = []
    while len(out) < n and gens:
        alive = []
        for g in gens:
            if len(out) >= n:
                break
            item = next((it for it in g if normalize_question(it["question"]) not in seen), None)
            if item is None:
                continue  # this kind has nothing more to offer
            seen.add(normalize_question(item["question"]))
            out.append(item)
            alive.append(g)
        gens = alive
    return out


def template_questions(video_id: str, captions: Sequence[dict], facts: dict[str, dict], category: str, *,
                       n_mc: int, n_open: int, seed: int = 0, window: int = 0) -> list[dict]:
    """Items (question, problem_type, options, answer, reasoning, kind) for one video window and category.

    ``captions``: the window's captions ordered by time; ``facts``: ``clip_facts`` rows by clip id (may be
    empty: only caption-based kinds then apply). Returns at most ``n_mc`` multiple-choice and ``n_open``
    open-ended items; fewer when the video does not support more distinct verifiable questions.
    """
    if category not in KINDS:
        raise ValueError(f"unknown category {category!r}")
    rng = _rng(RNG_SALT, video_id, window, category, seed)
    mc_kinds, open_kinds = KINDS[category]
    seen: set = set()
    return _take(mc_kinds, captions, facts, rng, n_mc, seen) + _take(open_kinds, captions, facts, rng, n_open, seen)

