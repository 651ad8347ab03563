"""Where the ffmpeg binary comes from.

Order: ``$LONGREEL_FFMPEG``, an ``ffmpeg`` on PATH, then the static build shipped inside the
``imageio-ffmpeg`` wheel (a PyPI package), so a fresh machine without ffmpeg still works.
ffprobe is not needed: probing uses PyAV, whose wheels carry the FFmpeg libraries.
"""
from __future__ import annotations

import functools
import os
import shutil


class FFmpegNotFound(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def ffmpeg_exe() -> str:
    env = os.environ.get("LONGREEL_FFMPEG")
    if env:
        if not os.path.isfile(env):
            raise FFmpegNotFound(f"LONGREEL_FFMPEG={env!r} does not exist")
        return env
    found = shutil.which("ffmpeg")
    if found:
        return found
    try:
        import imageio_ffmpeg
    except ImportError as e:  # pragma: no cover - it is an install requirement
        raise FFmpegNotFound("no ffmpeg on PATH and imageio-ffmpeg is not installed") from e
    return imageio_ffmpeg.get_ffmpeg_exe()
