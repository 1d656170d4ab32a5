"""A generated text corpus of any size, for data-build benchmarks and tests (no download).

Documents are topical word sequences: each topic draws from its own Zipf-ranked slice of a shared
vocabulary of made-up words (so TF-IDF embeddings and clusters have structure to find), with line
breaks and blank lines (so long documents have natural cut points). Lengths are log-normal, from
a few hundred bytes to about a megabyte. A known fraction of documents are planted duplicates:
exact copies (with the whitespace changed, which exact dedup normalises away) and near copies
(a few words changed, true shingle Jaccard well above 0.8). Written as `.jsonl` files of about
`file_mb` MB each, `{"text": ...}` per line; deterministic for a seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB = 40_000
TOPICS = 64
TOPIC_WORDS = 4_000


def _vocabulary(rng: np.random.Generator) -> np.ndarray:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lengths = rng.integers(2, 11, size=VOCAB)
    words = {"".join(rng.choice(letters, size=n)) for n in lengths}
    return np.array(sorted(words), dtype=object)


def _document(rng: np.random.Generator, vocab: np.ndarray, topics: np.ndarray, n_words: int) -> str:
    topic = topics[rng.integers(TOPICS)]
    ranks = np.minimum(rng.zipf(1.1, size=n_words) - 1, TOPIC_WORDS - 1)
    words = vocab[topic[ranks]]
    cuts = np.cumsum(rng.integers(6, 16, size=n_words // 6 + 2))
    lines, start = [], 0
    for end in cuts:
        if start >= n_words:
            break
        lines.append(" ".join(words[start:end].tolist()))
        if rng.random() < 0.15:
            lines.append("")
        start = end
    return "\n".join(lines) + "\n"


def _near_copy(rng: np.random.Generator, text: str, vocab: np.ndarray, changes: int = 4) -> str:
    words = text.split(" ")
    for i in rng.integers(0, len(words), size=changes):
        words[i] = str(vocab[rng.integers(len(vocab))])
    return " ".join(words)


def generate(out: str | Path, total_mb: float, seed: int = 0, file_mb: float = 10.0, mean_words: int = 1500,
             exact_dups: float = 0.01, near_dups: float = 0.01) -> dict:
    """Write about `total_mb` MB of documents under `out`; returns counts (documents, planted copies)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(rng)
    topics = np.stack([rng.permutation(len(vocab))[:TOPIC_WORDS] for _ in range(TOPICS)])
    total, file_bytes, index = 0, 0, 0
    counts = {"documents": 0, "exact_copies": 0, "near_copies": 0, "files": 0}
    recent: list[str] = []
    f = None
    while total < total_mb * 1e6:
        if f is None or file_bytes >= file_mb * 1e6:
            if f is not None:
                f.close()
            f = open(out / f"part-{index:05d}.jsonl", "w")
            index, file_bytes = index + 1, 0
            counts["files"] += 1
        u = rng.random()
        if recent and u < exact_dups:
            text = recent[rng.integers(len(recent))].replace("\n", "\n\n")
            counts["exact_copies"] += 1
        elif recent and u < exact_dups + near_dups:
            text = _near_copy(rng, recent[rng.integers(len(recent))], vocab)
            counts["near_copies"] += 1
        else:
            n_words = int(np.clip(rng.lognormal(np.log(mean_words), 1.0), 50, 150_000))
            text = _document(rng, vocab, topics, n_words)
            recent = (recent + [text])[-64:]
        line = json.dumps({"text": text}) + "\n"
        f.write(line)
        file_bytes += len(line)
        total += len(line)
        counts["documents"] += 1
    if f is not None:
        f.close()
    counts["bytes"] = total
    return counts


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mb", type=float, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(generate(args.out, args.mb, args.seed)))
