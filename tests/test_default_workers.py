"""``longreel curate`` without --workers: every core, but one for a single video file that has nothing to spread."""
import argparse

import pytest

from longreel.pipelines import cli_curate
from longreel.pipelines.config import CurateConfig


def _workers(argv, stages, monkeypatch, cores=4):
    monkeypatch.setattr(cli_curate, "default_workers", lambda: cores)
    p = argparse.ArgumentParser()
    cli_curate.add_arguments(p)
    return cli_curate._default_workers(p.parse_args(argv), CurateConfig(stages=stages))


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"not really a video")
    (tmp_path / "b.mp4").write_bytes(b"nor this")
    (tmp_path / "list.txt").write_text("a.mp4\n")
    return tmp_path


def test_one_video_file_without_captions_runs_in_one_worker(corpus, monkeypatch):
    assert _workers([str(corpus / "a.mp4")], [], monkeypatch) == 1


def test_one_video_with_captions_spreads_its_decode(corpus, monkeypatch):
    assert _workers([str(corpus / "a.mp4")], ["caption"], monkeypatch) == 4


@pytest.mark.parametrize("spec", ["{d}", "{d}/*.mp4", "{d}/list.txt", "{d}/a.mp4 {d}/b.mp4", "{d}/missing.mp4",
                                  "gs://bucket/a.mp4"])
def test_anything_that_may_hold_more_videos_uses_every_core(spec, corpus, monkeypatch):
    assert _workers(spec.format(d=corpus).split(), [], monkeypatch) == 4


def test_the_demo_uses_every_core(corpus, monkeypatch):
    assert _workers(["--demo"], [], monkeypatch) == 4
