"""Answerer backends for the pass-rate filter, as Beam RunInference ``ModelHandler`` s.

An *example* is one question with its video's frames (built by :mod:`longreel.pipelines.stages.passrate`)::

    {"qra": <qra row>, "messages": <trainer.prompting.build_messages(...)>, "seed": int,
     "frames": uint8 ndarray [T, H, W, 3], "video": {"fps", "n_frames", "duration_s", "frame_indices",
     "timestamps"}}

and its inference is ``{"completions": [k strings], "error": None | str, "latency_s": float}``. A failure on one
question (a decoding quirk of the processor, an out-of-memory) is returned as ``error`` for that question only and
becomes one ``answerer_failed`` reject; a model that cannot be loaded fails the run (a configuration error).

Backends (each samples k completions per question, with the prompt rendered by the model's own chat template from
the trainer's :func:`longreel.task.prompting.build_messages`):

* ``transformers``: ``AutoModelForImageTextToText`` + ``AutoProcessor`` from a local directory. Per question the
  processor runs once on the frames and ``generate(num_return_sequences=k)`` is called once; transformers' generate
  encodes the video with the vision tower once and repeats the features for the k rows (measured and tested:
  one vision-tower call per question). Sampling runs under the question's own seed in a forked RNG, so a question's
  samples do not depend on batching, order or the other questions.
* ``vllm``: one ``LLM.generate`` call per batch with one request per question and ``SamplingParams(n=k,
  seed=question seed)``; GPU only, imported lazily (checked by ``scripts/gpu_check_passrate_vllm.py``).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from longreel.pipelines.filter_config import FilterConfig
from longreel.pipelines.inference.base import weights_revision
from longreel.task.prompting import prompt_hash, render_prompt

log = logging.getLogger("longreel")

#: Qwen2-VL-family frames are cut in 14-pixel patches merged 2x2: frame sides are multiples of 28.
QWEN_FRAME_FACTOR = 28

__all__ = [
    "AnswererHandler",
    "Loaded",
    "TransformersAnswererHandler",
    "VLLMAnswererHandler",
    "make_handler",
    "question_seed",
]


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
        cfg.validate()
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
                inference = {"completions": [str(a) for a in ans], "error": None, "latency_s": per}
            results.append(PredictionResult(ex, inference, model_id=self.answerer_name()))
        return results

    def get_num_bytes(self, batch: Sequence[dict]) -> int:
        return sum(int(getattr(ex.get("frames"), "nbytes", 0)) for ex in batch)

    def get_metrics_namespace(self) -> str:
        return f"longreel_passrate_{self.backend}"


# ------------------------------------------------------------------------------------------------------------
# transformers
# ------------------------------------------------------------------------------------------------------------


def _torch_dtype(name: str):
    import torch

    return {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class TransformersAnswererHandler(AnswererHandler):
    """``AutoModelForImageTextToText`` from a local directory; k samples in one ``generate`` call per question."""

    backend = "transformers"

    def __init__(self, cfg: FilterConfig):
        super().__init__(cfg)
        self._revision = weights_revision(cfg.model, cfg.model_revision)

    def answerer_revision(self) -> str | None:
        return self._revision

    def load_model(self):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        c = self.cfg
        if not os.path.isdir(c.model):
            raise FileNotFoundError(f"answerer model directory {c.model!r} does not exist (nothing is downloaded)")
        device = c.device if c.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForImageTextToText.from_pretrained(c.model, dtype=_torch_dtype(c.dtype),
                                                            trust_remote_code=c.trust_remote_code,
                                                            local_files_only=True)
        model = model.to(device).eval()
        processor = AutoProcessor.from_pretrained(c.model, trust_remote_code=c.trust_remote_code,
                                                  local_files_only=True)
        return Loaded(model, processor)

    def processor_inputs(self, processor, example: dict):
        """Tokenized prompt + processed frames of one question (a dict of tensors on the CPU)."""
        from transformers.video_utils import VideoMetadata

        frames = example["frames"]
        v = example["video"]
        prompt = render_prompt(processor, example["messages"])
        meta = VideoMetadata(total_num_frames=int(v["n_frames"]), fps=float(v["fps"]), duration=float(v["duration_s"]),
                             width=int(frames.shape[2]), height=int(frames.shape[1]),
                             frames_indices=[int(i) for i in v["frame_indices"]])
        # frames were decoded at a size on the processor's grid: resizing again would only blur them
        on_grid = frames.shape[1] % QWEN_FRAME_FACTOR == 0 and frames.shape[2] % QWEN_FRAME_FACTOR == 0
        return processor(text=[prompt], videos=[frames], video_metadata=[meta], do_sample_frames=False,
                         do_resize=not on_grid, return_tensors="pt")

    def generate(self, model, processor, inputs, seed: int, num_return_sequences: int, **extra) -> list[str]:
        """Sample ``num_return_sequences`` completions in one generate call under ``seed`` (``extra``: further
        generate keywords, e.g. ``min_new_tokens`` for benchmarks that need equal-length samples)."""
        import torch

        c = self.cfg
        inputs = inputs.to(model.device)
        devices = [model.device.index or 0] if model.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(seed)
            out = model.generate(**inputs, do_sample=True, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                                 repetition_penalty=1.0, max_new_tokens=c.max_new_tokens,
                                 num_return_sequences=num_return_sequences, **extra)
        n_in = inputs["input_ids"].shape[1]
        return processor.batch_decode(out[:, n_in:], skip_special_tokens=True)

    def answer(self, model, example: dict) -> list[str]:
        mdl, processor = model
        inputs = self.processor_inputs(processor, example)
        return self.generate(mdl, processor, inputs, example["seed"], self.cfg.k)


# ------------------------------------------------------------------------------------------------------------
# vLLM (GPU)
# ------------------------------------------------------------------------------------------------------------


class VLLMAnswererHandler(AnswererHandler):
    """vLLM offline engine; one request per question with ``n=k``; the batch is one ``generate`` call."""

    backend = "vllm"

    def __init__(self, cfg: FilterConfig):
        super().__init__(cfg)
        self._revision = weights_revision(cfg.model, cfg.model_revision)

    def answerer_revision(self) -> str | None:
        return self._revision

    def load_model(self):
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise RuntimeError("backend vllm needs the `vllm` package (GPU machines); use backend transformers "
                               "on a CPU") from e
        from transformers import AutoProcessor

        c = self.cfg
        dtype = c.dtype if c.dtype != "auto" else "auto"
        llm = LLM(model=c.model, seed=c.seed, dtype=dtype, trust_remote_code=c.trust_remote_code,
                  limit_mm_per_prompt={"video": 1, "image": 0}, max_model_len=c.vllm_max_model_len or None,
                  gpu_memory_utilization=c.vllm_gpu_memory_utilization)
        processor = AutoProcessor.from_pretrained(c.model, trust_remote_code=c.trust_remote_code,
                                                  local_files_only=True)
        return Loaded(llm, processor)

    def requests(self, processor, batch: Sequence[dict]):
        from vllm import SamplingParams

        c = self.cfg
        prompts, params = [], []
        for ex in batch:
            # the frames are already sampled and sized on the Qwen grid (multiples of 28 within max_pixels), so the
            # engine's processor leaves them as they are; Qwen2-VL-family models take the bare (T, H, W, 3) array
            prompts.append({"prompt": render_prompt(processor, ex["messages"]),
                            "multi_modal_data": {"video": ex["frames"]}})
            params.append(SamplingParams(n=c.k, temperature=c.temperature, top_p=c.top_p,
                                         top_k=c.top_k if c.top_k > 0 else -1, repetition_penalty=1.0,
                                         max_tokens=c.max_new_tokens, seed=ex["seed"]))
        return prompts, params

    def answer_batch(self, model, batch: Sequence[dict]) -> list[list[str] | Exception]:
        llm, processor = model
        try:
            prompts, params = self.requests(processor, batch)
            outs = llm.generate(prompts, params, use_tqdm=False)
        except Exception as e:  # the whole batch failed: every question in it gets the error
            return [e] * len(batch)
        return [[o.text for o in out.outputs] for out in outs]


def make_handler(cfg: FilterConfig) -> AnswererHandler:
    """The answerer ``cfg.backend`` names. (Tests and other callers with their own answerer pass it to the stage
    instead: ``PassRateFilter(cfg, handler=...)``.)"""
    return {"transformers": TransformersAnswererHandler, "vllm": VLLMAnswererHandler}[cfg.backend](cfg)
