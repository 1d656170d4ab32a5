"""Config rules: impossible values and combinations, all reported together in one ConfigError.

Kept apart from load.py (which parses and writes) so the rules read as one list. Nothing here
imports from the rest of longctx but errors: config sits below every other module.
"""

from __future__ import annotations

import functools
import math

from ..errors import ConfigError
from .data_mix import mix_problems
from .data_parallel import data_parallel_problems
from .data_rules import data_rules
from .divisors import among, divisors
from .draft_rules import draft_problems
from .inert_options import inert_option_problems
from .moe_rules import moe_rules
from .positions import ms_poe_problems, rope_scaling_problems
from .rules_ranges import range_problems
from .schema import RECOMPUTE_POLICIES, Config

# families with q/k RMSNorm, and what it spans (model.qk_norm_span)
QK_NORM_SPAN = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "all"}


def memory_policy_problems(recompute: str, offload_fraction, block_chunk: int = 0) -> list[str]:
    """What is wrong with a memory policy, one sentence with its fix each (empty when it is fine).
    offload_fraction may be the word 'auto' (MEMO's rule, for selective)."""
    problems = []
    if recompute not in RECOMPUTE_POLICIES:
        problems.append(f"memory.recompute '{recompute}' is not available; choose one of {RECOMPUTE_POLICIES}.")
    auto = offload_fraction == "auto"
    if not auto and not 0 <= offload_fraction <= 1:
        problems.append(f"memory.offload_fraction must be in [0, 1] or 'auto', got {offload_fraction}.")
    elif (auto or offload_fraction > 0) and recompute == "none":
        problems.append(
            f"memory.offload_fraction = {offload_fraction} needs memory.recompute = selective or full (got "
            f"'none'): offload moves what a recomputing policy keeps to the host. Add --memory.recompute selective.")
    elif auto and recompute != "selective":
        problems.append(
            f"memory.offload_fraction = auto applies MEMO's rule, which is for memory.recompute = selective (got "
            f"'{recompute}'); with {recompute} give a number (1.0 moves every block input to the host).")
    if block_chunk < 0:
        problems.append(f"memory.block_chunk must be >= 0 (0 = whole blocks), got {block_chunk}.")
    elif block_chunk > 0 and recompute == "none":
        problems.append(
            f"memory.block_chunk = {block_chunk} needs memory.recompute = selective or full (got 'none'): "
            f"without recomputation every chunk's activations are kept anyway. Add --memory.recompute selective.")
    return problems


def validate(cfg: Config) -> None:
    """Reject impossible values and combinations; all problems are reported together."""
    problems: list[str] = []
    for section_rules in (_model_rules, _train_rules, data_rules, _parallel_rules, _memory_and_other_rules):
        section_rules(cfg, problems)
    problems += (draft_problems(cfg, shortest_length(cfg)) + data_parallel_problems(cfg) + range_problems(cfg)
                 + inert_option_problems(cfg) + mix_problems(cfg))
    if problems:
        raise ConfigError(" ".join(problems))


def _positive(problems: list[str], key: str, value) -> None:
    if value <= 0:
        problems.append(f"{key} must be positive, got {value}.")


def _model_rules(cfg: Config, problems: list[str]) -> None:
    m = cfg.model
    positive = functools.partial(_positive, problems)
    for key in ("dim", "layers", "heads", "kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
        positive(f"model.{key}", getattr(m, key))
    for key in ("norm_eps", "rope_theta", "init_std"):
        positive(f"model.{key}", getattr(m, key))
    if m.heads > 0 and m.kv_heads > 0 and m.heads % m.kv_heads:
        problems.append(
            f"model.heads ({m.heads}) must be divisible by model.kv_heads ({m.kv_heads}) for grouped-query "
            f"attention; choose kv_heads among {among(m.heads)}."
        )
    if not -1 <= m.padding_idx < max(m.vocab_size, 0):  # (nn.Embedding's own assertion, said as the key)
        problems.append(f"model.padding_idx must be -1 (none) or a token id below model.vocab_size ({m.vocab_size}), "
                        f"got {m.padding_idx}.")
    if m.head_dim < 0:
        problems.append(f"model.head_dim must be 0 (= dim // heads) or positive, got {m.head_dim}.")
    elif m.head_dim == 0 and m.heads > 0 and m.dim % m.heads:
        problems.append(
            f"model.dim ({m.dim}) must be divisible by model.heads ({m.heads}) when model.head_dim is 0; "
            f"set model.head_dim explicitly or change dim/heads."
        )
    if m.heads > 0 and m.dim > 0 and m.resolved_head_dim % 2:
        problems.append(f"the head size ({m.resolved_head_dim}) must be even for rotary embeddings.")
    moe_rules(m, problems)
    problems += rope_scaling_problems(m)
    if m.qk_norm != (m.family in QK_NORM_SPAN):
        problems.append(f"model.qk_norm={m.qk_norm} does not fit model.family={m.family}: q/k norms are what "
                        f"{', '.join(QK_NORM_SPAN)} have and the other families lack; set both or neither.")
    elif m.qk_norm and m.qk_norm_span != QK_NORM_SPAN[m.family]:
        problems.append(f"model.family={m.family} normalises q and k over "
                        f"{'each head' if QK_NORM_SPAN[m.family] == 'head' else 'the whole projection'}: set "
                        f"model.qk_norm_span={QK_NORM_SPAN[m.family]}.")
    if m.family == "qwen2" and (not m.qkv_bias or m.out_bias):
        problems.append("model.family=qwen2 has biases on q, k and v only: set model.qkv_bias=true, "
                        "model.out_bias=false.")
    elif m.family == "qwen2_moe" and m.out_bias:
        problems.append("model.family=qwen2_moe has no bias on the attention output: set model.out_bias=false.")
    elif m.family in ("mistral", "mixtral") and (m.qkv_bias or m.out_bias):  # (transformers' classes drop them)
        problems.append(f"model.family={m.family} has no attention biases: set model.qkv_bias and model.out_bias "
                        f"false (or model.family=llama, the same model with biases).")
    elif m.family not in ("qwen2", "qwen2_moe") and m.qkv_bias != m.out_bias:
        problems.append(f"model.family={m.family} has one attention_bias for q, k, v and o: set model.qkv_bias and "
                        f"model.out_bias alike.")
    if m.rope_scaling == "llama3" and not (0 < m.rope_low_freq_factor < m.rope_high_freq_factor):
        problems.append(
            f"llama3 rope scaling needs 0 < model.rope_low_freq_factor ({m.rope_low_freq_factor}) "
            f"< model.rope_high_freq_factor ({m.rope_high_freq_factor})."
        )
    problems += ms_poe_problems(m)  # (the model refuses them too, for a config built another way)


def _train_rules(cfg: Config, problems: list[str]) -> None:
    t, m = cfg.train, cfg.model
    if t.stages:
        try:
            stages = parse_stages(t.stages)
        except ConfigError as e:
            problems.append(str(e))
            stages = []
        named = [(s[0], f"stage {i} ({':'.join(str(x) for x in s if x)})") for i, s in enumerate(stages, 1)]
        if short := [name for length, name in named if length < 2]:  # (train.seq_len's rule: the last stage's)
            problems.append(f"train.stages: {', '.join(short)} must be at least 2 tokens long (no label in 1).")
        if longer := [f"{name} of {length} tokens" for length, name in named if length > m.max_seq_len]:
            problems.append(f"train.stages has {', '.join(longer)}, more than model.max_seq_len ({m.max_seq_len}); "
                            f"raise model.max_seq_len or shorten the stage.")
    if t.stages and cfg.data.path:
        problems.append(f"train.stages reads one store per stage length, built from data.corpus; data.path "
                        f"({cfg.data.path}) holds one length; drop data.path (data.corpus: your text) or train.stages.")
    positive = functools.partial(_positive, problems)
    for key in ("steps", "global_batch", "grad_accum", "eval_batches"):
        positive(f"train.{key}", getattr(t, key))
    try:  # (job/checks.py checks the stages' own batches)
        batch_used = global_batch_used(t.stages)
    except ConfigError:  # (said by the stages' own rule)
        batch_used = True
    if t.global_batch > 0 and t.grad_accum > 0 and t.global_batch % t.grad_accum and batch_used:
        problems.append(
            f"train.global_batch ({t.global_batch} sequences per optimizer step) must be divisible by "
            f"train.grad_accum ({t.grad_accum} micro-batches per step); use a multiple of {t.grad_accum}.")
    if t.seq_len < 2:
        problems.append(f"train.seq_len must be at least 2, got {t.seq_len}.")
    positive("train.lr", t.lr)
    if not 0 <= t.min_lr_ratio <= 1:
        problems.append(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}.")
    if t.warmup_steps < 0:
        problems.append(f"train.warmup_steps must be >= 0, got {t.warmup_steps}.")
    if not 0 < t.lr_decay_fraction <= 1:
        problems.append(f"train.lr_decay_fraction must be in (0, 1] (the share of train.steps the decay takes at the "
                        f"end; 1 = from the warmup's end), got {t.lr_decay_fraction}.")
    if t.weight_decay < 0:
        problems.append(f"train.weight_decay must be >= 0, got {t.weight_decay}.")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(t, key) < 1:
            problems.append(f"train.{key} must be in [0, 1), got {getattr(t, key)}.")
    positive("train.eps", t.eps)
    if t.grad_clip < 0:
        problems.append(f"train.grad_clip must be >= 0 (0 disables clipping), got {t.grad_clip}.")
    if t.eval_interval < 0:
        problems.append(f"train.eval_interval must be >= 0 (0 disables evaluation), got {t.eval_interval}.")
    if t.seq_len > m.max_seq_len and not t.stages:  # (with stages: their last one's, said above as the stage)
        problems.append(
            f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); raise model.max_seq_len "
            f"or shorten the sequence."
        )


def parse_stages(spec: str) -> list[tuple[int, int, int]]:
    """train.stages "1024:200:16,4096:100" -> [(1024, 200, 16), (4096, 100, 0)]: (seq_len, steps,
    global_batch or 0 for train.global_batch) per stage."""
    stages = []
    for item in spec.split(","):
        fields = item.strip().split(":")
        try:
            stage = tuple(int(f) for f in fields) + (0,) * (3 - len(fields)) if len(fields) in (2, 3) else (0, 0, 0)
        except ValueError:
            stage = (0, 0, 0)
        if stage[0] <= 0 or stage[1] <= 0 or stage[2] < 0 or (len(fields) == 3 and stage[2] == 0):
            raise ConfigError(f"train.stages = {spec!r}: {item.strip()!r} is not SEQ_LEN:STEPS[:GLOBAL_BATCH] with "
                              f"positive numbers; write e.g. \"1024:200:16,4096:100:4\" (200 steps of 16 sequences "
                              f"of 1024 tokens, then 100 of 4 of 4096; without the batch, train.global_batch).")
        stages.append(stage)
    return stages


def shortest_length(cfg: Config) -> int:
    """The shortest sequence a run trains on: train.seq_len, or its stages' shortest (a spec the stages'
    own rule refuses: train.seq_len)."""
    if not cfg.train.stages:
        return cfg.train.seq_len
    try:
        return min(length for length, _, _ in parse_stages(cfg.train.stages))
    except ConfigError:
        return cfg.train.seq_len


def global_batch_used(stages: str) -> bool:
    """Whether train.global_batch is read: no train.stages, or a stage that names no batch of its own."""
    return not stages or any(not batch for _, _, batch in parse_stages(stages))


DEGREES = ("dp_replicate", "dp_shard", "head", "ctx")  # the mesh's dims, outermost first


def degree_problems(degrees: dict[str, int], window: int) -> list[str]:
    """What is wrong with the parallel degrees alone (before a world size is known): each must be
    positive or -1 (inferred, at most one), and the Double-Ring window must divide ctx. The one
    statement of these rules: the config and ParallelDims both ask it."""
    problems = [f"parallel.{k} must be a positive degree or -1 (inferred), got {v}."
                for k, v in degrees.items() if v == 0 or v < -1]
    inferred = [k for k, v in degrees.items() if v == -1]
    if len(inferred) > 1:
        problems.append(f"at most one parallel degree may be -1 (inferred), got -1 for "
                        f"{' and '.join(f'parallel.{k}' for k in inferred)}"
                        + (" (parallel.dp_shard is -1 by default)" if "dp_shard" in inferred else "")
                        + "; give all but one of them a positive degree"
                        + (", e.g. --parallel.dp_shard 1." if "dp_shard" in inferred else "."))
    ctx = degrees.get("ctx", 1)
    if window < 0 or (window > 0 and ctx > 0 and ctx % window):
        valid = among(ctx) if ctx > 0 else ""
        problems.append(f"parallel.window ({window}) must be 0 (plain ring) or divide parallel.ctx ({ctx})"
                        + (f"; valid windows: {valid}." if valid else "."))
    return problems


def degrees_on(degrees: dict[str, int], world: int) -> dict[str, int] | None:
    """`degrees` (DEGREES; at most one -1) with the inferred one worked out on `world` ranks: the world over the
    product of the given ones. None where they cannot run on `world` (that product does not divide it, or, none
    inferred, is not it). The one statement of the inference: ParallelDims (job/dims.py) raises its errors on
    None, and a rollback's kept layout (config/resume_layout.py) compares layouts as they run."""
    known = math.prod(d for d in degrees.values() if d != -1)
    inferred = [n for n, d in degrees.items() if d == -1]
    if not inferred:
        return dict(degrees) if known == world else None
    return None if len(inferred) > 1 or world % known else {**degrees, inferred[0]: world // known}


def head_fits(heads: int, kv_heads: int, head: int) -> bool:
    """Whether `heads` query heads and `kv_heads` key/value heads split over a head degree `head`
    (kv heads are replicated when the degree is a multiple of them: parallel/context/ulysses.py check_heads)."""
    return heads % head == 0 and (kv_heads % head == 0 or head % kv_heads == 0)


def working_layouts(heads: int, kv_heads: int, ranks: int) -> list[str]:
    """The head x ctx layouts of `ranks` ranks whose head degree the model's heads split over."""
    return [f"--parallel.head {h} --parallel.ctx {ranks // h}" for h in divisors(ranks) or []
            if head_fits(heads, kv_heads, h)]


def _parallel_rules(cfg: Config, problems: list[str]) -> None:
    p, m = cfg.parallel, cfg.model
    problems += degree_problems({k: getattr(p, k) for k in DEGREES}, p.window)
    if p.head > 0 and m.heads > 0 and m.heads % p.head:
        ranks = p.head * p.ctx if p.ctx > 0 else p.head
        fits = working_layouts(m.heads, m.kv_heads or m.heads, ranks)
        problems.append(f"model.heads ({m.heads}) must be divisible by parallel.head ({p.head})"
                        + (f"; on the same {ranks} ranks these layouts work: {', '.join(fits)}" if fits else "")
                        + " (or --nproc 1).")
    if p.expert_pipeline_chunks < 0:
        problems.append(f"parallel.expert_pipeline_chunks must be >= 0 (1 = no pipelining, 0 = chosen by an online "
                        f"profile of the first steps), got {p.expert_pipeline_chunks}.")
    if p.grad_bucket_blocks < 0:
        problems.append(f"parallel.grad_bucket_blocks must be >= 0 (blocks per gradient reduce-scatter; 0 = chosen "
                        f"by the cost model), got {p.grad_bucket_blocks}.")
    if p.expert_replicas < 0 or p.expert_placement_window < 1:
        problems.append(f"parallel.expert_replicas must be >= 0 and parallel.expert_placement_window >= 1, got "
                        f"{p.expert_replicas} and {p.expert_placement_window}.")
    if p.expert_ranks_per_node and (p.expert_ranks_per_node < 0 or p.expert % p.expert_ranks_per_node):
        problems.append(f"parallel.expert_ranks_per_node = {p.expert_ranks_per_node} must divide parallel.expert "
                        f"({p.expert}): an expert group is a whole number of nodes (0 = flat dispatch).")
    if p.expert_ranks_per_node and p.expert_replicas:
        problems.append("parallel.expert_replicas (FlexMoE copies) and parallel.expert_ranks_per_node (hierarchical "
                        "dispatch) are not combined yet: set one of them to 0.")
    if p.expert_replicas and p.expert == 1:
        problems.append(f"parallel.expert_replicas = {p.expert_replicas} copies hot experts onto other ranks of an "
                        f"expert group, but parallel.expert = 1 (no group): set parallel.expert > 1 or "
                        f"expert_replicas = 0.")
    if p.expert < 1:
        problems.append(f"parallel.expert must be a positive degree, got {p.expert}.")
    elif p.expert > 1 and not m.is_moe:
        problems.append(f"parallel.expert = {p.expert} splits the experts of MoE layers, but the model has none "
                        f"(model.moe.experts = 0); use a MoE model (e.g. --model.preset debug-moe) or "
                        f"parallel.expert 1.")
    elif p.expert > 1 and m.moe_experts % p.expert:
        # (the world size is not known here: job/dims.py checks that the degree divides it too)
        problems.append(f"parallel.expert ({p.expert}) must divide model.moe.experts ({m.moe_experts}) and the number "
                        f"of ranks: choose among {among(m.moe_experts)}, one that also "
                        f"divides the ranks.")
    if p.timeout_s <= 0:
        problems.append(f"parallel.timeout_s must be positive, got {p.timeout_s}.")


def _memory_and_other_rules(cfg: Config, problems: list[str]) -> None:
    mem, ck, mt = cfg.memory, cfg.checkpoint, cfg.metrics
    problems += memory_policy_problems(mem.recompute, mem.offload_fraction, mem.block_chunk)
    if mem.attention_chunk < 0:
        problems.append(f"memory.attention_chunk must be >= 0 (0 = the attention core over all tokens at once), "
                        f"got {mem.attention_chunk}.")
    elif mem.attention_offload and not mem.attention_chunk:
        problems.append("memory.attention_offload keeps the attention core's chunks in host memory, so it needs "
                        "memory.attention_chunk > 0 (e.g. --memory.attention_chunk 8192).")
    if mem.expert_chunk < 0:
        problems.append(f"memory.expert_chunk must be >= 0 (0 = the experts' rows at once), got {mem.expert_chunk}.")
    if mem.loss_chunk < 0:
        problems.append(f"memory.loss_chunk must be >= 0 (0 = never chunk), got {mem.loss_chunk}.")
    if mem.offload_skip_last < 0:
        problems.append(f"memory.offload_skip_last must be >= 0, got {mem.offload_skip_last}.")
    if ck.interval < 0 or ck.keep < 1:
        problems.append(f"checkpoint.interval must be >= 0 and checkpoint.keep >= 1, got {ck.interval} and {ck.keep}.")
    if not ck.resume.strip():  # ('' would be read as the path '.', the working directory)
        problems.append("checkpoint.resume is empty; write auto (the latest checkpoint), none or a checkpoint path.")
    t = cfg.train
    if t.on_nonfinite == "rollback" and not ck.interval:
        problems.append("train.on_nonfinite = rollback reloads the last checkpoint, but checkpoint.interval is 0 (no "
                        "checkpoint is saved); set --checkpoint.interval N, or use skip or stop.")
    if t.spike_factor < 0 or 0 < t.spike_factor <= 1:
        problems.append(f"train.spike_factor must be 0 (no spike check) or above 1 (a loss this many times the "
                        f"running median is a spike), got {t.spike_factor}.")
    if t.spike_window < 1:
        problems.append(f"train.spike_window must be at least 1 step, got {t.spike_window}.")
    if t.skip_limit < 0:
        problems.append(f"train.skip_limit must be >= 0 (the skipped steps in a row that stop the run; 0 = no "
                        f"limit), got {t.skip_limit}.")
    try:
        parse_signals(ck.on_signal)
    except ConfigError as e:
        problems.append(str(e))

    _positive(problems, "metrics.log_interval", mt.log_interval)
    if mt.profile_step < 0 or mt.profile_step > max(t.steps, 0):  # (0, no profile, is no fault of a bad steps)
        problems.append(f"metrics.profile_step must be 0 (no profile) or a step of the run (1..train.steps = "
                        f"{t.steps}), got {mt.profile_step}.")
    if mt.peak_tflops < 0:
        problems.append(f"metrics.peak_tflops must be >= 0 (0 = automatic), got {mt.peak_tflops}.")


def parse_signals(text: str) -> list:
    """checkpoint.on_signal 'SIGTERM,SIGUSR1' (or 'TERM,USR1') -> [signal.Signals]; '' or 'none' -> []."""
    import signal

    out = []
    for part in (p.strip().upper() for p in str(text).split(",")):
        if not part or part == "NONE":
            continue
        name = part if part.startswith("SIG") else f"SIG{part}"
        if name in ("SIGKILL", "SIGSTOP") or not isinstance(getattr(signal, name, None), signal.Signals):
            raise ConfigError(f"checkpoint.on_signal: '{part}' is not a signal a process can catch; write names "
                              f"such as SIGTERM,SIGUSR1 (or '' for none).")
        out.append(signal.Signals[name])
    return out
