"""The pipeline commands refuse a leftover argument that is not a Beam pipeline option: Beam alone drops it with a
warning and runs without it, so a misspelt option gave a run without it that exited 0."""
import pytest

from longreel.cli import main
from longreel.pipelines.cli_common import beam_args_error

DATAFLOW = ["--runner", "DataflowRunner", "--project", "P", "--region", "europe-west1",
            "--temp_location", "gs://b/tmp", "--sdk_container_image", "r-docker.pkg.dev/P/longreel/worker:0.1.0",
            "--experiments=use_runner_v2", "--experiments", "no_use_multiple_sdk_containers", "--num_workers=4",
            "--max_num_workers", "8", "--machine_type", "n1-standard-8", "--setup_file", "./setup.py"]
PORTABLE = ["--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=EXTERNAL",
            "--environment_config=localhost:50000", "--direct_num_workers", "2"]


@pytest.mark.parametrize("argv", [[], DATAFLOW, PORTABLE, ["--runner", "FlinkRunner", "--flink_master", "host:8081",
                                                          "--parallelism", "4"],
                                  ["--direct_running_mode", "multi_processing", "--direct_num_workers=2"]])
def test_beam_options_pass(argv):
    assert beam_args_error(argv) is None


@pytest.mark.parametrize("argv, says", [
    (["--workerz", "2"], "unknown option --workerz (did you mean --workers?)"),
    (["--run", "DataflowRunner"], "unknown option --run (did you mean --runner?)"),
    (["--temp-location=gs://b/tmp"], "unknown option --temp-location (did you mean --temp_location?)"),
    (DATAFLOW + ["--sett", "a=1", "--qra_table", "x"],
     "unknown options --sett (did you mean --set?), --qra_table (did you mean --qra-table?)"),
    (["--zzzz"], "unknown option --zzzz:"),
    (["clips.mp4"], "unexpected argument 'clips.mp4'"),
    (["a.mp4", "b.mp4"], "unexpected arguments ['a.mp4', 'b.mp4']"),
    (["--num_workers", "four"], "bad Beam option: argument --num_workers: invalid int value: 'four'"),
    (["--runner"], "bad Beam option: argument --runner: expected one argument"),
])
def test_what_beam_would_drop_is_named(argv, says):
    error = beam_args_error(argv, ("--workers", "--set", "--qra-table", "--out"))
    assert error is not None and says in error, error


# each pipeline command that passes options on to Beam, with the option naming its output directory
COMMANDS = [["curate", "--demo", "--out"], ["caption", "--clips-dir"], ["qra", "--out"], ["pack"],
            ["blind", "--out"], ["judge", "--out"], ["filter", "--out"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_every_pipeline_command_refuses_a_misspelt_option_before_it_writes(command, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main([*command, str(out), "--runr", "DataflowRunner", "--project", "P"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"longreel {command[0]}: unknown option --runr (did you mean --runner?)" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_a_command_suggests_its_own_option(tmp_path, capsys):
    rc = main(["filter", "--out", str(tmp_path), "--shrads", "x.tar"])
    assert rc == 2
    assert "unknown option --shrads (did you mean --shards?)" in capsys.readouterr().err


def test_no_beam_option_is_an_abbreviation_of_a_command_option():
    # argparse takes an unambiguous prefix of an option for the option: a Beam option that began one of a command's
    # own (`--project` and a `--projection`, say) would be eaten by the command before Beam saw it
    import argparse
    import importlib
    import re

    from longreel.cli import COMMANDS
    from longreel.pipelines.cli_common import _beam_parser

    beam = set(re.findall(r"--[\w-]+", _beam_parser().format_usage()))
    assert {"--runner", "--project", "--temp_location"} <= beam
    for name, (module, _) in COMMANDS.items():
        parser = argparse.ArgumentParser(prog=name)
        importlib.import_module(module).add_arguments(parser)
        own = set(re.findall(r"--[\w-]+", parser.format_usage()))
        assert not [(b, o) for b in beam for o in own if o.startswith(b)], name


@pytest.mark.parametrize("argv, path, extra", [
    (["curate", "IN.mp4", "--out", "gs://b/run"], "gs://b/run", "gcp"),
    (["curate", "s3://b/raw/a.mp4", "--out", "OUT"], "s3://b/raw/a.mp4", "aws"),
    (["qra", "--out", "gs://b/run"], "gs://b/run", "gcp"),
    (["pack", "gs://b/run"], "gs://b/run", "gcp"),
])
def test_a_remote_path_without_its_client_is_one_line(argv, path, extra, tmp_path, capsys, monkeypatch):
    """gs:// without Beam's gcp extra (this env) and s3:// without boto3 stopped the run in a traceback reported as
    an internal error; now exit 2, naming the extra to install, before anything is read or written."""
    import importlib.util

    from apache_beam.io.filesystems import FileSystems

    try:
        FileSystems.get_filesystem("gs://b/x")
        have_gcs = True
    except ValueError:
        have_gcs = False
    if (extra == "gcp" and have_gcs) or (extra == "aws" and importlib.util.find_spec("boto3")):
        pytest.skip(f"this environment has the {extra} client")  # the dataflow env has the gcp extra
    monkeypatch.chdir(tmp_path)
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and f"{path}: {path.split(':')[0]}:// paths need Beam's {extra} extra" in err, err
    assert f"pip install 'longreel[{extra}]'" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_a_beam_option_before_the_paths_says_where_its_value_went(tmp_path, capsys):
    """`curate --runner DirectRunner VIDEOS --out O`: argparse gives "DirectRunner" to INPUT; the one line must
    say so, not only "expected one argument", which reads as if the command line lacked the value."""
    out = tmp_path / "out"
    rc = main(["curate", "--runner", "DirectRunner", str(tmp_path / "videos"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "expected one argument" in err and "--name=VALUE" in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("argv, says", [
    (["--runner", "DataflowRunner", "--project", "P", "--region", "R", "--temp_location", "gs://bucket/tmp"],
     "--runner DataflowRunner: Invalid Project ID (P)"),
    (["--runner", "DataflowRunner"], "Missing required option: project"),
    (["--runner", "FooRunner"], "--runner FooRunner: Unexpected pipeline runner: FooRunner"),
])
def test_the_runners_own_checks_come_before_anything_is_written(argv, says, tmp_path, capsys):
    """Beam checks a runner's options when the pipeline object is made, which was after curate had claimed --out:
    the README's `--project P` was an internal-error traceback (exit 1) that left `_INPUTS.json` and `config.yaml`,
    and the corrected command was then refused for the unfinished run."""
    video = tmp_path / "a.mp4"
    video.write_bytes(b"\0")
    out = tmp_path / "out"
    assert main(["curate", str(video), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "Traceback" not in err and err.count("longreel curate:") == 1, err
    assert not out.exists()
