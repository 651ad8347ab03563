"""``longreel card build``: a run's outputs -> a Hugging Face dataset card, ``card.json`` and plots.

Everything the card states is first gathered as a flat, ordered list of *claims* (``{"id", "value",
"check", "source"}``) written to ``card.json``; ``README.md`` is then rendered from ``card.json`` alone
(:func:`render_readme`) with the Jinja2 template ``data_cards/card.md.j2``. So an auditor's
``longreel card verify`` can (1) re-render the README from ``card.json`` and find any edited number, and
(2) recompute, claim by claim, everything derivable from the shards. ``check`` says how a claim can be
checked: ``shards`` (recomputed from the shards by verify), ``funnel`` (``in == out + rejected``, recomputed
from the card's own numbers) or ``recorded`` (what the pipeline recorded: configs, models, sources).

Inputs, all under the run's output directory: ``stats.json`` (funnel, and ``distributions`` when the
pipeline computed them), ``config.yaml``, the stage tables (``videos``, ``clips``, ``captions``, ``qra``,
``pass_rate``, ``rejects``, ``pack_rejects``) and the shards' wids index files (``<run>/shards`` unless
given). A distribution the pipeline did not compute is computed here from the tables (or, for the
``released_*`` sections, from the shards) with the same functions, and the card says so.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re

import yaml

from longreel import data_cards
from longreel.pipelines import distributions as D
from longreel.pipelines.card.claims import claims_by_id  # noqa: F401  (part of this module's API)
from longreel.schemas.atomic import write_atomic

log = logging.getLogger("longreel")

CARD_SCHEMA = "1.0"
TEMPLATE_DIR = os.path.dirname(os.path.abspath(data_cards.__file__))
TEMPLATE_NAME = "card.md.j2"

TABLES = {"videos": "video", "clips": "clip", "clip_facts": "clip_facts", "captions": "caption", "qras": "qra",
          "pass_rate": "pass_rate", "rejects": "reject", "pack_rejects": "reject"}
REJECT_TABLES = ("rejects", "pack_rejects")
REJECT_EXAMPLES = 3
# The libraries whose versions shape the bytes of a run's outputs and so of its card: PyAV and the FFmpeg it carries
# (decoded frames, probe numbers), numpy and Pillow (resizing, PNG encoding), torch/torchvision/transformers (the
# processor's resize rules in the frame cache), matplotlib (plots), datasets (front-matter features).
CARD_LIBRARIES = ("av", "numpy", "pillow", "torch", "torchvision", "transformers", "matplotlib", "datasets")
PLOTS = ("funnel.png", "category_balance.png", "pass_count.png", "duration.png", "answer_letters.png",
         "blind_pass_count.png")

# SPDX-ish ids recorded by the inputs -> Hugging Face licence ids.
HF_LICENSES = {"cc-by-3.0": "cc-by-3.0", "cc-by-4.0": "cc-by-4.0", "cc-by-sa-3.0": "cc-by-sa-3.0",
               "cc-by-sa-4.0": "cc-by-sa-4.0", "cc0-1.0": "cc0-1.0", "bsd-3-clause": "bsd-3-clause",
               "bsd-2-clause": "bsd-2-clause", "mit": "mit", "apache-2.0": "apache-2.0", "lppl-1.3c": "lppl-1.3c",
               "cc-by-nc-4.0": "cc-by-nc-4.0", "cc-by-nc-sa-4.0": "cc-by-nc-sa-4.0", "unknown": "unknown"}


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def ffmpeg_version() -> str:
    """The FFmpeg that PyAV's wheel carries (its own build, not any system ffmpeg)."""
    try:
        import av
    except ImportError:
        return "not installed"
    info = getattr(av, "ffmpeg_version_info", None)
    codec = getattr(av, "library_versions", {}).get("libavcodec")
    return f"{info or 'unknown'} (libavcodec {'.'.join(map(str, codec)) if codec else 'unknown'})"


def card_libraries() -> dict[str, str]:
    """{distribution: version} of :data:`CARD_LIBRARIES`, plus ``ffmpeg (PyAV)``: recorded in every card."""
    out = {lib: _version(lib) for lib in CARD_LIBRARIES}
    out["ffmpeg (PyAV)"] = ffmpeg_version()
    return out


def template_path() -> str:
    return os.path.join(TEMPLATE_DIR, TEMPLATE_NAME)


def template_sha256() -> str:
    with open(template_path(), "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


class Claims:
    def __init__(self):
        self.items: list[dict] = []
        self._ids: set[str] = set()

    def add(self, cid: str, value, check: str = "recorded", source: str = "") -> None:
        if cid in self._ids:
            raise ValueError(f"duplicate claim {cid!r}")
        self._ids.add(cid)
        self.items.append({"id": cid, "value": value, "check": check, "source": source})


def hf_license(lic: str) -> str:
    return HF_LICENSES.get(lic.lower(), "other")


def size_category(n: int) -> str:
    for hi, label in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
                      (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"), (1_000_000_000, "100M<n<1B")):
        if n < hi:
            return label
    return "n>1T" if n > 10 ** 12 else "1B<n<10B"


_URL_QUERY = re.compile(r"""(\b[a-z][a-z0-9+.-]*://[^\s'"?#]+)[?#][^\s'"]*""", re.IGNORECASE)


def redact_urls(text: str | None) -> str | None:
    """URLs keep scheme, host and path; their query and fragment (signed-URL tokens) become ``?…``."""
    return None if text is None else _URL_QUERY.sub(r"\1?…", text)


def _basename(uri: str) -> str:
    """The file name of a path or URL, without query or fragment (a signed URL's token stays out of the card)."""
    import urllib.parse
    path = urllib.parse.urlsplit(uri).path if "://" in uri else uri
    return path.rstrip("/").rsplit("/", 1)[-1]


def _read_tables(run_dir: str) -> dict[str, list[dict]]:
    from longreel.pipelines.io.parquet_sink import read_table
    out = {}
    for t in TABLES:
        try:
            out[t] = read_table(run_dir, t).to_pylist()
        except FileNotFoundError:
            continue
    return out


def _flatten_config(node, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            out += _flatten_config(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [(prefix, node)]


def _provenance(rows: list[dict], fields: tuple[str, ...]) -> list[dict]:
    """Distinct combinations of provenance ``fields`` with how many rows carry each (sorted)."""
    acc: dict[str, int] = {}
    for r in rows:
        key = json.dumps([r.get(f) for f in fields])
        acc[key] = acc.get(key, 0) + 1
    return [{**dict(zip(fields, json.loads(k))), "rows": n} for k, n in sorted(acc.items())]


CAPTION_PROVENANCE = ("backend", "model", "model_revision", "prompt_name", "prompt_hash", "sampling")
QRA_PROVENANCE = ("generator", "model", "model_revision", "prompt_hash", "sampling", "refined", "refine_prompt_hash")
PASS_RATE_PROVENANCE = ("backend", "answerer", "answerer_revision", "k", "temperature", "top_p", "top_k",
                        "max_new_tokens", "prompt_hash", "pass_threshold", "policy")


class ShardSamples:
    """The samples of each shard, read once per card and without digests: the released distributions and the
    features both read them, and the card needs their JSON members and ``.npy`` headers, not hashes (the verifier
    reads its own, hashed). One instance per card: a shard rewritten between two cards is read again."""

    def __init__(self):
        self._samples: dict[str, list[dict]] = {}

    def __call__(self, url: str) -> list[dict]:
        if url not in self._samples:
            from longreel.pipelines.card.shardread import read_shard
            self._samples[url] = read_shard(url, hashes=False)["samples"]
        return self._samples[url]

    def keys(self, url: str) -> set[str]:
        """The shard's sample keys: from the samples when already read, else from its tar headers alone."""
        import tarfile

        from longreel.pipelines.card.shardread import sample_keys
        if url not in self._samples:
            try:
                return sample_keys(url)
            except tarfile.TarError:  # a damaged shard: the tolerant reader keeps the whole samples before the break
                pass
        return {s["key"] for s in self(url)}


def _released_from_shards(indexes: list[tuple[str, dict]], samples_of: ShardSamples) -> list[dict]:
    """Sample descriptors (JSON members + cached frames from the npy header) read back from the shards."""
    from longreel.pipelines.card.shardread import join, sample_descriptor
    samples = []
    for path, doc in indexes:
        split = doc.get("longreel", {}).get("split") or doc["name"].rsplit("-", 1)[-1]
        for sh in doc["shardlist"]:
            for s in samples_of(join(path, sh["url"])):
                samples.append(sample_descriptor(split, s))
    return samples


def _features_yaml_for_kind(kind: str) -> list:
    import datasets
    from longreel.schemas import KINDS
    return datasets.Features.from_arrow_schema(KINDS[kind].schema)._to_yaml_list()


FEATURE_SAMPLES = 256


def shard_features(indexes: list[tuple[str, dict]], max_samples: int = FEATURE_SAMPLES,
                   samples_of: ShardSamples | None = None) -> list | None:
    """The features the ``datasets`` WebDataset builder infers, from the JSON members of up to ``max_samples``
    samples (whole shards, every split in turn; promoted across samples, so optional fields that are null in one
    sample and set in another type correctly) and the ``.npy`` headers (an array of the same dtype and rank
    stands in for the frames)."""
    import datasets
    import numpy as np
    import pyarrow as pa
    from datasets.features.features import cast_to_python_objects

    from longreel.pipelines.card.shardread import join
    samples_of = samples_of or ShardSamples()
    tables = []
    order = [(path, sh) for i in range(max((len(d["shardlist"]) for _, d in indexes), default=0))
             for path, d in indexes if i < len(d["shardlist"]) for sh in [d["shardlist"][i]]]
    for path, sh in order:
        if len(tables) >= max_samples:
            break
        url = join(path, sh["url"])
        for s in samples_of(url):
            ex = {}
            for name in sorted(s["members"]):
                if name in s["json"]:
                    ex[name] = s["json"][name]
                elif name in s["npy"]:
                    h = s["npy"][name]
                    ex[name] = np.zeros((1,) * len(h["shape"]), dtype=np.dtype(h["dtype"]))
                else:
                    ex[name] = b""
            ex["__key__"] = s["key"]
            ex["__url__"] = sh["url"]
            tables.append(pa.Table.from_pylist(cast_to_python_objects([ex], only_1d_for_numpy=True)))
    if not tables:
        return None
    schema = pa.concat_tables(tables, promote_options="default").schema
    return datasets.Features.from_arrow_schema(schema)._to_yaml_list()


def collect(run_dir: str, shards: str | None = None, *, name: str | None = None, pretty_name: str | None = None,
            command: str | None = None, data_prefix: str = "data/", tables_prefix: str = "tables/",
            features: bool = True) -> dict:
    """Gather every claim of the card of the run in ``run_dir`` (see the module docstring), one phase per group
    of claims, in the order the card lists them."""
    stats, config, tables = _load_run(run_dir)
    indexes = _load_indexes(_shards_of(run_dir, config, shards))
    if shards is None:
        indexes = _own_dataset(indexes, config)
    data_prefix, tables_prefix = dir_prefix(data_prefix), dir_prefix(tables_prefix)
    # The dataset is named as its shard files are (the card's file list and data_files name them so); ``name``
    # only titles the card then: a name of its own made data_files match no shard.
    dataset = next((d.get("longreel", {}).get("dataset") for _, d in indexes), None) or name or "longreel"
    samples_of = ShardSamples()
    dist, dist_source = _distributions(stats, tables, indexes, samples_of)
    videos = sorted(tables["videos"], key=lambda v: v["video_id"])
    c = Claims()
    _identity_claims(c, dataset, pretty_name or (f"{name}: long-video reasoning questions" if name else None), dist,
                     tables, videos)
    _reproduction_claims(c, stats, command, config)
    stage_names = _funnel_claims(c, stats)
    _reject_claims(c, tables, stage_names)
    _source_claims(c, videos, _released_video_ids(indexes, samples_of), tables, stage_names)
    _model_claims(c, tables)
    _compute_claims(c, stats)
    _quality_claims(c, stats, dist)
    _distribution_claims(c, dist, dist_source)
    splits = _release_claims(c, indexes)
    _hf_claims(c, tables, indexes, splits, dataset, data_prefix, tables_prefix, features, samples_of)
    return {"card_schema": CARD_SCHEMA, "claims": c.items}


def _load_run(run_dir: str) -> tuple[dict, dict, dict]:
    """(stats.json, config.yaml, the stage tables) of a run; a run without stats or videos is an error."""
    from longreel.pipelines.stats import read_json

    stats = read_json(os.path.join(run_dir, "stats.json") if "://" not in run_dir else run_dir + "/stats.json")
    if stats is None:
        raise FileNotFoundError(f"{run_dir}: no stats.json (run `longreel curate` first)")
    config = {}
    cfg_path = os.path.join(run_dir, "config.yaml")
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as fh:
            config = yaml.safe_load(fh) or {}
    config = _with_stage_configs(run_dir, config)
    tables = _read_tables(run_dir)
    if "videos" not in tables:
        raise FileNotFoundError(f"{run_dir}: no videos table")
    return stats, config, tables


def _with_stage_configs(run_dir: str, config: dict) -> dict:
    """``config`` with the sections a stage run alone recorded since (``longreel qra --set per_category=1``: the
    qras table is that run's, so the card states its settings; it stated config.yaml's, curate's, instead)."""
    from longreel.pipelines.io.run_dir import STAGE_CONFIG_FILES

    config = dict(config)
    for section, name in STAGE_CONFIG_FILES.items():
        path = os.path.join(run_dir, name)
        if "://" not in run_dir and os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                recorded = yaml.safe_load(fh)
            if isinstance(recorded, dict):
                config[section] = recorded
    return config


def _shards_of(run_dir: str, config: dict, shards: str | None) -> str:
    """Where the card reads the shards: ``shards`` as given, which must exist (a mistyped path made a card that
    said "No shards", exit 0, over the run's good one); else where the run's pack wrote them (``pack.shards_dir``
    of its config.yaml, or ``RUN/shards``), where a run without shards has none."""
    if shards is not None:
        from longreel.pipelines.card.shardread import as_local
        shards = as_local(shards)
        local = "://" not in shards
        if local and not (os.path.isdir(shards) or (shards.endswith(".index.json") and os.path.isfile(shards))):
            raise FileNotFoundError(f"--shards {shards}: no such shards directory or .index.json file")
        return shards
    pack = (config or {}).get("pack") if isinstance(config, dict) else None
    return (pack or {}).get("shards_dir") or os.path.join(run_dir, "shards")


def dir_prefix(prefix: str | None) -> str:
    """A published path prefix (``--data-prefix``, ``--tables-prefix``) as a directory: ``shards`` is ``shards/``
    (joined as it was given, it made ``shardslongreel_demo-train-*.tar``); empty stays empty (beside the card)."""
    prefix = prefix or ""
    return prefix if not prefix or prefix.endswith("/") else prefix + "/"


def _load_indexes(shards: str) -> list[tuple[str, dict]]:
    """``(path, index)`` of every split's wids index under ``shards`` (none when there are no shards), by name."""
    from longreel.pipelines.card.shardread import list_indexes, read_index

    indexes: list[tuple[str, dict]] = []
    if shards.endswith(".index.json") or "://" in shards or os.path.isdir(shards):
        indexes = [(p, read_index(p)) for p in list_indexes(shards)]
    indexes.sort(key=lambda pd: pd[1]["name"])
    return indexes


def _own_dataset(indexes: list[tuple[str, dict]], config: dict) -> list[tuple[str, dict]]:
    """The indexes of the run's own dataset (``pack.dataset``, as the index records it) when the run's shards
    directory holds others too: a ``pack.shards_dir`` shared by several runs, or an earlier pack under another
    name. Two datasets' splits made one card, which refused them ("two indexes of split 'train'") after the run had
    written everything: curate exited 1. Indexes that record no dataset (older packs) are all kept, as before."""
    pack = (config or {}).get("pack") if isinstance(config, dict) else None
    dataset = (pack or {}).get("dataset")
    recorded = [(p, d) for p, d in indexes if (d.get("longreel") or {}).get("dataset")]
    if not dataset or not recorded:
        return indexes
    return [(p, d) for p, d in indexes if (d.get("longreel") or {}).get("dataset") in (None, dataset)]


def _distributions(stats: dict, tables: dict, indexes: list, samples_of: ShardSamples) -> tuple[dict, dict]:
    """The distributions the pipeline computed, completed here from the tables and shards with the same
    functions; and where each came from."""
    dist = (stats.get("distributions") or {}).get("sections", {})
    dist_source = {s: "stats.json" for s in dist}
    for table in ("videos", "clips", "captions", "qras", "pass_rate"):
        wanted = [s for s, spec in D.SECTIONS.items() if spec["table"] == table]
        if table in tables and any(s not in dist for s in wanted):
            computed = D.distributions_from_rows({table: tables[table]})["sections"]
            for s in wanted:
                if s not in dist and s in computed:
                    dist[s], dist_source[s] = computed[s], f"{table} table (computed by card build)"
    if indexes:
        released = [s for s, spec in D.SECTIONS.items() if spec["table"] in ("pack_samples", "shards")]
        if any(s not in dist for s in released):
            computed = D.distributions_from_rows({"pack_samples": _released_from_shards(indexes, samples_of),
                                                  "shards": [dict(sh) for _, d in indexes for sh in d["shardlist"]]})
            for s in released:
                if s not in dist and s in computed["sections"]:
                    dist[s], dist_source[s] = computed["sections"][s], "shards (computed by card build)"
    return dist, dist_source


def _identity_claims(c: Claims, dataset: str, pretty_name: str | None, dist: dict, tables: dict,
                     videos: list) -> None:
    """The card itself, the dataset's name, licences and size (in released questions when there are any)."""
    released_q = sum(dist.get("released_split_questions", {}).get("counts", {}).values())
    n_for_size = released_q or len(tables.get("qras", [])) or len(videos)
    if "released_license" in dist:
        lic_names = sorted(dist["released_license"]["counts"])
    else:
        lic_names = sorted({v.get("license") or "unknown" for v in videos})
    c.add("card/schema", CARD_SCHEMA)
    c.add("card/template_sha256", template_sha256())
    c.add("card/plots", {"files": list(PLOTS)})
    c.add("card/libraries", card_libraries())
    c.add("dataset/name", dataset)
    c.add("dataset/pretty_name", pretty_name or f"{dataset}: long-video reasoning questions")
    c.add("dataset/licenses", sorted({hf_license(x) for x in lic_names}), source="video licences")
    c.add("dataset/license_names", lic_names, source="video licences")
    c.add("dataset/size_category", size_category(n_for_size))
    c.add("dataset/size_unit", "questions" if released_q or tables.get("qras") else "videos")
    c.add("dataset/size_count", n_for_size)


def _reproduction_claims(c: Claims, stats: dict, command: str | None, config: dict) -> None:
    """Code version, config hashes, the command, and every resolved config value."""
    c.add("reproduction/code_version", stats.get("code_version"), source="stats.json")
    c.add("reproduction/config_hash", stats.get("config_hash"), source="stats.json")
    c.add("reproduction/stats_schema", stats.get("schema_version"), source="stats.json")
    c.add("reproduction/distributions_schema",
          (stats.get("distributions") or {}).get("schema_version", D.DISTRIBUTIONS_VERSION), source="stats.json")
    c.add("reproduction/command", command or _commands(stats), source="stats.json or --command")
    others = {k: stats[k] for k in sorted(stats) if k.endswith("config_hash") and k != "config_hash"}
    if "passrate" in stats and stats["passrate"].get("config_hash"):
        others["filter_config_hash"] = stats["passrate"]["config_hash"]
    c.add("reproduction/other_config_hashes", others, source="stats.json")
    c.add("config", [{"key": k, "value": v} for k, v in _flatten_config(config)], source="config.yaml")


def _commands(stats: dict) -> str:
    """The run's command, then each stage command run alone on it since, one a line (stats.json records both)."""
    lines = [stats.get("command") or ""] if stats.get("command") else []
    lines += [e["command"] for e in stats.get("stage_commands") or [] if isinstance(e, dict) and e.get("command")]
    return "\n".join(lines)


def _funnel_claims(c: Claims, stats: dict) -> list[str]:
    """Each stage's in/out/rejected and the totals; returns the stage names in run order."""
    stage_names = []
    for st in stats.get("stages", []):
        s = st["stage"]
        stage_names.append(s)
        c.add(f"funnel/{s}", {"unit": st.get("unit", "item"), "in": st["in"], "out": st["out"],
                              "rejected": dict(st.get("rejected", {})),
                              "rejected_total": sum(st.get("rejected", {}).values()),
                              "extra": dict(st.get("extra", {}))}, check="funnel", source="stats.json")
    c.add("funnel/stages", stage_names, source="stats.json")
    if "totals" in stats:
        c.add("funnel/totals", stats["totals"], check="funnel", source="stats.json")
    return stage_names


def _reject_claims(c: Claims, tables: dict, stage_names: list[str]) -> None:
    """Rejects by stage and reason, with example keys."""
    summary: dict[tuple[str, str], dict] = {}
    for t in REJECT_TABLES:
        for r in tables.get(t, []):
            d = summary.setdefault((r["stage"], r["reason"]), {"table": t, "rows": 0, "keys": [], "message": None})
            d["rows"] += 1
            d["keys"].append(r["key"])
    for t in REJECT_TABLES:
        for r in sorted(tables.get(t, []), key=lambda r: (r["stage"], r["reason"], r["key"])):
            d = summary[(r["stage"], r["reason"])]
            if d["message"] is None:
                d["message"] = r["message"]
    c.add("rejects", [{"stage": s, "reason": reason, "table": d["table"], "rows": d["rows"],
                       "examples": [redact_urls(k) for k in sorted(d["keys"])[:REJECT_EXAMPLES]],
                       "message": redact_urls(d["message"])}
                      for (s, reason), d in sorted(summary.items(), key=lambda kv: (
                          stage_names.index(kv[0][0]) if kv[0][0] in stage_names else len(stage_names), kv[0]))],
          source="rejects tables")


def _released_video_ids(indexes: list, samples_of: ShardSamples) -> set[str] | None:
    """The videos with a sample in the shards (a sample's key is its video id); None without shards, or when a
    shard does not hold the samples its index counts (damaged: ``card verify`` says so), so that no released video
    is called unreleased."""
    if not indexes:
        return None
    from longreel.pipelines.card.shardread import join
    released = set()
    for path, doc in indexes:
        for sh in doc["shardlist"]:
            keys = samples_of.keys(join(path, sh["url"]))
            if len(keys) != sh["nsamples"]:
                log.warning("card: shard %s holds %d samples, its index says %d: the source videos are listed "
                            "whole", sh["url"], len(keys), sh["nsamples"])
                return None
            released |= keys
    return released


def _not_released(videos: list, tables: dict, stage_names: list[str]) -> list[dict]:
    """Videos of the run with no sample in the shards, each with its video-level rejects in run order (the first
    one stopped it)."""
    why: dict[str, set] = {}
    for t in REJECT_TABLES:
        for r in tables.get(t, []):
            if r.get("video_id") and r["key"] == r["video_id"]:
                why.setdefault(r["video_id"], set()).add((r["stage"], r["reason"]))

    def order(sr):
        return (stage_names.index(sr[0]) if sr[0] in stage_names else len(stage_names), sr)

    return [{"video_id": v["video_id"], "file": _basename(v["uri"]),
             "reasons": [f"{st}: {reason}" for st, reason in sorted(why.get(v["video_id"], ()), key=order)]
             or ["no question of it released"]} for v in videos]


def _source_claims(c: Claims, videos: list, released: set[str] | None = None, tables: dict | None = None,
                   stage_names: list[str] | None = None) -> None:
    """The source videos: count, hours, licences and one line each. With shards, those of the released samples
    (a video rejected before release was listed beside "licences travel with every sample"); the others are
    ``sources/not_released``, a claim only where there are some (cards of fully released runs keep their bytes)."""
    if released is not None:
        dropped = [v for v in videos if v["video_id"] not in released]
        videos = [v for v in videos if v["video_id"] in released]
    else:
        dropped = []
    total_ms = sum(D._ms(v["duration_s"]) for v in videos)
    c.add("sources/videos", len(videos), source="videos table")
    c.add("sources/duration_s", round(total_ms / 1000, 3), source="videos table")
    c.add("sources/hours", round(total_ms / 3_600_000, 4), source="videos table")
    by_lic: dict[str, int] = {}
    for v in videos:
        by_lic[v.get("license") or "unknown"] = by_lic.get(v.get("license") or "unknown", 0) + 1
    c.add("sources/by_license", dict(sorted(by_lic.items())), source="videos table")
    c.add("sources/list", [{"video_id": v["video_id"], "file": _basename(v["uri"]), "license": v.get("license"),
                            "attribution": v.get("attribution"), "duration_s": round(float(v["duration_s"]), 3),
                            "width": v["width"], "height": v["height"], "sha256": v["sha256"]} for v in videos],
          source="videos table")
    if dropped:
        c.add("sources/not_released", _not_released(dropped, tables or {}, stage_names or []),
              source="videos and rejects tables")


def _model_claims(c: Claims, tables: dict) -> None:
    """The models behind each stage's rows, from the provenance columns."""
    c.add("models/caption", _provenance(tables.get("captions", []), CAPTION_PROVENANCE), source="captions table")
    c.add("models/qra", _provenance(tables.get("qras", []), QRA_PROVENANCE), source="qras table")
    c.add("models/pass_rate", _provenance(tables.get("pass_rate", []), PASS_RATE_PROVENANCE),
          source="pass_rate table")


def _compute_claims(c: Claims, stats: dict) -> None:
    """The compute bill per model stage: calls and tokens (deterministic; the run's wall seconds stay in
    stats.json, so that the card of a re-run is the same bytes)."""
    from longreel.pipelines.compute import compute_table

    rows = [{k: v for k, v in r.items() if k != "model_seconds"} for r in compute_table(stats)]
    c.add("compute", rows, source="stats.json")


#: funnel stages that are quality gates, by gate (the card's quality funnel); stages named ``*dedup`` count as
#: duplicates and ``*align*`` as alignment, so gates added later join without a change here
GATES = {"dedup": "duplicates", "judge": "judge", "blind": "blind"}


def gate_of(stage: str) -> str | None:
    if stage in GATES:
        return GATES[stage]
    if stage.endswith("dedup"):
        return "duplicates"
    if "align" in stage:
        return "alignment"
    return None


def quality_funnel(stats: dict) -> list[dict]:
    """The gates that ran, in run order: in, out and rejects by reason per gate stage."""
    return [{"gate": gate_of(st["stage"]), "stage": st["stage"], "unit": st.get("unit", "item"), "in": st["in"],
             "out": st["out"], "rejected": dict(st.get("rejected", {}))}
            for st in stats.get("stages", []) if gate_of(st["stage"])]


def answer_letters(dist: dict) -> dict | None:
    """The released answer letters with Pearson's chi-square against uniform (None: no multiple choice)."""
    from longreel.pipelines.gates.options import chi_square_uniform

    letters = (dist.get("released_mc_answer") or {}).get("counts")
    return {"counts": dict(letters), **chi_square_uniform(list(letters.values()))} if letters else None


def _quality_claims(c: Claims, stats: dict, dist: dict) -> None:
    """The question quality gates: the funnel of the gates that ran (counts by reason), the released answer
    letters tested against uniform (a writer's letter bias is a shortcut for RL), the blind filter's pass-count
    histogram with its answerer (null when not run), and the judge's failures per check with its model, revision
    and prompt hash (when it ran)."""
    c.add("quality/funnel", quality_funnel(stats), check="funnel", source="stats.json")
    c.add("quality/answer_letters", answer_letters(dist), source="stats.json (released_mc_answer)")
    blind = stats.get("blind")
    c.add("quality/blind", {k: v for k, v in blind.items() if k != "config_hash"} if blind else None,
          source="stats.json")
    if stats.get("judge"):  # only where the judge ran: cards of runs without it keep their bytes
        c.add("quality/judge", stats["judge"], source="stats.json")
    if stats.get("embed"):  # only where an embedding gate ran: cards of runs without one keep their bytes
        c.add("quality/embed", stats["embed"], source="stats.json")


def _distribution_claims(c: Claims, dist: dict, dist_source: dict) -> None:
    """Every distribution section (released ones are checked against the shards by ``card verify``)."""
    ordered = [s for s in D.SECTIONS if s in dist] + sorted(s for s in dist if s not in D.SECTIONS)
    c.add("dist/sections", ordered)
    for s in ordered:
        check = "shards" if D.SECTIONS.get(s, {}).get("table") in ("pack_samples", "shards") else "recorded"
        c.add(f"dist/{s}", dict(dist[s]["counts"]), check=check, source=dist_source.get(s, "stats.json"))


def _release_claims(c: Claims, indexes: list) -> list[str]:
    """The released shards (one claim per split and per shard); returns the splits."""
    splits, index_of = [], {}
    for path, doc in indexes:
        lr = doc.get("longreel", {})
        split = lr.get("split") or doc["name"].rsplit("-", 1)[-1]
        if split in index_of:  # e.g. `longreel pack` run again with another pack.dataset beside the first shards
            raise ValueError(f"two indexes of split {split!r}: {os.path.basename(index_of[split])} and "
                             f"{os.path.basename(path)} (packs of two datasets in one shards directory); give the "
                             "one to describe with --shards INDEX, or remove the other dataset's shards")
        index_of[split] = path
        splits.append(split)
        c.add(f"split/{split}", {"index": os.path.basename(path), "shards": len(doc["shardlist"]),
                                 "samples": sum(s["nsamples"] for s in doc["shardlist"]),
                                 "questions": sum(s.get("nquestions", 0) for s in doc["shardlist"]),
                                 "bytes": sum(s["bytes"] for s in doc["shardlist"])},
              check="shards", source="index")
        for sh in doc["shardlist"]:
            c.add(f"shard/{sh['url']}", {"split": split, "nsamples": sh["nsamples"],
                                         "nquestions": sh.get("nquestions", 0), "bytes": sh["bytes"],
                                         "sha256": sh["sha256"]}, check="shards", source="index")
    c.add("splits", splits, source="index")
    c.add("released/frames", (indexes[0][1].get("longreel", {}).get("frames") if indexes else None) or {},
          source="index")
    c.add("released/processor", (indexes[0][1].get("longreel", {}).get("processor") if indexes else None) or {},
          source="index")
    return splits


def _hf_claims(c: Claims, tables: dict, indexes: list, splits: list[str], dataset: str, data_prefix: str,
               tables_prefix: str, features: bool, samples_of: ShardSamples) -> None:
    """Hugging Face configs and features."""
    configs = []
    if indexes:
        configs.append({"config_name": "default",
                        "data_files": [{"split": sp, "path": _data_files(doc, data_prefix)}
                                       for sp, (_, doc) in zip(splits, indexes)],
                        "features": shard_features(indexes, samples_of=samples_of) if features else None,
                        "splits": [{"name": sp, "num_bytes": claims_split(c, sp)["bytes"],
                                    "num_examples": claims_split(c, sp)["samples"]} for sp in splits]})
    # The `datasets` library picks one builder for all the configs of a repository, so the parquet stage tables
    # are configs only when there are no shards; with shards they are listed as files.
    table_list = [{"table": t, "kind": kind, "rows": len(tables[t]), "path": f"{tables_prefix}{t}-*.parquet"}
                  for t, kind in TABLES.items() if t in tables]
    c.add("tables", table_list, source="run directory")
    c.add("hf/data_prefix", data_prefix)
    c.add("hf/tables_prefix", tables_prefix)
    if not indexes:
        from longreel.schemas import to_table
        for t in table_list:
            configs.append({"config_name": t["table"], "data_files": [{"split": "train", "path": t["path"]}],
                            "features": _features_yaml_for_kind(t["kind"]) if features else None,
                            "splits": [{"name": "train", "num_bytes": to_table(t["kind"], tables[t["table"]]).nbytes,
                                        "num_examples": t["rows"]}]})
    c.add("hf/configs", configs)


_SHARD_NAME = re.compile(r"(?P<stem>[^/]+)-\d+\.tar")


def _data_files(doc: dict, data_prefix: str) -> str | list[str]:
    """A split's ``data_files``: the glob of its shard files' own names (``{stem}-*.tar``), or the names one by one
    when they share no such stem. From the index, not from the dataset's name: ``--name`` once made a pattern that
    matched no shard, and ``datasets`` found no data."""
    urls = [sh["url"] for sh in doc["shardlist"]]
    stems = {m["stem"] if m else None for m in map(_SHARD_NAME.fullmatch, urls)}
    if len(stems) == 1 and None not in stems:
        return f"{data_prefix}{stems.pop()}-*.tar"
    return [f"{data_prefix}{_basename(u)}" for u in urls]


def claims_split(c: Claims, split: str) -> dict:
    return next(i["value"] for i in c.items if i["id"] == f"split/{split}")


# ---------------------------------------------------------------------------------------------------------------
# rendering (a pure function of card.json)
# ---------------------------------------------------------------------------------------------------------------


def front_matter(cl: dict) -> str:
    configs = cl["hf/configs"]
    fm = {
        "pretty_name": cl["dataset/pretty_name"],
        "license": cl["dataset/licenses"][0] if len(cl["dataset/licenses"]) == 1 else cl["dataset/licenses"],
        "task_categories": ["video-text-to-text", "visual-question-answering"],
        "language": ["en"],
        "size_categories": [cl["dataset/size_category"]],
        "source_datasets": ["original"],
        "annotations_creators": ["machine-generated"],
        "language_creators": ["machine-generated"],
        "multilinguality": ["monolingual"],
        "tags": ["video", "reasoning", "long-video", "webdataset", "synthetic"],
        "configs": [{"config_name": cf["config_name"], "data_files": cf["data_files"],
                     **({"default": True} if cf["config_name"] == "default" else {})} for cf in configs],
        "dataset_info": [{"config_name": cf["config_name"], **({"features": cf["features"]} if cf["features"] else {}),
                          "splits": cf["splits"]} for cf in configs],
    }
    if "other" in cl["dataset/licenses"]:
        fm["license_name"] = "see the Source videos section"
    return yaml.safe_dump(fm, sort_keys=False, allow_unicode=True, width=1000)


def _context(card: dict) -> dict:
    cl = claims_by_id(card)
    stages = [dict(cl[f"funnel/{s}"], stage=s) for s in cl["funnel/stages"]]
    return {"c": cl, "front_matter": front_matter(cl), "stages": stages,
            "dist": {s: cl[f"dist/{s}"] for s in cl["dist/sections"]},
            "dist_source": {i["id"][5:]: i["source"] for i in card["claims"] if i["id"].startswith("dist/")
                            and i["id"] != "dist/sections"},
            "splits": [dict(cl[f"split/{sp}"], name=sp) for sp in cl["splits"]],
            "shards": [dict(i["value"], url=i["id"][6:]) for i in card["claims"] if i["id"].startswith("shard/")],
            "sections": D.SECTIONS, "plots": cl["card/plots"]["files"]}


def _fmt_num(x) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:,.3f}".rstrip("0").rstrip(".")
    return str(x)


def render_readme(card: dict, template: str | None = None) -> str:
    import jinja2
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.filters["num"] = _fmt_num
    env.filters["tojson"] = lambda v: json.dumps(v, sort_keys=True, ensure_ascii=False)
    env.filters["cell"] = lambda v: str(v).replace("|", "\\|").replace("\n", " ")
    tpl = env.get_template(template or TEMPLATE_NAME)
    return tpl.render(**_context(card))


def dump_card_json(card: dict) -> str:
    return json.dumps(card, indent=1, sort_keys=False, ensure_ascii=False) + "\n"


def write_card(card: dict, out_dir: str, plots: bool = True) -> list[str]:
    """Write README.md, card.json and the plots into ``out_dir``; return the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, text in (("card.json", dump_card_json(card)), ("README.md", render_readme(card))):
        written.append(write_atomic(os.path.join(out_dir, name), text))
    if plots:
        from longreel.pipelines.card.plots import write_plots
        written += write_plots(card, out_dir)
    return written


def import_ahead() -> None:
    """Import what building a card imports on first use (datasets, matplotlib, jinja2, PyAV: about 0.7 s of a
    2-second card here). A local run of several workers calls this in a thread while its workers run
    (``longreel.pipelines.curate._card_imports_ahead``): the launcher's core is idle while the workers' zygote
    imports torch, and the card then starts without that wait when the pipeline ends."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import av  # noqa: F401
    import datasets  # noqa: F401
    import jinja2  # noqa: F401
    import matplotlib.pyplot  # noqa: F401

    from longreel.pipelines.card import plots, shardread  # noqa: F401


def build_card(run_dir: str, out_dir: str, shards: str | None = None, *, before_write=None, **kw) -> dict:
    """Collect the claims, then write the card. ``before_write``: called between the two (a card built into its
    run removes the run's marker there), so a card refused while collecting leaves the run as it was."""
    card = collect(run_dir, shards, **kw)
    if before_write is not None:
        before_write()
    paths = write_card(card, out_dir)
    log.info("card: %d claims from %s -> %s", len(card["claims"]), run_dir, ", ".join(map(os.path.basename, paths)))
    return card
