"""Loading the last stages' slow, model-free setup ahead (``longreel.pipelines.curate.warm_tail``): once per worker,
in a background thread, when the worker's decode bundle ends; and the tokenizer it loads is loaded once per process
even when the stage asks for it while the warm-up is still loading it (transformers' tokenizer, where the QRA
counter needs it: longreel.engines.chat_count)."""
import threading

from longreel.engines import chat_count, local_models
from longreel.pipelines.caption_config import CaptionConfig
from longreel.pipelines.config import CurateConfig
from longreel.pipelines.curate import warm_tail
from longreel.pipelines.stages.caption import DecodeClipFrames


def test_after_decode_runs_once_per_worker_in_a_background_thread():
    ran, done = [], threading.Event()

    def after():
        ran.append(threading.current_thread().name)
        done.set()

    fn = DecodeClipFrames(CaptionConfig(), (50176, 28, 3136), keep_frames=False, after_decode=after)
    fn.finish_bundle()
    assert done.wait(30)
    fn.finish_bundle()  # a runner that cuts the stage into several bundles: still once
    assert ran == ["after-decode"]


def test_a_failing_warm_up_does_not_reach_the_bundle(caplog):
    failed = threading.Event()

    def boom():
        failed.set()
        raise RuntimeError("no tokenizer here")

    fn = DecodeClipFrames(CaptionConfig(), (50176, 28, 3136), keep_frames=False, after_decode=boom)
    fn.finish_bundle()  # does not raise
    assert failed.wait(30)
    DecodeClipFrames(CaptionConfig(), (50176, 28, 3136), keep_frames=False).finish_bundle()  # none: nothing runs


def test_two_threads_asking_for_a_tokenizer_load_it_once():
    local_models._cached_generic_tokenizer.cache_clear()
    barrier, got = threading.Barrier(2), []

    def load():
        barrier.wait()
        got.append(local_models.load_generic_tokenizer("smollm2"))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == 2 and got[0] is got[1]
    assert local_models._cached_generic_tokenizer.cache_info().misses == 1


def test_warm_tail_loads_the_qra_counters_tokenizer():
    local_models.load_tokenizer("smollm2")  # the GGUF tokenizer converted once, as the first run on a machine does
    chat_count._cached_counter.cache_clear()
    local_models._cached_generic_tokenizer.cache_clear()
    warm_tail(CurateConfig(stages=["caption", "qra"], qra={"backend": "template"}))
    assert chat_count._cached_counter.cache_info().currsize == 1
    from longreel.pipelines.qra.generate import TokenCounter
    TokenCounter("smollm2")  # what the stage's setup builds: served from the cache
    assert chat_count._cached_counter.cache_info().hits == 1
    assert local_models._cached_generic_tokenizer.cache_info().currsize == 0  # transformers' was not needed
    chat_count._cached_counter.cache_clear()
    warm_tail(CurateConfig(stages=["caption"]))  # no QRA stage: nothing to load
    assert chat_count._cached_counter.cache_info().currsize == 0
