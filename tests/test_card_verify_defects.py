"""`longreel card verify` on a real demo run: a missing remote index, a card built outside its run, and shards
packed from an earlier questions table. One test each.
"""
from __future__ import annotations

import functools
import glob
import os
import shutil
import socket
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from longreel.cli import main

HINT = "the shards were packed from another qras table"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("card_verify_defects") / "demo"
    assert main(["curate", "--demo", "--out", str(out)]) == 0
    return str(out)


@pytest.fixture
def run(demo, tmp_path):
    return shutil.copytree(demo, str(tmp_path / "run"))


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass


def _free_port() -> int:
    """A port nothing listens on (bound, then closed): a server that cannot be reached."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_missing_or_unreachable_index_url_is_one_line_exit_2(demo, capsys):
    """An index URL that answered 404 exited 1 with "internal error (HTTPError): this is a bug"; a missing local
    path exits 2 with one line, and so must an URL that is missing or cannot be reached."""
    card = os.path.join(demo, "card")
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=os.path.join(demo, "shards")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/nothere.index.json"
        assert main(["card", "verify", card, url, "--no-loader"]) == 2
        err = _one_line_error(capsys)
        assert url in err and "404" in err, err
    finally:
        server.shutdown()
        server.server_close()
    url = f"http://127.0.0.1:{_free_port()}/nothere.index.json"
    assert main(["card", "verify", card, url, "--no-loader"]) == 2
    err = _one_line_error(capsys)
    assert url in err and "cannot be reached" in err, err


def test_a_card_built_outside_the_run_verifies_against_the_runs_marker(run, tmp_path, capsys):
    """`card build RUN --out /elsewhere` then `card verify /elsewhere INDEX --run RUN` failed "run marker lists
    card.json": a card outside the run is none of its files, so its marker cannot list it. The run's own files are
    still checked, and a card inside the run must still be listed."""
    card = str(tmp_path / "x" / "card_elsewhere")  # a title of its own: not the bytes of RUN/card's card.json
    assert main(["card", "build", run, "--out", card, "--pretty-name", "Elsewhere"]) == 0
    (index,) = glob.glob(os.path.join(run, "shards", "*-train.index.json"))
    capsys.readouterr()
    assert main(["card", "verify", card, index, "--run", run, "--no-loader"]) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and "run marker lists longreel" in out, out[-2000:]
    shutil.copytree(card, os.path.join(run, "card2"))  # the same card inside the run: the marker never listed it
    assert main(["card", "verify", os.path.join(run, "card2"), index, "--marker", run, "--no-loader"]) == 1
    out = capsys.readouterr().out
    assert out.split("MISMATCH: ", 1)[1].strip() == "run marker lists card.json", out[-2000:]
    with open(index, "a") as fh:  # a run's listed file changed: the marker check still fails it
        fh.write(" ")
    assert main(["card", "verify", card, index, "--run", run, "--no-loader"]) == 1
    assert "run marker: shards/" in capsys.readouterr().out


def test_shards_packed_from_an_earlier_qras_table_fail_verify(run, capsys):
    """`longreel qra RUN --set qra.categories=[spatial]` rewrote the qras table, not the shards: verify said every
    claim matched, although the shards released questions the table no longer holds."""
    card, shards = os.path.join(run, "card"), os.path.join(run, "shards")
    assert main(["card", "verify", card, shards, "--run", run, "--no-loader"]) == 0  # a subset of the table is fine
    assert main(["qra", "--out", run, "--set", "qra.categories=[spatial]"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    for extra in (["--run", run], []):  # the card's parent is the run: it is known without --run too
        assert main(["card", "verify", card, shards, "--no-loader", "--failures-only", *extra]) == 1, extra
        out = capsys.readouterr().out
        assert HINT in out and "run: question " in out and "-train-000000.tar" in out, out[-2000:]
    assert main(["pack", run]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["card", "verify", card, shards, "--run", run, "--no-loader"]) == 0
    assert HINT not in capsys.readouterr().out
