"""What a policy writes in its traces on the synthetic time kinds: does it read the frames, and does it apply the rule?

With ``--reasoning trace`` every time kind's CoT target lists what the frames show (direction: the ball's column in
each frame; count_colours: its colour in each frame; ...), and the answer follows from those words by a fixed rule
(``synthetic_task.answer_from_trace``). Held-out accuracy alone cannot tell a policy that does not read the frames
from one that reads them and does not apply the rule; this benchmark can. For each checkpoint and kind it greedy-
decodes ``learn.py``'s held-out set of the seed and reports:

* ``accuracy``: the answer's, as ``learn.py`` scores it;
* ``trace_word_accuracy``: per position, the share of items whose word there is the true trace's (chance: 1/4 for
  a colour or a column, 1/16 for a cell, 1/2 for a size);
* ``well_formed``: the share of traces the kind's rule can be applied to;
* ``answer_follows_own_trace``: of those, the share whose answer is the one the model's own trace implies.

Diagnostics D33-D35 (``results/learn_time_trials.json``) come from this measure: T12's SFT models do not read
direction's columns (at chance), a 1,200-step SFT does, and GRPO from it still does not learn the rule.

    python benchmarks/learn_reads.py --checkpoints WORK/sft1/final,WORK/grpo1/final --seeds 1 \\
        --kinds order,count_colours,direction,change --reasoning trace --max-new-tokens 24 --temporal-patch 1 \\
        --spatial-merge 8 --eval-items 200 --out /tmp/reads.json

Pass the build options of the run that made the checkpoints (``--temporal-patch``, ``--spatial-merge``, frame
options): they fix the held-out videos' vision grid, which the loader checks against the policy's. A checkpoint is
a policy directory: a run's ``final`` or one of its ``checkpoints/step-N`` (which carry the config and processor).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import learn  # noqa: E402  (puts the repository on sys.path)

from longreel.task.rewards.extract import extract_answer_text  # noqa: E402
from longreel.trainer.eval import evaluate  # noqa: E402
from longreel.trainer.policy import load_policy  # noqa: E402
from longreel.trainer.synthetic_task import TIME_KINDS, answer_from_trace, trace_words  # noqa: E402


def trace_reads(rows: list[dict]) -> dict:
    """Per kind, the reads of a set of decoded items. ``rows``: ``{"kind", "target", "options", "output",
    "accuracy"}`` each (``target`` the item's CoT target, ``output`` the model's response). Only the time kinds
    are counted (the others have no trace)."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["kind"] not in TIME_KINDS:
            continue
        truth, got = trace_words(r["target"]), trace_words(r["output"]) or []
        s = out.setdefault(r["kind"], {"n": 0, "accuracy": 0.0, "hits": [0] * len(truth), "well_formed": 0,
                                       "follows": 0})
        s["n"] += 1
        s["accuracy"] += r["accuracy"]
        for i, word in enumerate(truth):
            s["hits"][i] += int(i < len(got) and got[i] == word)
        implied = answer_from_trace(r["kind"], got, r["options"])
        if implied is not None:
            s["well_formed"] += 1
            s["follows"] += int(implied == extract_answer_text(r["output"]))
    return {kind: {"n": s["n"], "accuracy": s["accuracy"] / s["n"],
                   "trace_word_accuracy": [h / s["n"] for h in s["hits"]],
                   "well_formed": s["well_formed"] / s["n"],
                   "answer_follows_own_trace": s["follows"] / s["well_formed"] if s["well_formed"] else None}
            for kind, s in sorted(out.items())}


def decode_rows(checkpoint: str, held_out: list[dict], max_new_tokens: int) -> list[dict]:
    """Greedy outputs of ``checkpoint`` on ``held_out`` (loaded items, which carry their CoT ``target``) as
    :func:`trace_reads` rows."""
    model, processor = load_policy(checkpoint)
    model.eval()
    result = evaluate(model, processor, held_out, max_new_tokens=max_new_tokens, keep_outputs=True)
    by_key = {item["key"]: item for item in held_out}
    rows = []
    for o in result["outputs"]:
        item = by_key[o["key"]]
        rows.append({"kind": item["category"], "target": item["target"], "options": item["options"],
                     "output": o["output"], "accuracy": o["accuracy"]})
    return rows


def build_parser() -> argparse.ArgumentParser:
    """What decides the held-out items and the decoding: ``learn.py``'s item and build options, the same definitions,
    so the build part of a run's command line carries over (of the build options only ``--temporal-patch`` changes
    the held-out shards), and none of its training options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", required=True,
                   help="policy directories, comma-separated: a run's final/ or any checkpoints/step-N/")
    learn.add_item_options(p, train=False)
    learn.add_build_options(p)
    learn.add_max_new_tokens(p)
    p.add_argument("--work", default="", help="where the held-out shards are written (default: a temp dir)")
    p.add_argument("--out", default="", help="write the reads as JSON here (default: print only)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    seed = int(args.seeds.split(",")[0])
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="longreel-reads-"))
    held_out = learn.held_out_items(seed, args, work)
    doc = {"benchmark": "learn_reads", "seed": seed, "eval_items": args.eval_items,
           "command": "python " + " ".join(["benchmarks/learn_reads.py"] + list(argv if argv is not None
                                                                               else sys.argv[1:])),
           "checkpoints": {}}
    for ck in args.checkpoints.split(","):
        reads = trace_reads(decode_rows(ck, held_out, args.max_new_tokens))
        doc["checkpoints"][ck] = reads
        for kind, r in reads.items():
            follows = "-" if r["answer_follows_own_trace"] is None else f"{r['answer_follows_own_trace']:.2f}"
            print(f"{ck} {kind:13s} accuracy {r['accuracy']:.2f}  words "
                  f"{' '.join(f'{w:.2f}' for w in r['trace_word_accuracy'])}  well-formed {r['well_formed']:.2f}  "
                  f"answer follows own trace {follows}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
