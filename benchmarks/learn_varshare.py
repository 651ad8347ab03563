"""How large a direction of what the language model sees is the answer? (learn benchmark diagnostic, no training.)

For each tiny-model build variant and each question kind, the share of the vision tower's output variance that the
answer explains: between-class variance / total variance, summed over the feature dims (raw features, no per-dim
standardisation, so a direction counts by its size, as the LM's attention sees it). Three views of a clip's video
tokens ``[n, H]``: mean over tokens, max over tokens, and the one token farthest from the clip's median token (where
the ball is). Random labels give about ``(classes - 1) / (items - 1)``. The same measure as diagnostic D18 in
``results/learn_time_trials.json``.

    python benchmarks/learn_varshare.py --variants random:4,frame_difference:4 --out /tmp/varshare.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402
from longreel.trainer.policy import encode_prompt, encode_video, load_policy, video_token_id  # noqa: E402
from longreel.trainer.synthetic_task import make_items  # noqa: E402


def answer_variance_share(x: torch.Tensor, labels: list[str]) -> float:
    """``x`` ``[N, D]``, ``labels`` N class names -> sum_d between-class variance / sum_d total variance."""
    x = x.double()
    mu = x.mean(0)
    total = ((x - mu) ** 2).sum()
    between = x.new_zeros(())
    for c in sorted(set(labels)):
        idx = torch.tensor([i for i, lab in enumerate(labels) if lab == c])
        between = between + len(idx) * ((x[idx].mean(0) - mu) ** 2).sum()
    return float(between / total) if total > 0 else 0.0


@torch.no_grad()
def views(model, processor, items) -> dict[str, torch.Tensor]:
    """Per item: mean / max over the video tokens and the token farthest from the median token, each ``[N, H]``."""
    vt = video_token_id(model)
    out = {"mean": [], "max": [], "ball_token": []}
    for item in items:
        f = encode_video(model, encode_prompt(processor, item, video_token_id=vt)).features.float()
        out["mean"].append(f.mean(0))
        out["max"].append(f.max(0).values)
        out["ball_token"].append(f[((f - f.median(0).values) ** 2).sum(1).argmax()])
    return {k: torch.stack(v) for k, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="random:4,frame_difference:4",
                   help="comma-separated PATCH_EMBED:TEMPORAL_PATCH build variants")
    p.add_argument("--kinds", default="colour,order,count_colours,direction,change")
    p.add_argument("--items", type=int, default=300, help="items per kind")
    p.add_argument("--seed", type=int, default=0, help="build seed")
    p.add_argument("--data-seed", type=int, default=3)
    p.add_argument("--size", type=int, default=112)
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="longreel-varshare-"))
    res = {}
    for variant in args.variants.split(","):
        embed, tp = variant.split(":")
        path = build_tiny_qwen2vl(work / variant.replace(":", "_"), seed=args.seed, temporal_patch_size=int(tp),
                                  patch_embed=embed)
        model, processor = load_policy(path)
        model.eval()
        res[variant] = {}
        for kind in args.kinds.split(","):
            items = make_items(args.items, seed=args.data_seed, kinds=[kind], n_frames=args.frames, size=args.size)
            labels = [it["answer"] for it in items]
            v = views(model, processor, items)
            res[variant][kind] = {k: round(answer_variance_share(x, labels), 4) for k, x in v.items()}
            print(variant, kind, res[variant][kind], flush=True)
    doc = {"what": "answer's share of vision-tower output variance", "settings": vars(args), "result": res}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
