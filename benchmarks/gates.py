"""Benchmark: the question quality gates on the CPU: their cost per 1,000 questions, and the share of
text-answerable questions of the demo corpus before and after the template writer's fix (issue 18 item 6).

Cost (``benchmarks/results/gates.json``): one SmolLM2-135M engine (transformers, float32, ``--threads``) answers the
questions of ``--after`` two ways, interleaved question by question so both share the machine's noise: the blind
filter's k samples (options rotated, JSON-schema constrained, scored with the trainer's rewards) and, as the
baseline, one greedy unconstrained answer to the same text-only prompt. Reported: seconds and tokens per question
of each, the blind/baseline ratio, and the projection to 1,000 questions; the balance step (a permutation per
question, no model) timed over 1,000 synthetic rows; the judge's verdict per question (captions in the prompt,
greedy, JSON-schema constrained) against the same greedy baseline. Model loading is outside every timing.

Leak (``benchmarks/results/blind_template_before_after.json``): the ``blind`` stage (``longreel blind``'s code
path) run on copies of two ``longreel curate --demo`` output directories, ``--before`` (made by the commit before
the fix) and ``--after`` (this commit), with two text-only answerers: SmolLM2 (the default blind model) and
:class:`longreel.testing.blind_probe.TimestampReader` (a rule that reads answers off time references: an upper
bound of what the timestamps leak).

    python benchmarks/gates.py --before DIR --after DIR [--k 8] [--threads 1] [--only-probe]

    python benchmarks/gates.py --shared [--k 8] [--k-shared 4] [--threads 1] [--work DIR] \
        [--shared-blind-set KEY=VALUE ...] [--shared-judge-set KEY=VALUE ...] [--summarize-only]

``--shared`` (``benchmarks/results/gates_shared.json``): the gates on the demo corpus and on all shared videos
(``$LONGREEL_SHARED_VIDEOS``, else ``../shared/videos``), SmolLM2 on the CPU as blind answerer and judge. Per corpus:
``longreel curate`` with the demo's weight-free captioner and template writer (``stages=[caption, qra]``), then
``longreel blind`` and ``longreel judge`` each on their own copy of that run (both see every question: the counts
per gate are on the same questions), and a ``stages=[]`` run for the dedup gate (exact and near-duplicate videos;
the questions of the videos it rejects are counted). Reported: counts per gate and reason, the blind pass-count
histogram, the released answer letters with their chi-square, each command's wall seconds per question (the
blind filter and the judge run side by side, so these are a shared machine's figures: the controlled cost per
1,000 questions is ``gates.json``), and the text-answerable share before/after the template fix as measured in
``blind_template_before_after.json``.

``--only-probe`` re-measures only the timestamp reader's entries of the leak file (no model, seconds) and keeps
the rest of it; ``--only-judge`` measures only the judge's cost (its verdict per question vs one greedy answer,
interleaved) into the cost file.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def _questions(run_dir: str) -> list[dict]:
    from longreel.pipelines.io.parquet_sink import read_table

    return sorted(read_table(run_dir, "qras").to_pylist(), key=lambda q: q["qra_id"])


def leak(label: str, run_dir: str, cfg, answerers: dict) -> dict:
    """The blind stage on a copy of ``run_dir`` with each answerer: counts and shares."""
    from longreel.pipelines.cli_blind import run_blind
    from longreel.pipelines.io.parquet_sink import read_table

    qras = {q["qra_id"]: q for q in _questions(run_dir)}
    out = {"questions": len(qras), "multiple_choice": sum(q["problem_type"] == "multiple_choice"
                                                          for q in qras.values()), "answerers": {}}
    for name, factory in answerers.items():
        with tempfile.TemporaryDirectory(prefix=f"gates-{label}-") as tmp:
            work = os.path.join(tmp, "run")
            shutil.copytree(run_dir, work)
            t0 = time.perf_counter()
            doc = run_blind(work, cfg, engine_factory=factory)
            wall = time.perf_counter() - t0
            rows = read_table(work, "blind").to_pylist()
        sec = doc["blind"]
        answerable = sorted(qras[r["qra_id"]]["question"][:80] for r in rows if r["text_answerable"])
        out["answerers"][name] = {"text_answerable": sec["text_answerable"], "scored": sec["scored"],
                                  "text_answerable_share": sec["text_answerable_share"],
                                  "pass_count_histogram": sec["pass_count_histogram"],
                                  "text_answerable_questions": answerable, "wall_s": round(wall, 1)}
    return out


def cost(questions: list[dict], cfg, engine) -> dict:
    """Seconds and tokens per question: blind filter vs one greedy unconstrained answer (interleaved)."""
    from longreel.engines.base import EngineRequest, Sampling
    from longreel.pipelines.gates import blind as G
    from longreel.pipelines.stages.passrate import sample_passes

    t = {"blind": [], "baseline": []}
    tok = {"blind": [0, 0, 0], "baseline": [0, 0, 0]}  # calls, input, output
    for q in questions:
        vs = G.views(q, cfg)
        base = EngineRequest(key=f"base:{q['qra_id']}", messages=vs[0].messages,
                             sampling=Sampling(max_new_tokens=cfg.max_new_tokens, temperature=0.0, n=1))
        t0 = time.perf_counter()
        c = engine.generate([base])
        t["baseline"].append(time.perf_counter() - t0)
        tok["baseline"] = [tok["baseline"][0] + 1, tok["baseline"][1] + c[0].prompt_tokens,
                           tok["baseline"][2] + c[0].new_tokens]
        t0 = time.perf_counter()
        cs = engine.generate(G.requests_for(q, vs, cfg))
        G.score_views(q, vs, cs, cfg, sample_passes)
        t["blind"].append(time.perf_counter() - t0)
        tok["blind"] = [tok["blind"][0] + len(cs), tok["blind"][1] + sum(x.prompt_tokens for x in cs),
                        tok["blind"][2] + sum(x.new_tokens for x in cs)]
    n = len(questions)
    out = {}
    for m in ("blind", "baseline"):
        s = sum(t[m])
        out[m] = {"seconds_per_question": round(s / n, 3), "seconds_per_1000_questions": round(1000 * s / n, 1),
                  "calls_per_question": round(tok[m][0] / n, 2), "input_tokens_per_question": round(tok[m][1] / n, 1),
                  "output_tokens_per_question": round(tok[m][2] / n, 1)}
    out["blind_over_baseline"] = round(out["blind"]["seconds_per_question"] / out["baseline"]["seconds_per_question"],
                                       2)
    return out


def judge_cost(run_dir: str, engine, threads: int) -> dict:
    """Seconds and tokens per question of the judge's verdict vs one greedy unconstrained answer to the question
    alone (interleaved), with the same engine."""
    from longreel.engines.base import EngineRequest, Sampling
    from longreel.pipelines.gates import blind as G
    from longreel.pipelines.gates import judge as J
    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.pipelines.judge_config import JudgeConfig

    cfg = JudgeConfig(threads=threads)
    captions = read_table(run_dir, "captions").to_pylist()
    t = {"judge": 0.0, "baseline": 0.0}
    tok = {"judge": [0, 0], "baseline": [0, 0]}
    questions = _questions(run_dir)
    for q in questions:
        caps = [c for c in captions if c["video_id"] == q["video_id"]]
        base = EngineRequest(key="base", messages=G.blind_messages(q["question"], q.get("options"),
                                                                   G.problem_type(q)),
                             sampling=Sampling(max_new_tokens=cfg.max_new_tokens, temperature=0.0))
        for name, req in (("baseline", base), ("judge", J.request_for(q, caps, cfg))):
            t0 = time.perf_counter()
            c = engine.generate([req])[0]
            if name == "judge":
                J.parse_verdict(c.text)
            t[name] += time.perf_counter() - t0
            tok[name] = [tok[name][0] + c.prompt_tokens, tok[name][1] + c.new_tokens]
    n = len(questions)
    out = {m: {"seconds_per_question": round(t[m] / n, 3), "seconds_per_1000_questions": round(1000 * t[m] / n, 1),
               "input_tokens_per_question": round(tok[m][0] / n, 1),
               "output_tokens_per_question": round(tok[m][1] / n, 1)} for m in t}
    out["judge_over_baseline"] = round(t["judge"] / t["baseline"], 2)
    return out


def balance_cost(n: int = 1000) -> dict:
    from longreel.pipelines.gates.options import balance
    from longreel.pipelines.qra.targets import make_target

    rows = []
    for i in range(n):
        r = f"Checking the video at [00:10-00:20]: option B is shown. So the answer is B."
        rows.append({"qra_id": f"{i:016x}", "problem_type": "multiple_choice", "options": ["w", "x", "y", "z"],
                     "answer": "B", "reasoning": r, "target": make_target(r, "B")})
    t0 = time.perf_counter()
    for r in rows:
        balance(r)
    return {"seconds_per_1000_questions": round((time.perf_counter() - t0) * 1000 / n, 4)}


def judge_only(args) -> int:
    from longreel.pipelines.blind_config import BlindConfig
    from longreel.pipelines.gates.blind import build_engine

    with open(args.out_cost) as fh:
        result = json.load(fh)
    engine = build_engine(BlindConfig(threads=args.threads))
    engine.setup()
    result["judge"] = {"commit": _git("rev-parse", "--short", "HEAD"), **judge_cost(args.after, engine, args.threads)}
    with open(args.out_cost, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result["judge"], indent=2))
    return 0


def probe_only(args) -> int:
    from longreel.pipelines.blind_config import BlindConfig
    from longreel.testing.blind_probe import TimestampReader

    with open(args.out_leak) as fh:
        leaks = json.load(fh)
    cfg = BlindConfig(k=args.k, threads=args.threads)
    for label, run_dir in (("before", args.before), ("after", args.after)):
        got = leak(label, run_dir, cfg, {"timestamp_reader": TimestampReader})
        leaks[label]["answerers"]["timestamp_reader"] = got["answerers"]["timestamp_reader"]
    leaks["timestamp_reader_commit"] = _git("rev-parse", "--short", "HEAD")
    with open(args.out_leak, "w") as fh:
        json.dump(leaks, fh, indent=2)
    print(json.dumps(leaks, indent=2))
    return 0


def _longreel(args: list[str]) -> float:
    """Run ``python -m longreel ARGS`` (an argument list, no shell) at low priority; return its wall seconds."""
    t0 = time.perf_counter()
    subprocess.run(["nice", "-n", "10", sys.executable, "-m", "longreel", "-q", *args], check=True, cwd=ROOT)
    return round(time.perf_counter() - t0, 1)


def corpus_commands(corpus: str, videos: str, work: str, k: int, threads: int, blind_sets: list[str] = (),
                    judge_sets: list[str] = ()) -> dict[str, list[str]]:
    """The ``longreel`` argument lists of one corpus' gate runs (``demo``: the embedded corpus); ``*_sets``: more
    ``--set`` overrides of the blind filter and the judge."""
    src = ["--demo"] if corpus == "demo" else [videos]
    base = os.path.join(work, corpus)
    demo_cfg = os.path.join(ROOT, "pipelines", "configs", "demo.yaml")
    return {"questions": ["curate", *src, "--out", base, "--config", demo_cfg, "--set", "stages=[caption, qra]",
                          "--workers", "1"],
            "dedup": ["curate", *src, "--out", base + "_dedup", "--set", "stages=[]", "--workers", "1"],
            "blind": ["blind", "--out", base + "_blind", "--set", f"threads={threads}", "--set", f"k={k}",
                      *[a for kv in blind_sets for a in ("--set", kv)]],
            "judge": ["judge", "--out", base + "_judge", "--set", f"threads={threads}",
                      *[a for kv in judge_sets for a in ("--set", kv)]]}


def run_corpus(cmds: dict[str, list[str]]) -> dict[str, float]:
    """The gate runs of one corpus, in order; the blind filter and the judge each on a copy of the questions' run."""
    wall = {"questions": _longreel(cmds["questions"]), "dedup": _longreel(cmds["dedup"])}
    base = cmds["questions"][cmds["questions"].index("--out") + 1]
    for gate in ("blind", "judge"):
        out = cmds[gate][cmds[gate].index("--out") + 1]
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(base, out)
        wall[gate] = _longreel(cmds[gate])
    return wall


def summarize_corpus(base: str, dedup: str, blind: str, judge: str, wall: dict | None = None) -> dict:
    """Counts per gate of one corpus from its run directories (see :func:`corpus_commands`)."""
    from longreel.pipelines.card.build import answer_letters
    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.pipelines.stats import read_json

    qras = _questions(base)
    st_dedup = {s["stage"]: s for s in read_json(os.path.join(dedup, "stats.json"))["stages"]}["dedup"]
    dup_rejects = [r for r in read_table(dedup, "rejects").to_pylist() if r["stage"] == "dedup"]
    dup_ids = {r["video_id"] for r in dup_rejects}
    bl = (read_json(os.path.join(blind, "stats.json")) or {}).get("blind")  # None: the run did not finish
    jd = (read_json(os.path.join(judge, "stats.json")) or {}).get("judge")
    from longreel.task.prompting import OPTION_LETTERS

    mc = [q for q in qras if q["problem_type"] == "multiple_choice"]
    letters = {L: 0 for L in OPTION_LETTERS[:max([len(q["options"]) for q in mc] or [0])]}
    for q in mc:
        letters[q["answer"]] += 1
    n = len(qras)
    out = {"questions": n, "multiple_choice": sum(letters.values()),
           "dedup": {"videos_in": st_dedup["in"], "kept": st_dedup["out"], "rejected": st_dedup["rejected"],
                     "near_duplicates": sorted([os.path.basename(r["key"]),
                                                os.path.basename(json.loads(r["details"])["kept"])]
                                               for r in dup_rejects if r["reason"] == "near_duplicate"),
                     "questions_of_rejected_videos": sum(q["video_id"] in dup_ids for q in qras)},
           "blind": {"k": bl["k"], "scored": bl["scored"], "text_answerable": bl["text_answerable"],
                     "text_answerable_share": bl["text_answerable_share"], "kept": bl["kept"],
                     "failed_by_reason": bl["failed_by_reason"], "pass_count_histogram": bl["pass_count_histogram"],
                     "answerer": bl["answerer"]["answerer"], "answerer_revision": bl["answerer"]["answerer_revision"]}
           if bl else None,
           "judge": {"questions_in": jd["questions_in"], "kept": jd["kept"],
                     "rejected_by_reason": jd["rejected_by_reason"], "failed_by_check": jd["failed_by_check"],
                     "judge": jd["judge"]["judge"], "prompt_hash": jd["judge"]["prompt_hash"]} if jd else None,
           "answer_letters": answer_letters({"released_mc_answer": {"counts": letters}}) if mc else None}
    if wall:
        out["wall_s"] = wall
        out["wall_s_per_1000_questions"] = {g: round(1000 * wall[g] / n, 1) for g in ("blind", "judge") if g in wall}
    return out


def before_after(path: str) -> dict:
    """The text-answerable share before/after the template fix, as ``blind_template_before_after.json`` has it."""
    with open(path) as fh:
        doc = json.load(fh)
    return {"source": os.path.relpath(path, ROOT), "commit": doc["commit"], "k": doc["k"],
            **{f"{label}_{name}": {"questions": doc[label]["questions"],
                                   "text_answerable": a["text_answerable"],
                                   "text_answerable_share": a["text_answerable_share"]}
               for label in ("before", "after") for name, a in doc[label]["answerers"].items()}}


def shared_mode(args) -> int:
    """``--shared``: run (or, with ``--summarize-only``, read) each corpus' gate runs under ``--work``."""
    videos = os.environ.get("LONGREEL_SHARED_VIDEOS") or os.path.join(os.path.dirname(ROOT), "shared", "videos")
    result = {"benchmark": "gates_shared", "machine": platform.machine(), "cpus": os.cpu_count(),
              "python": platform.python_version(), "commit": _git("rev-parse", "--short", "HEAD"),
              "threads": args.threads, "corpora": {}}
    for corpus, k in (("demo", args.k), ("shared_videos", args.k_shared or args.k)):
        shared = corpus != "demo"
        cmds = corpus_commands("shared" if shared else "demo", videos, args.work, k, args.threads,
                               args.shared_blind_set if shared else (), args.shared_judge_set if shared else ())
        wall = None if args.summarize_only else run_corpus(cmds)
        dirs = [c[c.index("--out") + 1] for c in (cmds["questions"], cmds["dedup"], cmds["blind"], cmds["judge"])]
        result["corpora"][corpus] = {"commands": {g: "longreel " + " ".join(c) for g, c in cmds.items()},
                                     **summarize_corpus(*dirs, wall=wall)}
    result["template_fix"] = before_after(args.out_leak)
    with open(args.out_cost) as fh:
        cost_doc = json.load(fh)
    result["cost_per_1000_questions_s"] = {
        "source": os.path.relpath(args.out_cost, ROOT),
        "machine": f"{cost_doc['cpus']} CPUs, {cost_doc['threads']} thread",
        "blind": cost_doc["blind"]["blind"]["seconds_per_1000_questions"],
        "blind_over_one_greedy_answer": cost_doc["blind"]["blind_over_baseline"],
        "judge": cost_doc["judge"]["judge"]["seconds_per_1000_questions"],
        "judge_over_one_greedy_answer": cost_doc["judge"]["judge_over_baseline"],
        "balance": cost_doc["balance"]["seconds_per_1000_questions"]}
    if args.note:
        result["note"] = args.note
    with open(args.out_shared, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))
    return 0


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="`longreel curate --demo` output of the commit before the fix")
    ap.add_argument("--before-commit", default="467f2c7", help="the commit that made --before (recorded)")
    ap.add_argument("--after", help="`longreel curate --demo` output of this commit")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-cost", default=os.path.join(HERE, "results", "gates.json"))
    ap.add_argument("--out-leak", default=os.path.join(HERE, "results", "blind_template_before_after.json"))
    ap.add_argument("--only-probe", action="store_true", help="re-measure only the timestamp reader's entries")
    ap.add_argument("--only-judge", action="store_true", help="measure only the judge's cost into --out-cost")
    ap.add_argument("--shared", action="store_true", help="the gates on the demo corpus and all shared videos")
    ap.add_argument("--k-shared", type=int, help="--shared: k of the blind filter on the shared videos (default --k)")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "gates-shared"),
                    help="--shared: directory of the runs")
    ap.add_argument("--summarize-only", action="store_true",
                    help="--shared: read the runs already in --work (made by the commands it records)")
    ap.add_argument("--shared-blind-set", action="append", default=[], metavar="KEY=VALUE",
                    help="--shared: a blind config override for the shared videos only (repeatable)")
    ap.add_argument("--shared-judge-set", action="append", default=[], metavar="KEY=VALUE",
                    help="--shared: a judge config override for the shared videos only (repeatable)")
    ap.add_argument("--note", help="--shared: a note recorded in the result (how the runs were made)")
    ap.add_argument("--out-shared", default=os.path.join(HERE, "results", "gates_shared.json"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.shared:
        return shared_mode(args)
    if not (args.before and args.after):
        ap.error("--before and --after are required (except with --shared)")
    if args.only_probe:
        return probe_only(args)
    if args.only_judge:
        return judge_only(args)

    from longreel.pipelines.blind_config import BlindConfig
    from longreel.pipelines.gates.blind import build_engine
    from longreel.testing.blind_probe import TimestampReader

    cfg = BlindConfig(k=args.k, threads=args.threads)
    engine = build_engine(cfg)
    engine.setup()
    env = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "commit": _git("rev-parse", "--short", "HEAD"), "k": args.k, "threads": args.threads,
           "answerer": engine.model, "answerer_revision": engine.revision}
    result = {"benchmark": "gates", **env, "questions": "the demo corpus' questions (--after)",
              "blind": cost(_questions(args.after), cfg, engine), "balance": balance_cost(),
              "judge": judge_cost(args.after, engine, args.threads)}
    with open(args.out_cost, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))

    answerers = {"smollm2": lambda: build_engine(cfg), "timestamp_reader": TimestampReader}
    leaks = {"benchmark": "blind_template_before_after", **env,
             "before": {"commit": args.before_commit, **leak("before", args.before, cfg, answerers)},
             "after": {"commit": env["commit"], **leak("after", args.after, cfg, answerers)}}
    with open(args.out_leak, "w") as fh:
        json.dump(leaks, fh, indent=2)
    print(json.dumps(leaks, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
