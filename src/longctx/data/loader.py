"""Reading a packed store for training: samples -> tokens, labels, positions, document ids.

`PackedSamples` is a store split seen as one list of samples (over all parts): `len`,
`batch(indices)`, `num_tokens`. In sample i:

- `labels[t] = tokens[t + 1]` inside a segment; the last token of a segment has no label in this
  sample (its document ends, or continues in another sample), nor does padding: IGNORE (-100);
- `doc_ids` number the sample's segments 0, 1, ...; padding gets the next id of its own, so it
  never attends to real tokens and they never attend to it;
- `positions` restart at 0 at every segment (and in the padding);
- `real` is False at the padding (Batch.real): MoE layers leave it out of their router statistics and
  capacity queues (models/moe_stats.py); the labels cannot say it (a document's last token has none).

Without document masks (`doc_mask=False`) a sample is a plain causal sequence: labels run across
segment boundaries, positions are 0..L-1, no doc ids; padding, always at the end, stays ignored.

Positions, doc ids and which tokens have a label all follow from the store's segment index, so a
training rank reads no tokens to learn them (`frames`); it plans its share of the sequences from
them and then gathers from the memory-mapped token array only the positions it holds, plus the next
position of each one that has a label (`read_at`, driven by `read_local_batch`, parallel/context/shares.py). The token
elements gathered are counted (`bytes_read`), so a benchmark can show that each rank reads its
share and no more. `label_count` gives a global batch's valid labels from the index alone.

`BatchLoader` draws global batches: a seeded shuffle of the samples whose whole state is one
global cursor (`SampleOrder`), so a resumed job continues with exactly the samples not yet seen
under any data-parallel degree (the position also records its store's identity, data/store_identity.py: a
resume refuses a store rebuilt with other content, whatever its sample count); with `dp > 1` each
batch is permuted so that the dp blocks
`local_batch` (parallel/context/shares.py) hands out have balanced estimated cost (data/balance.py). What a training
rank reads of each step, and the background read of the next step, live in stages.py
(`StagedLoader.step_batches`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from ..models.flops import forward_flops_per_token
from .balance import balanced_order
from .samples import IGNORE, Batch, SampleOrder
from .store import (
    S_DOC,
    S_LENGTH,
    S_START,
    load_split,
    read_manifest,
    text_prefix,
)
from .store_identity import describe_store, repacked, store_identity
from .trained_spans import TrainedSpans, part_trained_spans


@dataclass
class Frames:
    """What rows of samples carry besides their tokens, from the segment index alone: [rows, seq_len]."""
    positions: np.ndarray       # int64
    doc_ids: np.ndarray | None  # int64; None without document masks
    labelled: np.ndarray        # bool: token t has a label (token t + 1 of the same segment)
    real: np.ndarray | None = None  # bool: token t is a document's, not padding (None: every token)


def store_of(samples) -> PackedSamples | None:
    """The store a sample set reads (through wrappers such as data/synthetic.py's, which hold theirs as
    `samples`); None for a set that is no store's (tests' stand-ins)."""
    while samples is not None and not isinstance(samples, PackedSamples):
        samples = getattr(samples, "samples", None)
    return samples


def _data_read(samples):
    """The store, or mix of stores (data/store_mix.py StoreMix), a sample set reads (through wrappers): what has
    an `identity` and a `root`; None for a set of no store."""
    while samples is not None and not isinstance(getattr(samples, "identity", None), dict):
        samples = getattr(samples, "samples", None)
    return samples


def identity_of(samples) -> dict | None:
    data = _data_read(samples)
    return None if data is None else data.identity


class SampleSet:
    """What the loader needs of a list of samples, given `sample(i)`, `seq_len`, `doc_mask` and per sample
    `real_tokens` (its padding follows them) and `sq_tokens` (the sum of squared document lengths): token
    counts, estimated costs, batches (with `real`). A set that can read a sample at given positions only
    sets `reads_by_position` and provides `frames`, `read_at` and `label_count` (PackedSamples)."""

    reads_by_position = False
    text_prefix: list[int] = []  # the special tokens each document begins with (PackedSamples: its store's)

    @property
    def num_tokens(self) -> int:
        return int(self.real_tokens.sum())

    def costs(self, a: float, b: float) -> np.ndarray:
        """Estimated work per sample: a * attention pairs + b * tokens."""
        quad = self.sq_tokens if self.doc_mask else self.real_tokens ** 2
        return a * quad + b * self.real_tokens

    def batch(self, indices) -> Batch:
        indices = [int(i) for i in indices]
        batch = stack_samples([self.sample(i) for i in indices], self.doc_mask)
        # a sample's padding is its tail past its real tokens: MoE statistics leave it out (Batch.real)
        real = np.arange(self.seq_len)[None] < np.asarray(self.real_tokens)[indices][:, None]
        batch.real = torch.from_numpy(real.reshape(len(indices), self.seq_len))
        return batch


class PackedSamples(SampleSet):
    reads_by_position = True

    def __init__(self, root: str | Path, split: str = "train", doc_mask: bool = True):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        self.seq_len = int(self.manifest["seq_len"])
        # every id a sample holds is below it (text, EOS and pad alike): train checks model.vocab_size against it
        self.vocab_size = int(self.manifest["tokenizer"]["vocab_size"])
        self.doc_mask = doc_mask
        # spans: per part, which tokens of its documents are trained on (None: all) and each segment's document
        self.split = split
        self.parts, self.spans, self.part_dirs = [], [], []
        for part in self.manifest["parts"]:
            arrays = load_split(self.root, part, split, self.seq_len)
            if arrays is not None:
                self.parts.append(arrays)
                self.part_dirs.append(part["dir"])
                spans = part_trained_spans(self.root, part)
                self.spans.append(None if spans is None else
                                  (spans, arrays.segments[:, S_DOC].astype(np.int64) - int(part["first_doc"])))
        # what a data position records of this store, to know it again on resume: of the store as opened here
        self.identity = store_identity(self.manifest, self.root)
        counts = [len(a.pointer) - 1 for a in self.parts]
        self.offsets = np.cumsum([0, *counts])
        self.num_samples = int(self.offsets[-1])
        # per sample: real tokens, sum of squared segment lengths (for the cost estimate) and labels
        # (every token of a segment but its last has one)
        real, sq, labels, sequences = [], [], [], []
        for a, spans in zip(self.parts, self.spans):
            w = np.repeat(np.arange(len(a.pointer) - 1), np.diff(a.pointer))  # each segment's sample
            n = len(a.pointer) - 1
            lens = a.segments[:, S_LENGTH].astype(np.float64)
            real.append(np.bincount(w, weights=lens, minlength=n))
            sq.append(np.bincount(w, weights=lens ** 2, minlength=n))
            by_segment = _label_counts(a, spans, w, n, doc_mask)
            labels.append(np.bincount(w, weights=by_segment, minlength=n) if doc_mask else by_segment)
            # the trained sequences (train.loss_weighting = sequence): a sample's documents with a label, or the sample
            sequences.append(np.bincount(w, weights=by_segment > 0, minlength=n) if doc_mask else by_segment > 0)
        self.real_tokens = np.concatenate(real) if real else np.zeros(0)
        self.sq_tokens = np.concatenate(sq) if sq else np.zeros(0)
        self.label_counts = (np.concatenate(labels) if labels else np.zeros(0)).astype(np.int64)
        self.sequence_counts = (np.concatenate(sequences) if sequences else np.zeros(0)).astype(np.int64)
        # token elements gathered from the token arrays x their size. One reader at a time: the
        # loader waits for its background read before it reads itself (stages.py)
        self.bytes_read = 0

    def __len__(self) -> int:
        return self.num_samples

    @property
    def tokenizer_spec(self) -> str:
        return self.manifest["tokenizer"]["spec"]

    @property
    def text_prefix(self) -> list[int]:
        """The special tokens each of the store's documents begins with (e.g. BOS)."""
        return text_prefix(self.manifest)

    def _where(self, i: int) -> tuple[int, int]:
        """(part, row in the part) of sample i."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        p = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return p, i - int(self.offsets[p])

    def _locate(self, i: int):
        p, j = self._where(i)
        return self.parts[p], j

    def segments(self, i: int) -> np.ndarray:
        return self._segments_and_spans(i)[0]

    def _segments_and_spans(self, i: int) -> tuple[np.ndarray, tuple | None]:
        """Sample i's segments and (its part's TrainedSpans, each segment's document in it); None: every
        token is trained on."""
        p, j = self._where(i)
        rows = slice(self.parts[p].pointer[j], self.parts[p].pointer[j + 1])
        return self.parts[p].segments[rows], None if self.spans[p] is None else (self.spans[p][0],
                                                                                  self.spans[p][1][rows])

    def label_count(self, indices) -> int:
        """Valid (non-ignored) labels of these samples, from the segment index."""
        return int(self.label_counts[np.asarray(indices, dtype=np.int64)].sum())

    def sequence_count(self, indices) -> int:
        """Trained sequences of these samples (data/sequence_weights.py), from the segment index."""
        return int(self.sequence_counts[np.asarray(indices, dtype=np.int64)].sum())

    def _frame(self, i: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Sample i's positions, doc ids and labelled tokens [seq_len], from its segments."""
        segs, spans = self._segments_and_spans(i)
        L = self.seq_len
        real = int(segs[:, S_LENGTH].sum())
        # a token trained on: an answer's, not a prompt's (instruction data)
        trained = None if spans is None else _trained_tokens(segs, *spans)
        if not self.doc_mask:
            labelled = np.arange(L) < real - 1
            if trained is not None and real > 1:
                labelled[:real - 1] &= trained[1:]
            return np.arange(L), None, labelled
        lengths = np.append(segs[:, S_LENGTH], L - real) if real < L else segs[:, S_LENGTH]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        doc_ids = np.repeat(np.arange(len(lengths)), lengths)
        positions = np.arange(L) - np.repeat(starts, lengths)
        labelled = np.zeros(L, dtype=bool)  # True where token t + 1 is in the same segment (and trained on)
        labelled[:-1] = doc_ids[1:] == doc_ids[:-1]
        labelled[real:] = False  # padding predicts nothing
        if trained is not None and real > 1:
            labelled[:real - 1] &= trained[1:]
        return positions, doc_ids, labelled

    def frames(self, indices) -> Frames:
        rows = [self._frame(int(i)) for i in indices]
        real = np.arange(self.seq_len)[None] < self.real_tokens[np.asarray(indices, dtype=np.int64)][:, None]
        return Frames(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]) if self.doc_mask else None,
                      np.stack([r[2] for r in rows]), real.reshape(len(rows), self.seq_len))

    def _tokens_at(self, i: int, labelled: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sample i's tokens at positions `held` and their labels, gathered from the memory-mapped
        token array: those positions and the next one of each labelled token, each read once."""
        part, j = self._locate(i)
        want = np.zeros(self.seq_len, dtype=bool)
        want[held] = True
        has_label = labelled[held]
        want[held[has_label] + 1] = True
        need = np.flatnonzero(want)
        slot = np.cumsum(want) - 1  # position -> its index in `need`
        values = np.asarray(part.tokens[j, need], dtype=np.int64)
        self.bytes_read += need.size * part.tokens.dtype.itemsize
        if values.size and int(values.max()) >= self.vocab_size:
            self._out_of_vocabulary(i, int(values.max()))
        labels = np.full(len(held), IGNORE, dtype=np.int64)
        labels[has_label] = values[slot[held[has_label] + 1]]
        return values[slot[held]], labels

    def _out_of_vocabulary(self, i: int, found: int):
        """A token id the store's tokenizer has not (a damaged or hand-edited store, one another tool wrote):
        read into an embedding it would be an index error, on a GPU a device-side assert."""
        p, j = self._where(i)
        raise DataError(f"the store '{self.root}' is damaged: row {j:,} of {self.root / self.part_dirs[p]}/"
                        f"{self.split}.tokens.npy holds token id {found:,}, but its tokenizer ({self.tokenizer_spec}) "
                        f"has {self.vocab_size:,} ids (manifest.json tokenizer.vocab_size); rebuild the store with "
                        f"`longctx data build`.")

    def read_at(self, indices, frames: Frames, held: np.ndarray | None) -> Batch:
        """Rows `indices` (with their `frames`) at the global positions `held` [rows, k] in that
        order (None: every position), reading only the tokens that needs."""
        n = len(indices)
        if held is None:
            held = np.broadcast_to(np.arange(self.seq_len), (n, self.seq_len))
        read = [self._tokens_at(int(i), frames.labelled[r], held[r]) for r, i in enumerate(indices)]
        rows = np.arange(n)[:, None]
        long = lambda a: torch.from_numpy(np.ascontiguousarray(a)).long()  # noqa: E731
        return Batch(long(np.stack([t for t, _ in read])), long(np.stack([lab for _, lab in read])),
                     long(frames.positions[rows, held]),
                     None if frames.doc_ids is None else long(frames.doc_ids[rows, held]),
                     None if frames.real is None else torch.from_numpy(np.ascontiguousarray(frames.real[rows, held])))

    def batch(self, indices) -> Batch:
        indices = list(indices)
        return self.read_at(indices, self.frames(indices), None)

    def sample(self, i: int):
        positions, doc_ids, labelled = self._frame(i)
        tokens, labels = self._tokens_at(i, labelled, np.arange(self.seq_len))
        return tokens, labels, positions, doc_ids


def _trained_tokens(segs: np.ndarray, spans: TrainedSpans, docs: np.ndarray) -> np.ndarray:
    """[real tokens] bool: whether each of a sample's tokens is one its document is trained on."""
    lengths = segs[:, S_LENGTH]
    in_doc = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths - segs[:, S_START], lengths)
    return spans.trained(np.repeat(docs, lengths), in_doc)


def _label_counts(a, spans: tuple | None, w: np.ndarray, n: int, doc_mask: bool) -> np.ndarray:
    """A part's split's tokens that have a label (as _frame labels them): per segment with document masks
    (a label never crosses one), else per sample."""
    lens, starts = a.segments[:, S_LENGTH].astype(np.int64), a.segments[:, S_START].astype(np.int64)
    if spans is None:  # (every token trained on: each segment its own document, trained from its start)
        spans = (TrainedSpans(np.zeros(len(lens), dtype=np.int64)), np.arange(len(lens)))
    trained, docs = spans
    if doc_mask:  # token t labelled by t + 1 of the same segment: targets at in-document start + 1 ... end - 1
        return trained.before(docs, starts + lens) - trained.before(docs, starts + 1)
    # labels cross segments: every trained-on token is a target but a sample's first one
    targets = np.bincount(w, weights=trained.before(docs, starts + lens) - trained.before(docs, starts), minlength=n)
    leading = a.pointer[:-1]  # each sample's first segment (a sample has one at least)
    return np.maximum(targets - trained.trained(docs[leading], starts[leading]), 0)


def stack_samples(parts: list[tuple], doc_mask: bool) -> Batch:
    """(tokens, labels, positions, doc ids) per sample -> one Batch."""
    stack = lambda j: torch.from_numpy(np.stack([p[j] for p in parts])).long()  # noqa: E731
    return Batch(stack(0), stack(1), stack(2), stack(3) if doc_mask else None)


class BatchLoader:
    """Global batches of `batch_size` samples in seeded order, cost-balanced over `dp` ranks."""

    store: dict | None = None  # the identity of the store read (store_identity); None: samples of no store
    mix = None  # the mix of stores read (data/store_mix.py StoreMix); None: one store, or samples of none

    def __init__(self, samples, batch_size: int, seed: int, dp: int = 1, balance: bool = True,
                 cost: tuple[float, float] = (1.0, 0.0)):
        if len(samples) == 0:
            raise DataError("the data store has no training samples; build it from more documents.")
        self.samples, self.batch_size, self.dp = samples, batch_size, dp
        # (a mix of stores is read in its blend's own order: data/store_mix.py)
        self.order = samples.sample_order(seed) if hasattr(samples, "sample_order") else SampleOrder(len(samples), seed)
        self.balance = balance and dp > 1 and hasattr(samples, "costs")
        self.costs = samples.costs(*cost) if self.balance else None
        # taken once: the position is taken every step a run may roll back to
        self.store = identity_of(samples)
        # a mix of stores (data/store_mix.py): its position records each store's count, by which a resume on an
        # edited mix goes on from each store's own place
        data = _data_read(samples)
        self.mix = data if hasattr(data, "blend_position") else None

    def next_indices(self) -> list[int]:
        idx = self.order.next_indices(self.batch_size)
        return balanced_order(idx, self.costs, self.dp) if self.balance else idx

    def next_batch(self) -> Batch:
        return self.samples.batch(self.next_indices())

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """The sample order's cursor, and the identity of the store it is a cursor into (`store`); for a mix, each
        store's count (`mix`)."""
        return {**self.order.state_dict(), **({"store": self.store} if self.store is not None else {}),
                **({"mix": self.mix.blend_position(self.order.cursor)} if self.mix is not None else {})}

    def _continue_mix(self, state: dict, cursor: int, same: bool) -> list[str] | None:
        """A mix's position: its schedule taken up again (same: the mix it was saved on), or each store's count
        carried into this mix's schedule from the cursor on; None where there is nothing to take up (no mix, or
        a position saved before the counts were recorded: the same cursor, as before)."""
        record = state.get("mix")
        if self.mix is None or record is None:
            return None
        return self.mix.continue_from(cursor, record, same)

    def _repacked_note(self, saved: dict, now: dict, allow_changes: bool) -> str:
        """The same documents, packed into other samples (both layouts recorded and different): refused, or
        continued on with a note under `allow_changes`."""
        what = (f"the store {_data_read(self.samples).root} holds the documents the checkpoint's data position was "
                f"saved on ({describe_store(now)}) but packed into other samples (layout {saved['layout']} then, "
                f"{now['layout']} now: built again with another --max-memory, or by another longctx version)")
        if not allow_changes:
            raise DataError(f"{what}, so the saved cursor would point at other samples. Resume with the store the run "
                            f"trained on (rebuild it with the --max-memory it was built with), or add "
                            f"--checkpoint.allow_changes true to continue on the new packing from the same cursor.")
        return f"{what}; continuing from the same cursor (--checkpoint.allow_changes)."

    def load_state_dict(self, state: dict, allow_changes: bool = False) -> str | None:
        """Continue from a saved position; refused when it is for other data. A store of other content (its
        identity; a position saved before identities were recorded has none, and is not checked) is refused
        unless `allow_changes` (--checkpoint.allow_changes), which continues from the same cursor on the new
        store: what to tell the user then is returned (None: nothing to say). Every check runs before anything
        changes: a refused position leaves the loader as it was (a caller that catches the error, or tries another
        position, reads on from where it was, a mix's schedule included)."""
        saved, now = state.get("store"), self.store
        other = saved is not None and now is not None and saved.get("identity") != now["identity"]
        what = None
        if other:
            what = (f"the checkpoint's data position was saved on a store {describe_store(saved)}, but the store "
                    f"{_data_read(self.samples).root} is one {describe_store(now)}")
            if not allow_changes:
                raise DataError(
                    f"{what}: it was rebuilt with other content (or is another store, or mix), so the saved cursor "
                    f"would point into other data. "
                    f"Resume with the store the run trained on, or add --checkpoint.allow_changes true to continue "
                    f"on the new data from the same cursor.")
        note = self._repacked_note(saved, now, allow_changes) if (
            not other and saved is not None and now is not None and repacked(saved, now)) else None
        # (a mix's stores each go on from their own count: the blend's size is no cursor's epoch)
        mixed = self.mix is not None and state.get("mix") is not None
        counts = None if mixed else self._counts_note(state, allow_changes)
        if "seed" in state and int(state["seed"]) != self.order.seed:
            raise DataError(
                f"the checkpoint's data order was drawn with seed {state['seed']} but this run uses train.seed="
                f"{self.order.seed}; resuming would repeat some samples and skip others. Resume with "
                f"--train.seed {state['seed']}."
            )
        cursor = int(state["cursor"])  # (read before anything changes, as the order's load_state_dict reads it)
        # (the same mix's identity with a store and its copy listed the other way round: an edited mix, by names)
        relisted = mixed and not other and self.mix.relisted(state["mix"])
        where = self._continue_mix(state, cursor, same=not (other or relisted))
        self.order.load_state_dict(state)
        if other:
            note = (f"{what}; continuing on the new data from the same cursor (--checkpoint.allow_changes)."
                    if where is None else
                    f"{what}; each store goes on from its own place ({', '.join(where)}), drawn at the new mix's "
                    f"weights from here on (--checkpoint.allow_changes).")
        elif relisted:
            note = (f"{note + ' ' if note else ''}the mix's stores of one content are listed in other places than "
                    f"the checkpoint's data position records ({', '.join(state['mix']['names'])}); each store goes on "
                    f"from its own place ({', '.join(where)}), drawn at this mix's weights from here on.")
        return f"{note + ' ' if note else ''}{counts}" if counts else note

    def _counts_note(self, state: dict, allow_changes: bool) -> str | None:
        """A position for another number of samples: refused, or continued on from the same cursor with a note
        under `allow_changes` (None: the same number, or none recorded)."""
        saved_n = state.get("num_samples")
        if saved_n is None or int(saved_n) == len(self.samples):
            return None
        counts = (f"the checkpoint's data position is for {saved_n} training samples but the data has "
                  f"{len(self.samples)}")
        if not allow_changes:
            raise DataError(
                f"{counts}; resume with the same data (data.path / data.corpus and train.seq_len), or add "
                f"--checkpoint.allow_changes true to continue on this data from the same cursor.")
        # the cursor counts samples drawn; on a store of another size it indexes that store's own seeded order
        # (an epoch of N' samples), so samples drawn before may come again and others not yet
        epoch, pos = divmod(int(state.get("cursor", 0)), len(self.samples))  # (a loader has samples)
        return (f"{counts}: continuing at sample {pos} of epoch {epoch} of this data's own order "
                f"(--checkpoint.allow_changes); samples drawn before may be drawn again.")


def cost_coefficients(model_cfg) -> tuple[float, float]:
    """(a, b) of a*s^2 + b*s: the model's forward FLOPs (metrics.py) of a document of s tokens are
    s * forward_flops_per_token(s), linear in s per token (causal attention), so b is the per-token
    cost at length 0 and a the attention slope."""
    b = forward_flops_per_token(model_cfg, 0)
    return float(forward_flops_per_token(model_cfg, 1) - b), float(b)
