import pytest

from longreel.pipelines.media.worker import IsolatedWorker, WorkerCrashed, WorkerError, WorkerTimeout


def test_hang_is_killed_and_the_worker_recovers():
    with IsolatedWorker(default_timeout=30) as w:
        assert w.call("sleep", seconds=0.01) == {"slept": 0.01}
        with pytest.raises(WorkerTimeout) as e:
            w.call("sleep", timeout=1.0, seconds=60)
        assert e.value.reason == "timeout"
        assert w.call("sleep", seconds=0.01) == {"slept": 0.01}  # a fresh child took over


def test_crash_is_reported_and_the_worker_recovers():
    with IsolatedWorker(default_timeout=30) as w:
        with pytest.raises(WorkerCrashed) as e:
            w.call("crash")
        assert e.value.reason == "worker_crashed"
        assert w.call("sleep", seconds=0.0) == {"slept": 0.0}


def test_clean_errors_keep_their_reason(tmp_path):
    bad = tmp_path / "x.mp4"
    bad.write_text("not a video")
    with IsolatedWorker() as w:
        with pytest.raises(WorkerError) as e:
            w.call("probe", path=str(bad))
        assert e.value.reason == "not_a_video"
        with pytest.raises(WorkerError) as e:
            w.call("no_such_op")
        assert e.value.reason == "bad_request"
