"""Per-video caption context: rendering, ordering, and the long-video fallback on Big Buck Bunny (60 clips)."""
import pytest

from longreel.pipelines.qra.context import ContextError, caption_line, fmt_ts, order_captions, plan_context
from longreel.pipelines.qra.generate import TokenCounter, VideoQRAWriter
from longreel.pipelines.qra_config import QRAConfig
from longreel.pipelines.stages.segment import plan_clips


def test_timestamps_and_lines():
    assert fmt_ts(0) == "00:00" and fmt_ts(9.6) == "00:10" and fmt_ts(596.47) == "09:56"
    assert fmt_ts(3725) == "1:02:05"
    assert caption_line({"start_s": 10.0, "end_s": 20.0, "text": " A rabbit\n wakes up. "}) == \
        "[00:10-00:20] A rabbit wakes up."
    caps = [{"clip_id": "b", "start_s": 10.0, "end_s": 20.0, "text": "x"},
            {"clip_id": "a", "start_s": 0.0, "end_s": 10.0, "text": "y"},
            {"clip_id": "b", "start_s": 10.0, "end_s": 20.0, "text": "x"}]
    assert [c["clip_id"] for c in order_captions(caps)] == ["a", "b"]


def test_no_captions_is_a_reject_reason():
    with pytest.raises(ContextError) as e:
        plan_context([], len, 100)
    assert e.value.reason == "no_captions"


@pytest.fixture(scope="module")
def bbb_captions(shared_videos):
    """Captions of the 60 clips of the full 10-minute Big Buck Bunny, synthesized from its real clip ranges."""
    from longreel.pipelines.media.probe import probe_file

    info = probe_file(str(shared_videos / "moviepy__bbb_full.mp4"))
    clips, _ = plan_clips(info["duration_s"], info.get("fps_avg") or 24.0)
    assert len(clips) == 60
    caps = [{"clip_id": f"bbb-{c.index:05d}", "video_id": "bbb", "start_s": c.start_s, "end_s": c.end_s,
             "text": f"Clip {c.index}: the big rabbit walks through the meadow while a squirrel watches from "
                     f"the tree number {c.index}."} for c in clips]
    return info["duration_s"], caps


@pytest.fixture(scope="module")
def counter():
    return TokenCounter("smollm2")


def _prompt_tokens(writer, duration):
    return writer.prompt_tokens(duration)


def test_bbb_long_video_windows_cover_every_clip_within_budget(bbb_captions, counter):
    duration, caps = bbb_captions
    cfg = QRAConfig()
    cfg.context.max_tokens = 900
    writer = VideoQRAWriter(cfg, counter=counter)
    count = writer.prompt_tokens(duration)
    full = count("\n".join(caption_line(c) for c in caps))
    assert full > 900  # the whole video does not fit: the fallback must kick in
    plan = writer.plan("bbb", duration, caps)
    assert len(plan.windows) > 1 and plan.full_tokens == full and plan.notes
    # consecutive, in order, no clip lost or repeated, every real prompt within the budget
    seen = [c["clip_id"] for w in plan.windows for c in w.captions]
    assert seen == [c["clip_id"] for c in caps]
    for w in plan.windows:
        assert w.strategy == "windows" and w.n_windows == len(plan.windows)
        assert count(w.text) == w.prompt_tokens <= 900
    # windows are maximal: adding the next clip would exceed the budget
    for w, nxt in zip(plan.windows, plan.windows[1:]):
        assert count(w.text + "\n" + caption_line(nxt.captions[0])) > 900

    # with overlap, neighbouring windows share clips
    cfg.context.window_overlap_clips = 2
    overl = VideoQRAWriter(cfg, counter=counter).plan("bbb", duration, caps)
    assert overl.windows[1].captions[0]["clip_id"] == overl.windows[0].captions[-2]["clip_id"]


def test_bbb_reject_strategy_and_too_small_budget(bbb_captions, counter):
    duration, caps = bbb_captions
    cfg = QRAConfig()
    cfg.context.max_tokens = 900
    cfg.context.long_video = "reject"
    events = list(VideoQRAWriter(cfg, counter=counter).process("bbb", duration, caps, {}))
    rejects = [e[1] for e in events if e[0] == "reject"]
    assert [r["reason"] for r in rejects] == ["context_too_long"]
    assert not [e for e in events if e[0] == "qra"]
    cfg.context.long_video = "windows"
    cfg.context.max_tokens = 200  # below the template text itself: no caption fits anywhere
    events = list(VideoQRAWriter(cfg, counter=counter).process("bbb", duration, caps, {}))
    assert [e[1]["reason"] for e in events if e[0] == "reject"] == ["caption_exceeds_budget"]


def test_bbb_windowed_generation_questions_stay_inside_their_window(bbb_captions, counter):
    duration, caps = bbb_captions
    cfg = QRAConfig(per_category=4)
    cfg.context.max_tokens = 900
    writer = VideoQRAWriter(cfg, counter=counter)
    events = list(writer.process("bbb", duration, caps, {}))
    rows = [e[1] for e in events if e[0] == "qra"]
    counts = {}
    for e in events:
        if e[0] == "count":
            counts[e[1]] = counts.get(e[1], 0) + e[2]
    n_windows = counts[("qra_context", "windows")]
    assert n_windows > 1 and counts[("qra_context", "windowed_videos")] == 1
    assert rows
    from longreel.pipelines.qra.validate import time_refs_s
    import json
    used = set()
    for r in rows:
        ctx = json.loads(r["context"])
        used.add(ctx["window"])
        assert ctx["n_windows"] == n_windows and ctx["strategy"] == "windows"
        lo, hi = ctx["start_s"], ctx["end_s"]
        ids = set(r["source_caption_ids"])
        assert ids <= {c["clip_id"] for c in caps}
        for t in time_refs_s(r["question"] + " " + r["reasoning"]):
            assert lo - 1 <= t <= hi + 1, (t, lo, hi, r["question"])
    assert len(used) > 1  # the questions of a video are spread over its windows
    assert counts[("qra", "in")] == counts[("qra", "out")] + sum(
        v for k, v in counts.items() if k[0] == "qra" and k[1].startswith("rejected:"))


def test_default_token_counter_falls_back_to_bytes_with_a_warning(monkeypatch, caplog):
    """A missing optional reader (e.g. the `gguf` package transformers needs for SmolLM2's GGUF) must not take
    the run down: the default counter falls back to UTF-8 bytes and says so."""
    import longreel.pipelines.qra.generate as generate
    from longreel.pipelines.stages.qra import build_counter

    real = generate.TokenCounter

    def no_gguf(name):
        if name == "smollm2":
            raise ImportError("Please install torch and gguf>=0.10.0 to load a GGUF checkpoint")
        return real(name)

    monkeypatch.setattr(generate, "TokenCounter", no_gguf)
    with caplog.at_level("WARNING"):
        counter = build_counter(QRAConfig(), None)
    assert counter.name == "bytes" and counter([{"role": "user", "content": "abc"}]) == 3 + 8
    assert "SmolLM2 tokenizer is unavailable" in caplog.text and "gguf" in caplog.text


def test_counting_tokenizer_is_the_auto_tokenizer_without_its_registry(counter):
    """The counter counts SmolLM2's chats without transformers (longreel.engines.chat_count) and, for what that does
    not take, loads the tokenizer through the generic fast class: both give the same chat-template token counts as
    AutoTokenizer (load_tokenizer), and in a fresh interpreter neither torch nor the AutoTokenizer registry gets
    imported on the way."""
    import subprocess
    import sys

    from longreel.engines.local_models import load_tokenizer

    auto = load_tokenizer("smollm2")
    assert counter._chat is not None and counter._tok is None
    generic = counter._transformers_tokenizer()
    assert type(generic).__name__ == type(auto).__name__
    texts = ["Captions: a man walks.", "ünïcode 日本語 <|im_start|> tricky\n\n  spaces", "x" * 3000, ""]
    for text in texts:
        msgs = [{"role": "system", "content": "You write questions."}, {"role": "user", "content": text}]
        want = auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert counter(msgs) == len(want)
        generic_ids = generic.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        assert len(generic_ids["input_ids"] if hasattr(generic_ids, "keys") else generic_ids) == len(want)
        assert generic.encode(text) == auto.encode(text)
    code = ("import sys\nfrom longreel.pipelines.qra.generate import TokenCounter\n"
            "n = TokenCounter('smollm2')([{'role': 'user', 'content': 'hello'}])\n"
            "print(n > 0, 'torch' in sys.modules, 'transformers.models.auto.tokenization_auto' in sys.modules)\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert got.split() == ["True", "False", "False"]
