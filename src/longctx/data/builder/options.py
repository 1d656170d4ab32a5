"""What a build is asked to do (`BuildOptions`, one field per `longctx data build` flag), checked
before any work starts, and the memory bound turned into scan workers and group sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError, DataError
from ..chat_template import load_chat_template
from .conversations import ANSWERS, LONG_CONVERSATIONS
from .inputs import overlapping_inputs
from .pack import STRATEGIES
from .scan import ScanOptions

DEDUP_MODES = ("minhash", "exact", "none")
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
    response_field: str = ""  # records as (prompt = text_field, response = this): loss on the response only
    messages_field: str = ""  # records as conversations, trained on their answers (conversations.py)
    answers: str = "all"  # which of a conversation's answers: all, or the last (--answers)
    # a conversation longer than a sample: cut after its last answer that fits, or dropped (--long-conversations)
    long_conversations: str = "truncate"
    eval_fraction: float = 0.0
    # the eval split's grid: a document longer than this is held out in pieces of about this many tokens
    # (0 = seq_len). Stores of one corpus at several lengths hold out the same text when they share it.
    holdout_tokens: int = 0
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
    # not an option: the record of the chat template the scan rendered its conversations with, which the store
    # records (pipeline.py sets it from the scan's plan; None: not recorded, scans made before 2026-12-06)
    chat_template: dict | None = None

    @property
    def holdout_len(self) -> int:
        return self.holdout_tokens or self.seq_len

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

    def scan_options(self) -> ScanOptions:
        return ScanOptions(self.tokenizer, self.dedup, self.text_field, self.response_field, self.messages_field,
                           self.answers)


def check_options(opts: BuildOptions) -> None:
    """Every problem with the options at once, as one DataError."""
    problems = []
    if opts.seq_len < 2:
        problems.append(f"--seq-len must be at least 2 tokens, got {opts.seq_len}.")
    if opts.strategy not in STRATEGIES:
        problems.append(f"--strategy {opts.strategy!r} is not one of {', '.join(STRATEGIES)}.")
    if opts.dedup not in DEDUP_MODES:
        problems.append(f"--dedup {opts.dedup!r} is not one of {', '.join(DEDUP_MODES)}.")
    overlaps = overlapping_inputs(opts.inputs)
    if overlaps:
        problems.append(f"--input: {'; '.join(overlaps)}: their files would be read, and stored, once for each. "
                        f"Pass each directory or file once, and none inside another.")
    if not opts.text_field:
        problems.append("--text-field '' names no field: no .jsonl record has one (each would be skipped as "
                        "having no text) and no .parquet or .arrow column does; pass the field holding the "
                        "documents' text (default: text).")
    problems += _instruction_problems(opts)
    problems += _tokenizer_problems(opts.tokenizer) + _embed_model_problems(opts.embed_model)
    if opts.workers < 1:
        problems.append(f"--workers must be >= 1, got {opts.workers}.")
    if not 0 <= opts.eval_fraction < 1:
        problems.append(f"--eval-fraction must be in [0, 1), got {opts.eval_fraction}.")
    if opts.holdout_tokens < 0:
        problems.append(f"--holdout-tokens must be >= 0 (0 = --seq-len), got {opts.holdout_tokens}.")
    if opts.seed < 0:  # (numpy's default_rng takes none: a traceback after the scan and dedup)
        problems.append(f"--seed must be >= 0, got {opts.seed}.")
    if not 0 < opts.dedup_threshold <= 1:
        problems.append(f"--dedup-threshold must be in (0, 1], got {opts.dedup_threshold}.")
    elif opts.dedup != "minhash" and opts.dedup_threshold != BuildOptions.dedup_threshold:
        problems.append(f"--dedup-threshold {opts.dedup_threshold} would be ignored: it is the near-duplicate "
                        f"(MinHash) Jaccard threshold, and --dedup {opts.dedup} finds no near duplicates; pass "
                        f"--dedup minhash to use it, or drop it.")
    if opts.max_docs < 0:
        problems.append(f"--max-docs must be >= 0 (0 = all), got {opts.max_docs}.")
    if opts.clusters < 0:
        problems.append(f"--clusters must be >= 0 (0 = automatic), got {opts.clusters}.")
    if opts.seq_len > opts.group_tokens:
        problems.append(f"--seq-len {opts.seq_len}: one sample is more tokens than the build packs at a time in "
                        f"--max-memory {opts.memory / 2**20:.0f}MB ({opts.group_tokens:,}); raise --max-memory or "
                        f"lower --seq-len.")
    if opts.max_memory and opts.max_memory < MAIN_BYTES + WORKER_BYTES:
        problems.append(f"--max-memory {_size(opts.max_memory)} is below what a build needs at the least "
                        f"(~{(MAIN_BYTES + WORKER_BYTES) / 2**20:.0f}MB: its imports and one scan worker).")
    if opts.shard is not None:
        i, n = opts.shard
        if not 0 <= i < n:
            problems.append(f"--shard {i}/{n}: expected i/n with 0 <= i < n, e.g. --shard 0/4.")
        if opts.append:
            problems.append("--shard and --append do not go together: a shard's scan is merged into a new store "
                            "with `longctx data merge`.")
        if opts.max_docs:
            problems.append("--shard and --max-docs do not go together: which documents are the first N is only "
                            "known once every shard is scanned.")
    if problems:
        raise DataError(" ".join(problems))


def _tokenizer_problems(tokenizer: str) -> list[str]:
    """--tokenizer, in the flag's words (the tokenizer's own error names train's key, data.tokenizer)."""
    from pathlib import Path

    path = Path(tokenizer)
    if tokenizer == "byte" or path.is_file() or (path / "tokenizer.json").is_file():
        return []
    return [f"--tokenizer {tokenizer}: no such tokenizer.json (nor a directory holding one); pass --tokenizer byte or "
            f"the path of a tokenizer.json."]


def _embed_model_problems(model: str) -> list[str]:
    """--embed-model's directory and package, checked before the scan: the embedding stage, which found both
    missing, comes after the scan and the dedup (minutes of a large build)."""
    import importlib.util
    from pathlib import Path

    if not model:
        return []
    if not Path(model).is_dir():
        return [f"--embed-model {model} is not a directory: pass the directory of a downloaded sentence-transformers "
                f"model, or leave --embed-model out to use the built-in TF-IDF embeddings."]
    if importlib.util.find_spec("sentence_transformers") is None:
        return [f"--embed-model {model} needs the sentence-transformers package, which is not installed; pip install "
                f"sentence-transformers, or leave --embed-model out to use the built-in TF-IDF embeddings."]
    return []


def _instruction_problems(opts: BuildOptions) -> list[str]:
    """What would train a response without its prompt, or cannot make pairs at all (instruction data)."""
    problems = []
    if opts.response_field and opts.response_field == opts.text_field:
        problems.append(f"--response-field {opts.response_field!r} is the --text-field too: a record's prompt and "
                        f"response must be two fields (e.g. --text-field prompt --response-field response).")
    pairs = opts.response_field or opts.messages_field  # (instruction data: a response trained after its prompt)
    if opts.response_field and opts.messages_field:
        problems.append("--response-field and --messages-field do not go together: a record is a prompt and a "
                        "response, or a conversation; build each kind into its own store, or append one to the other.")
    if opts.answers not in ANSWERS:
        problems.append(f"--answers {opts.answers!r} is not one of {', '.join(ANSWERS)}.")
    elif opts.answers != "all" and not opts.messages_field:
        problems.append(f"--answers {opts.answers} chooses a conversation's answers to train on; it needs "
                        f"--messages-field (a pair's --response-field is one answer).")
    if opts.long_conversations not in LONG_CONVERSATIONS:
        problems.append(f"--long-conversations {opts.long_conversations!r} is not one of "
                        f"{', '.join(LONG_CONVERSATIONS)}.")
    elif opts.long_conversations != "truncate" and not opts.messages_field:
        problems.append(f"--long-conversations {opts.long_conversations} chooses what becomes of a conversation "
                        f"longer than a sample; it needs --messages-field (a longer pair is dropped either way).")
    if opts.messages_field:
        try:
            load_chat_template(opts.tokenizer, "--messages-field").check("--messages-field")
        except ConfigError as e:
            problems.append(str(e))
    if pairs and opts.strategy == "concat":
        problems.append("--strategy concat cuts documents wherever a sample ends, so a response could be trained "
                        "in another sample than its prompt (instruction data); use datasculpt or bfd, which keep "
                        "a document that fits a sample whole.")
    if pairs and 0 < opts.holdout_tokens < opts.seq_len:
        problems.append(f"--holdout-tokens {opts.holdout_tokens} below --seq-len {opts.seq_len} would hold out pieces "
                        f"of an instruction pair apart (instruction data): its response in one split, its prompt in "
                        f"the other. Leave it at 0 (= --seq-len) or raise it.")
    return problems


def _size(n: int) -> str:
    """Bytes as the MB --max-memory is mostly given in, or as bytes where that would read 0MB ('--max-memory 10')."""
    return f"{n / 2**20:.0f}MB" if abs(n) >= 2**19 else f"{n:,} bytes"


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
    except (ValueError, OverflowError):  # (OverflowError: 'inf', '1e400GB')
        raise DataError(f"--max-memory {text!r} is not a size; write it like 300MB or 4GB.") from None
