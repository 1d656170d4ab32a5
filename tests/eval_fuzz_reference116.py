"""The reference side of tests/unit/test_eval_fuzz116.py: five tiny random Llama models (one a MoE) saved as
hf:DIR and read back by transformers in float64 (one plain forward per sequence: the log-probabilities every check
starts from), the text and two packed stores the cases read, the in-training evaluation's reference loss, read
from a store's arrays, the reference's greedy continuation, and random sequences to score."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import torch
import transformers

from longctx.config import load_config
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.data.samples import IGNORE
from longctx.data.store import S_LENGTH, S_OFFSET, load_split, read_manifest
from longctx.data.tokenizer import load_tokenizer
from longctx.eval.tasks import Sequence
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

MODELS = [  # (shape overrides of the debug preset)
    ["--model.layers=1", "--model.dim=32", "--model.heads=4", "--model.kv_heads=2", "--model.ffn_dim=64"],
    ["--model.layers=2", "--model.dim=16", "--model.heads=2", "--model.kv_heads=1", "--model.ffn_dim=40",
     "--model.tie_embeddings=true"],
    ["--model.layers=1", "--model.dim=24", "--model.heads=3", "--model.kv_heads=3", "--model.ffn_dim=48",
     "--model.rope_theta=500"],
    # a Mixtral-shaped MoE whose capacity would drop tokens: evaluation scores it dropless (docs/eval.md), as
    # transformers' Mixtral computes it
    ["--model.layers=2", "--model.dim=32", "--model.heads=4", "--model.kv_heads=2", "--model.ffn_dim=16",
     "--model.family=mixtral", "--model.moe.experts=4", "--model.moe.top_k=2", "--model.moe.expert_dim=16",
     "--model.moe.norm_topk=true", "--model.moe.capacity_factor=1.0"],
    # a model that writes digits: its LM head's rows of '0'..'9' scaled up (generate mode's answers are runs of them)
    ["--model.layers=1", "--model.dim=32", "--model.heads=4", "--model.kv_heads=2", "--model.ffn_dim=64"],
]
DIGITS = 4  # (MODELS' index of the model that writes digits)
MARGIN = 1e-3  # a reference argmax closer than this to the runner-up is a near tie: either verdict is right


def capacity(m: int) -> list[str]:
    """Model m's capacity flag (an hf:DIR does not record one: passed to eval and training as a user would)."""
    return [flag for flag in MODELS[m] if flag.startswith("--model.moe.capacity_factor")]


@dataclasses.dataclass
class Pool:
    hf: list[Path]          # each model's hf:DIR
    ours: list              # each model (ours, float32), for the in-training evaluation
    refs: list              # each model in transformers, float64
    text: Path              # ppl's text and passkey's filler (byte tokenizer)
    stores: dict            # seq_len -> a packed store (eval split)
    docs: dict              # seq_len -> its store's source documents, as token arrays (byte ids, then EOS)
    seen: dict = dataclasses.field(default_factory=dict)

    @torch.no_grad()
    def lp(self, m: int, tokens) -> torch.Tensor:
        """[L, vocab] float64 log-probabilities of model m over one sequence (a plain forward, positions 0..)."""
        key = (m, np.asarray(tokens, dtype=np.int64).tobytes())
        if key not in self.seen:
            ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None]
            self.seen[key] = torch.log_softmax(self.refs[m](ids).logits[0].double(), dim=-1)
        return self.seen[key]


def _sharp(model, seed: int):
    """Weights of unit scale (init's std 0.02 leaves logits near uniform): NLLs differ by far more than float32's
    error, so a token scored with the wrong context, position or label shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # (a matrix, or experts' stacked matrices)
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 if "embeddings" in name else 2 / p.shape[-1] ** 0.5))
            else:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    return model


def packed_store(tmp: Path, seq_len: int, rng: random.Random) -> Path:
    """A store of documents of 3 to 24 and 60 to 130 characters, packed by bfd into samples of `seq_len` (a document
    longer than a sample is cut; several short ones share one), half of them held out."""
    src = tmp / f"docs{seq_len}"
    src.mkdir()
    for i in range(60):
        n = rng.randint(3, 24) if rng.random() < 0.75 else rng.randint(60, 130)
        (src / f"{i:03d}.txt").write_text("".join(rng.choice("abcdefgh   xyz.\n") for _ in range(n)))
    out = tmp / f"store{seq_len}"
    build_store(BuildOptions([str(src)], str(out), seq_len, strategy="bfd", dedup="none", workers=1,
                             eval_fraction=0.5, progress=False, stats=False), log=lambda *a, **k: None)
    return out


def make_pool(tmp: Path) -> Pool:
    """Five sharp random models (hf:DIR, ours, transformers' in float64), a text and two packed stores in `tmp`."""
    hf, ours, refs = [], [], []
    for i, shape in enumerate(MODELS):
        model = _sharp(build_model(load_config(overrides=["--model.preset=debug", *shape]).model, seed=i), 10 + i)
        if i == DIGITS:
            with torch.no_grad():
                model.output.weight[ord("0"):ord("9") + 1] *= 2.5
        hf.append(save_hf(model, tmp / f"hf{i}"))
        ours.append(model.eval())
        refs.append(transformers.AutoModelForCausalLM.from_pretrained(hf[-1], dtype=torch.float64,
                                                                  experts_implementation="eager").eval())
    rng = random.Random(116)
    words = "the pass key river stone cloud alpha beta gamma 0 1 2 3 4 5 6 7 8 9 long context token".split()
    text = tmp / "text.txt"
    text.write_text("\n".join(" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(300)))
    stores = {seq: packed_store(tmp, seq, rng) for seq in (40, 56)}
    eos = load_tokenizer("byte").eos_id
    docs = {seq: [np.append(np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.int64), eos)
                  for p in sorted((tmp / f"docs{seq}").iterdir())] for seq in stores}
    return Pool(hf, ours, refs, text, stores, docs)


def reference_train_eval(pool: Pool, case: dict) -> tuple[float, int, int]:
    """(mean NLL, labelled tokens, samples) over the first eval_batches whole global batches of the store's eval
    samples, read from its arrays here: with document masks each segment a forward of its own, without them each
    sample's real tokens one causal sequence; a segment's or sample's last token predicts nothing."""
    root = pool.stores[case["seq_len"]]
    rows = []  # (tokens [seq_len], [(offset, length)] per segment), in sample order
    for part in read_manifest(root)["parts"]:
        a = load_split(root, part, "eval")
        for j in range(0 if a is None else len(a.pointer) - 1):
            segs = a.segments[a.pointer[j]:a.pointer[j + 1]]
            rows.append((np.asarray(a.tokens[j], dtype=np.int64), [(int(s[S_OFFSET]), int(s[S_LENGTH])) for s in segs]))
    gb = case["global_batch"]
    n = min(len(rows), case["eval_batches"] * gb) // gb * gb
    nll, count = 0.0, 0
    for tokens, segs in rows[:n]:
        real = sum(length for _, length in segs)
        assert [off for off, _ in segs] == list(np.cumsum([0] + [length for _, length in segs])[:-1])
        for off, length in segs if case["doc_mask"] else [(0, real)]:
            doc = tokens[off:off + length]
            lp = pool.lp(case["model"], doc)
            nll -= float(lp[np.arange(length - 1), doc[1:]].sum())
            count += length - 1
    return nll / count, count, n


def reference_greedy(pool: Pool, m: int, prompt: np.ndarray, new: int) -> str | None:
    """The text the reference's greedy continuation of `prompt` by `new` tokens is read from: its bytes up to the
    first id past them (the byte tokenizer's specials, ids >= 256, decode to nothing), as UTF-8; None where a step
    is a near tie (either continuation is right)."""
    tokens = list(prompt)
    for _ in range(new):
        lp = pool.lp(m, np.asarray(tokens))[-1]
        top = torch.topk(lp, 2).values
        if top[0] - top[1] <= MARGIN:
            return None
        tokens.append(int(lp.argmax()))
    out = tokens[len(prompt):]
    cut = next((i for i, t in enumerate(out) if t >= 256), len(out))
    return bytes(out[:cut]).decode("utf-8", errors="replace")


def random_sequences(rng: np.random.Generator, length: int, n: int, vocab: int) -> list[Sequence]:
    """`n` sequences of random tokens; labels the next token with random holes (as ppl's, instruction data's),
    or arbitrary targets; each length scores something."""
    out = []
    for _ in range(n):
        tokens = rng.integers(0, vocab, length)
        if rng.random() < 0.5:
            labels = np.full(length, IGNORE)
            labels[:-1] = tokens[1:]
        else:
            labels = rng.integers(0, vocab, length)
        labels[rng.random(length) < rng.choice([0.0, 0.3, 0.9, 1.0])] = IGNORE
        out.append(Sequence(tokens.astype(np.int64), labels.astype(np.int64), length))
    if all((s.labels == IGNORE).all() for s in out):
        out[0].labels[rng.integers(0, length)] = int(rng.integers(0, vocab))
    return out
