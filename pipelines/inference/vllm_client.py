"""In-process vLLM client (GPU): Qwen2.5-VL / Qwen3-VL with video given as frames plus metadata.

``vllm`` is imported only when a client is built, so the rest of longreel works without it.
The prompt is rendered by the checkpoint's own processor chat template (one ``{"type": "video"}``
item), and the frames go in as ``multi_modal_data={"video": (frames, metadata)}`` where
``frames`` is ``uint8 [N, H, W, 3]`` already sampled and resized by the stage and ``metadata``
states fps, the source frame indices and ``do_sample_frames=False``; ``mm_processor_kwargs``
repeats ``do_sample_frames=False`` so vLLM's HF processor neither re-samples nor re-times the
frames (Qwen3-VL puts the timestamps into the prompt from this metadata).

Every request carries its own sampling seed (``item_seed``), so sampled captions are
reproducible whatever the batching. Text-only requests (``frames=None``) work too (QRA).
Checked on a GPU with ``scripts/gpu_check_caption_vllm.py``; never run in CI.
"""
from __future__ import annotations

import logging
import time

from longreel.pipelines.inference.base import Generation, GenerationParams, ModelInfo, Request, item_seed, weights_revision

log = logging.getLogger("longreel")


def video_metadata(req: Request) -> dict:
    n = int(req.frames.shape[0])
    fps = float(req.fps or 1.0)
    idx = list(req.frame_indices or [round(t * fps) for t in (req.timestamps or range(n))])
    return {"fps": fps, "frames_indices": idx, "total_num_frames": max(idx) + 1 if idx else n,
            "duration": (max(idx) + 1) / fps if idx else n / fps, "video_backend": "pyav",
            "do_sample_frames": False, "width": int(req.frames.shape[2]), "height": int(req.frames.shape[1])}


class VLLMClient:
    def __init__(self, path: str, *, revision: str | None = None, trust_remote_code: bool = False,
                 dtype: str = "auto", tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.85,
                 max_model_len: int = 32768, enforce_eager: bool = False, seed: int = 0):
        try:
            import vllm
        except ImportError as e:  # the GPU stack is an extra: pip install 'longreel[gpu]'
            raise RuntimeError("the vllm backend needs the vllm package on a GPU machine "
                               "(pip install 'longreel[gpu]')") from e
        from transformers import AutoProcessor

        t0 = time.monotonic()
        self._vllm = vllm
        self.processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.llm = vllm.LLM(model=path, revision=None, trust_remote_code=trust_remote_code, dtype=dtype,
                            tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                            max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
                            limit_mm_per_prompt={"video": 1, "image": 0})
        self.info = ModelInfo("vllm", path, weights_revision(path, revision))
        log.info("vllm: loaded %s in %.1f s", path, time.monotonic() - t0)

    def _prompt(self, req: Request) -> dict:
        messages = [{"role": "system", "content": req.system}] if req.system else []
        content = ([{"type": "video"}] if req.frames is not None else []) + [{"type": "text", "text": req.text}]
        messages.append({"role": "user", "content": content})
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = {"prompt": text}
        if req.frames is not None:
            prompt["multi_modal_data"] = {"video": (req.frames, video_metadata(req))}
            prompt["mm_processor_kwargs"] = {"do_sample_frames": False}
        return prompt

    def generate(self, requests: list[Request], params: GenerationParams) -> list[Generation]:
        sp = [self._vllm.SamplingParams(max_tokens=params.max_new_tokens, temperature=params.temperature,
                                        top_p=params.top_p if not params.greedy else 1.0,
                                        seed=item_seed(params.seed, r.key)) for r in requests]
        t0 = time.monotonic()
        outs = self.llm.generate([self._prompt(r) for r in requests], sampling_params=sp, use_tqdm=False)
        each = (time.monotonic() - t0) / max(1, len(requests))
        return [Generation(text=o.outputs[0].text.strip(), latency_s=each, finish_reason=o.outputs[0].finish_reason)
                for o in outs]

    def close(self) -> None:
        self.llm = None
