"""`longctx data build`: arguments and the command (cli.py only registers it)."""

from __future__ import annotations

from ..errors import UserError


def _cmd_data(args, overrides) -> int:
    if overrides:
        raise UserError(f"unexpected arguments for longctx data {args.data}: {' '.join(overrides)}.")
    # imported when the command runs: `longctx` builds every command's parser at start-up, and the
    # build's modules (numpy and ~0.15 s of imports) are needed by this command only
    from .builder.options import BuildOptions, parse_memory
    from .builder.pipeline import build_store, merge_scans

    memory = parse_memory(args.max_memory) if args.max_memory else 0
    if args.data == "merge":
        merge_scans(args.scans, args.out, workers=args.workers, max_memory=memory, progress=not args.no_progress)
        return 0
    build_store(BuildOptions(
        inputs=args.input, out=args.out, seq_len=args.seq_len, tokenizer=args.tokenizer, strategy=args.strategy,
        dedup=args.dedup, workers=args.workers, text_field=args.text_field,
        response_field=args.response_field, messages_field=args.messages_field, answers=args.answers,
        long_conversations=args.long_conversations,
        eval_fraction=args.eval_fraction,
        holdout_tokens=args.holdout_tokens,
        seed=args.seed, embed_model=args.embed_model, dedup_threshold=args.dedup_threshold, max_docs=args.max_docs,
        append=args.append, progress=not args.no_progress, clusters=args.clusters, max_memory=memory,
        shard=_shard(args.shard),
    ))
    return 0


def _shard(text: str | None):
    if not text:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--shard {text!r}: expected I/N, e.g. --shard 0/4 for the first of four machines.") from None
    return i, n


def add_parser(sub) -> None:
    data = sub.add_parser("data", help="build packed training data stores").add_subparsers(dest="data", required=True)
    p = data.add_parser("build", help="read, dedup, tokenize, cluster and pack documents into a store for "
                                      "`longctx train --data.path DIR`", allow_abbrev=False)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="directories of text files, .jsonl, .parquet or .arrow files (text and .jsonl also .gz / "
                        ".zst), Hugging Face datasets saved with save_to_disk, or 'stdlib'")
    p.add_argument("--seq-len", type=int, required=True, metavar="N",
                   help="sequence length: tokens per packed sample (= train.seq_len)")
    p.add_argument("--out", required=True, help="the store directory")
    p.add_argument("--tokenizer", default="byte", help="'byte' or PATH/tokenizer.json (default byte)")
    p.add_argument("--strategy", default="datasculpt", choices=("datasculpt", "bfd", "concat"),
                   help="packing strategy (default datasculpt)")
    p.add_argument("--dedup", default="minhash", choices=("minhash", "exact", "none"),
                   help="exact and near-duplicate removal (default minhash = exact + MinHash LSH)")
    p.add_argument("--workers", type=int, default=2, help="processes / threads for the parallel stages (default 2)")
    p.add_argument("--text-field", default="text", help="the text field of .jsonl records / .parquet column")
    p.add_argument("--response-field", default="", metavar="FIELD",
                   help="instruction data: each record is a prompt (--text-field) and a response (this field), "
                        "trained on the response's tokens only (docs/data.md; default: plain documents)")
    p.add_argument("--messages-field", default="", metavar="FIELD",
                   help="conversations: each record's FIELD is [{role, content}, ...] ending with the assistant's "
                        "answer, rendered by the tokenizer's chat template and trained on its answers (--answers)")
    p.add_argument("--answers", default="all", choices=("all", "last"),
                   help="with --messages-field: train on every answer of a conversation (default all) or on the "
                        "last one only, the earlier ones read as its prompt")
    p.add_argument("--long-conversations", default="truncate", choices=("truncate", "drop"),
                   help="a conversation longer than --seq-len: cut after its last answer that fits (default "
                        "truncate; one whose first answer does not fit is dropped, as is a longer pair) or dropped")
    p.add_argument("--eval-fraction", type=float, default=0.02,
                   help="documents held out (by name hash) as eval samples (default 0.02)")
    p.add_argument("--holdout-tokens", type=int, default=0, metavar="N",
                   help="a document longer than N tokens is held out in pieces of about N (default 0 = --seq-len); "
                        "stores of one corpus with the same N hold out the same text: give every length you train "
                        "or evaluate a model at the longest, so that no length's eval text is another's training "
                        "text")
    p.add_argument("--seed", type=int, default=0, help="seed for embeddings and clustering")
    p.add_argument("--embed-model", default="", help="a local sentence-transformers model directory "
                                                     "(default: hashed n-gram TF-IDF + SVD, no download)")
    p.add_argument("--dedup-threshold", type=float, default=0.8, help="MinHash Jaccard threshold (default 0.8)")
    p.add_argument("--clusters", type=int, default=0, help="k-means clusters (default 0 = automatic)")
    p.add_argument("--max-docs", type=int, default=0, help="read at most this many documents (0 = all)")
    p.add_argument("--append", action="store_true", help="add the inputs to an existing store as a new part")
    p.add_argument("--max-memory", default="", metavar="SIZE",
                   help="resident memory the whole build may use, e.g. 300MB or 8GB (default 2GB): sets the scan "
                        "workers that run at once and the tokens packed per group")
    p.add_argument("--shard", default="", metavar="I/N",
                   help="scan only the I-th of N shares of the inputs into --out, for `longctx data merge` "
                        "(one per machine)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_data)

    m = data.add_parser("merge", help="dedup across and pack the scans of `data build --shard i/n` into one store",
                        allow_abbrev=False)
    m.add_argument("scans", nargs="+", metavar="SCAN_DIR", help="the --out directories of all N shard scans")
    m.add_argument("--out", required=True, help="the store directory")
    m.add_argument("--workers", type=int, default=0, help="default: the shard builds' --workers")
    m.add_argument("--max-memory", default="", metavar="SIZE", help="default: the shard builds' --max-memory")
    m.add_argument("--no-progress", action="store_true", help="no progress bars")
    m.set_defaults(func=_cmd_data)
