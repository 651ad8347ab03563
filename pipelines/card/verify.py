"""``longreel card verify CARD_DIR SHARDS_OR_INDEX``: check a data card against the shards, claim by claim.

Nothing the pipeline wrote is trusted except as the thing being checked:

1. ``README.md`` is re-rendered from ``card.json`` with the template it was built with (its sha256 is a
   claim); an edited number in the README shows as the differing line.
2. Funnel claims are re-added: for every stage ``in == out + sum(rejected by reason)``.
3. Every shard listed by the index files is streamed once (local path or URL): its bytes and sha256 are
   compared with the index and with the card; every sample's members are hashed and compared with its
   ``sums.json``; ``frames.npy`` headers give the frame counts (the arrays are never loaded, nothing is
   unpickled).
4. Every split is also read through the shard reader behind the trainer's loader (``longreel.task.shard_reader``):
   the samples and questions training will see are compared with the card (skip with ``--no-loader``).
5. The distributions the card states about the released data (``released_*``, ``shard_*``: samples and
   questions per split, categories, problem types, MC answer letters, pass counts, frames per video,
   licences and attributions, shard sizes) are recomputed from what was read, with the functions the
   pipeline uses, and compared.

With ``--run RUN_DIR`` every claim is also recomputed from the run's own outputs (``card build`` again, with
the card's options) and compared, so the claims the shards cannot determine (sources, models, stage
parameters, funnel, distributions of the stage tables) are checked against the pipeline's tables too.

When the card sits in a run directory that has a completion marker (``OUT/card`` beside ``OUT/_SUCCESS.json``),
or with ``--run RUN_DIR`` / ``--marker RUN_DIR``, every file the marker lists is also checked (size and sha256), so
a run that did not finish, or whose files changed since, does not pass; the card must be one of those files when it
sits in a run directory (a card built elsewhere is no run's file). When the run is known (``--run``, or the card's
parent), every question in the shards must also be a row of the run's questions table, the same question and answer.

The result is a table ``claim | card | recomputed | ok``; any mismatch makes the command exit 1.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass

from longreel.pipelines import distributions as D
from longreel.pipelines.card.build import claims_by_id, render_readme, template_sha256
from longreel.pipelines.card.shardread import join, list_indexes, read_index, read_shard, sample_descriptor
from longreel.task import shard_reader


def _short(v, width: int = 72) -> str:
    s = v if isinstance(v, str) else json.dumps(v, sort_keys=True, ensure_ascii=False)
    return s if len(s) <= width else s[: width - 1] + "…"


def _nz(d: dict) -> dict:
    return {k: v for k, v in (d or {}).items() if v}


def _dict_diff(card: dict, got: dict) -> tuple[dict, dict]:
    keys = sorted(set(card) | set(got))
    bad = [k for k in keys if card.get(k, 0) != got.get(k, 0)]
    return {k: card.get(k, 0) for k in bad}, {k: got.get(k, 0) for k in bad}


class Report:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, claim: str, card, recomputed, ok: bool | None = None) -> None:
        if ok is None:
            ok = card == recomputed
        self.rows.append({"claim": claim, "card": card, "recomputed": recomputed, "ok": bool(ok)})

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.rows)

    def failures(self) -> list[dict]:
        return [r for r in self.rows if not r["ok"]]

    def table(self) -> str:
        rows = [("claim", "card", "recomputed", "ok")]
        rows += [(r["claim"], _short(r["card"]), _short(r["recomputed"]), "ok" if r["ok"] else "MISMATCH")
                 for r in self.rows]
        widths = [min(max(len(r[i]) for r in rows), 72) for i in range(4)]
        lines = []
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def check_readme(card_dir: str, card: dict, rep: Report) -> None:
    cl = claims_by_id(card)
    want = template_sha256()
    if cl.get("card/template_sha256") != want:
        rep.add("card/template_sha256 (README.md cannot be re-rendered)", cl.get("card/template_sha256"), want)
        return
    path = os.path.join(card_dir, "README.md")
    if not os.path.exists(path):
        rep.add("README.md", "missing", "rendered from card.json", False)
        return
    with open(path, encoding="utf-8") as fh:
        have = fh.read()
    expected = render_readme(card)
    if have == expected:
        rep.add("README.md = render(card.json)", "same", "same", True)
        return
    a, b = have.splitlines(), expected.splitlines()
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        rep.add(f"README.md line {i1 + 1}", "\n".join(a[i1:i2]) or "(nothing)", "\n".join(b[j1:j2]) or "(nothing)",
                False)


def check_funnel(card: dict, rep: Report) -> None:
    cl = claims_by_id(card)
    for s in cl.get("funnel/stages", []):
        st = cl[f"funnel/{s}"]
        rejected = sum(st["rejected"].values())
        rep.add(f"funnel/{s}: rejected_total = sum by reason", st["rejected_total"], rejected)
        rep.add(f"funnel/{s}: in = out + rejected", st["in"], st["out"] + rejected)
    for row in cl.get("quality/funnel") or []:
        st = cl.get(f"funnel/{row['stage']}") or {}
        rep.add(f"quality/funnel {row['gate']} ({row['stage']}) = funnel/{row['stage']}",
                [row["in"], row["out"], row["rejected"]], [st.get("in"), st.get("out"), st.get("rejected")])
        rep.add(f"quality/funnel {row['stage']}: in = out + rejected", row["in"],
                row["out"] + sum(row["rejected"].values()))
    t = cl.get("funnel/totals")
    if t and "videos_in" in t:
        rep.add("funnel/totals: videos_in = ok + rejected", t["videos_in"], t["videos_ok"] + t["videos_rejected"])


def read_all(shards: str | list[str]) -> dict:
    """Every index under ``shards`` (a directory or index file, or a list of them) and every shard it lists,
    read back."""
    out = {"indexes": [], "shards": []}
    sources = [shards] if isinstance(shards, str) else list(shards)
    paths = list(dict.fromkeys(p for src in sources for p in list_indexes(src)))
    for path in paths:
        doc = read_index(path)
        split = doc.get("longreel", {}).get("split") or doc["name"].rsplit("-", 1)[-1]
        out["indexes"].append({"path": path, "doc": doc, "split": split})
        for sh in doc["shardlist"]:
            url = join(path, sh["url"])
            try:
                got = read_shard(url)
            except OSError as e:
                got = {"url": url, "bytes": None, "sha256": None, "samples": [], "errors": [f"cannot read: {e}"]}
            out["shards"].append({"split": split, "name": sh["url"], "index": sh, "read": got})
    return out


def check_shards(card: dict, data: dict, rep: Report) -> None:
    """Every shard against its index and the card, every sample against its sums.json, the splits, and the
    released distributions recomputed from what was read."""
    cl = claims_by_id(card)
    card_shards = {i["id"][len("shard/"):]: i["value"] for i in card["claims"] if i["id"].startswith("shard/")}
    found = _SampleFindings()
    splits, infos, seen = _check_each_shard(card_shards, data, rep, found)
    _check_shard_lists(card_shards, data, seen, rep)
    rep.add("samples: sums.json matches every member", [], sorted(found.sums_bad), not found.sums_bad)
    rep.add("samples: meta.json num_frames = frames.npy frames", [], sorted(found.meta_frames_bad),
            not found.meta_frames_bad)
    if found.errors:
        rep.add("samples: well-formed", [], found.errors, False)
    _check_splits(cl, splits, rep)
    _check_released_distributions(card, cl, infos, found, rep)


@dataclass
class _SampleFindings:
    """What the samples of every shard showed: descriptors and video facts for the distributions, and problems."""
    descriptors: list = dataclasses.field(default_factory=list)
    facts: set = dataclasses.field(default_factory=set)
    meta_frames_bad: list = dataclasses.field(default_factory=list)
    sums_bad: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)

    def add(self, split: str, s: dict) -> int:
        """Check one sample read from a shard of ``split``; return its question count."""
        q = s["json"].get("qras.json")
        self.descriptors.append(sample_descriptor(split, s))
        meta = s["json"].get("meta.json") or {}
        npy = s["npy"].get("frames.npy")
        frames = npy["shape"][0] if npy and npy["shape"] else None
        if frames is None or meta.get("num_frames") != frames:
            self.meta_frames_bad.append(s["key"])
        self.facts.add((meta.get("video_id", s["key"]), frames if frames is not None else -1,
                        meta.get("license") or "unknown", meta.get("attribution") or ""))
        sums = s["json"].get("sums.json") or {}
        for member, digest in s["sha256"].items():
            if member == "sums.json":
                continue
            want = sums.get(member, {})
            if want.get("sha256") != digest or want.get("bytes") != s["members"][member]:
                self.sums_bad.append(f"{s['key']}.{member}")
        self.sums_bad += [f"{s['key']}.{m} (missing)" for m in sorted(set(sums) - set(s["sha256"]))]
        self.errors += [f"{s['key']}: {e}" for e in s["errors"]]
        return len(q) if isinstance(q, list) else 0


def _check_each_shard(card_shards: dict, data: dict, rep: Report, found: _SampleFindings):
    """Each shard as read against its index entry and its card claim; returns (per-split totals, the shard
    infos the distributions take, the shard names seen)."""
    seen = set()
    splits: dict[str, dict] = {}
    infos = []
    for sh in data["shards"]:
        name, got, idx = sh["name"], sh["read"], sh["index"]
        seen.add(name)
        nq = sum(found.add(sh["split"], s) for s in got["samples"])
        recomputed = {"split": sh["split"], "nsamples": len(got["samples"]), "nquestions": nq,
                      "bytes": got["bytes"], "sha256": got["sha256"]}
        infos.append({"url": name, **recomputed})
        for field in ("nsamples", "bytes", "sha256"):
            rep.add(f"index {name}: {field}", idx.get(field), recomputed[field])
        claimed = card_shards.get(name)
        if claimed is None:
            rep.add(f"shard/{name}", "not in the card", recomputed, False)
        else:
            for field in ("split", "nsamples", "nquestions", "bytes", "sha256"):
                rep.add(f"shard/{name}: {field}", claimed.get(field), recomputed[field])
        for e in got["errors"]:
            rep.add(f"shard/{name}: readable", "readable tar", e, False)
        sp = splits.setdefault(sh["split"], {"shards": 0, "samples": 0, "questions": 0, "bytes": 0})
        sp["shards"] += 1
        sp["samples"] += recomputed["nsamples"]
        sp["questions"] += nq
        sp["bytes"] += got["bytes"] or 0
    return splits, infos, seen


def _check_shard_lists(card_shards: dict, data: dict, seen: set, rep: Report) -> None:
    """No shard file of a split is missing from its index, and no shard the card claims is missing."""
    for d in sorted({os.path.dirname(ix["path"]) for ix in data["indexes"] if "://" not in ix["path"]}):
        prefixes = tuple(f"{ix['doc']['name']}-" for ix in data["indexes"])
        unlisted = sorted(n for n in os.listdir(d) if n.endswith(".tar") and n.startswith(prefixes) and n not in seen)
        if unlisted:
            rep.add(f"shard files in {d} listed by an index", [], unlisted, False)
    for name in sorted(set(card_shards) - seen):
        rep.add(f"shard/{name}", card_shards[name], "not in the shards' index", False)


def _check_splits(cl: dict, splits: dict, rep: Report) -> None:
    for split in sorted(set(splits) | set(cl.get("splits", []))):
        claimed = cl.get(f"split/{split}")
        got = splits.get(split)
        if claimed is None or got is None:
            rep.add(f"split/{split}", claimed or "not in the card", got or "no shards", False)
            continue
        for field in ("shards", "samples", "questions", "bytes"):
            rep.add(f"split/{split}: {field}", claimed[field], got[field])


def _check_released_distributions(card: dict, cl: dict, infos: list, found: _SampleFindings, rep: Report) -> None:
    """The distributions the card states about the released data, recomputed from what was read."""
    pairs = D.pairs_for_rows("shards", infos)
    for s in found.descriptors:
        try:
            pairs += D.released_pairs(s)
        except (KeyError, TypeError, ValueError) as e:
            rep.add(f"sample {s['key']}: readable questions", "qras.json with questions", str(e), False)
    for f in sorted(found.facts):
        pairs += D.video_fact_pairs(f)
    recomputed_sections = D.fold_distributions(D.sum_pairs(pairs))["sections"]
    claimed_sections = [i["id"][len("dist/"):] for i in card["claims"]
                        if i["id"].startswith("dist/") and i["check"] == "shards"]
    names = list(dict.fromkeys(claimed_sections + [s for s in recomputed_sections if s not in claimed_sections]))
    for s in names:
        have = _nz(cl.get(f"dist/{s}")) if f"dist/{s}" in cl else None
        got = _nz(recomputed_sections.get(s, {}).get("counts", {}))
        if have is None:
            rep.add(f"dist/{s}", "not in the card", got, not got)
            continue
        if have == got:
            rep.add(f"dist/{s}", have, got, True)
        else:
            a, b = _dict_diff(have, got)
            rep.add(f"dist/{s}", a, b, False)
    _check_quality(cl, recomputed_sections, rep)
    if "released_license" in recomputed_sections:
        rep.add("dataset/license_names = licences of the released videos", cl.get("dataset/license_names"),
                sorted(_nz(recomputed_sections["released_license"]["counts"])))


def _check_quality(cl: dict, sections: dict, rep: Report) -> None:
    """The quality claims the shards allow: the answer letters and their chi-square recomputed from the released
    questions; where the blind filter ran, the released questions' blind pass counts (carried in the shards)
    each within the card's blind histogram and under its rejection threshold."""
    from longreel.pipelines.card.build import answer_letters

    if "quality/answer_letters" in cl:
        rep.add("quality/answer_letters", cl["quality/answer_letters"], answer_letters(sections))
    released = {int(k): n for k, n in _nz(sections.get("released_blind_pass_count", {}).get("counts", {})).items()}
    blind = cl.get("quality/blind")
    if not blind:
        rep.add("quality/blind: no blind pass count in the shards without a blind filter", {}, released, not released)
        return
    hist, k = blind["pass_count_histogram"], blind["k"]
    over = {c: n for c, n in released.items() if c >= len(hist) or n > hist[c]}
    rep.add("quality/blind: released blind pass counts within the card's histogram", {}, over, not over)
    rate = (blind.get("answerer") or {}).get("max_pass_rate")
    if rate is not None:
        answerable = sorted(c for c in released if c / k >= rate)
        rep.add("quality/blind: no released question is text-answerable", [], answerable, not answerable)


def check_loader(card: dict, data: dict, rep: Report) -> None:
    """Read every split through the reader the trainer's loader uses (:mod:`longreel.task.shard_reader`: safe
    members only, each sample checked against its sums.json, frames decoded with ``allow_pickle=False``): what
    training will see must be what the card states."""
    cl = claims_by_id(card)
    for ix in data["indexes"]:
        split = ix["split"]
        stats, errors = shard_reader.LoaderStats(), []
        videos = questions = 0
        for spec in shard_reader.resolve_shards(ix["path"]):
            for sample in shard_reader.read_shard(spec, stats, lambda err, _whole: errors.append(str(err)), verify="sample"):
                videos += 1
                questions += len(sample["qras"])
        claimed = cl.get(f"split/{split}") or {}
        rep.add(f"trainer loader: split/{split}: samples", claimed.get("samples"), videos)
        rep.add(f"trainer loader: split/{split}: questions", claimed.get("questions"), questions)
        rep.add(f"trainer loader: split/{split}: errors", [], errors[-20:], not errors)


def check_run(card: dict, run_dir: str, shards: str | list[str], rep: Report) -> None:
    """Recompute every claim from the run's own outputs (stats.json, config.yaml, stage tables, index) with the
    options the card was built with, and compare claim by claim: the ``recorded`` claims (sources, models,
    stage parameters, funnel, distributions of the stage tables) become checkable too."""
    from longreel.pipelines.card.build import collect
    cl = claims_by_id(card)
    index = shards if isinstance(shards, str) else (shards[0] if len(shards) == 1 else None)
    fresh = collect(run_dir, index, name=cl.get("dataset/name"), pretty_name=cl.get("dataset/pretty_name"),
                    command=cl.get("reproduction/command") or None, data_prefix=cl.get("hf/data_prefix", "data/"),
                    tables_prefix=cl.get("hf/tables_prefix", "tables/"))
    got = claims_by_id(fresh)
    for cid in list(dict.fromkeys(list(cl) + list(got))):
        if cid not in got:
            rep.add(f"run: {cid}", cl[cid], "not produced from the run", False)
        elif cid not in cl:
            rep.add(f"run: {cid}", "not in the card", got[cid], False)
        elif cl[cid] != got[cid]:
            a, b = (_dict_diff(cl[cid], got[cid]) if isinstance(cl[cid], dict) and isinstance(got[cid], dict)
                    else (cl[cid], got[cid]))
            rep.add(f"run: {cid}", a, b, False)
    n_ok = sum(1 for cid in cl if cid in got and cl[cid] == got[cid])
    rep.add("run: claims recomputed from the run's outputs", len(cl), n_ok, n_ok == len(cl) == len(got))


def find_marker_dir(card_dir: str, run_dir: str | None = None) -> str | None:
    """The run directory whose ``_SUCCESS.json`` to check: ``run_dir`` if it has one, else the card's parent (a
    card built by ``longreel curate`` sits in ``OUT/card``); None when neither has one."""
    from longreel.schemas.run_marker import MARKER_NAME
    for d in ([run_dir] if run_dir else []) + [os.path.dirname(os.path.abspath(card_dir))]:
        if "://" not in d and os.path.isfile(os.path.join(d, MARKER_NAME)):
            return d
    return None


def default_marker_dir(card_dir: str, run_dir: str | None = None) -> str | None:
    """The run directory whose marker ``card verify`` must find, present or not: ``--run``'s, else the card's parent
    when that is a run directory (it holds stats.json: a card built into its run). Where :func:`find_marker_dir`
    looks only for a marker that is there, a missing one passed ("59 of 59 claims match" of a run that never
    finished) while ``--marker`` failed it. None for a card away from any run, or a remote run."""
    from longreel.schemas.run_marker import MARKER_NAME
    if run_dir:
        return run_dir if "://" not in run_dir else None
    parent = os.path.dirname(os.path.abspath(card_dir))
    is_run = any(os.path.isfile(os.path.join(parent, n)) for n in ("stats.json", MARKER_NAME))
    return parent if "://" not in card_dir and is_run else None


def check_marker(marker_dir: str, rep: Report) -> None:
    """Every file the run's completion marker lists is there with its size and sha256 (see schemas.run_marker)."""
    from longreel.schemas.run_marker import MARKER_NAME, check_run_marker
    if os.path.basename(marker_dir.rstrip("/")) == MARKER_NAME:
        marker_dir = os.path.dirname(marker_dir.rstrip("/"))
    marker, problems = check_run_marker(marker_dir)
    listed = len(marker["files"]) if marker else 0
    rep.add(f"run marker: {os.path.join(marker_dir, MARKER_NAME)}", f"{listed} files listed",
            f"{listed - len([p for p in problems if p['path'] != MARKER_NAME])} match" if marker else "no marker",
            not problems)
    for p in problems:
        rep.add(f"run marker: {p['path']}", p["expected"], p["found"], False)


def verify(card_dir: str, shards: str | list[str], loader: bool = True, run_dir: str | None = None,
           marker: str | None = None) -> Report:
    """``marker``: a run directory (or its ``_SUCCESS.json``) whose completion marker to check; by default the
    one of ``run_dir`` or of the card's parent directory, when there is one."""
    with open(os.path.join(card_dir, "card.json"), encoding="utf-8") as fh:
        card = json.load(fh)
    rep = Report()
    check_readme(card_dir, card, rep)
    check_funnel(card, rep)
    data = read_all(shards)
    if not data["indexes"]:
        rep.add("shards", "index files", f"no *.index.json under {shards}", False)
    check_shards(card, data, rep)
    if loader and data["indexes"]:
        check_loader(card, data, rep)
    if run_dir is not None:
        check_run(card, run_dir, shards, rep)
    questions_run = run_dir or default_marker_dir(card_dir)
    if questions_run is not None:
        check_shard_questions(questions_run, data, rep)
    marker_dir = marker or find_marker_dir(card_dir, run_dir)
    if marker_dir is not None:
        check_marker(marker_dir, rep)
        check_marker_lists(marker_dir, card_dir, data, rep)
    return rep


def check_marker_lists(marker_dir: str, card_dir: str, data: dict, rep: Report) -> None:
    """The card and the index files verified here are the ones the marker lists (by sha256): checked alone, the
    marker of another run passed as long as that run's own files were whole ("62 of 62 claims match" of a card the
    marker had never seen)."""
    from longreel.schemas.run_marker import read_marker, sha256_of

    if os.path.basename(marker_dir.rstrip("/")) == "_SUCCESS.json":
        marker_dir = os.path.dirname(marker_dir.rstrip("/"))
    try:
        marker = read_marker(marker_dir)
    except Exception:  # noqa: BLE001 - a damaged or missing marker is check_marker's row already
        return
    if not marker:
        return
    listed = {e.get("sha256") for e in marker.get("files", []) if isinstance(e, dict)}
    ours = [ix["path"] for ix in data["indexes"] if "://" not in ix["path"]]
    if _card_of_a_run(card_dir, marker_dir):
        ours.insert(0, os.path.join(card_dir, "card.json"))
    else:
        rep.add("run marker lists card.json", "not required: the card is not in a run directory", "not required", True)
    for path in ours:
        with open(path, "rb") as fh:
            digest = sha256_of(fh)[1]
        rep.add(f"run marker lists {os.path.basename(path)}", "its sha256 among the marker's files",
                "listed" if digest in listed else f"not listed ({digest[:12]})", digest in listed)


def _card_of_a_run(card_dir: str, marker_dir: str) -> bool:
    """Whether the card is one of a run's files, which that run's marker must list: it sits in the marker's run
    directory (``RUN/card``, what curate writes), or its parent is another run's directory (whose card the marker
    of this one never listed). A card built elsewhere (``card build RUN --out /elsewhere``) is no run's file: no
    marker can list it, and requiring it failed the documented build-then-verify flow."""
    from longreel.schemas.run_marker import MARKER_NAME

    here = os.path.realpath(card_dir)
    run = os.path.realpath(marker_dir)
    if here == run or here.startswith(run + os.sep):
        return True
    parent = os.path.dirname(here)
    return any(os.path.isfile(os.path.join(parent, n)) for n in ("stats.json", MARKER_NAME))


HINT_REPACK = "the shards were packed from another {table} table: run `longreel pack {run}`"


def check_shard_questions(run_dir: str, data: dict, rep: Report) -> None:
    """Every question in the shards is a row of the run's questions table, with the same question and answer. A
    stage run alone (``longreel qra RUN --set ...``) rewrites the table but not the shards, whose claims all still
    matched: the released questions were not the run's. The shards may hold fewer questions than the table (a
    pass-rate filter or the pack's selection drops some); only one absent from the table, or different, fails."""
    table = _packed_table(run_dir)
    rows = _read_questions(run_dir, table)
    shard_qs = [(sh["name"], q) for sh in data["shards"] for s in sh["read"]["samples"]
                for q in _sample_questions(s)]
    if rows is None:
        rep.add(f"run: the {table} table the shards were packed from", f"{len(shard_qs)} shard questions",
                f"no {table} table in {run_dir}", not shard_qs)
        return
    hint = HINT_REPACK.format(table=table, run=run_dir)
    bad = 0
    for shard, q in shard_qs:
        got = rows.get(q.get("qra_id"))
        have = {"question": q.get("question"), "answer": q.get("answer")}
        if got != have:
            bad += 1
            rep.add(f"run: question {q.get('qra_id')} of {shard} in the {table} table ({hint})", have,
                    got or f"not in the {table} table", False)
    rep.add(f"run: the shards' questions are rows of the {table} table", f"{len(shard_qs)} questions",
            f"{len(shard_qs) - bad} match", not bad)


def _sample_questions(sample: dict) -> list[dict]:
    """A shard sample's questions (its ``qras.json``); a malformed one is check_shards' row already."""
    qs = sample["json"].get("qras.json")
    return [q for q in qs if isinstance(q, dict)] if isinstance(qs, list) else []


def _packed_table(run_dir: str) -> str:
    """The table the run's pack read its questions from: ``pack.qra_table`` of the config a pack run alone recorded
    (config_pack.yaml), else of config.yaml; ``qras`` by default."""
    import yaml

    from longreel.pipelines.card.build import _with_stage_configs

    config = {}
    path = os.path.join(run_dir, "config.yaml")
    if "://" not in run_dir and os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            config = yaml.safe_load(fh) or {}
    config = _with_stage_configs(run_dir, config if isinstance(config, dict) else {})
    pack = config.get("pack")
    return (pack.get("qra_table") if isinstance(pack, dict) else None) or "qras"


def _read_questions(run_dir: str, table: str) -> dict | None:
    """``{qra_id: {"question", "answer"}}`` of the run's questions table; None when the run has none."""
    from longreel.pipelines.io.parquet_sink import read_table

    try:
        rows = read_table(run_dir, table).select(["qra_id", "question", "answer"]).to_pylist()
    except FileNotFoundError:
        return None
    return {r["qra_id"]: {"question": r["question"], "answer": r["answer"]} for r in rows}
