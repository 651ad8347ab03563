"""Per-video caption context for QRA generation: ordering, timestamped rendering, token budget, windows.

A video's captions are ordered by time and rendered one line per clip, ``[00:10-00:20] caption``.
The whole prompt (template + captions) must fit ``max_tokens`` counted with the model's tokenizer.
When it does not, the stated fallback applies (never a silent truncation):

* ``windows``: the captions are cut into consecutive windows, each the longest run of clips whose prompt
  still fits (optionally overlapping by a few clips); every window becomes its own generation calls and
  the questions of a window cite only its clips (its caption ids are the QRA's source_caption_ids);
* ``reject``: the video is rejected with reason ``context_too_long``.

A single caption line whose prompt alone exceeds the budget cannot be placed in any window: that video
is rejected with reason ``caption_exceeds_budget`` whatever the strategy.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

_SPACE_RE = re.compile(r"\s+")


class ContextError(ValueError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def fmt_ts(t: float) -> str:
    """Seconds as ``MM:SS`` (``H:MM:SS`` from one hour), rounded to the nearest second."""
    s = max(0, int(math.floor(t + 0.5)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


def fmt_span(start_s: float, end_s: float) -> str:
    return f"{fmt_ts(start_s)}-{fmt_ts(end_s)}"


def caption_line(caption: dict) -> str:
    text = _SPACE_RE.sub(" ", str(caption["text"])).strip()
    return f"[{fmt_span(caption['start_s'], caption['end_s'])}] {text}"


def order_captions(captions: Sequence[dict]) -> list[dict]:
    """Captions of one video ordered by start time (clip id breaks ties), one per clip id."""
    by_id: dict[str, dict] = {}
    for c in captions:
        prev = by_id.get(c["clip_id"])
        if prev is None or (c.get("text") or "") > (prev.get("text") or ""):
            by_id[c["clip_id"]] = c  # a duplicate clip id keeps a deterministic one
    return sorted(by_id.values(), key=lambda c: (float(c["start_s"]), float(c["end_s"]), c["clip_id"]))


@dataclass
class Window:
    index: int
    n_windows: int
    captions: list[dict]
    prompt_tokens: int          # the largest prompt of this window over the prompts it is used with
    strategy: str               # whole | windows

    @property
    def text(self) -> str:
        return "\n".join(caption_line(c) for c in self.captions)

    @property
    def start_s(self) -> float:
        return float(self.captions[0]["start_s"])

    @property
    def end_s(self) -> float:
        return float(self.captions[-1]["end_s"])

    @property
    def caption_ids(self) -> list[str]:
        return [c["clip_id"] for c in self.captions]

    def describe(self) -> dict:
        return {"strategy": self.strategy, "window": self.index, "n_windows": self.n_windows,
                "start_s": round(self.start_s, 3), "end_s": round(self.end_s, 3), "clips": len(self.captions),
                "prompt_tokens": self.prompt_tokens}


@dataclass
class ContextPlan:
    windows: list[Window]
    budget: int
    full_tokens: int            # prompt tokens with every caption (over the budget when windowed)
    notes: list[str] = field(default_factory=list)


def plan_context(captions: Sequence[dict], prompt_tokens: Callable[[str], int], budget: int,
                 strategy: str = "windows", overlap: int = 0) -> ContextPlan:
    """Split one video's ordered captions into windows whose prompts fit ``budget`` tokens.

    ``prompt_tokens(captions_text)`` returns the token count of the largest prompt built around that
    captions block (the caller renders its templates and counts with the model's tokenizer).
    Raises :class:`ContextError` (``no_captions``, ``context_too_long`` with strategy ``reject``,
    ``caption_exceeds_budget``).
    """
    caps = order_captions(captions)
    if not caps:
        raise ContextError("no_captions", "the video has no captions")
    lines = [caption_line(c) for c in caps]
    full = prompt_tokens("\n".join(lines))
    if full <= budget:
        return ContextPlan([Window(0, 1, caps, full, "whole")], budget, full)
    if strategy == "reject":
        raise ContextError("context_too_long", f"the captions need {full} prompt tokens; budget {budget}")
    if strategy != "windows":
        raise ValueError(f"unknown long-video strategy {strategy!r}")
    overhead = prompt_tokens("")
    per_line = [prompt_tokens(line) - overhead + 1 for line in lines]  # +1: the joining newline
    spans: list[tuple[int, int, int]] = []  # [start, end) and exact tokens
    start = 0
    while start < len(caps):
        end, used = start, overhead
        while end < len(caps) and used + per_line[end] <= budget:
            used += per_line[end]
            end += 1
        # the per-line estimate may be off where tokens merge across lines: check exactly, then grow while the
        # next clip still fits and shrink while the window does not (windows are maximal and within budget)
        exact = prompt_tokens("\n".join(lines[start:end])) if end > start else budget + 1
        while end < len(caps) and exact <= budget:
            bigger = prompt_tokens("\n".join(lines[start:end + 1]))
            if bigger > budget:
                break
            end, exact = end + 1, bigger
        while end > start and exact > budget:
            end -= 1
            exact = prompt_tokens("\n".join(lines[start:end])) if end > start else budget + 1
        if end == start:
            raise ContextError("caption_exceeds_budget",
                               f"the caption of {caps[start]['clip_id']} alone needs "
                               f"{prompt_tokens(lines[start])} prompt tokens; budget {budget}")
        spans.append((start, end, exact))
        if end >= len(caps):
            break
        start = max(end - overlap, start + 1)
    n = len(spans)
    windows = [Window(i, n, caps[a:b], t, "windows") for i, (a, b, t) in enumerate(spans)]
    note = (f"captions need {full} prompt tokens > budget {budget}: {n} windows of "
            f"{', '.join(str(len(w.captions)) for w in windows)} clips")
    return ContextPlan(windows, budget, full, [note])


def assign_slots(n_slots: int, n_windows: int, offset: int = 0) -> list[int]:
    """Window index of each of ``n_slots`` question slots, spread round-robin starting at ``offset``
    (categories use different offsets so that together they cover every window)."""
    return [(offset + i) % n_windows for i in range(n_slots)]
