"""The child side of :class:`longreel.pipelines.media.worker.IsolatedWorker`: JSON requests in, JSON replies out.

Operations are registered in ``OPS``; each takes keyword arguments and returns something JSON-able.
An exception with a ``reason`` attribute becomes a clean error reply with that reason.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback

#: the pid of the process that started the worker (see _exit_with_parent)
PARENT_ENV = "LONGREEL_WORKER_PARENT"


def _probe(path: str) -> dict:
    from longreel.pipelines.media.probe import probe_file
    return probe_file(path)


def _decode(tmpdir: str, **kw) -> dict:
    from longreel.pipelines.media.decode import decode_to_npy
    return decode_to_npy(tmpdir=tmpdir, **kw)


#: decoders a signature runs side by side (each on its own share of the seeks)
SIGNATURE_DECODERS = 2


def _signature(path: str, duration_s: float, n: int, rotation: int | None = 0) -> dict:
    """The perceptual signature of a video (:mod:`longreel.pipelines.gates.videodup`): n small frames decoded.

    Every signature frame is a seek and a decode from the keyframe before it. A frame-threaded decoder is the
    wrong tool for that: it refills its threads after every seek and must decode the non-reference frames a
    single-threaded one skips (Big Buck Bunny, 8 frames: 0.78 s wall, 1.19 CPU-s). Instead the seeks are dealt to
    :data:`SIGNATURE_DECODERS` single-threaded decoders in threads (PyAV decodes without the GIL): 0.35 s wall,
    0.61 CPU-s. Ingest runs before any other stage has work, so on a small corpus the second core is otherwise idle.
    """
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from longreel.pipelines.gates import videodup
    from longreel.pipelines.media.decode import decode_frames

    times = videodup.signature_times(duration_s, n)
    shares = [times[i::SIGNATURE_DECODERS] for i in range(SIGNATURE_DECODERS) if times[i::SIGNATURE_DECODERS]]
    if not shares:  # n = 0: nothing to decode
        return {"signature": []}

    def decode(share: list[float]) -> np.ndarray:
        return decode_frames(path, share, width=videodup.DECODE_W, height=videodup.DECODE_H, rotation=rotation,
                             threads=False).frames

    with ThreadPoolExecutor(len(shares)) as pool:
        parts = list(pool.map(decode, shares))
    frames = np.empty((len(times),) + parts[0].shape[1:], np.uint8)
    for i, part in enumerate(parts):  # back to the times' order, whatever the decoders' order
        frames[i::SIGNATURE_DECODERS] = part
    return {"signature": videodup.signature(frames)}


def _sleep(seconds: float) -> dict:  # lets tests prove a hang costs one request, not the run
    import time
    time.sleep(seconds)
    return {"slept": seconds}


def _crash() -> dict:  # likewise for a hard crash of the decoder
    import os
    os.abort()


OPS = {"probe": _probe, "decode": _decode, "signature": _signature, "sleep": _sleep, "crash": _crash}
NEEDS_TMPDIR = {"decode"}


def _exit_with_parent(tmpdirs: set[str]) -> None:
    """End this worker, and remove the scratch directories its replies went to, once the process that started it
    is gone without closing it (Ctrl-C, a SIGKILL, the out-of-memory killer).

    The worker runs in a session of its own (so that a timeout kills it alone), so the terminal's Ctrl-C does not
    reach it, and it reads its next request only after the current one: without this it finished a decode no one
    would read and left that decode's frames (up to ~100 MB) in the temporary directory."""
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        for d in list(tmpdirs):
            shutil.rmtree(d, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main() -> None:
    # Ctrl-C signals the whole process group: the run that owns this worker reports it; the worker only ends, without
    # a KeyboardInterrupt traceback from the middle of a decode
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    tmpdirs: set[str] = set()
    _exit_with_parent(tmpdirs)
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        req = json.loads(line)
        if req.get("tmpdir"):
            tmpdirs.add(req["tmpdir"])
        op = req.get("op")
        try:
            fn = OPS[op]
            args = dict(req.get("args") or {})
            if op in NEEDS_TMPDIR:
                args["tmpdir"] = req["tmpdir"]
            reply = {"ok": True, "result": fn(**args)}
        except KeyError as e:
            reply = {"ok": False, "reason": "bad_request", "message": f"unknown op or argument {e}"}
        except Exception as e:  # every failure is reported, with its reason code when it has one
            reply = {"ok": False, "reason": getattr(e, "reason", type(e).__name__),
                     "message": str(e) or traceback.format_exc(limit=2)}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
    # stdin closed: the owner closed this worker (and removes the directories too), or it is gone
    for d in tmpdirs:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
