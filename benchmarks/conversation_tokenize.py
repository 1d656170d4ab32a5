"""How the tokenisation of a conversation trained on every answer grows with its turns (data/builder/tokenize.py
tokenize_answers, `data build --messages-field`), against the same text tokenized as one plain document.

    python benchmarks/conversation_tokenize.py [--turns 4,16,64] [--words 300] [--out FILE.json]

A small byte-level BPE with ChatML special tokens and template is trained here (no download); each turn is a
user message and an answer of `--words` random words. Checking each answer's boundary by encoding the whole
text up to it would cost turns x length; it is encoded from the last special token before it instead, so
the ratio to a plain document stays flat as the turns grow. One thread (RAYON_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = "def class return value the of and what is assistant system user".split()


def chat_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 200, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    return folder / "tokenizer.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", default="4,16,64")
    ap.add_argument("--words", type=int, default=300)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from longctx.data.builder.conversations import Conversations
    from longctx.data.builder.tokenize import tokenize_answers, tokenize_one
    from longctx.data.tokenizer import load_tokenizer

    rows, rng = [], random.Random(0)
    with tempfile.TemporaryDirectory() as d:
        spec = str(chat_tokenizer(Path(d)))
        tok, conversations = load_tokenizer(spec), Conversations(spec, "messages")
        for turns in [int(t) for t in args.turns.split(",")]:
            messages = [{"role": role, "content": " ".join(rng.choice(WORDS) for _ in range(args.words))}
                        for _ in range(turns) for role in ("user", "assistant")]
            pieces = conversations.pieces(messages, Counter())
            text, switches = "".join(pieces), list(itertools.accumulate(len(p) for p in pieces[:-1]))
            t0 = time.perf_counter()
            tokens = tokenize_answers(text, switches, tok, prefix=False)[0]
            t1 = time.perf_counter()
            tokenize_one(text, tok)
            t2 = time.perf_counter()
            rows.append({"turns": turns, "tokens": len(tokens), "answers_s": round(t1 - t0, 4),
                         "plain_s": round(t2 - t1, 4), "ratio": round((t1 - t0) / (t2 - t1), 2)})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "words_per_message": args.words}, indent=1) + "\n")


if __name__ == "__main__":
    main()
