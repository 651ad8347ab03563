"""Test files start longest first (tests/file_order.py), so that pytest-xdist does not leave the long end-to-end
files to one worker at the end; ``--durations-out`` records what the order is made from."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from file_order import file_of, file_seconds, load_durations, longest_first, write_durations

REPO = Path(__file__).resolve().parents[1]


def test_files_start_longest_first_unrecorded_before_all_and_stay_whole():
    ids = ["tests/test_a.py::t1", "tests/test_a.py::t2", "tests/test_b.py::t[x]", "tests/test_c.py::t",
           "tests/test_b.py::t[y]", "tests/test_d.py::C::t", "tests/test_e.py::t"]
    durations = {"tests/test_a.py": 5.0, "tests/test_b.py": 90.0, "tests/test_c.py": 5.0, "tests/test_e.py": 40.0}
    order = [ids[i] for i in longest_first(ids, durations)]
    assert order == ["tests/test_d.py::C::t",  # not recorded: starts first
                     "tests/test_b.py::t[x]", "tests/test_b.py::t[y]",  # gathered, in their own order
                     "tests/test_e.py::t",
                     "tests/test_a.py::t1", "tests/test_a.py::t2", "tests/test_c.py::t"]  # a tie keeps pytest's order
    assert sorted(longest_first(ids, durations)) == list(range(len(ids)))  # a permutation: nothing lost
    assert longest_first(ids, {}) == [0, 1, 2, 4, 3, 5, 6]  # no record: files in pytest's order, each gathered


def test_seconds_add_up_per_file_and_round_trip(tmp_path):
    reports = [("tests/test_a.py::t1", 1.04), ("tests/test_a.py::t1", 2.0), ("tests/test_a.py::t2", 0.5),
               ("tests/test_b.py::C::t[1]", 7.25)]
    seconds = file_seconds(reports)
    assert seconds == {"tests/test_a.py": 3.5, "tests/test_b.py": 7.2}
    path = tmp_path / "d.json"
    write_durations(path, seconds, "how")
    assert load_durations(path) == seconds
    assert list(json.loads(path.read_text())["seconds"]) == ["tests/test_b.py", "tests/test_a.py"]
    assert load_durations(tmp_path / "missing.json") == {}
    assert file_of("tests/test_b.py::C::t[1]") == "tests/test_b.py"


def test_the_record_names_test_files_that_exist():
    recorded = load_durations()
    assert recorded, "tests/durations.json is missing or empty"
    assert all(v >= 0 for v in recorded.values())
    gone = sorted(f for f in recorded if not (REPO / f).is_file())
    assert not gone, f"tests/durations.json names files that are gone: {gone} (rewrite it: see tests/file_order.py)"


def test_collection_follows_the_record_and_a_run_rewrites_it(tmp_path):
    """The hooks in tests/conftest.py, through pytest itself on two light files: the one recorded as longer is
    collected first, and ``--durations-out`` writes both files' seconds."""
    recorded = load_durations()
    files = ["tests/test_file_order.py", "tests/test_layers.py"]
    longer, shorter = sorted(files, key=lambda f: -recorded.get(f, float("inf")))
    out = tmp_path / "durations.json"
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-k", "layer or seconds_add_up", "--durations-out", str(out), shorter, longer],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(load_durations(out)) == set(files)
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                             "--collect-only", shorter, longer], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600).stdout.splitlines()
    firsts = [file_of(line) for line in listed if "::" in line]
    assert firsts and firsts[0] == longer and firsts[-1] == shorter, listed[:5]
