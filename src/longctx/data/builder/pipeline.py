"""`longctx data build` and `longctx data merge`: inputs -> scan -> dedup -> embed -> cluster -> pack -> store.

A build streams: the scan (scan.py) reads the inputs shard by shard in worker processes and leaves
each document's text, tokens, cut points, hashes and features on disk in a work directory
(`OUT/.build`); the rest (assembly.py) reads them back in input order, a group at a time. So the
build's memory follows `--max-memory`, not the corpus: it sets how many workers scan at once and
how many tokens are packed per group.

- Resume: a build that was interrupted picks up its work directory and redoes only the shards whose
  scan had not finished (a different set of inputs or scan options starts over, and says so).
- One at a time: a build, append, shard scan or merge holds its --out directory while it runs (a lock); a
  second one into it is refused instead of deleting the first's files and mixing their parts.
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

import os
import shutil
from contextlib import contextmanager, suppress
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from ...config.tokenizer import tokenizer_identity
from ...durable import DirectoryInUse, lock_directory
from ...errors import DataError
from ...progress import current, phase, progress_bar
from .. import store
from ..store_template import check_append_template, merged_template, template_record
from ..tokenizer import load_tokenizer, tokenizer_digest
from . import disk_full, scan
from .assembly import Assembly
from .options import BuildOptions, check_options
from .out_dir import WORK, check_out, check_parts
from .readers import unit_format
from .scan import ScannedShard
from .scan_progress import ShardsRead
from .timing import timed

# what a scan's plan does not record of its build's options (its own place and display, and the chat template, which
# it records apart: the one its conversations are rendered with, which the store records, a merge the scans')
_NOT_BUILD_SETTINGS = ("out", "shown_as", "progress", "shard", "append", "chat_template")


def scan_inputs(opts: BuildOptions, work: Path, machine: tuple[int, int], log) -> dict:
    """Scan machine `machine`'s share of the inputs into `work` (resuming what is there); its plan."""
    tok = load_tokenizer(opts.tokenizer)
    sopts = opts.scan_options()
    units, other = scan.plan_units(opts.inputs, opts.out)
    if opts.response_field or opts.messages_field:
        _refuse_json_text(units, "--messages-field" if opts.messages_field else "--response-field")
    shards = scan.plan_shards(units)
    digest = scan.plan_digest(units, sopts)
    todo = scan.machine_range(shards, *machine)
    resume = scan.resume_key(units, opts.max_docs)
    plan = scan.read_plan(work)
    if plan is not None and (plan["digest"] != digest or plan["machine"] != list(machine)
                             or plan.get("resume") != resume):
        log(f"  {work} holds an unfinished build of other inputs (or inputs changed since), another tokenizer, "
            f"--max-docs or scan options; starting over")
        shutil.rmtree(work)
        plan = None
    elif plan is None and (work / scan.SHARDS).exists():
        # shards without the plan they were scanned under (a removal of the work directory cut short): of
        # unknown inputs, never resumed (they would stand in for this build's first shards)
        log(f"  {work} holds scanned shards without their plan; starting over")
        shutil.rmtree(work / scan.SHARDS)
    build = {k: v for k, v in asdict(opts).items() if k not in _NOT_BUILD_SETTINGS}
    plan = {"format": scan.FORMAT, "version": scan.VERSION, "digest": digest, "resume": resume,
            "options": asdict(sopts),
            "build": build, "token_dtype": np.dtype(store.token_dtype(tok.vocab_size)).name,
            "tokenizer_digest": tokenizer_digest(opts.tokenizer),  # (what a merge checks its tokenizer file against)
            **({"chat_template": template_record(opts.tokenizer)} if opts.messages_field else {}),  # (recorded)
            "shards": len(shards), "machine": list(machine), "range": [todo.start, todo.stop],
            "other_suffix": other if machine[0] == 0 else 0,
            "bytes": sum(u.size for s in shards[todo.start:todo.stop] for u in s)}
    scan.write_plan(work, plan)
    done = [i for i in todo if (scan.shard_dir(work, i) / "shard.json").is_file()]
    done = _drop_damaged(work, done, plan, log)
    if done:
        log(f"  scan      resuming: {len(done)} of {len(todo)} shards already scanned in {work}")
    bar = progress_bar(plan["bytes"], "scan", "B", opts.progress)
    if bar is not None:
        bar.unit_scale = True
    progress = current()  # the scan stage's phase (timing.py): MB of input scanned
    progress.expect(plan["bytes"] / 1e6, "MB")
    # (each shard's bytes read so far, also those a worker process is reading: scan_progress.py; a shard scanned
    # before a resume is counted as the scan skips it)
    read = ShardsRead(len(shards), opts.scan_workers)
    progress.follow(lambda: read.total() / 1e6)

    def scanned_shard(_counts, size):
        if bar is not None:
            bar.update(size)

    counts = scan.run_scans(work, shards, todo, sopts, plan["token_dtype"], opts.scan_workers, opts.max_docs,
                            on_done=scanned_shard, read=read)
    if bar is not None:
        bar.close()
    plan["complete"] = [c["index"] for c in counts]
    return plan


def _drop_damaged(work: Path, done: list[int], plan: dict, log) -> list[int]:
    """The shards of `done` whose files hold what their shard.json says; each other one (cut short or lost since
    it was scanned: a disk full, a copy, a hand) is removed, said, and scanned again, where it was read as it
    is (a traceback in the packing, or shorter texts) or failed on a missing file."""
    whole = []
    for i in done:
        d = scan.shard_dir(work, i)
        try:
            hurt = ScannedShard(d, plan["token_dtype"], plan["options"]["dedup"] == "minhash").damage()
        except (OSError, ValueError, KeyError) as e:  # (its shard.json itself)
            hurt = f"shard.json: {type(e).__name__}: {e}"
        if hurt is None:
            whole.append(i)
        else:
            log(f"  scan      {d} is damaged ({hurt}): scanning it again")
            shutil.rmtree(d)
    return whole


def _scan_stage(opts: BuildOptions, work: Path, machine: tuple[int, int], log) -> tuple[tuple, dict]:
    """((plan, the scanned shards), counts) of the scan stage."""
    plan = scan_inputs(opts, work, machine, log)
    shards = scanned(work, plan)
    return (plan, shards), {"shards": len(shards), "documents": sum(s.n for s in shards),
                            "mb": round(sum(s.counts["bytes"] for s in shards) / 1e6, 2)}


def scanned(work: Path, plan: dict) -> list[ScannedShard]:
    minhash = plan["options"]["dedup"] == "minhash"
    lo, hi = plan["range"]
    out = []
    for i in range(lo, hi):
        d = scan.shard_dir(work, i)
        if not (d / "shard.json").is_file():
            break  # --max-docs stopped the scan here; later shards are not needed
        out.append(ScannedShard(d, plan["token_dtype"], minhash))
    return out


# ----------------------------------------------------------------------------------------------
# build and merge


def _open_store(opts: BuildOptions, tok, merge: bool = False) -> tuple[Path, dict | None]:
    root = Path(opts.out)
    old = None
    if (root / store.MANIFEST).is_file():
        if not opts.append:
            how = ("a merge writes a new store: choose another --out" if merge else
                   "pass --append to add documents to it, or choose another --out")
            raise DataError(f"'{root}' already holds a data store; {how}.")
        old = store.read_manifest(root)
        check_parts(root, old)
        # (eval_fraction: a document's revision, under its name, is held out as its first version was)
        for key, want in (("seq_len", opts.seq_len), ("strategy", opts.strategy),
                          ("holdout_tokens", opts.holdout_len), ("eval_fraction", opts.eval_fraction)):
            had = old.get(key, old["seq_len"])  # (a store from before holdout_tokens: its seq_len)
            if had != want:
                raise DataError(f"the store '{root}' was built with {key} {had}; an append must use the same (got "
                                f"{want}: pass --{key.replace('_', '-')} {had}).")
        if old["tokenizer"]["spec"] != opts.tokenizer:
            raise DataError(f"the store '{root}' was built with tokenizer {old['tokenizer']['spec']!r}; an append "
                            f"must use the same (got {opts.tokenizer!r}).")
        recorded = old["tokenizer"].get("identity")  # (a store from before it was recorded: its spec alone)
        now = tokenizer_identity(opts.tokenizer)
        if recorded and recorded != now:
            raise DataError(f"the tokenizer file {opts.tokenizer} is not the one the store '{root}' was built with "
                            f"(its content has changed since: {recorded[:19]} then, {now[:19]} now); an append "
                            f"would store other token ids under the same manifest. Restore that file, or rebuild "
                            f"the store (all its inputs) into a new --out.")
        if opts.messages_field:
            check_append_template(root, old, opts.tokenizer)
        had = store.text_prefix(old)
        if had != tok.text_prefix():  # (a store from before documents began with it: its parts would mix)
            raise DataError(f"the store '{root}' holds documents that begin with {had or 'no special tokens'}, but "
                            f"this version of longctx begins each with the tokenizer's own prefix "
                            f"{tok.text_prefix()}; an append would mix the two. Rebuild the store (all its inputs) "
                            f"into a new --out.")
        had = old["tokenizer"].get("eos_id")
        if had is not None and int(had) != tok.eos_id:  # (a store from before the EOS was a special token first)
            raise DataError(f"the store '{root}' ends its documents with token id {had}, but this version of longctx "
                            f"ends each with {tok.eos_id}, the tokenizer's special end-of-document token (before "
                            f"2026-12-07 the first candidate string in its vocabulary, a plain word there); an append "
                            f"would mix the two. Rebuild the store (all its inputs) into a new --out.")
    return root, old


@contextmanager
def _exclusive(out: Path, scan_dir: bool = False):
    """`out` (created if missing) held by this build, append, shard scan or merge until it ends: a second
    one into the same directory while it runs is refused. Unchecked, the second would delete the first's
    scan and unlisted part (as stale) and the two would publish over each other, leaving one's manifest
    over the other's part. A lock on the directory itself (flock), so it leaves no file behind and a
    killed build never holds it. A build that fails before writing anything into an `out` it created
    removes it again (an empty --out left behind looked like a store that had lost its files)."""
    check_out(out, scan_dir)
    created = [d for d in (out, *out.parents) if not d.exists()]  # (deepest first)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out '{out}' cannot be created ({e.strerror}); choose a directory you can write.") from None
    try:  # (None: a file system without locks, some network mounts: build as before, unguarded)
        fd = lock_directory(out)
    except DirectoryInUse:
        # (refused, it removes nothing: the build holding it may have found it missing too, and not written yet)
        raise DataError(f"another `longctx data build` or `data merge` is writing to '{out}' now; wait for it to "
                        f"end, or choose another --out.") from None
    try:
        yield
    except BaseException:
        with suppress(OSError):
            for d in created:
                d.rmdir()  # only while empty: a started scan stays, to be resumed
        raise
    finally:
        if fd is not None:
            os.close(fd)  # (releases the lock)


@contextmanager
def _said_if_disk_full(out: Path, scan_dirs: list[Path], append: bool, scans_in_out: bool = True):
    """A full disk (or quota) inside: a DataError naming `out`, its free space and the space the build needs
    there (disk_full.py), from the scans in `scan_dirs` (a build's work directory, or a merge's scans)."""
    try:
        yield
    except OSError as e:
        if not disk_full.is_disk_full(e):
            raise
        need = None
        with suppress(OSError, ValueError, KeyError, TypeError, DataError):  # (an estimate: never the error itself)
            plans = [scan.read_plan(d) for d in scan_dirs]
            if all(plans):
                need = disk_full.space_needed([s for d in scan_dirs for s in disk_full.shard_dirs(d)],
                                              sum(p["range"][1] - p["range"][0] for p in plans),
                                              sum(map(disk_full.input_bytes, plans)),
                                              disk_full.token_itemsize(plans[0]), disk_full.per_document(plans[0]),
                                              scans_in_out)
        raise disk_full.disk_full_error(e, out, need, append) from e


def _describe(opts: BuildOptions, tok) -> str:
    workers = opts.scan_workers
    return (f"(seq_len {opts.seq_len}, {opts.strategy}, dedup {opts.dedup}, {tok.name} tokenizer, {workers} "
            f"worker{'s' if workers != 1 else ''}, max memory {opts.memory / 2**20:.0f}MB)")


def json_read_as_text(paths: list[Path]) -> list[Path]:
    """The .json files (also .json.gz / .json.zst) among `paths`: each read as one plain text document (a code
    corpus' package.json), which a build of records (--response-field, --messages-field) would train on whole,
    a JSON array of conversations or pairs with its prompts and its JSON syntax. Records are read from JSON Lines."""
    found = []
    for path in paths:
        fmt, compression = unit_format(path)
        name = path.name.lower()
        if fmt == "text" and Path(name[: -len(compression)] if compression else name).suffix == ".json":
            found.append(path)
    return found


def _refuse_json_text(units: list, flag: str) -> None:
    """A DataError for .json files among a build of records' inputs: each would be one plain text document, trained
    on whole (a JSON array of conversations or pairs: its prompts, role names and JSON syntax), where the user meant
    its records (json_read_as_text)."""
    found = json_read_as_text([Path(u.path) for u in units])
    if found:
        more = f" (and {len(found) - 1} more .json file{'s' if len(found) > 2 else ''})" if len(found) > 1 else ""
        stem = found[0].name[:found[0].name.lower().rindex(".json")]
        raise DataError(f"{flag} reads its records from .jsonl, .parquet and .arrow files, but '{found[0]}'{more} is "
                        f"a .json file, which longctx reads as one plain text document, trained on whole (its "
                        f"prompts and JSON syntax too). Convert it to JSON Lines, one record a line (for a JSON "
                        f"array: jq -c '.[]' {found[0].name} > {stem}.jsonl), or move it out of the input.")


def build_store(opts: BuildOptions, log=print) -> dict:
    """Build (or append to) the store at `opts.out`; returns its manifest. With `opts.shard`, only scan
    that share of the inputs into `opts.out` (for `merge_scans`) and return its plan."""
    check_options(opts)
    tok = load_tokenizer(opts.tokenizer)
    if opts.shard is not None:
        out = Path(opts.out)
        if (out / store.MANIFEST).is_file():
            raise DataError(f"--out '{out}' holds a data store; a --shard scan goes to a directory of its own.")
        i, n = opts.shard
        log(f"data build: {', '.join(opts.inputs)} shard {i}/{n} -> {out} {_describe(opts, tok)}")
        records: dict = {}
        with _exclusive(out, scan_dir=True), _said_if_disk_full(out, [out], False), \
                phase(f"data build of shard {i}/{n}", done_line=False):
            plan, shards = timed(records, "scan", None, log, _scan_stage, opts, out, opts.shard, log)
        docs = sum(s.n for s in shards)
        log(f"data build: scanned shard {i}/{n} into {out} ({docs:,} documents); combine all {n} with "
            f"`longctx data merge`")
        return plan
    with _exclusive(Path(opts.out)):
        root, old = _open_store(opts, tok)  # (under the lock: a build that just ended may have written it)
        shown = opts.shown_as or root
        log(f"data build: {', '.join(opts.inputs)} -> {shown} {_describe(opts, tok)}")
        work = root / WORK
        records: dict = {}
        with _said_if_disk_full(root, [work], opts.append), phase("data build"):  # (the line above says of what)
            plan, shards = timed(records, "scan", None, log, _scan_stage, opts, work, (0, 1), log)
            opts = replace(opts, chat_template=plan.get("chat_template"))  # (what rendered the scan, recorded)
            manifest = Assembly(opts, root, old, tok, shards, plan.get("other_suffix", 0), work, records, log).run()
        (work / scan.PLAN).unlink(missing_ok=True)  # first: a removal cut short leaves nothing a later build resumes
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _scan_settings(build: dict) -> dict:
    """A scan's build options less those each machine chooses for itself (its processes and memory), which
    change no document: the merge runs with its own (--workers, --max-memory) or the first scan's; and a
    --dedup-threshold without minhash, which changes none either (scans before 3151722 took it)."""
    mine = ("workers", "max_memory") + (("dedup_threshold",) if build.get("dedup") != "minhash" else ())
    return {k: v for k, v in build.items() if k not in mine}


def _check_cover(plans: list[tuple[dict, Path]], n: int) -> None:
    """The scans (sorted by machine) are those of `--shard 0/n` ... `--shard n-1/n`, once each, and their shard
    ranges follow one another over all the input's shards: scans of `--shard 0/2` and `--shard 1/3` would
    otherwise merge into a store that silently lacks part of the input."""
    other = [f"'{d}' (--shard {p['machine'][0]}/{p['machine'][1]})" for p, d in plans if p["machine"][1] != n]
    if other:
        raise DataError(f"data merge needs the scans of one `--shard i/{n}` run, but {', '.join(other)} split the "
                        f"input into another number of machines; scan it again with --shard i/{n}.")
    got = [p["machine"][0] for p, _ in plans]
    if got != list(range(n)):
        missing = sorted(set(range(n)) - set(got))
        raise DataError(f"data merge needs the scans of all {n} shards, once each; got shards {got}"
                        + (f" (missing {missing})" if missing else "") + ".")
    ends = [0] + [p["range"][1] for p, _ in plans]
    if [p["range"][0] for p, _ in plans] != ends[:-1] or ends[-1] != plans[0][0]["shards"]:
        ranges = ", ".join(f"{p['machine'][0]}/{n}: {p['range']}" for p, _ in plans)
        raise DataError(f"the scans' shares of the input ({ranges}) do not cover its {plans[0][0]['shards']} "
                        f"shards once each; scan them again with one longctx, each with its --shard i/{n}.")


def merge_scans(dirs: list[str], out: str, workers: int = 0, max_memory: int = 0, progress: bool = True,
                log=print) -> dict:
    """`longctx data merge`: the store of the scans of `--shard 0/n` ... `--shard n-1/n`."""
    plans = []
    for d in dirs:
        p = scan.read_plan(Path(d))
        if p is None or p.get("format") != scan.FORMAT:
            raise DataError(f"'{d}' is not a scan directory of `longctx data build --shard i/n` (no {scan.PLAN}).")
        if p.get("version") != scan.VERSION:
            raise DataError(f"'{d}' was scanned by another version of longctx (scan version {p.get('version')}, this "
                            f"one merges {scan.VERSION}); run its `longctx data build --shard i/n` again.")
        plans.append((p, Path(d)))
    plans.sort(key=lambda pd: pd[0]["machine"][0])
    first = plans[0][0]
    n = first["machine"][1]
    rendered_by = merged_template(plans, log)  # (first: two templates are that, not "other options")
    for p, d in plans:
        if p["digest"] != first["digest"] or _scan_settings(p["build"]) != _scan_settings(first["build"]):
            raise DataError(f"'{d}' was scanned from other inputs or with other options than '{plans[0][1]}'; "
                            f"merge the scans of one `data build --shard i/n` run.")
    _check_cover(plans, n)
    shards = []
    for p, d in plans:
        have = scanned(d, p)
        if len(have) != p["range"][1] - p["range"][0]:
            raise DataError(f"the scan in '{d}' (shard {p['machine'][0]}/{n}) is unfinished: run its "
                            f"`longctx data build --shard {p['machine'][0]}/{n}` again to complete it.")
        for shard in have:
            hurt = shard.damage()
            if hurt is not None:
                raise DataError(f"the scan in '{d}' (shard {p['machine'][0]}/{n}) is damaged: {shard.path} says "
                                f"{shard.n} documents, but {hurt} (a copy cut short?); copy it again, or run its "
                                f"`longctx data build --shard {p['machine'][0]}/{n}` again.")
        shards.extend(have)
    built = first["build"]
    if built.get("dedup") != "minhash":  # (a threshold without minhash, which scans before 3151722 took and ignored)
        built = {**built, "dedup_threshold": BuildOptions.dedup_threshold}
    opts = BuildOptions(**{**built, "out": out, "progress": progress, "workers": workers or built["workers"],
                           "max_memory": max_memory or built["max_memory"], "chat_template": rendered_by})
    check_options(opts)  # (the scans' own were checked by their builds; --workers and --max-memory are new)
    if "tokenizer_digest" in first and tokenizer_digest(opts.tokenizer) != first["tokenizer_digest"]:
        raise DataError(f"the tokenizer file {opts.tokenizer} is not what the scans were tokenized with: its content "
                        f"has changed since they were made, or (scans made before 2026-12-07) this version of "
                        f"longctx ends documents with another end-of-document token of it (its special one, not a "
                        f"plain word); the store would record it for tokens of the other. Restore that file if it "
                        f"changed, or scan again with this one (`longctx data build --shard i/n`).")
    tok = load_tokenizer(opts.tokenizer)
    with _exclusive(Path(out)):
        root, old = _open_store(opts, tok, merge=True)
        log(f"data merge: {len(dirs)} scans -> {root} {_describe(opts, tok)}")
        records = {"scan": {"shards": len(shards), "machines": n}}
        with _said_if_disk_full(root, [Path(d) for d in dirs], False, scans_in_out=False), phase("data merge"):
            manifest = Assembly(opts, root, old, tok, shards, first.get("other_suffix", 0), root / WORK, records,
                                log).run()
        shutil.rmtree(root / WORK, ignore_errors=True)  # (its embeddings; the scans stay where they are)
    return manifest
