"""The offline data build: `longctx data build | merge` turns input documents into a packed store.

Training never runs this code; it reads the store the build wrote (data/store.py, data/loader.py),
or asks data/default_store.py for the default store, which builds it here once on first use.

    pipeline.py     build_store / merge_scans: the command, from options to a published store
    options.py      BuildOptions, their checks, the memory bound -> scan workers and group sizes
    out_dir.py      what an existing --out may hold (a build removes what it finds under its own names)
    scan.py         inputs -> shards, scanned in worker processes into a work directory; ScannedCorpus
    scan_pool.py    the scan's worker processes: any failure, a worker killed outright too, stops them all
    disk_full.py    a full disk said with the directory, its free space and the space the build needs
    shard_files.py  a shard's files, written a document at a time
    inputs.py       the units (files) of an input, in order; read_inputs (all documents in memory)
    readers.py      one unit's documents, streamed: text, jsonl, parquet, arrow, .gz / .zst
    table_readers.py  readers.py's parquet and arrow units, record batch by record batch
    corpus.py       Document; the default corpus (the standard library's own sources)
    conversations.py  --messages-field: a conversation made an instruction pair by the chat template
    tokenize.py     tokens of a document (or an instruction pair) with its line and paragraph breaks
    features.py     hashed word features of a document's head, for the embeddings
    scripts.py      scripts written without spaces: each character a word (dedup, features)
    dedup.py        exact and MinHash near-duplicate removal (Deduper)
    assembly.py     Assembly: dedup -> embed -> cluster -> split -> pack -> publish, one method each
    embed.py        document vectors on disk (TF-IDF + SVD, or a sentence-transformers model)
    cluster.py      chunked spherical k-means, near clusters merged
    holdout.py      the eval split: documents or pieces (--holdout-tokens) held out by the hash of their name
    pack.py         packing algorithms: concat, bfd, datasculpt; packing figures
    pack_search.py  datasculpt's searches (greedy, nearest group, gaps) without a pass over all candidates
    part_writer.py  a store part's files, written a group of samples at a time
    manifest.py     the store manifest: settings, parts, totals, packing figures
    spill.py        arrays written and read piece by piece (bounded memory)
    timing.py       each stage timed and logged
    parallel.py     parallel_map (the in-memory reference dedup's signatures)

This package file imports nothing: scan workers are spawned processes that import scan.py and
what it needs, nothing more. (It is `builder`, not `build`: directories named build/ are ignored
by .gitignore and removed by clean-up scripts.)
"""
