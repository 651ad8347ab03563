"""The openai backend against a real HTTP server on 127.0.0.1 that parses the OpenAI multimodal request.

The server (written for these tests) validates each chat-completions request the way a vision
server must: a user turn whose content is a list of ``image_url`` parts holding base64 JPEG data
URLs followed by a text part. It decodes every JPEG, answers with what it saw (frame count, size,
mean brightness of the first frame), and misbehaves on purpose for chosen clips, picked by the
clip start time that the caption prompt states: a 500 once (the retry must succeed), a 500
always, an answer slower than the client's timeout, a 400, a looping answer and the prompt
echoed back.
"""
import base64
import io
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from longreel.pipelines.cli_caption import run_caption
from longreel.engines.openai_engine import OpenAIEngine
from longreel.pipelines.inference.base import GenerationParams, Request
from longreel.pipelines.inference.captioner import EngineCaptioner
from test_caption_common import assert_caption_funnel, caption_cfg, copy_out, curate_dir, stage, tables

START = re.compile(r"from (\d+(?:\.\d+)?) s to")


class FakeVisionServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, behaviour: dict[float, str]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.behaviour = behaviour
        self.lock = threading.Lock()
        self.log: list[dict] = []          # one entry per request: start, n_images, size, status
        self.seen: dict[float, int] = {}   # requests per clip start

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _reply(self, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
            pass

    def _bad(self, why: str) -> None:
        self._reply(400, {"error": {"message": why, "type": "invalid_request_error"}})

    def do_POST(self):  # noqa: N802 - http.server's name
        srv: FakeVisionServer = self.server
        if self.path != "/v1/chat/completions":
            return self._reply(404, {"error": {"message": f"no route {self.path}"}})
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            req = json.loads(raw)
        except ValueError:
            return self._bad("body is not JSON")
        if not isinstance(req.get("model"), str) or not isinstance(req.get("messages"), list):
            return self._bad("model and messages are required")
        user = [m for m in req["messages"] if m.get("role") == "user"]
        if len(user) != 1 or not isinstance(user[0].get("content"), list):
            return self._bad("expected one user message with a list of content parts")
        parts = user[0]["content"]
        images, texts = [], []
        for part in parts:
            if part.get("type") == "image_url":
                url = part.get("image_url", {}).get("url", "")
                m = re.fullmatch(r"data:image/jpeg;base64,([A-Za-z0-9+/=]+)", url)
                if not m:
                    return self._bad("image_url must be a base64 JPEG data URL")
                data = base64.b64decode(m.group(1))
                if data[:3] != b"\xff\xd8\xff":
                    return self._bad("image is not a JPEG")
                images.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
            elif part.get("type") == "text":
                texts.append(part["text"])
            else:
                return self._bad(f"unknown part type {part.get('type')!r}")
        if not images or len(texts) != 1 or parts[-1].get("type") != "text":
            return self._bad("expected image parts followed by one text part")
        if len({im.shape for im in images}) != 1:
            return self._bad("frames of one clip differ in size")
        m = START.search(texts[0])
        start = float(m.group(1)) if m else -1.0
        with srv.lock:
            srv.seen[start] = srv.seen.get(start, 0) + 1
            nth = srv.seen[start]
        what = srv.behaviour.get(start, "ok")
        h, w = images[0].shape[:2]
        entry = {"start": start, "n_images": len(images), "size": (w, h), "model": req["model"],
                 "max_tokens": req.get("max_tokens"), "seed": req.get("seed")}
        if what == "fail_once" and nth == 1 or what == "fail_always":
            entry["status"] = 500
            srv.log.append(entry)
            return self._reply(500, {"error": {"message": "the GPU is on fire"}})
        if what == "bad_request":
            entry["status"] = 400
            srv.log.append(entry)
            return self._bad("this model does not take that many images")
        if what == "slow":
            entry["status"] = "slow"
            srv.log.append(entry)
            time.sleep(1.5)
        else:
            entry["status"] = 200
            srv.log.append(entry)
        if what == "loop":
            text = "the the the the the the the the the the the the the the the the"
        elif what == "echo":
            text = texts[0]
        else:
            text = (f"I see {len(images)} frames of {w}x{h} pixels; the first frame has a mean brightness of "
                    f"{images[0].mean():.1f} and the last of {images[-1].mean():.1f}.")
        self._reply(200, {"id": "cmpl-test", "object": "chat.completion", "model": req["model"],
                          "choices": [{"index": 0, "finish_reason": "stop",
                                       "message": {"role": "assistant", "content": text}}]})


@pytest.fixture
def server():
    srv = FakeVisionServer({})
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def movie_5s(shared_videos, tmp_path_factory):
    """The 61 s timecode movie in 5 s clips: 12 clips starting at 0, 5, ..., 55 s."""
    return curate_dir(shared_videos, ["texlive-mwe__example-movie.mp4"], tmp_path_factory.mktemp("movie"),
                      overrides=["segment.clip_s=5"])


def test_client_sends_frames_as_jpeg_image_parts(server):
    frames = np.zeros((3, 56, 84, 3), dtype=np.uint8)
    frames[1] += 100
    frames[2] += 200
    client = EngineCaptioner(OpenAIEngine(server.base_url, "test-vlm", max_retries=0, timeout_s=10))
    [g] = client.generate([Request(key="k", text="Describe the clip from 0.0 s to 5.0 s.", frames=frames)],
                          GenerationParams(max_new_tokens=33))
    assert g.ok and g.text.startswith("I see 3 frames of 84x56 pixels")
    assert "mean brightness of 0.0 and the last of 200.0" in g.text  # JPEG keeps flat grey levels exactly
    assert server.log[0]["max_tokens"] == 33 and server.log[0]["model"] == "test-vlm"
    client.close()


def test_openai_backend_in_the_pipeline(server, movie_5s, tmp_path):
    server.behaviour.update({5.0: "fail_once", 10.0: "fail_always", 15.0: "slow", 20.0: "bad_request",
                             25.0: "loop", 30.0: "echo"})
    out = copy_out(movie_5s, tmp_path / "out")
    cfg = caption_cfg(backend="openai", **{
        "model.path": "test-vlm", "openai.base_url": server.base_url, "openai.timeout_s": 0.5,
        "openai.max_retries": 2, "openai.concurrency": 2, "model.batch_size": 4,
        "frames.max_pixels": 200704})
    t0 = time.monotonic()
    run_caption(str(out), cfg)
    elapsed = time.monotonic() - t0
    caps, facts, rejects, stats = tables(out)
    assert_caption_funnel(stats, 12)
    by_start = {c["start_s"]: c for c in caps}
    rej = {r["reason"]: r for r in rejects}
    assert stage(stats, "caption")["rejected"] == {"prompt_echo": 1, "repetitive_caption": 1,
                                                   "request_failed": 1, "request_rejected": 1,
                                                   "request_timeout": 1}
    assert sorted(by_start) == [0.0, 5.0, 35.0, 40.0, 45.0, 50.0, 55.0]
    # frames were sent: 8 JPEG images of the decoded size per request, and the answer describes them
    for c in caps:
        assert c["text"].startswith(f"I see 8 frames of {c['frame_width']}x{c['frame_height']} pixels")
        assert c["backend"] == "openai" and c["model"] == "test-vlm"
        assert json.loads(c["sampling"])["endpoint"] == server.base_url
    assert all(e["n_images"] == 8 for e in server.log)
    assert {e["size"] for e in server.log} == {(588, 336)}  # 1280x720 within 448*448 pixels, multiples of 28
    # retries: the clip at 5 s failed once and then succeeded; the one at 10 s was tried 1 + 2 times
    assert server.seen[5.0] == 2 and server.seen[10.0] == 3 and server.seen[15.0] == 3
    assert server.seen[20.0] == 1  # a 400 is not retried
    assert "HTTP 500" in rej["request_failed"]["message"] and "after 3 attempts" in rej["request_failed"]["message"]
    assert "no answer within 0.5 s" in rej["request_timeout"]["message"]
    assert "HTTP 400" in rej["request_rejected"]["message"] and "that many images" in rej["request_rejected"]["message"]
    assert json.loads(rej["request_failed"]["details"])["attempts"] == 3
    # per-item seeds: the same clip always gets the same seed, different clips different ones
    seeds = {}
    for e in server.log:
        seeds.setdefault(e["start"], set()).add(e["seed"])
    assert all(len(s) == 1 for s in seeds.values()) and len({next(iter(s)) for s in seeds.values()}) == 12
    assert elapsed < 300


def test_a_dead_server_is_rejects_not_a_crash(movie_5s, tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = copy_out(movie_5s, tmp_path / "out")
    run_caption(str(out), caption_cfg(backend="openai", **{
        "model.path": "m", "openai.base_url": f"http://127.0.0.1:{port}/v1", "openai.max_retries": 1}))
    caps, _, rejects, stats = tables(out)
    assert caps == [] and stage(stats, "caption")["rejected"] == {"request_failed": 12}
    assert all("connection error" in r["message"] for r in rejects)
    assert_caption_funnel(stats, 12)
