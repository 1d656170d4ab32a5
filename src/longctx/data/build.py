"""`longctx data build` and `longctx data merge`: inputs -> scan -> dedup -> embed -> cluster -> pack -> store.

A build streams: the scan (scan.py) reads the inputs shard by shard in worker processes and leaves
each document's text, tokens, split points, hashes and features on disk in a work directory
(`OUT/.build`); the rest (assemble.py) reads them back in input order, a group at a time. So the
build's memory follows `--max-memory`, not the corpus: it sets how many workers scan at once and
how many tokens are packed per group.

- Resume: a build that was interrupted picks up its work directory and redoes only the shards whose
  scan had not finished (a different set of inputs or scan options starts over, and says so).
- Several machines: `--shard i/n` scans only the i-th of n contiguous, byte-balanced runs of the
  input into `--out` (a scan directory, not a store); `longctx data merge DIR ... --out STORE`
  then dedups across all of them and packs the store, exactly as one build of all the inputs would.

Each stage reports its counts and its throughput in MB/s of raw input text (the UTF-8 bytes of
the documents read); they also go into the manifest. A build writes one new part (store.py) and
then the manifest; `append=True` adds a part to an existing store, removing documents that
duplicate ones already stored, without touching the existing parts. The manifest is written
last, so a failed or interrupted build never leaves a store that looks complete.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..progress import progress_bar
from . import assemble as asm
from . import scan
from . import store as st
from .pack import STRATEGIES
from .readers import skipped_text
from ..config_tokenizer import tokenizer_identity
from .tokenizer import load_tokenizer

DEDUP_MODES = ("minhash", "exact", "none")
WORK = ".build"
DEFAULT_MAX_MEMORY = 2 << 30
# resident memory of a scan worker and of the main process outside their data (spawned workers
# import numpy and the tokenizer, ~35 MB; the main process adds scipy.sparse for the embed stage)
WORKER_BYTES = 64 << 20
MAIN_BYTES = 96 << 20


@dataclass
class BuildOptions:
    inputs: list[str]
    out: str
    seq_len: int
    tokenizer: str = "byte"
    strategy: str = "datasculpt"
    dedup: str = "minhash"
    workers: int = 2
    text_field: str = "text"
    eval_fraction: float = 0.0
    seed: int = 0
    embed_model: str = ""
    dedup_threshold: float = 0.8
    max_docs: int = 0
    append: bool = False
    stats: bool = True  # embeddings (and homogeneity) also for concat / bfd
    progress: bool = True
    clusters: int = 0  # 0 = automatic
    shown_as: str = ""  # the path messages name, when `out` is a temporary directory renamed into it after
    max_memory: int = 0  # bytes the whole build may hold resident (0 = DEFAULT_MAX_MEMORY)
    shard: tuple[int, int] | None = None  # (i, n): scan only machine i's share of n into `out`

    @property
    def memory(self) -> int:
        return self.max_memory or DEFAULT_MAX_MEMORY

    @property
    def scan_workers(self) -> int:
        """Workers that fit the memory bound next to the main process, which holds a quarter of
        MAIN_BYTES while the scan runs (it has not loaded scipy yet); at least one."""
        return max(1, min(self.workers, (self.memory - MAIN_BYTES // 4) // WORKER_BYTES))

    @property
    def group_tokens(self) -> int:
        """Tokens packed per group: a group's documents, pieces and samples take ~4-8 bytes a token."""
        return int(max(1 << 20, (self.memory - MAIN_BYTES) // 8))

    def scan_options(self) -> scan.ScanOptions:
        return scan.ScanOptions(self.tokenizer, self.dedup, self.text_field)


def check_options(o: BuildOptions) -> None:
    problems = []
    if o.seq_len < 2:
        problems.append(f"--seq-len must be at least 2 tokens, got {o.seq_len}.")
    if o.strategy not in STRATEGIES:
        problems.append(f"--strategy {o.strategy!r} is not one of {', '.join(STRATEGIES)}.")
    if o.dedup not in DEDUP_MODES:
        problems.append(f"--dedup {o.dedup!r} is not one of {', '.join(DEDUP_MODES)}.")
    if o.workers < 1:
        problems.append(f"--workers must be >= 1, got {o.workers}.")
    if not 0 <= o.eval_fraction < 1:
        problems.append(f"--eval-fraction must be in [0, 1), got {o.eval_fraction}.")
    if not 0 < o.dedup_threshold <= 1:
        problems.append(f"--dedup-threshold must be in (0, 1], got {o.dedup_threshold}.")
    if o.max_memory and o.max_memory < MAIN_BYTES + WORKER_BYTES:
        problems.append(f"--max-memory {o.max_memory / 2**20:.0f}MB is below what a build needs at the least "
                        f"(~{(MAIN_BYTES + WORKER_BYTES) / 2**20:.0f}MB: its imports and one scan worker).")
    if o.shard is not None:
        i, n = o.shard
        if not 0 <= i < n:
            problems.append(f"--shard {i}/{n}: expected i/n with 0 <= i < n, e.g. --shard 0/4.")
        if o.append:
            problems.append("--shard and --append do not go together: a shard's scan is merged into a new store "
                            "with `longctx data merge`.")
        if o.max_docs:
            problems.append("--shard and --max-docs do not go together: which documents are the first N is only "
                            "known once every shard is scanned.")
    if problems:
        raise DataError(" ".join(problems))


def parse_memory(text: str) -> int:
    """'300MB', '2GB', '512MiB', '1e9' -> bytes."""
    t = text.strip().upper().replace("IB", "B")
    for suffix, mult in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if t.endswith(suffix):
            t, m = t[:-len(suffix)], mult
            break
    else:
        m = 1
    try:
        return int(float(t) * m)
    except ValueError:
        raise DataError(f"--max-memory {text!r} is not a size; write it like 300MB or 4GB.") from None


# ----------------------------------------------------------------------------------------------
# scan


def scan_inputs(o: BuildOptions, work: Path, machine: tuple[int, int], log) -> dict:
    """Scan machine `machine`'s share of the inputs into `work` (resuming what is there); its plan."""
    tok = load_tokenizer(o.tokenizer)
    sopts = o.scan_options()
    units, other = scan.plan_units(o.inputs)
    shards = scan.plan_shards(units)
    digest = scan.plan_digest(units, sopts)
    todo = scan.machine_range(shards, *machine)
    plan = scan.read_plan(work)
    if plan is not None and (plan["digest"] != digest or plan["machine"] != list(machine)):
        log(f"  {work} holds an unfinished build of other inputs or scan options; starting over")
        shutil.rmtree(work)
        plan = None
    build = {k: v for k, v in asdict(o).items() if k not in ("out", "shown_as", "progress", "shard", "append")}
    plan = {"format": scan.FORMAT, "version": scan.VERSION, "digest": digest, "options": asdict(sopts),
            "build": build, "token_dtype": np.dtype(st.token_dtype(tok.vocab_size)).name,
            "shards": len(shards), "machine": list(machine), "range": [todo.start, todo.stop],
            "other_suffix": other if machine[0] == 0 else 0,
            "bytes": sum(u.size for s in shards[todo.start:todo.stop] for u in s)}
    scan.write_plan(work, plan)
    done = [i for i in todo if (scan.shard_dir(work, i) / "shard.json").is_file()]
    if done:
        log(f"  scan      resuming: {len(done)} of {len(todo)} shards already scanned in {work}")
    bar = progress_bar(plan["bytes"], "scan", "B", o.progress)
    if bar is not None:
        bar.unit_scale = True
    counts = scan.run_scans(work, shards, todo, sopts, plan["token_dtype"], o.scan_workers, o.max_docs,
                            on_done=(lambda _c, size: bar.update(size)) if bar is not None else None)
    if bar is not None:
        bar.close()
    plan["complete"] = [c["index"] for c in counts]
    return plan


def _scan_stage(o: BuildOptions, work: Path, machine: tuple[int, int], log) -> tuple[tuple, dict]:
    """((plan, the scanned shards), counts) of the scan stage."""
    plan = scan_inputs(o, work, machine, log)
    shards = scanned(work, plan)
    return (plan, shards), {"shards": len(shards), "documents": sum(s.n for s in shards),
                            "mb": round(sum(s.counts["bytes"] for s in shards) / 1e6, 2)}


def scanned(work: Path, plan: dict) -> list[scan.ScannedShard]:
    minhash = plan["options"]["dedup"] == "minhash"
    lo, hi = plan["range"]
    out = []
    for i in range(lo, hi):
        d = scan.shard_dir(work, i)
        if not (d / "shard.json").is_file():
            break  # --max-docs stopped the scan here; later shards are not needed
        out.append(scan.ScannedShard(d, plan["token_dtype"], minhash))
    return out


# ----------------------------------------------------------------------------------------------
# build and merge


def _open_store(o: BuildOptions) -> tuple[Path, dict | None]:
    root = Path(o.out)
    old = None
    if (root / st.MANIFEST).is_file():
        if not o.append:
            raise DataError(f"'{root}' already holds a data store; pass --append to add documents to it, or "
                            f"choose another --out.")
        old = st.read_manifest(root)
        for key, want in (("seq_len", o.seq_len), ("strategy", o.strategy)):
            if old[key] != want:
                raise DataError(f"the store '{root}' was built with {key} {old[key]}; an append must use the same "
                                f"(got {want}).")
        if old["tokenizer"]["spec"] != o.tokenizer:
            raise DataError(f"the store '{root}' was built with tokenizer {old['tokenizer']['spec']!r}; an append "
                            f"must use the same (got {o.tokenizer!r}).")
    elif root.exists() and not root.is_dir():
        raise DataError(f"--out '{root}' exists and is not a directory.")
    return root, old


def _describe(o: BuildOptions, tok, shown) -> str:
    return (f"(seq_len {o.seq_len}, {o.strategy}, dedup {o.dedup}, {tok.name} tokenizer, {o.scan_workers} "
            f"worker{'s' if o.scan_workers != 1 else ''}, max memory {o.memory / 2**20:.0f}MB)")


def build_store(o: BuildOptions, log=print) -> dict:
    """Build (or append to) the store at `o.out`; returns its manifest. With `o.shard`, only scan
    that share of the inputs into `o.out` (for `merge_scans`) and return its plan."""
    check_options(o)
    tok = load_tokenizer(o.tokenizer)
    if o.shard is not None:
        out = Path(o.out)
        if (out / st.MANIFEST).is_file():
            raise DataError(f"--out '{out}' holds a data store; a --shard scan goes to a directory of its own.")
        log(f"data build: {', '.join(o.inputs)} shard {o.shard[0]}/{o.shard[1]} -> {out} {_describe(o, tok, out)}")
        records: dict = {}
        plan, shards = asm.timed(records, "scan", 0, log, _scan_stage, o, out, o.shard, log)
        docs = sum(s.n for s in shards)
        log(f"data build: scanned shard {o.shard[0]}/{o.shard[1]} into {out} ({docs:,} documents); combine all "
            f"{o.shard[1]} with `longctx data merge`")
        return plan
    root, old = _open_store(o)
    shown = o.shown_as or root
    log(f"data build: {', '.join(o.inputs)} -> {shown} {_describe(o, tok, shown)}")
    work = root / WORK
    records: dict = {}
    plan, shards = asm.timed(records, "scan", 0, log, _scan_stage, o, work, (0, 1), log)
    manifest = _assemble(o, root, old, tok, shards, plan.get("other_suffix", 0), work, records, log)
    shutil.rmtree(work, ignore_errors=True)
    return manifest


def merge_scans(dirs: list[str], out: str, workers: int = 0, max_memory: int = 0, progress: bool = True,
                log=print) -> dict:
    """`longctx data merge`: the store of the scans of `--shard 0/n` ... `--shard n-1/n`."""
    plans = []
    for d in dirs:
        p = scan.read_plan(Path(d))
        if p is None or p.get("format") != scan.FORMAT:
            raise DataError(f"'{d}' is not a scan directory of `longctx data build --shard i/n` (no {scan.PLAN}).")
        plans.append((p, Path(d)))
    plans.sort(key=lambda pd: pd[0]["machine"][0])
    first = plans[0][0]
    n = first["machine"][1]
    for p, d in plans:
        if p["digest"] != first["digest"] or p["build"] != first["build"]:
            raise DataError(f"'{d}' was scanned from other inputs or with other options than '{plans[0][1]}'; "
                            f"merge the scans of one `data build --shard i/n` run.")
    got = [p["machine"][0] for p, _ in plans]
    if got != list(range(n)):
        missing = sorted(set(range(n)) - set(got))
        raise DataError(f"data merge needs the scans of all {n} shards, once each; got shards {got}"
                        + (f" (missing {missing})" if missing else "") + ".")
    shards = []
    for p, d in plans:
        have = scanned(d, p)
        if len(have) != p["range"][1] - p["range"][0]:
            raise DataError(f"the scan in '{d}' (shard {p['machine'][0]}/{n}) is unfinished: run its "
                            f"`longctx data build --shard {p['machine'][0]}/{n}` again to complete it.")
        shards.extend(have)
    b = first["build"]
    o = BuildOptions(**{**b, "out": out, "progress": progress, "workers": workers or b["workers"],
                        "max_memory": max_memory or b["max_memory"]})
    tok = load_tokenizer(o.tokenizer)
    root, old = _open_store(o)
    log(f"data merge: {len(dirs)} scans -> {root} {_describe(o, tok, root)}")
    records = {"scan": {"shards": len(shards), "machines": n}}
    return _assemble(o, root, old, tok, shards, first.get("other_suffix", 0), root / WORK, records, log)


def _assemble(o: BuildOptions, root: Path, old: dict | None, tok, shards: list[scan.ScannedShard], other: int,
              work: Path, records: dict, log) -> dict:
    dtype = st.token_dtype(tok.vocab_size)
    corpus = asm.Corpus(shards, np.dtype(dtype).name)
    skipped: dict = {}
    for sh in shards:
        for k, v in sh.counts["skipped"].items():
            skipped[k] = skipped.get(k, 0) + v
    if other:
        skipped["other_suffix"] = skipped.get("other_suffix", 0) + other
    files = sum(sh.counts["files"] for sh in shards)
    if corpus.n == 0:
        raise DataError(f"the inputs ({', '.join(o.inputs)}) hold no usable document ({skipped_text(skipped)}). "
                        f"Point --input at text, .jsonl or .parquet data.")
    read = min(corpus.n, o.max_docs) if o.max_docs else corpus.n
    text_bytes = corpus.per_doc(lambda sh: sh.text_bytes())[:read]
    raw = int(text_bytes.sum())
    records.setdefault("scan", {}).update(files=files, documents=read, skipped=dict(sorted(skipped.items())),
                                          mb=round(raw / 1e6, 2))
    if "seconds" in records["scan"] and records["scan"]["seconds"]:
        records["scan"]["mb_per_s"] = round(raw / 1e6 / records["scan"]["seconds"], 2)
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _assemble_in(o, root, old, tok, dtype, corpus, work, records, raw, files, read, skipped, log)
    finally:
        corpus.close()


def _assemble_in(o, root, old, tok, dtype, corpus, work, records, raw, files, read, skipped, log) -> dict:
    seen = _seen(root, old, o.dedup)
    bar = progress_bar(read, "dedup", "doc", o.progress)
    keep = asm.timed(records, "dedup", raw, log, asm.dedup, corpus, o.dedup, o.dedup_threshold, o.max_docs, seen, bar)
    dd = records["dedup"]
    if bar is not None:
        bar.close()
    kept = np.flatnonzero(keep)
    asm.check_not_empty(kept)
    lengths = corpus.per_doc(lambda sh: sh.token_lengths())[kept].astype(np.int64)
    names = _kept_names(corpus, kept)
    records["tokenize"] = {"tokens": int(lengths.sum()), "longest": int(lengths.max()),
                           "longer_than_seq_len": int((lengths > o.seq_len).sum())}
    emb = clusters = None
    if o.strategy == "datasculpt" or o.stats:
        emb = asm.timed(records, "embed", raw, log, asm.embed, corpus, kept, work / "emb.npy", o.seed, o.embed_model,
                        o.memory)
    if o.strategy == "datasculpt":
        clusters = asm.timed(records, "cluster", raw, log, asm.cluster, emb, lengths, o.seq_len, o.clusters, o.seed,
                             o.memory)
    items, where, split_info = asm.split_items(corpus, kept, names, lengths, o.seq_len, o.eval_fraction, log)
    if not items["train"].doc:
        raise DataError("every document landed in the eval split; lower --eval-fraction.")

    index = len(old["parts"]) if old else 0
    doc_base = old["totals"]["documents"] if old else 0
    st.remove_stale(root, old)
    tmp = st.new_part_dir(root, index)
    split_info_out = {}

    def pack_and_write():
        bar = progress_bar(int(lengths.sum()), "pack", "tok", o.progress)
        n_groups = 0
        for split in st.SPLITS:
            w = asm.SplitWriter(tmp, split, o.seq_len, dtype, tok.eos_id)
            n_groups += asm.pack_split(w, items[split], o.strategy, o.seq_len, corpus, kept, clusters, emb,
                                       o.group_tokens, doc_base, bar)
            stats = w.close()
            docs_in = int(np.isin(where, (st.SPLITS.index(split), 2)).sum())
            split_info_out[split] = {"samples": stats["samples"], "tokens": stats["tokens"], "documents": docs_in,
                                     "stats": stats if stats["samples"] else None}
        if bar is not None:
            bar.close()
        asm.write_doc_files(tmp, corpus, kept, names, lengths, where, o.dedup == "minhash")
        t = split_info_out["train"]["stats"]
        hom = t.get("homogeneity")
        rec = {"samples": t["samples"], "fill_rate": round(t["fill_rate"], 4),
               "split_fraction": round(t["split_fraction"], 4),
               "homogeneity": None if hom is None else round(hom, 4),
               "groups": n_groups, "group_tokens": o.group_tokens, **split_info}
        if hom is None:  # the manifest keeps null; the log line says why
            rec[asm.MISSING] = {"homogeneity": "not measured without document embeddings" if emb is None
                                else "no train sample holds two documents"}
        return None, rec

    asm.timed(records, "pack", raw, log, pack_and_write)
    for split in st.SPLITS:  # an empty split has no files, as before
        if not split_info_out[split]["samples"]:
            for f in tmp.glob(f"{split}.*"):
                f.unlink()
    name = st.publish_part(tmp, root, index)
    if emb is not None:
        emb.close()
    part = {
        "dir": name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "inputs": list(o.inputs),
        "documents": len(kept),
        "first_doc": doc_base,
        "counts": {
            "files": files, "documents_read": read, "skipped": dict(sorted(skipped.items())),
            "exact_duplicates": dd["exact_duplicates"], "near_duplicates": dd["near_duplicates"],
            "documents_kept": len(kept), "tokens": int(lengths.sum()), "raw_bytes": raw,
        },
        "splits": split_info_out,
        "stages": records,
    }
    manifest = _manifest(o, tok, dtype, old, part)
    st.write_manifest(root, manifest)
    tr = split_info_out["train"]
    shown = o.shown_as or root
    log(f"data build: wrote {shown} ({tr['samples']:,} train / {split_info_out['eval']['samples']:,} eval samples "
        f"of {o.seq_len} tokens; fill {tr['stats']['fill_rate']:.3f}, {len(kept):,} documents, "
        f"{dd['exact_duplicates'] + dd['near_duplicates']:,} duplicates removed, {skipped_text(skipped)})")
    return manifest


def _kept_names(corpus: asm.Corpus, kept: np.ndarray) -> list[str]:
    names = []
    for s, sh in enumerate(corpus.shards):
        lo, hi = int(corpus.starts[s]), int(corpus.starts[s + 1])
        mine = kept[(kept >= lo) & (kept < hi)] - lo
        if len(mine):
            all_names = sh.names()
            names.extend(all_names[j] for j in mine.tolist())
    return names


def _seen(root: Path, old: dict | None, mode: str):
    if old is None or mode == "none":
        return None, None
    hs, ss = [], []
    for part in old["parts"]:
        h, s = st.load_part_docs(root, part)
        hs.append(h)
        if s is not None:
            ss.append(s)
    sigs = np.concatenate(ss) if mode == "minhash" and ss else None
    return np.concatenate(hs), sigs


def _manifest(o: BuildOptions, tok, dtype, old: dict | None, part: dict) -> dict:
    parts = (old["parts"] if old else []) + [part]
    totals: dict = {"documents": 0, "tokens": 0, "duplicates_removed": 0, "files_skipped": 0,
                    "train_samples": 0, "eval_samples": 0}
    for p in parts:
        c = p["counts"]
        totals["documents"] += c["documents_kept"]
        totals["tokens"] += c["tokens"]
        totals["duplicates_removed"] += c["exact_duplicates"] + c["near_duplicates"]
        totals["files_skipped"] += sum(c["skipped"].values())
        totals["train_samples"] += p["splits"]["train"]["samples"]
        totals["eval_samples"] += p["splits"]["eval"]["samples"]
    # packing figures of the whole store (samples of different parts never mix)
    packing = {}
    for split in st.SPLITS:
        rows = [p["splits"][split] for p in parts if p["splits"][split]["samples"]]
        if not rows:
            continue
        samples = sum(r["samples"] for r in rows)
        tokens = sum(r["tokens"] for r in rows)
        docs = sum(r["documents"] for r in rows)
        packing[split] = {
            "fill_rate": tokens / (samples * o.seq_len),
            "split_fraction": sum(r["stats"]["split_fraction"] * r["documents"] for r in rows) / max(docs, 1),
            "docs_per_sample": sum(r["stats"]["docs_per_sample"] * r["samples"] for r in rows) / samples,
            "homogeneity": (sum(r["stats"]["homogeneity"] * r["samples"] for r in rows) / samples
                            if all(r["stats"].get("homogeneity") is not None for r in rows) else None),
        }
    return {
        "format": st.FORMAT,
        "version": st.VERSION,
        "seq_len": o.seq_len,
        "strategy": o.strategy,
        "dedup": o.dedup,
        "eval_fraction": o.eval_fraction,
        "seed": o.seed,
        "tokenizer": {"spec": o.tokenizer, "name": tok.name, "identity": tokenizer_identity(o.tokenizer),
                      "vocab_size": int(tok.vocab_size),
                      "eos_id": int(tok.eos_id), "pad_id": int(tok.eos_id)},
        "token_dtype": np.dtype(dtype).name,
        "inputs": [i for p in parts for i in p["inputs"]],
        "totals": totals,
        "packing": packing,
        "parts": parts,
    }
