"""Captioning over any engine of :mod:`longreel.engines`: a clip's :class:`Request` becomes an engine request and
the completion a :class:`Generation`.

The prompt is one user turn (after the optional system prompt) holding the video and then the text; the frames go
with the metadata the stage decoded them under (fps, source frame indices, their time span), so the model's
processor neither re-samples nor re-times them. A sampled caption is drawn under its clip's own seed
(``item_seed(params.seed, request.key)``): the same caption whatever batch the clip lands in, on every engine.
"""
from __future__ import annotations

from longreel.engines.base import Engine, EngineRequest, Sampling, Video
from longreel.pipelines.inference.base import Generation, GenerationParams, ModelInfo, Request, item_seed


def clip_video(req: Request) -> Video:
    """The processor's view of a clip's frames: their source indices (from the timestamps when not given) and the
    span they cover (first to last timestamp plus one frame)."""
    n = int(req.frames.shape[0])
    fps = float(req.fps or 1.0)
    idx = list(req.frame_indices or [round(t * fps) for t in (req.timestamps or range(n))])
    duration = (req.timestamps[-1] - req.timestamps[0] + 1 / fps) if req.timestamps else n / fps
    return Video(frames=req.frames, fps=fps, frame_indices=[int(i) for i in idx], total_frames=n,
                 duration_s=float(duration))


def engine_request(req: Request, params: GenerationParams) -> EngineRequest:
    messages = [{"role": "system", "content": req.system}] if req.system else []
    video = clip_video(req) if req.frames is not None else None
    content = ([{"type": "video"}] if video is not None else []) + [{"type": "text", "text": req.text}]
    messages.append({"role": "user", "content": content})
    sampling = Sampling(max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                        seed=item_seed(params.seed, req.key))
    return EngineRequest(key=req.key, messages=messages, video=video, sampling=sampling)


class EngineCaptioner:
    """A caption client (``generate(requests, params) -> [Generation]``) over an engine."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.info = ModelInfo(engine.backend, engine.model, engine.revision)

    def generate(self, requests: list[Request], params: GenerationParams) -> list[Generation]:
        out = []
        for c in self.engine.generate([engine_request(r, params) for r in requests]):
            if c.ok:
                out.append(Generation(text=c.text.strip(), latency_s=c.latency_s,
                                      finish_reason=c.finish[0] if c.finish else None, attempts=c.attempts,
                                      prompt_tokens=c.prompt_tokens, vision_tokens=c.vision_tokens,
                                      output_tokens=c.new_tokens))
            else:
                out.append(Generation.failed(c.error_reason, c.error_message or "", c.latency_s, c.attempts))
        return out

    def close(self) -> None:
        self.engine.close()
