"""The forked local workers send each output element to the runner whole.

The FnApiRunner decodes every data chunk a worker sends on its own (``GroupingBuffer.append``), so a chunk that
ends inside an element is read as garbage; the runner's stream reads have no bounds check, and a garbled length made
the launcher of a 2-worker curate grow to 23 GB. Beam's time-based output buffer (``data_buffer_time_limit_ms``)
flushes from a timer thread whatever has been written, wherever the encoder is. Here an element whose encoding
pauses for longer than that timer's period goes through a GroupByKey on two forked workers and must come out intact.
"""
import time
import typing

import apache_beam as beam
import pytest
from apache_beam.coders import coder_impl
from apache_beam.testing.util import assert_that, equal_to

from longreel.pipelines.runner import make_pipeline

PAUSE_S = 1.6  # longer than Beam's 1 s time-based flush period


class Blob(bytes):
    """Bytes with a coder of their own (:class:`SlowBlobCoder`)."""


class _SlowBlobImpl(coder_impl.StreamCoderImpl):
    """Writes the first half of a blob, waits, then the rest: a slow encoder (a large pickled array) caught by a
    flush in the middle."""

    def encode_to_stream(self, value, out, nested):
        out.write_var_int64(len(value))
        half = len(value) // 2
        out.write(bytes(value[:half]))
        time.sleep(PAUSE_S)
        out.write(bytes(value[half:]))

    def decode_from_stream(self, in_stream, nested):
        n = in_stream.read_var_int64()
        if n < 0 or n > in_stream.size():
            raise ValueError(f"blob of {n} bytes with {in_stream.size()} left: a chunk cut inside an element")
        return Blob(in_stream.read(n))


class SlowBlobCoder(beam.coders.Coder):
    def _create_impl(self):
        return _SlowBlobImpl()

    def to_type_hint(self):
        return Blob

    def is_deterministic(self):
        return True

    def __eq__(self, other):
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))


beam.coders.registry.register_coder(Blob, SlowBlobCoder)


def _blob(i: int) -> tuple[str, Blob]:
    return f"k{i % 2}", Blob(bytes([i]) * 4096)


def test_an_element_encoded_slowly_reaches_the_runner_whole():
    with make_pipeline(workers=2) as p:
        assert not p.runner.workers_started.is_set()
        got = (p
               | beam.Create(range(4))
               | beam.Map(_blob).with_output_types(typing.Tuple[str, Blob])
               | beam.GroupByKey()
               | beam.MapTuple(lambda k, vs: (k, sorted(v[0] for v in vs))))
        assert_that(got, equal_to([("k0", [0, 2]), ("k1", [1, 3])]))
    assert p.runner.workers_started.is_set()  # what the card's imports wait for (pipelines/curate.py)


def test_thread_workers_are_refused_with_a_reason():
    from longreel.schemas.config import ConfigError

    for args in (["--direct_running_mode=multi_threading"],
                 ["--runner=DirectRunner", "--direct_running_mode=multi_threading", "--direct_num_workers=2"]):
        with pytest.raises(ConfigError, match="multi_threading is not supported.*cut an element in two"):
            make_pipeline(args, workers=2)


def test_curate_refuses_thread_workers_before_taking_its_output_directory(tmp_path, capsys):
    from longreel.cli import main

    out = tmp_path / "out"
    assert main(["curate", "--demo", "--out", str(out), "--direct_running_mode=multi_threading"]) == 2
    assert "multi_threading is not supported" in capsys.readouterr().err
    assert not out.exists()
