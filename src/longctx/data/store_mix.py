"""A weighted blend of several stores' samples (`data.path = "books,code"`, `data.weights = "0.7,0.3"`):
what Megatron's `--data-path 0.7 a 0.3 b` gives, and long-context recipes (upsampled long books mixed
with short text) rely on.

`StoreMix` is one sample set over the stores of one split. Blend sample k (k = 0, 1, ... without end)
is sample `perm_s[e][j]` of store s, where s is the store the blend's schedule gives position k,
j its count of earlier positions of store s, and `perm_s[e]` store s's own seeded permutation of its
e-th epoch: each store cycles its epochs on its own, so a small store with a large weight repeats.

The schedule keeps every prefix of the blend within one sample of its weights: after k samples,
|count_s - w_s k| < 1 for every store. The plain greedy (the store with the largest w_s (k + 1) -
count_s) does not quite: with many stores it strays past one sample (five weighed 12:1:1:12:3: 1.03, tested;
up to ~1.1 seen in random trials of 2-5 stores); Tijdeman's rule
(1980, "the chairman assignment problem") does, within 1 - 1/(2n - 2) for n stores: among the stores
at least 1/(2n - 2) behind, the one whose next sample falls due first (w_s (k + 1) - count_s is the
same greedy deficit), ties to the lower index.

The training order of a mix is the blend itself (`sample_order`, read by data/loader.py BatchLoader):
no shuffle over it, which would break the weights at every prefix; its state is still the one
global cursor of SampleOrder, so checkpoints, resumes, data-parallel balance (`costs`) and rank reads
(`frames`, `read_at`, `label_count`: each row read from its store) work as for one store. `len` is
the stores' samples together (one "blend epoch"), what a resume compares and the epochs are said of.

A resume on an edited mix (other weights, a store added or dropped; under --checkpoint.allow_changes) goes on
from each store's own place: the data position records how many samples each store had given (with its identity,
in the mix's order: `blend_position`; a store and its copy at another path, one identity, are two counts) and
the key each store's permutations are drawn from (its place in the mix the run began with: a store that moves to
another place goes on in its own order, not the order of its new place; a store and its copy listed the other way
round, which the mix's identity cannot see, is an edited mix too: `relisted`), and
from the resumed position on the blend's schedule starts afresh under the new weights, each store numbering its
samples on from its count (`continue_from`). The same cursor in the new blend would
map to other counts (count_s ~ w_s k under the new weights), repeating samples of a store weighed down and
skipping some of one weighed up. The schedule's start is part of the position, so a later resume goes on exactly.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from ..config.tokenizer import stored_identity
from ..errors import ConfigError
from .loader import Frames, PackedSamples, SampleSet
from .samples import Batch, SampleOrder
from .store import text_prefix
from .store_identity import layout_of


class BlendOrder(SampleOrder):
    """The blend's positions in order, k = cursor (no shuffle: the stores' own permutations are the
    shuffle); the state is SampleOrder's one cursor."""

    def _order(self, epoch: int) -> np.ndarray:
        return np.arange(epoch * self.num_samples, (epoch + 1) * self.num_samples)


def blend_schedule(weights: np.ndarray, start_counts: list[int], first: int, n: int) -> np.ndarray:
    """The store of blend positions first .. first + n - 1, given each store's count before `first`
    (updated in place): Tijdeman's chairman assignment (module docstring)."""
    w = [float(x) for x in weights]
    stores = range(len(w))
    slack = 1.0 / (2 * len(w) - 2)
    counts, out = start_counts, np.empty(n, dtype=np.int64)
    for k in range(first, first + n):
        behind = [i for i in stores if w[i] > 0 and w[i] * (k + 1) - counts[i] >= slack - 1e-12]
        s = min(behind or [i for i in stores if w[i] > 0], key=lambda i: ((counts[i] + 1 - slack) / w[i], i))
        out[k - first] = s
        counts[s] += 1
    return out


def store_name(path: str, paths: list[str]) -> str:
    """A store's short name in messages: its directory's name, or its path where two names would clash."""
    name = Path(path).name or path
    return name if sum((Path(p).name or p) == name for p in paths) == 1 else path


class StoreMix(SampleSet):
    reads_by_position = True

    def __init__(self, stores: list[PackedSamples], paths: list[str], weights: list[float] | None, seed: int):
        self.stores, self.paths, self.seed = stores, list(paths), seed
        self.names = [store_name(p, self.paths) for p in self.paths]
        self.root = ",".join(self.paths)  # (what messages name as the data read)
        sizes = np.asarray([len(s) for s in stores], dtype=np.float64)
        raw = np.asarray(weights if weights else sizes, dtype=np.float64)
        with np.errstate(over="ignore"):  # (finite weights whose sum overflows, 1e308,1e308: scaled down first)
            overflows = not np.isfinite(raw.sum())
        raw = raw / raw.max() if overflows else raw  # (any other weights as they always were, to the last bit)
        self.weights = raw / raw.sum()
        self.seq_len, self.doc_mask = stores[0].seq_len, stores[0].doc_mask
        self.num_samples = int(sizes.sum())
        # the schedule runs from blend position `_first` (0, or where a resume on an edited mix began), each store
        # numbering its samples on from `_start[s]` (what it had given before); positions are counted from `_first`
        self._first, self._start = 0, [0] * len(stores)
        self._known_from(0, [0] * len(stores))
        # each store's permutations are drawn from its key, kept over a resume on an edited mix (a store that moves
        # to another place goes on in its own order); a run's stores start with their places
        self._keys = list(range(len(stores)))
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self.identity = mix_identity(stores, self.names, self.weights)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def weighed_samples(self) -> int:
        """The samples of the stores the blend draws from (weight > 0): what an evaluation of the blend can read
        without repeating one (`len` counts every store's, what a resume compares)."""
        return int(sum(len(s) for s, w in zip(self.stores, self.weights) if w > 0))

    def sample_order(self, seed: int) -> BlendOrder:
        return BlendOrder(self.num_samples, seed)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.stores)

    @property
    def tokenizer_spec(self) -> str:
        return self.stores[0].tokenizer_spec

    @property
    def text_prefix(self) -> list[int]:
        return self.stores[0].text_prefix

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self.stores)

    def _known_from(self, origin: int, counts: list[int]) -> None:
        """Forget the schedule known so far: it is known from position `origin` (counted from `_first`) on, where
        each store had given `counts` (counted from `_first`). The chairman assignment at a position depends only on
        the position and the counts there, so a resume at position r with the counts its data position recorded
        goes on with the schedule the run had, without computing the r positions before it."""
        self._origin = origin
        self._choice = np.zeros(0, dtype=np.int64)  # the schedule from `_origin` on, extended as far as it is read
        self._ordinal = np.zeros(0, dtype=np.int64)  # each position's count of earlier ones of its store
        self._counts = list(counts)  # each store's count at the end of `_choice`
        self._counted = (origin, np.asarray(counts, dtype=np.int64))  # (a position, each store's count before it)

    def _extend(self, upto: int) -> None:
        """The schedule known through position upto - 1 (extended by doubling: a resume far into a run
        computes it once); from position 0 again where upto falls before what is known (a rollback past a
        resume)."""
        if upto <= self._origin and self._origin:
            self._known_from(0, [0] * len(self.stores))
        have = self._origin + len(self._choice)
        if upto <= have:
            return
        n = max(upto - have, len(self._choice), 1024)
        before = list(self._counts)
        choice = blend_schedule(self.weights, self._counts, have, n)
        ordinal = np.empty(n, dtype=np.int64)
        for s in range(len(self.stores)):
            mine = choice == s
            ordinal[mine] = before[s] + np.arange(int(mine.sum()))
        self._choice, self._ordinal = np.concatenate([self._choice, choice]), np.concatenate([self._ordinal, ordinal])

    def _permutation(self, s: int, epoch: int) -> np.ndarray:
        key = (s, epoch)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.stores):  # (a run reads each store's epochs in order)
                self._perms.clear()
            rng = np.random.default_rng([self.seed, 0x4D4958, self._keys[s], epoch])
            self._perms[key] = rng.permutation(len(self.stores[s]))
        return self._perms[key]

    def locate(self, k: int) -> tuple[int, int]:
        """Blend position k -> (its store, the sample of that store)."""
        r = k - self._first
        if r < 0:
            raise IndexError(f"blend position {k} < {self._first}, where this run's schedule of the mix starts")
        self._extend(r + 1)
        s = int(self._choice[r - self._origin])
        epoch, pos = divmod(self._start[s] + int(self._ordinal[r - self._origin]), len(self.stores[s]))
        return s, int(self._permutation(s, epoch)[pos])

    def _given(self, k: int) -> list[int]:
        """Each store's samples given before blend position k (k at least the schedule's start)."""
        r = k - self._first
        self._extend(r + 1)  # (the position k too: so that r is never before the known schedule's origin)
        done, counts, o = *self._counted, self._origin
        if r < done:  # (a rollback's position: the positions rolled back taken off, not counted again from 0)
            counts = counts - np.bincount(self._choice[r - o:done - o], minlength=len(self.stores))
        else:
            counts = counts + np.bincount(self._choice[done - o:r - o], minlength=len(self.stores))
        self._counted = (r, counts)
        return [int(a + b) for a, b in zip(self._start, counts)]

    def blend_position(self, k: int) -> dict:
        """What a data position at blend position k records of the mix: where this schedule started (`from`, each
        store's count there) and each store's count at k (`given`), each with the store's identity, in the mix's order,
        and the stores' names in that order (`names`: a store rebuilt in place, under another identity, goes on from
        its count; of a store and its copy, one identity, each from its own)."""
        ids = [store.identity["identity"] for store in self.stores]
        return {"from": self._first, "start": [list(p) for p in zip(ids, self._start)],
                "given": [list(p) for p in zip(ids, self._given(k))], "names": list(self.names),
                "keys": list(self._keys)}

    def relisted(self, record: dict) -> bool:
        """Whether a data position of this mix's identity (its stores' contents and weights, in order) has its stores
        in other places: a store and its copy at another path (one identity) listed the other way round, which the
        identity cannot see but the names recorded do. Each store goes on from its own count then, so the mix is
        taken up as an edited one (continue_from with same=False), not in the schedule it was in."""
        ids = [store.identity["identity"] for store in self.stores]
        return _own_entries(record["given"], record.get("names") or [], ids, self.names) != list(range(len(ids)))

    def continue_from(self, cursor: int, record: dict, same: bool) -> list[str]:
        """Go on from a data position's `record` (blend_position) at blend position `cursor`: on the same mix, the
        schedule it was in; on an edited one, a schedule starting at `cursor` under this mix's weights, each store
        from its own count then (_own_entries: a store and its copy at another path, one identity, each from its own;
        a store rebuilt, of another identity, from the count of the store of its name it replaces; 0 for one the
        position does not know). Returns how far each store had gone (the stores' names with their counts), for the
        resume's note. Everything is read from the record before the mix changes: a record it cannot read leaves
        the mix as it was."""
        ids, entries = [store.identity["identity"] for store in self.stores], record["start" if same else "given"]
        own = _own_entries(entries, record.get("names") or [], ids, self.names)
        rebuilt = [None] * len(ids) if same else _rebuilt_entries(own, record.get("names") or [], self.names)
        first = int(record["from"]) if same else int(cursor)
        taken = [mine if mine is not None else other for mine, other in zip(own, rebuilt)]
        start = [0 if i is None else int(entries[i][1]) for i in taken]
        keys = _kept_keys(taken, record.get("keys") or list(range(len(entries))))
        # (on the same mix the record's lists follow the mix's stores: the counts at the cursor are known too)
        in_order = same and [ident for ident, _ in record["given"]] == ids == [ident for ident, _ in record["start"]]
        known = [int(g) - n for (_, g), n in zip(record["given"], start)] if in_order and cursor >= first else None
        if keys != self._keys:
            self._keys, self._perms = keys, {}
        # the schedule known so far stands (a rollback's, a read-ahead dropped) unless this position falls before it
        if ((first, start) != (self._first, self._start) or not len(self._choice)
                or cursor - first < self._origin):
            self._first, self._start = first, start
            if known is not None:  # (the counts at the cursor: go on from there)
                self._known_from(cursor - first, known)
            else:
                self._known_from(0, [0] * len(self.stores))
        said = ["" if mine is not None else " (new)" if other is None else " (rebuilt)"
                for mine, other in zip(own, rebuilt)]
        return [f"{name} at sample {n:,}{how}" for name, n, how in zip(self.names, self._start, said)]

    def _by_store(self, indices) -> list[tuple[int, np.ndarray, list[int]]]:
        """Rows of `indices` grouped by store: (store, the rows' places in `indices`, their samples there)."""
        where = [self.locate(int(k)) for k in indices]
        groups = []
        for s in sorted({s for s, _ in where}):
            rows = np.asarray([r for r, (t, _) in enumerate(where) if t == s], dtype=np.int64)
            groups.append((s, rows, [where[r][1] for r in rows]))
        return groups

    def stores_of(self, indices) -> np.ndarray:
        """The store of each blend position (e.g. to count the blend's realised fractions)."""
        return np.asarray([self.locate(int(k))[0] for k in indices], dtype=np.int64)

    def label_counts(self, indices) -> list[int]:
        """The labelled tokens of `indices` in each store, from the stores' segment indices (no token read):
        what label_count sums, and each store's eval loss divides by (train/evaluation.py)."""
        counts = [0] * len(self.stores)
        for s, _, local in self._by_store(indices):
            counts[s] = self.stores[s].label_count(local)
        return counts

    def label_count(self, indices) -> int:
        return sum(self.label_counts(indices))

    def sequence_count(self, indices) -> int:
        """Trained sequences of `indices` (train.loss_weighting = sequence), each store's from its index."""
        return sum(self.stores[s].sequence_count(local) for s, _, local in self._by_store(indices))

    def costs(self, a: float, b: float) -> BlendCosts:
        return BlendCosts(self, [s.costs(a, b) for s in self.stores])

    def frames(self, indices) -> Frames:
        n, parts = len(indices), [(rows, self.stores[s].frames(local)) for s, rows, local in self._by_store(indices)]
        field = lambda name: _rows_in_order(n, [(rows, getattr(f, name)) for rows, f in parts])  # noqa: E731
        return Frames(field("positions"), field("doc_ids"), field("labelled"), field("real"))

    def read_at(self, indices, frames: Frames, held: np.ndarray | None) -> Batch:
        """Each store's rows read from it (PackedSamples.read_at), back in the order of `indices`."""
        n, parts = len(indices), []
        for s, rows, local in self._by_store(indices):
            sub = Frames(*(None if a is None else a[rows] for a in (frames.positions, frames.doc_ids, frames.labelled,
                                                                     frames.real)))
            parts.append((rows, self.stores[s].read_at(local, sub, None if held is None else held[rows])))
        field = lambda name: _rows_in_order(n, [(rows, getattr(b, name)) for rows, b in parts])  # noqa: E731
        return Batch(field("tokens"), field("labels"), field("positions"), field("doc_ids"), field("real"))

    def batch(self, indices) -> Batch:
        indices = list(indices)
        return self.read_at(indices, self.frames(indices), None)

    def sample(self, k: int):
        s, j = self.locate(int(k))
        return self.stores[s].sample(j)


class BlendCosts:
    """The estimated cost of blend positions, by position (data/balance.py indexes it as an array)."""

    def __init__(self, mix: StoreMix, per_store: list[np.ndarray]):
        self.mix, self.per_store = mix, per_store

    def __getitem__(self, k) -> float:
        s, j = self.mix.locate(int(k))
        return float(self.per_store[s][j])


def _rows_in_order(n: int, parts: list[tuple[np.ndarray, object]]):
    """Row blocks (numpy arrays or tensors) put back at their rows of an n-row whole; None stays None."""
    if parts[0][1] is None:
        return None
    first = parts[0][1]
    if isinstance(first, torch.Tensor):
        out = first.new_empty((n, *first.shape[1:]))
        for rows, block in parts:
            out[torch.from_numpy(rows)] = block
        return out
    out = np.empty((n, *first.shape[1:]), dtype=first.dtype)
    for rows, block in parts:
        out[rows] = block
    return out


def _own_entries(entries: list, saved_names: list[str], ids: list[str], names: list[str]) -> list[int | None]:
    """Which of a position's `entries` ([identity, count] per store, in the order of the mix it was saved on;
    `saved_names` their names, [] in a position saved before names were recorded) each store of the mix goes on
    from; None for a store whose identity has no entry left. Stores of one identity (a store and its copy at another
    path) each keep their own count, which a lookup by identity would make one: each takes the entry of its identity
    and its name, else the next one of its identity in the entries' order (the mix's order)."""
    free: dict[str, list[int]] = {}
    for i, (ident, _) in enumerate(entries):
        free.setdefault(ident, []).append(i)
    chosen: list[int | None] = []
    for ident, name in zip(ids, names):  # (first by name: a copy dropped or another added leaves the others theirs)
        i = next((i for i in free.get(ident, []) if i < len(saved_names) and saved_names[i] == name), None)
        if i is not None:
            free[ident].remove(i)
        chosen.append(i)
    for s, ident in enumerate(ids):
        if chosen[s] is None and free.get(ident):
            chosen[s] = free[ident].pop(0)
    return chosen


def _kept_keys(taken: list[int | None], saved: list[int]) -> list[int]:
    """Each store's permutation key: the key of the entry it goes on from (`taken`, _own_entries or
    _rebuilt_entries; `saved`: the position's keys, its stores' places in one saved before keys were recorded,
    which were the keys then); a store new to the mix takes its place if no other store holds that key, else the
    lowest free one."""
    keys = [None if i is None else int(saved[i]) for i in taken]
    for s, key in enumerate(keys):
        if key is None:
            held = set(keys)
            keys[s] = s if s not in held else next(k for k in range(len(keys) + len(saved) + 1) if k not in held)
    return keys


def _rebuilt_entries(own: list[int | None], saved_names: list[str], names: list[str]) -> list[int | None]:
    """For each store of the mix that goes on from no entry of its identity (`own`: _own_entries), the entry of a
    store of its name that no store goes on from: the store rebuilt in place, under another identity (None: a new
    store, or a position saved before names were recorded)."""
    used = {i for i in own if i is not None}
    by_name = {name: i for i, name in enumerate(saved_names) if i not in used}
    return [by_name.get(name) if mine is None else None for mine, name in zip(own, names)]


def mix_identity(stores: list[PackedSamples], names: list[str], weights: np.ndarray) -> dict:
    """What a data position records of a mix (as data/store_identity.py store_identity of one store): a digest of
    every store's identity and the weights, so a resume on another mix is refused like another store."""
    records = [s.identity for s in stores]
    content = [[r["identity"] for r in records], [round(float(w), 12) for w in weights]]
    digest = hashlib.sha256(json.dumps(content).encode()).hexdigest()[:16]
    total = lambda key: sum(int(r.get(key, 0)) for r in records)  # noqa: E731
    return {"identity": digest, "inputs": [i for r in records for i in r["inputs"]], "documents": total("documents"),
            "tokens": total("tokens"), "train_samples": total("train_samples"),
            "mix": [f"{name} {w:.0%} ({r['identity']})" for name, w, r in zip(names, weights, records)],
            **({"layout": layout_of([r["layout"] for r in records])} if all(r.get("layout") for r in records) else {})}


def mix_line(mix: StoreMix, drawn: int) -> str:
    """The setup line of a mix: each store's share of the samples, the epochs of it that `drawn` samples
    read, and its expected share of the tokens trained on (the loss's labels): the weights are shares of
    samples, so a store of instruction data, whose prompts are not trained on, weighs less in the loss."""
    labels = [w * float(np.mean(store.label_counts)) if len(store) else 0.0
              for w, store in zip(mix.weights, mix.stores)]
    parts = []
    for name, w, store, trained in zip(mix.names, mix.weights, mix.stores, labels):
        epochs = w * drawn / max(1, len(store))
        said = f"{epochs:.1f}" if epochs >= 0.1 or epochs == 0 else f"{epochs:.1g}"  # (not "0.0" for a few samples)
        parts.append(f"{name} {w:.0%} ({said} epochs of {len(store):,} samples; "
                     f"{trained / max(sum(labels), 1e-12):.0%} of the tokens trained on)")
    return f"mix: {', '.join(parts)} over {drawn:,} samples (a store read past one epoch repeats, reshuffled)"


def check_same_kind(paths: list[str], manifests: list[dict]) -> None:
    """Refuse a mix whose stores do not mean the same token ids alike: the tokenizer (by content, as
    config/tokenizer.py stored_identity records it) and the special tokens each document begins with.
    (Each store's seq_len against the run is train/setup.py check_store's.)"""
    names = [store_name(p, paths) for p in paths]
    kinds = {"tokenizer": [stored_identity(m["tokenizer"]) or m["tokenizer"]["spec"] for m in manifests],
             "text prefix (the special tokens each document begins with)": [text_prefix(m) for m in manifests]}
    for what, values in kinds.items():
        if any(v != values[0] for v in values):
            said = "; ".join(f"{name}: {_short(v, m)}" for name, v, m in zip(names, values, manifests))
            raise ConfigError(f"the stores of data.path must share one {what} to be mixed, but they differ ({said}); "
                              f"rebuild them with the same `longctx data build --tokenizer`, or mix only those "
                              f"that agree.")


def _short(value, manifest: dict) -> str:
    """A tokenizer identity said with the spec it was built with; anything else as it is."""
    return f"{manifest['tokenizer']['spec']} ({value[:12]})" if isinstance(value, str) else str(value)
