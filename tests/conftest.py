import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_VIDEOS = Path(os.environ.get("LONGREEL_SHARED_VIDEOS", REPO.parent / "shared" / "videos"))


@pytest.fixture(scope="session")
def shared_videos() -> Path:
    if not (SHARED_VIDEOS / "moviepy__bbb_full.mp4").exists():
        pytest.skip(f"the sample videos are not at {SHARED_VIDEOS} (set LONGREEL_SHARED_VIDEOS)")
    return SHARED_VIDEOS


@pytest.fixture(scope="session")
def ffmpeg() -> str:
    from pipelines.media.ffmpeg_bin import ffmpeg_exe
    return ffmpeg_exe()


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
