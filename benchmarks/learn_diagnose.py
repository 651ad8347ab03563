"""Why does (or doesn't) the ``learn`` benchmark learn? Cheap probes of the SFT checkpoint (and a short GRPO run).

For each seed, with the settings of ``benchmarks/learn.py`` (same argparse options, same defaults), this builds the
tiny random policy, runs the benchmark's CoT-SFT stage, and measures on held-out items:

* ``greedy``: per true colour, the greedy answer letters and the colour word written in ``<think>``;
* ``sampled``: the same at the rollout temperature (``--samples`` per item), whether the think colour and the
  answer letter agree, the per-item probability of a correct answer and the fraction of groups of ``--group``
  rollouts whose rewards would all tie (no GRPO signal);
* ``teacher_forced``: P(colour word | prompt + "<think>The ball is") per true colour (does the LM read the video?)
  and P(answer letter | "... The ball is c.</think><answer>") per written colour c (does the answer follow the
  think?);
* ``probes``: linear separability of the colour (4 classes and red/green/blue only), 5-fold cross-validated
  nearest-centroid and L2 logistic regression, on (a) the mean-pooled vision-merger output (what the LM gets)
  and (b) the LM's last hidden state where it must write the colour word; at random init, after SFT, and after
  the short GRPO run;
* ``grad``: one GRPO-style policy-gradient step at the SFT checkpoint (``--grad-items`` prompts x ``--group``
  rollouts, group-normalised advantages, token-mean loss): gradient norm per module group;
* ``grpo_probe``: ``--grpo-probe-steps`` GRPO steps with the benchmark settings: the metrics.jsonl statistics
  (reward, clip fraction, grad norm, skipped updates) and the probes/greedy answers after them.

    python benchmarks/learn_diagnose.py --seeds 0,1 --out benchmarks/results/learn_diagnose.json

Any learn.py option (``--sft-lr``, ``--hidden-size``, ...) changes the configuration diagnosed.
"""
from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

import learn as L  # noqa: E402
from longreel.trainer import algorithms as A  # noqa: E402
from longreel.trainer.grpo import run_grpo  # noqa: E402
from longreel.trainer.logging_utils import read_metrics  # noqa: E402
from longreel.trainer.policy import encode_prompt, encode_video, load_policy, sequence_logprobs, video_token_id  # noqa: E402
from longreel.task.rewards import score  # noqa: E402
from longreel.trainer.rollout import SamplingConfig, TransformersEngine  # noqa: E402
from longreel.trainer.sft import run_sft  # noqa: E402
from longreel.trainer.synthetic_task import COLOURS  # noqa: E402

NAMES = list(COLOURS)
LETTER = dict(zip(NAMES, "ABCD"))
_ANS = re.compile(r"<answer>\s*([A-D])")
_THINK = re.compile(r"ball is (\w+)")


def _colour(item) -> str:
    return NAMES["ABCD".index(item["answer"])]


def _parse(text: str) -> tuple[str, str]:
    a, t = _ANS.search(text), _THINK.search(text)
    return (a.group(1) if a else "-"), (t.group(1) if t else "-")


def _dist(counter: Counter) -> dict:
    n = sum(counter.values()) or 1
    return {k: round(v / n, 3) for k, v in sorted(counter.items())}


# ----------------------------------------------------------------------------------------------- answers
@torch.no_grad()
def answers(model, processor, items, *, samples: int, temperature: float, group: int, seed: int) -> dict:
    engine = TransformersEngine(model, processor)
    vt = video_token_id(model)
    greedy_cfg = SamplingConfig(n=1, max_new_tokens=16, greedy=True)
    samp_cfg = SamplingConfig(n=samples, max_new_tokens=16, temperature=temperature)
    g_ans, g_think = defaultdict(Counter), defaultdict(Counter)
    s_ans, s_think = defaultdict(Counter), defaultdict(Counter)
    agree = Counter()
    p_item, tied, correct_g = [], [], []
    for k, item in enumerate(items):
        prompt = encode_prompt(processor, item, video_token_id=vt)
        emb = encode_video(model, prompt)
        c = _colour(item)
        text = engine.generate([prompt], greedy_cfg, [0], video_embeds=[emb])[0].texts[0]
        a, t = _parse(text)
        g_ans[c][a] += 1
        g_think[c][t] += 1
        correct_g.append(a == item["answer"])
        texts = engine.generate([prompt], samp_cfg, [1000 * seed + k], video_embeds=[emb])[0].texts
        rewards = []
        for text in texts:
            a, t = _parse(text)
            s_ans[c][a] += 1
            s_think[c][t] += 1
            agree["agree" if t in LETTER and LETTER[t] == a else ("no_think_colour" if t not in LETTER else
                                                                  "disagree")] += 1
            rewards.append(score(text, item["problem_type"], item["answer"], item.get("options")).reward)
        p = sum(rewards) / len(rewards)
        p_item.append(p)
        # chance that `group` independent rollouts all tie (all right or all wrong) for this item
        tied.append(p ** group + (1 - p) ** group)
    by = lambda d: {c: _dist(d[c]) for c in NAMES if c in d}  # noqa: E731
    return {
        "greedy_accuracy": sum(correct_g) / len(correct_g),
        "greedy_answer_by_colour": by(g_ans), "greedy_think_by_colour": by(g_think),
        "sampled_accuracy": sum(p_item) / len(p_item),
        "sampled_answer_by_colour": by(s_ans), "sampled_think_by_colour": by(s_think),
        "sampled_think_answer_agreement": _dist(agree),
        "sampled_p_correct_by_colour": {c: round(sum(p for p, it in zip(p_item, items) if _colour(it) == c)
                                                 / max(1, sum(_colour(it) == c for it in items)), 3) for c in NAMES},
        "expected_tied_group_fraction": sum(tied) / len(tied),
    }


# ----------------------------------------------------------------------------------------------- teacher forcing
@torch.no_grad()
def teacher_forced(model, processor, items) -> dict:
    tok = processor.tokenizer
    vt = video_token_id(model)
    col_ids = {c: tok(" " + c, add_special_tokens=False)["input_ids"] for c in NAMES}
    col_ids_nospace = {c: tok(c, add_special_tokens=False)["input_ids"] for c in NAMES}
    letter_ids = {L_: tok(L_, add_special_tokens=False)["input_ids"][0] for L_ in "ABCD"}
    prefix = tok("<think>The ball is", add_special_tokens=False)["input_ids"]
    first = {c: col_ids[c][0] for c in NAMES}
    colour_p = defaultdict(lambda: torch.zeros(4))
    letter_p = defaultdict(lambda: torch.zeros(4))
    n_by = Counter()
    for item in items:
        prompt = encode_prompt(processor, item, video_token_id=vt)
        emb = encode_video(model, prompt)
        c = _colour(item)
        n_by[c] += 1
        # P(first token of the colour word | prompt + "<think>The ball is")
        ids = torch.tensor([prefix + [first[NAMES[0]]]])
        logp = _next_logprobs(model, prompt, ids, emb)  # [T, V]
        colour_p[c] += torch.softmax(logp[len(prefix) - 1][[first[x] for x in NAMES]], -1)
        # P(letter | "... The ball is w.</think><answer>") for each written colour w
        for w in NAMES:
            ids = tok(f"<think>The ball is {w}.</think><answer>", add_special_tokens=False)["input_ids"]
            lp = _next_logprobs(model, prompt, torch.tensor([ids + [letter_ids['A']]]), emb)
            letter_p[w] += torch.softmax(lp[len(ids) - 1][[letter_ids[x] for x in "ABCD"]], -1)
    colour_mat = {c: {x: round(float(v), 3) for x, v in zip(NAMES, colour_p[c] / n_by[c])} for c in NAMES if n_by[c]}
    letter_mat = {w: {x: round(float(v), 3) for x, v in zip("ABCD", letter_p[w] / len(items))} for w in NAMES}
    follows = sum(letter_mat[w][LETTER[w]] for w in NAMES) / 4
    return {"p_colour_word_given_true_colour": colour_mat, "p_letter_given_written_colour": letter_mat,
            "answer_follows_think": round(follows, 3),
            "colour_word_tokens": {c: col_ids[c] for c in NAMES}, "colour_word_tokens_nospace": col_ids_nospace}


def _next_logprobs(model, prompt, response_ids, emb):
    """log-softmax over the vocabulary at each response position (row t predicts response token t+1)."""
    n, t = response_ids.shape
    ids = torch.cat([prompt.input_ids, response_ids], dim=1)
    attn = torch.ones_like(ids)
    kw = {}
    if prompt.mm_token_type_ids is not None:
        kw["mm_token_type_ids"] = torch.cat([prompt.mm_token_type_ids, prompt.mm_token_type_ids.new_zeros(1, t)], 1)
    out = model(input_ids=ids, attention_mask=attn, video_grid_thw=prompt.video_grid_thw,
                mm_encoder_outputs=emb.as_mm_encoder_outputs(1), use_cache=False, **kw)
    return torch.log_softmax(out.logits[0, prompt.length:, :].float(), -1)


# ----------------------------------------------------------------------------------------------- probes
@torch.no_grad()
def features(model, processor, items) -> dict[str, torch.Tensor]:
    tok = processor.tokenizer
    vt = video_token_id(model)
    prefix = tok("<think>The ball is", add_special_tokens=False)["input_ids"]
    vis, lm = [], []
    for item in items:
        prompt = encode_prompt(processor, item, video_token_id=vt)
        emb = encode_video(model, prompt)
        vis.append(emb.features.mean(0))
        ids = torch.cat([prompt.input_ids, torch.tensor([prefix])], dim=1)
        kw = {}
        if prompt.mm_token_type_ids is not None:
            kw["mm_token_type_ids"] = torch.cat([prompt.mm_token_type_ids,
                                                 prompt.mm_token_type_ids.new_zeros(1, len(prefix))], 1)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), video_grid_thw=prompt.video_grid_thw,
                    mm_encoder_outputs=emb.as_mm_encoder_outputs(1), use_cache=False, output_hidden_states=True,
                    **kw)
        lm.append(out.hidden_states[-1][0, -1])
    return {"vision_merger_meanpool": torch.stack(vis), "lm_hidden_at_colour_word": torch.stack(lm)}


def _logreg(x, y, xt, k, l2=1e-2, iters=200):
    w = torch.zeros(x.shape[1], k, requires_grad=True)
    b = torch.zeros(k, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w + b, y) + l2 * w.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return (xt @ w + b).argmax(-1)


def probe(x: torch.Tensor, labels: list[str], folds: int = 5) -> dict:
    classes = sorted(set(labels))
    y = torch.tensor([classes.index(c) for c in labels])
    n = len(y)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    hits = {"nearest_centroid": 0, "logistic": 0}
    for f in range(folds):
        te = perm[f * n // folds:(f + 1) * n // folds]
        tr = torch.cat([perm[:f * n // folds], perm[(f + 1) * n // folds:]])
        mu, sd = x[tr].mean(0), x[tr].std(0) + 1e-6
        xs, xts = (x[tr] - mu) / sd, (x[te] - mu) / sd
        cent = torch.stack([xs[y[tr] == c].mean(0) if (y[tr] == c).any() else torch.full((x.shape[1],), 1e9)
                            for c in range(len(classes))])
        hits["nearest_centroid"] += int((torch.cdist(xts, cent).argmin(-1) == y[te]).sum())
        hits["logistic"] += int((_logreg(xs, y[tr], xts, len(classes)) == y[te]).sum())
    # without standardisation (which blows tiny, output-irrelevant differences up to unit scale): nearest centroid
    # on the raw features, and the raw centroid distance over the raw within-class spread
    raw_hits = 0
    for f in range(folds):
        te = perm[f * n // folds:(f + 1) * n // folds]
        tr = torch.cat([perm[:f * n // folds], perm[(f + 1) * n // folds:]])
        cent = torch.stack([x[tr][y[tr] == c].mean(0) for c in range(len(classes))])
        raw_hits += int((torch.cdist(x[te], cent).argmin(-1) == y[te]).sum())
    rc = torch.stack([x[y == c].mean(0) for c in range(len(classes))])
    rw = torch.stack([(x[y == c] - rc[c]).pow(2).sum(-1).mean() for c in range(len(classes))]).mean().sqrt()
    raw = {"raw_nearest_centroid": round(raw_hits / n, 3),
           "raw_min_centroid_dist_over_within_rms": round(float(torch.pdist(rc).min() / rw), 3),
           "raw_min_centroid_dist_over_feature_norm": round(float(torch.pdist(rc).min() / x.norm(dim=-1).mean()), 5)}
    # spread of class centroids relative to within-class spread (a scale-free separability number)
    xs = (x - x.mean(0)) / (x.std(0) + 1e-6)
    cents = torch.stack([xs[y == c].mean(0) for c in range(len(classes))])
    within = torch.stack([(xs[y == c] - cents[c]).pow(2).sum(-1).mean() for c in range(len(classes))]).mean()
    between = torch.pdist(cents).pow(2).mean()
    return {k: round(v / n, 3) for k, v in hits.items()} | raw | {"between_over_within": round(float(between / within), 3),
                                                           "chance": round(1 / len(classes), 3), "n": n}


def probes(model, processor, items) -> dict:
    feats = features(model, processor, items)
    labels = [_colour(it) for it in items]
    rgb = [i for i, c in enumerate(labels) if c != "yellow"]
    out = {}
    for name, x in feats.items():
        out[name] = {"4_colours": probe(x, labels), "red_green_blue": probe(x[rgb], [labels[i] for i in rgb])}
    return out


# ----------------------------------------------------------------------------------------------- gradients
def _group(name: str) -> str:
    if "visual.patch_embed" in name:
        return "vision.patch_embed"
    if "visual.blocks" in name:
        return "vision.blocks"
    if "visual.merger" in name:
        return "vision.merger"
    if "embed_tokens" in name:
        return "lm.embed_tokens"
    if "lm_head" in name:
        return "lm.lm_head"
    return "lm.layers+norm"


def grad_stats(model, processor, items, *, group: int, temperature: float, seed: int) -> dict:
    engine = TransformersEngine(model, processor)
    vt = video_token_id(model)
    samp = SamplingConfig(n=group, max_new_tokens=16, temperature=temperature)
    model.zero_grad(set_to_none=True)
    batches, tied = [], 0
    for k, item in enumerate(items):
        prompt = encode_prompt(processor, item, video_token_id=vt)
        g = engine.generate([prompt], samp, [77 + 1000 * seed + k])[0]
        r = torch.tensor([score(t, item["problem_type"], item["answer"], item.get("options")).reward
                          for t in g.texts])
        adv = A.group_advantages(r[None])[0]
        tied += int(bool((adv == 0).all()))
        batches.append((prompt, g, adv))
    denom = sum(float(g.response_mask.sum()) for _, g, _ in batches)
    model.train()
    for prompt, g, adv in batches:
        logp = sequence_logprobs(model, prompt, g.response_ids, g.response_mask, temperature=temperature)
        loss, _ = A.policy_loss(logp, logp.detach(), adv, g.response_mask, denominator=denom)
        loss.backward()
    model.eval()
    sq, psq, cnt = defaultdict(float), defaultdict(float), defaultdict(int)
    for n, p in model.named_parameters():
        grp = _group(n)
        if p.grad is not None:
            sq[grp] += float(p.grad.pow(2).sum())
        psq[grp] += float(p.detach().pow(2).sum())
        cnt[grp] += p.numel()
    total = sum(sq.values()) ** 0.5
    model.zero_grad(set_to_none=True)
    return {"tied_groups": tied, "groups": len(items), "grad_norm_total": total,
            "per_group": {k: {"grad_norm": sq[k] ** 0.5, "share_of_sq_norm": sq[k] / max(total ** 2, 1e-30),
                              "rms_grad_per_param": (sq[k] / cnt[k]) ** 0.5, "param_norm": psq[k] ** 0.5,
                              "params": cnt[k]} for k in sorted(cnt)}}


# ----------------------------------------------------------------------------------------------- main
def diagnose_seed(seed: int, args, work: Path) -> dict:
    t0 = time.perf_counter()
    base = L.build_base(seed, args, work)
    train_index, held_out = L.prepare_data(seed, args, work)
    probe_items = L.run_items(args.probe_items, 9000 + seed, args)
    ans_items = held_out[:args.answer_items]
    torch.set_num_threads(args.threads)
    res: dict = {"seed": seed}

    model, proc = load_policy(base)
    model.eval()
    res["probes_random_init"] = probes(model, proc, probe_items)
    del model

    sft_dir = work / f"sft{seed}"
    run_sft(L.sft_config(seed, args, base, train_index, sft_dir))
    model, proc = load_policy(str(sft_dir / "final"))
    model.eval()
    torch.manual_seed(seed)
    res["sft"] = {"answers": answers(model, proc, ans_items, samples=args.samples, temperature=args.temperature,
                                     group=args.group, seed=seed),
                  "teacher_forced": teacher_forced(model, proc, ans_items[:args.tf_items]),
                  "probes": probes(model, proc, probe_items),
                  "grad": grad_stats(model, proc, held_out[-args.grad_items:], group=args.group,
                                     temperature=args.temperature, seed=seed)}
    sft_metrics = read_metrics(sft_dir / "metrics.jsonl")
    res["sft"]["train_loss_first_last"] = [sft_metrics[0]["loss"], sft_metrics[-1]["loss"]]
    del model
    print(f"seed {seed}: SFT diagnosed ({time.perf_counter() - t0:.0f}s)", flush=True)

    if args.grpo_probe_steps:
        grpo_dir = work / f"grpo{seed}"
        run_grpo(L.grpo_config(seed, args, str(sft_dir / "final"), train_index, grpo_dir,
                               steps=args.grpo_probe_steps))
        m = read_metrics(grpo_dir / "metrics.jsonl")
        keys = ("reward_mean", "grad_norm", "clip_frac", "approx_kl", "skipped_update", "response_len_mean")
        chunk = max(1, len(m) // 4)
        res["grpo_probe"] = {
            "steps": len(m),
            "metrics_by_quarter": [{k: round(sum(r.get(k, 0.0) for r in m[i:i + chunk]) / len(m[i:i + chunk]), 4)
                                    for k in keys} | {"steps": f"{m[i]['step']}-{m[min(i + chunk, len(m)) - 1]['step']}"}
                                   for i in range(0, len(m), chunk)],
        }
        model, proc = load_policy(str(grpo_dir / "final"))
        model.eval()
        res["grpo_probe"]["answers"] = answers(model, proc, ans_items, samples=args.samples,
                                               temperature=args.temperature, group=args.group, seed=seed)
        res["grpo_probe"]["probes"] = probes(model, proc, probe_items)
        res["grpo_probe"]["teacher_forced"] = teacher_forced(model, proc, ans_items[:args.tf_items])
        del model
    res["wall_s"] = time.perf_counter() - t0
    print(f"seed {seed}: done ({res['wall_s']:.0f}s)", flush=True)
    return res


def main(argv=None) -> int:
    p = L.build_parser()
    p.description = __doc__
    p.set_defaults(out=str(REPO / "benchmarks" / "results" / "learn_diagnose.json"))
    p.add_argument("--probe-items", type=int, default=200, help="items for the linear probes")
    p.add_argument("--answer-items", type=int, default=100, help="held-out items for greedy/sampled answers")
    p.add_argument("--samples", type=int, default=8, help="sampled answers per item")
    p.add_argument("--tf-items", type=int, default=60, help="items for the teacher-forced probabilities")
    p.add_argument("--grad-items", type=int, default=8, help="prompts of the one-step gradient probe")
    p.add_argument("--grpo-probe-steps", type=int, default=40, help="short GRPO run (0: skip)")
    args = p.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="longreel-learn-diag-"))
    results = [diagnose_seed(int(s), args, work) for s in args.seeds.split(",")]
    doc = {"benchmark": "learn_diagnose",
           "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work", "replot")},
           "per_seed": results}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
