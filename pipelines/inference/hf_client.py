"""In-process ``transformers`` client: ``AutoModelForImageTextToText`` + ``AutoProcessor`` from a local directory.

Video requests go to the processor as already-sampled frames with their ``VideoMetadata`` and
``do_sample_frames=False`` (the frames were chosen and resized by the stage, to the
processor's own pixel budget, so the processor's resize is the identity). Text-only requests
(``kind="text"``, e.g. the QRA stage's LLM) load ``AutoModelForCausalLM`` and
``AutoTokenizer`` instead; ``gguf_file=`` loads a GGUF checkpoint such as SmolLM2's.

Greedy requests are batched (left padding). Sampled requests run one at a time with a
per-item seed so that a caption never depends on which batch its clip landed in.

NVILA (``Efficient-Large-Model/NVILA-*``) is native in neither transformers nor vLLM. Download the
checkpoint once (``huggingface-cli download Efficient-Large-Model/NVILA-8B-hf --local-dir /models/nvila``
on a machine with network access), then run with ``--set caption.model.path=/models/nvila
--trust-remote-code``: the checkpoint's own Python code (``auto_map`` in its config.json) is then
imported and run. Without the explicit flag, remote code is never executed. When the remote
code registers no ``AutoModelForImageTextToText`` class, ``AutoModelForCausalLM`` and then
``AutoModel`` are tried.
"""
from __future__ import annotations

import json
import logging
import os
import time

from longreel.pipelines.inference.base import Generation, GenerationParams, ModelInfo, Request, item_seed, weights_revision

log = logging.getLogger("longreel")

DEFAULT_MAX_PIXELS = 448 * 448
DEFAULT_MULTIPLE = 28


def processor_pixel_budget(path: str) -> tuple[int, int, int]:
    """``(max_pixels, multiple, min_pixels)`` per frame from a checkpoint's processor files, without loading it.

    Reads the video processor's (else the image processor's) ``size.longest_edge`` / ``max_pixels`` and
    ``patch_size * merge_size``; falls back to 448*448 pixels in multiples of 28 when the files say nothing.
    """
    sections = []
    for name in ("video_preprocessor_config.json", "processor_config.json", "preprocessor_config.json"):
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            continue
        try:
            with open(p, encoding="utf-8") as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            continue
        sections += [doc.get("video_processor"), doc.get("image_processor"), doc]
    for sec in sections:
        if not isinstance(sec, dict):
            continue
        size = sec.get("size") or {}
        max_px = sec.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
        if max_px:
            min_px = sec.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 0
            multiple = int(sec.get("patch_size") or 14) * int(sec.get("merge_size") or 2)
            return int(max_px), multiple, int(min_px)
    return DEFAULT_MAX_PIXELS, DEFAULT_MULTIPLE, 0


def _torch_dtype(name: str):
    import torch

    return {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class TransformersClient:
    def __init__(self, path: str, *, kind: str = "vision", revision: str | None = None,
                 trust_remote_code: bool = False, dtype: str = "auto", device: str = "cpu",
                 gguf_file: str | None = None):
        import torch
        import transformers

        if kind not in ("vision", "text"):
            raise ValueError(f"kind must be vision or text, got {kind!r}")
        self.kind, self.device = kind, device
        self.info = ModelInfo("transformers", path, weights_revision(path, revision))
        common = {"trust_remote_code": bool(trust_remote_code)}
        load = dict(common, dtype=_torch_dtype(dtype))
        if gguf_file:
            load["gguf_file"] = gguf_file
        if device == "auto":
            load["device_map"] = "auto"
        t0 = time.monotonic()
        if kind == "vision":
            self.processor = transformers.AutoProcessor.from_pretrained(path, **common)
            self.tokenizer = self.processor.tokenizer
            self.model = self._load_vision(transformers, path, load, trust_remote_code)
        else:
            self.processor = None
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(path, **common, **(
                {"gguf_file": gguf_file} if gguf_file else {}))
            self.model = transformers.AutoModelForCausalLM.from_pretrained(path, **load)
        if device != "auto":
            self.model.to(device)
        self.model.eval()
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self._torch = torch
        log.info("transformers: loaded %s (%s) in %.1f s", path, type(self.model).__name__, time.monotonic() - t0)

    @staticmethod
    def _load_vision(transformers, path: str, load: dict, trust_remote_code: bool):
        try:
            return transformers.AutoModelForImageTextToText.from_pretrained(path, **load)
        except ValueError:
            if not trust_remote_code:
                raise
        for cls in (transformers.AutoModelForCausalLM, transformers.AutoModel):  # remote-code checkpoints (NVILA)
            try:
                return cls.from_pretrained(path, **load)
            except ValueError:
                continue
        raise ValueError(f"{path}: no Auto class loads this checkpoint, even with trust_remote_code")

    # -- prompts ----------------------------------------------------------------------------------------------
    def _messages(self, req: Request) -> list[dict]:
        messages = [{"role": "system", "content": req.system}] if req.system else []
        if self.kind == "vision":
            content = ([{"type": "video"}] if req.frames is not None else []) + [{"type": "text", "text": req.text}]
            messages.append({"role": "user", "content": content})
        else:
            messages.append({"role": "user", "content": req.text})
        return messages

    def _inputs(self, reqs: list[Request]):
        templ = self.processor if self.kind == "vision" else self.tokenizer
        texts = [templ.apply_chat_template(self._messages(r), add_generation_prompt=True, tokenize=False)
                 for r in reqs]
        if self.kind == "text":
            return self.tokenizer(texts, return_tensors="pt", padding=True)
        with_video = [r for r in reqs if r.frames is not None]
        if with_video and len(with_video) != len(reqs):
            raise ValueError("a batch mixes requests with and without frames")
        if not with_video:
            return self.processor(text=texts, return_tensors="pt", padding=True)
        from transformers.video_utils import VideoMetadata

        metas = []
        for r in reqs:
            n, h, w = r.frames.shape[0], r.frames.shape[1], r.frames.shape[2]
            fps = r.fps or 1.0
            idx = r.frame_indices or [round(t * fps) for t in (r.timestamps or range(n))]
            metas.append(VideoMetadata(total_num_frames=n, fps=fps, frames_indices=list(idx), width=w, height=h,
                                       duration=(r.timestamps[-1] - r.timestamps[0] + 1 / fps) if r.timestamps
                                       else n / fps))
        return self.processor(text=texts, videos=[list(r.frames) for r in reqs], video_metadata=metas,
                              do_sample_frames=False, return_tensors="pt", padding=True)

    def _run(self, reqs: list[Request], params: GenerationParams, seed: int | None):
        torch = self._torch
        inputs = self._inputs(reqs).to(self.model.device)
        kw = {"max_new_tokens": params.max_new_tokens, "do_sample": not params.greedy}
        if not params.greedy:
            kw.update(temperature=params.temperature, top_p=params.top_p)
            torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(**inputs, **kw)
        new = out[:, inputs["input_ids"].shape[1]:]
        eos = set(self.model.generation_config.eos_token_id if isinstance(
            self.model.generation_config.eos_token_id, list) else [self.model.generation_config.eos_token_id])
        texts = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        finish = ["stop" if any(int(t) in eos for t in row) else "length" for row in new]
        return texts, finish

    def generate(self, requests: list[Request], params: GenerationParams) -> list[Generation]:
        if params.greedy:
            t0 = time.monotonic()
            texts, finish = self._run(requests, params, None)
            each = (time.monotonic() - t0) / len(requests)
            return [Generation(text=t.strip(), latency_s=each, finish_reason=f) for t, f in zip(texts, finish)]
        out = []
        for r in requests:  # sampled: one at a time, seeded per item
            t0 = time.monotonic()
            texts, finish = self._run([r], params, item_seed(params.seed, r.key))
            out.append(Generation(text=texts[0].strip(), latency_s=time.monotonic() - t0, finish_reason=finish[0]))
        return out

    def close(self) -> None:
        self.model = None
