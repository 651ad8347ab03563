"""Answerer backends for the pass-rate filter, as Beam RunInference ``ModelHandler`` s.

An *example* is one question with its video's frames (built by :mod:`longreel.pipelines.stages.passrate`)::

    {"qra": <qra row>, "messages": <longreel.task.prompting.build_messages(...)>, "seed": int,
     "frames": uint8 ndarray [T, H, W, 3], "video": {"fps", "n_frames", "duration_s", "frame_indices",
     "timestamps"}}

and its inference is ``{"completions": [k strings], "error": None | str, "latency_s": float, "tokens": None |
{"input", "vision", "output"}}`` (``tokens``: the compute bill of the question's one model call). A failure on one
question (a decoding quirk of the processor, an out-of-memory) is returned as ``error`` for that question only and
becomes one ``answerer_failed`` reject; a model that cannot be loaded fails the run (a configuration error).

The model runs on an engine of :mod:`longreel.engines` (the same ones that write captions and QRA): each question
is one request for ``n=k`` samples under the question's own seed, with the prompt rendered by the model's own chat
template from the trainer's :func:`longreel.task.prompting.build_messages` and every sampling parameter passed
explicitly (the model's generation config is never used), so both backends sample alike.

* ``transformers``: ``AutoModelForImageTextToText`` + ``AutoProcessor`` from a local directory; the processor runs
  once on the frames and one ``generate(num_return_sequences=k)`` call encodes the video with the vision tower
  once for the k rows (measured and tested: one vision-tower call per question). Sampling runs in a forked RNG, so
  a question's samples do not depend on batching, order or the other questions.
* ``vllm``: one ``LLM.generate`` call per batch with one request per question (``SamplingParams(n=k, seed=question
  seed)``); GPU only, imported lazily (checked by ``scripts/gpu_check_passrate_vllm.py``).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from typing import Any


from longreel.pipelines.inference.beam_ml import ModelHandler, PredictionResult
from longreel.pipelines.filter_config import FilterConfig
from longreel.engines.base import weights_revision
from longreel.task.prompting import prompt_hash

log = logging.getLogger("longreel")

__all__ = [
    "AnswererHandler",
    "Loaded",
    "EngineAnswererHandler",
    "TransformersAnswererHandler",
    "VLLMAnswererHandler",
    "make_handler",
    "question_seed",
]


class Answers(list):
    """The k completions of one question, with the compute bill of the call that sampled them."""

    def __init__(self, texts, input_tokens: int | None = None, vision_tokens: int | None = None,
                 output_tokens: int | None = None):
        super().__init__(texts)
        self.tokens = None if input_tokens is None else {"input": input_tokens, "vision": vision_tokens,
                                                         "output": output_tokens}


class Loaded:
    """What ``load_model`` returns: Beam's model sharing keeps a weak reference to it (tuples cannot be)."""

    def __init__(self, model: Any = None, processor: Any = None):
        self.model, self.processor = model, processor

    def __iter__(self):  # ``model, processor = loaded``
        return iter((self.model, self.processor))


def question_seed(seed: int, qra_id: str) -> int:
    """The sampling seed of one question: stable across processes, runs and batchings (31 bits)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{qra_id}".encode()).digest()[:4], "big") & 0x7FFFFFFF


class AnswererHandler(ModelHandler):
    """Shared by every backend: batching, per-question error capture, provenance."""

    backend = "?"

    def __init__(self, cfg: FilterConfig):
        super().__init__(min_batch_size=1, max_batch_size=cfg.batch_size)
        cfg.check_runnable()
        self.cfg = cfg

    # -- what the rows record -------------------------------------------------------------------------------
    def answerer_name(self) -> str:
        return self.cfg.model

    def answerer_revision(self) -> str | None:
        return self.cfg.model_revision

    def processor_dir(self) -> str | None:
        """Where the frame cache's video processor comes from (``frame_source: cache``): the answering model's
        own directory; None means Qwen2-VL's defaults."""
        return self.cfg.model or None

    def provenance(self) -> dict:
        c = self.cfg
        return {"backend": self.backend, "answerer": self.answerer_name(),
                "answerer_revision": self.answerer_revision(), "k": c.k, "temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k,
                "max_new_tokens": c.max_new_tokens, "seed": c.seed, "prompt_hash": prompt_hash()}

    # -- inference ------------------------------------------------------------------------------------------
    def answer(self, model: Any, example: dict) -> list[str]:
        raise NotImplementedError

    def answer_batch(self, model: Any, batch: Sequence[dict]) -> list[list[str] | Exception]:
        out: list[list[str] | Exception] = []
        for ex in batch:
            try:
                out.append(self.answer(model, ex))
            except Exception as e:  # one question's failure is that question's reject
                out.append(e)
        return out

    def run_inference(self, batch: Sequence[dict], model: Any, inference_args: dict | None = None):
        t0 = time.monotonic()
        answers = self.answer_batch(model, batch)
        per = (time.monotonic() - t0) / max(len(batch), 1)
        results = []
        for ex, ans in zip(batch, answers):
            if isinstance(ans, Exception):
                err = f"{type(ans).__name__}: {ans}"
                log.warning("passrate: answerer failed on %s: %s", ex["qra"]["qra_id"], err)
                inference = {"completions": [], "error": err, "latency_s": per}
            elif len(ans) != self.cfg.k:
                inference = {"completions": [], "error": f"expected {self.cfg.k} completions, got {len(ans)}",
                             "latency_s": per}
            else:
                inference = {"completions": [str(a) for a in ans], "error": None, "latency_s": per,
                             "tokens": getattr(ans, "tokens", None)}
            results.append(PredictionResult(ex, inference, model_id=self.answerer_name()))
        return results

    def get_num_bytes(self, batch: Sequence[dict]) -> int:
        return sum(int(getattr(ex.get("frames"), "nbytes", 0)) for ex in batch)

    def get_metrics_namespace(self) -> str:
        return f"longreel_passrate_{self.backend}"


# ------------------------------------------------------------------------------------------------------------
# the engines
# ------------------------------------------------------------------------------------------------------------


def engine_request(cfg: FilterConfig, example: dict):
    """One question as an engine request: its k samples under its own seed, the frames with their metadata."""
    from longreel.engines.base import EngineRequest, Sampling, Video

    v = example["video"]
    frames = example["frames"]
    video = Video(frames=frames, fps=float(v["fps"]), frame_indices=[int(i) for i in v["frame_indices"]],
                  total_frames=int(v["n_frames"]), duration_s=float(v["duration_s"]))
    sampling = Sampling(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                        top_k=cfg.top_k, repetition_penalty=1.0, n=cfg.k, seed=int(example["seed"]))
    return EngineRequest(key=str(example["qra"]["qra_id"]), messages=example["messages"], video=video,
                         sampling=sampling)


class EngineAnswererHandler(AnswererHandler):
    """An answerer whose model is an engine (``load_model`` returns it, set up)."""

    def __init__(self, cfg: FilterConfig):
        super().__init__(cfg)
        self._revision = weights_revision(cfg.model, cfg.model_revision)

    def answerer_revision(self) -> str | None:
        return self._revision

    def make_engine(self):
        raise NotImplementedError

    def load_model(self):
        if not os.path.isdir(self.cfg.model):
            raise FileNotFoundError(f"answerer model directory {self.cfg.model!r} does not exist (nothing is "
                                    "downloaded)")
        engine = self.make_engine()
        engine.setup()
        return engine

    def answer_batch(self, model: Any, batch: Sequence[dict]) -> list[list[str] | Exception]:
        out: list[list[str] | Exception] = []
        requests, where = [], []
        for ex in batch:
            try:
                requests.append(engine_request(self.cfg, ex))
                where.append(len(out))
                out.append([])
            except Exception as e:  # a malformed example is that question's reject
                out.append(e)
        for i, c in zip(where, model.generate(requests) if requests else []):
            out[i] = (Answers(c.texts, c.prompt_tokens, c.vision_tokens, c.new_tokens) if c.ok
                      else RuntimeError(f"{c.error_reason}: {c.error_message}"))
        return out

    def answer(self, model: Any, example: dict) -> list[str]:
        [ans] = self.answer_batch(model, [example])
        if isinstance(ans, Exception):
            raise ans
        return ans


class TransformersAnswererHandler(EngineAnswererHandler):
    """``AutoModelForImageTextToText`` from a local directory; k samples in one ``generate`` call per question."""

    backend = "transformers"

    def make_engine(self):
        from longreel.engines.transformers_engine import TransformersEngine

        c = self.cfg
        return TransformersEngine(c.model, self._revision, kind="vision", dtype=c.dtype, device=c.device,
                                  trust_remote_code=c.trust_remote_code, batch_size=c.batch_size)


class VLLMAnswererHandler(EngineAnswererHandler):
    """vLLM offline engine; one request per question with ``n=k``; the batch is one ``generate`` call."""

    backend = "vllm"

    def make_engine(self):
        from longreel.engines.vllm_engine import VLLMEngine

        c = self.cfg
        return VLLMEngine(c.model, self._revision, trust_remote_code=c.trust_remote_code, dtype=c.dtype,
                          max_model_len=c.vllm_max_model_len or None,
                          gpu_memory_utilization=c.vllm_gpu_memory_utilization, seed=c.seed)


def make_handler(cfg: FilterConfig) -> AnswererHandler:
    """The answerer ``cfg.backend`` names. (Tests and other callers with their own answerer pass it to the stage
    instead: ``PassRateFilter(cfg, handler=...)``.)"""
    return {"transformers": TransformersAnswererHandler, "vllm": VLLMAnswererHandler}[cfg.backend](cfg)
