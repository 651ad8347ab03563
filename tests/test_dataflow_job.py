"""The Dataflow job of ``longreel curate``, built offline: DataflowRunner with ``--dry_run=True`` translates the pipeline
(Runner v2's portable proto, the job request, the staged ``--setup_file`` package) and stops before talking to Google
Cloud, so no credentials are needed (``--no_auth``). Needs apache-beam[gcp]: ``tox -e dataflow`` (marker ``dataflow``).

Checked on the job:

* the README's GPU command: every model step (caption, QRA generation, pass-rate answering) runs in an environment
  with its accelerator hint, decoding and writing in the plain one, all on the worker image given with
  ``--sdk_container_image``, with the ``--setup_file`` package staged;
* no secret of the launcher is in the job: an API key in the launcher's environment is not, the Secret Manager name
  the config gives is (resolved on the workers);
* no input is in the job, and it does not grow with the corpus: a 100,000-line manifest's job within 10% of a
  10-line one's. Inputs are still expanded on the launcher and embedded in the graph (``beam.Create``) until issue
  16's first item reads them on the workers: those two are expected failures (strict, so they flip when the change
  lands).

:func:`curate_job` is the one place that turns a manifest into the job as ``longreel curate`` does
(``pipelines/cli_curate.py``: inputs expanded, then ``build_curate``); it follows that command when it changes.
"""
from __future__ import annotations

import base64
import binascii
import bz2
import os
import tarfile
import zlib

import pytest

from longreel.pipelines.cli_curate import DEMO_CONFIG

pytestmark = pytest.mark.dataflow

IMAGE = "us-docker.pkg.dev/my-project/longreel/worker-gpu:0.1.0"
GPU = "type:nvidia-l4;count:1;install-nvidia-driver"
SECRET = "projects/my-project/secrets/vllm-api-key/versions/latest"
LAUNCHER_KEY = "sk-launcher-only-0123456789"
ACCELERATOR = "beam:resources:accelerator:v1"
MIN_RAM = "beam:resources:min_ram_bytes:v1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATAFLOW = ["--runner=DataflowRunner", "--project=longreel-dry-run", "--region=us-central1",
            "--temp_location=gs://longreel-dry-run/tmp", "--staging_location=gs://longreel-dry-run/staging",
            "--job_name=longreel-dry-run", "--no_auth", "--dry_run=True"]
#: the README's GPU job: model backends on vLLM / an OpenAI-compatible server, hints on the model steps
GPU_STAGES = ["stages=[caption, qra, filter, pack]",
              "caption.backend=vllm", "caption.model.path=/models/Qwen2.5-VL-7B-Instruct",
              f"caption.resources.accelerator={GPU}", "caption.resources.min_ram=32GB",
              "qra.backend=openai", "qra.model=deepseek-r1", "qra.base_url=http://10.0.0.2:8000/v1",
              f"qra.api_key_env={SECRET}",
              "filter.backend=vllm", "filter.model=/models/Qwen2.5-VL-7B-Instruct",
              f"filter.resources.accelerator={GPU}", "filter.resources.min_ram=32GB"]
#: the model step of each stage, by transform name prefix
MODEL_STEPS = ("CaptionClips/Caption/", "PassRate/Answer/")


def write_manifest(path, n: int) -> str:
    # local paths: the launcher still looks up a licence sidecar per entry, which for gs:// entries means one Cloud
    # Storage call each (no network here); the files need not exist to build the job
    with open(path, "w") as fh:
        fh.writelines(f"/data/videos/{i:06d}.mp4\n" for i in range(n))
    return str(path)


def curate_job(manifest: str, overrides: list[str], beam_args: list[str]):
    """``(runner, job)`` of ``longreel curate MANIFEST --out gs://... [overrides] [beam_args]`` under a dry run."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import build_curate
    from longreel.pipelines.io.inputs import plan_inputs
    from longreel.schemas.config import load_yaml

    cfg = load_yaml(CurateConfig, DEMO_CONFIG, overrides)
    p = beam.Pipeline(options=PipelineOptions(DATAFLOW + beam_args))
    # as `longreel curate` does: the launcher plans the specs, the workers list the videos
    build_curate(p, plan_inputs([manifest]), "gs://my-bucket/out", cfg)
    result = p.run()
    return p.runner, result.job


def job_bytes(runner, job) -> int:
    """What Dataflow receives: the job request and the pipeline proto (Runner v2 stages it beside the request)."""
    return len(job.json()) + len(runner.proto_pipeline.SerializeToString())


@pytest.fixture(scope="module")
def gpu_job(tmp_path_factory):
    # a key in the launcher's environment, under the name an OpenAI client reads by default: it must stay here
    saved = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = LAUNCHER_KEY
    try:
        manifest = write_manifest(tmp_path_factory.mktemp("job") / "videos.txt", 10)
        return curate_job(manifest, GPU_STAGES,
                          [f"--sdk_container_image={IMAGE}", f"--setup_file={os.path.join(ROOT, 'setup.py')}"])
    finally:
        if saved is None:
            del os.environ["OPENAI_API_KEY"]
        else:
            os.environ["OPENAI_API_KEY"] = saved


def unpacked_payloads(proto) -> bytes:
    """Every transform's payload, with the pickled DoFns (base64 of bz2 or zlib, as Beam writes them) decompressed,
    so that a string a DoFn carries (a config value, a list of inputs) can be searched for."""
    from apache_beam.portability.api import beam_runner_api_pb2

    def unpack(blob: bytes) -> bytes:
        try:
            raw = base64.b64decode(blob, validate=True)
        except binascii.Error:
            return blob
        for decompress in (bz2.decompress, zlib.decompress):
            try:
                return decompress(raw)
            except (OSError, ValueError, zlib.error):
                continue
        return blob

    parts = []
    for t in proto.components.transforms.values():
        if t.spec.urn == "beam:transform:pardo:v1":
            parts.append(unpack(beam_runner_api_pb2.ParDoPayload.FromString(t.spec.payload).do_fn.payload))
        else:
            parts.append(t.spec.payload)
    return b"".join(parts)


def _leaves(proto) -> dict[str, str]:
    """unique name -> environment id of every leaf transform that runs Python."""
    return {t.unique_name: t.environment_id for t in proto.components.transforms.values()
            if not t.subtransforms and t.environment_id}


def test_the_model_steps_run_on_accelerator_workers_and_nothing_else_does(gpu_job):
    runner, _ = gpu_job
    proto = runner.proto_pipeline
    envs = proto.components.environments
    leaves = _leaves(proto)
    hinted = {n: dict(envs[e].resource_hints) for n, e in leaves.items() if envs[e].resource_hints}
    for prefix in MODEL_STEPS + ("QRA/WriteQRAs/",):
        assert any(n.startswith(prefix) for n in leaves), f"no step {prefix} in the job"
    for prefix in MODEL_STEPS:
        steps = {n: h for n, h in hinted.items() if n.startswith(prefix)}
        assert steps and all(h == {ACCELERATOR: GPU.encode(), MIN_RAM: b"32000000000"} for h in steps.values()), \
            (prefix, steps)
    # QRA talks to a server (openai backend, no hint): it stays on CPU workers, like decoding and writing
    assert not [n for n in hinted if not n.startswith(MODEL_STEPS)], sorted(hinted)
    assert any(n.startswith("CaptionClips/DecodeAndMeasure") for n in leaves)


def test_every_step_runs_the_worker_image_with_the_setup_file_package(gpu_job):
    from apache_beam.portability.api import beam_runner_api_pb2

    runner, _ = gpu_job
    envs = runner.proto_pipeline.components.environments
    used = set(_leaves(runner.proto_pipeline).values())
    assert len(used) >= 2  # the plain environment and the accelerator one
    for env_id in used:
        env = envs[env_id]
        assert env.urn == "beam:env:docker:v1"
        assert beam_runner_api_pb2.DockerPayload.FromString(env.payload).container_image == IMAGE
        staged = {beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(d.role_payload).staged_name:
                  beam_runner_api_pb2.ArtifactFilePayload.FromString(d.type_payload).path for d in env.dependencies}
        assert "workflow.tar.gz" in staged, sorted(staged)  # --setup_file's sdist, pip-installed by each worker
    sdist = staged["workflow.tar.gz"]
    if os.path.exists(sdist):  # the stager's temporary directory may be gone already
        with tarfile.open(sdist) as tf:
            assert any(n.endswith("/pipelines/curate.py") for n in tf.getnames())


def test_no_launcher_secret_is_in_the_job(gpu_job):
    runner, job = gpu_job
    payloads = unpacked_payloads(runner.proto_pipeline)
    assert b"vllm" in payloads and SECRET.encode() in payloads  # the search sees into the pickled stages ...
    # ... and the launcher's key is nowhere: the workers read the secret the config names
    assert LAUNCHER_KEY.encode() not in payloads + job.json().encode()


def test_no_input_is_in_the_job(gpu_job):
    """The workers list the inputs (issue 16 item 1): no video path travels in the job graph."""
    runner, _ = gpu_job
    assert b"/data/videos/000007.mp4" not in unpacked_payloads(runner.proto_pipeline)


@pytest.fixture(scope="module")
def job_sizes(tmp_path_factory):
    d = tmp_path_factory.mktemp("sizes")
    return {n: job_bytes(*curate_job(write_manifest(d / f"m{n}.txt", n), [], [])) for n in (10, 100_000)}


def test_the_job_is_built(job_sizes):
    assert job_sizes[10] > 10_000  # a real pipeline, not an empty request


def test_the_job_does_not_grow_with_the_manifest(job_sizes):
    assert job_sizes[100_000] <= 1.10 * job_sizes[10], job_sizes
