"""The child side of :class:`longreel.pipelines.media.worker.IsolatedWorker`: JSON requests in, JSON replies out.

Operations are registered in ``OPS``; each takes keyword arguments and returns something JSON-able.
An exception with a ``reason`` attribute becomes a clean error reply with that reason.
"""
from __future__ import annotations

import json
import sys
import traceback


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


def main() -> None:
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        req = json.loads(line)
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


if __name__ == "__main__":
    main()
