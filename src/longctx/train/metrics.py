"""Training metrics: MFU, memory, bytes sent, one printed line and one JSONL record per log step.

MFU divides achieved model FLOP/s (models/flops.py) by the device's peak (costs/peaks.py); the
line says which peak. `MetricsLogger` owns everything a metrics line needs (the interval since the
last line, the peak, the communication and FSDP byte figures), so the training loop only tells it
what happened: a step, an evaluation, a save.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import strict_json
from ..costs.model_states import fsdp_carried
from ..costs.peaks import device_peak, precision_name, raise_cpu_peak
from ..errors import TrainingError
from ..job.checks import hpz_group, launcher_node_ranks, node_size, zero_pp_names
from ..job.devices import resolve_dtype
from ..job.runtime import TRACKED_DIMS
from ..memory.rss import peak_rss_bytes
from ..models.flops import draft_train_flops_per_token, train_flops_per_token
from ..parallel.context.volumes import ZeroPP, fsdp_bytes_per_step
from ..parallel.fsdp.grad_buckets import grad_reduce_figures
from ..parallel.fsdp.shard import gathers_in_bf16


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "max allocated"
    return peak_rss_bytes(), "peak RSS"


def setup_peak_line(device: torch.device, rt) -> str:
    """The setup line: every rank's peak while building, loading and sharding the model (before
    anything the step allocates), lowest and highest over the ranks: what lets a model that no
    single rank could hold start at all. On CUDA the peak is then reset: setup transients are not
    the step's peak. A collective: every rank calls it."""
    setup_peak, peak_kind = peak_memory_bytes(device)
    high, neg_low = rt.max([float(setup_peak), -float(setup_peak)])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return f"setup: {peak_kind} per rank {-neg_low / 2**30:.2f}-{high / 2**30:.2f} GiB"


class MetricsWriter:
    """Appends one JSON object per record to a JSONL file; optionally mirrors to TensorBoard.

    `first_step`: the first step this writer logs. Past 1 (a resume), TensorBoard hides the events an earlier
    attempt wrote at that step or later (SummaryWriter's purge_step), as continue_run_files moves their records
    out of the JSONL file: both read as one run, each step once."""

    def __init__(self, path: Path, tensorboard_dir: Path | None = None, first_step: int = 1,
                 tags: dict | None = None):
        self.path = Path(path)
        self.tags = tags or {}  # fields every record carries (the run's id and attempt: run_identity.py)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard package

            self._tb = SummaryWriter(str(tensorboard_dir), purge_step=first_step if first_step > 1 else None)

    def write(self, record: dict) -> None:
        record = {**record, **self.tags}
        try:
            self._file.write(strict_json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:  # (a full disk, a lost mount: said as what it is, not a traceback)
            with contextlib.suppress(OSError):  # (closed now: its unwritten line would raise again at close(),
                self._file.close()               # in the run's `finally`, over this error)
            raise TrainingError(f"the metrics line of step {record.get('step')} could not be written to {self.path} "
                                f"({e.strerror or e}); the run stops. Free space there (or pass --metrics.file "
                                f"elsewhere) and resume with --checkpoint.resume auto: a line cut short is moved "
                                f"aside, and the steps after the last checkpoint train again. The line not written "
                                f"(a step saved before it is not trained again, so it is said here, not lost): "
                                f"{strict_json.dumps(record)}") from e
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", *self.tags):
                    self._tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def format_line(r: dict) -> str:
    parts = [f"step {r['step']:>5}", f"loss {r['loss']:.4f}"]
    if "grad_norm" in r:
        parts.append(f"gnorm {r['grad_norm']:.3f}")
    if "lr" in r:
        parts.append(f"lr {r['lr']:.2e}")
    parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    parts.append(f"{r['tflops']:.3f} TFLOP/s")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    parts.append(f"mem {r['memory_gib']:.2f} GiB ({r['memory_kind']})")
    if "moe_aux_loss" in r:
        parts.append(f"moe aux {r['moe_aux_loss']:.3f} z {r['moe_z_loss']:.2f} load {r['moe_load_mean']:.2f}/"
                     f"{r['moe_load_worst']:.2f}" + (f" drop {100 * r['moe_drop_rate']:.1f}%" if r["moe_drop_rate"]
                                                     else "")
                     + (f" rank load {r['expert_rank_load']:.2f}" if "expert_rank_load" in r else ""))
    if r.get("compile_recompiles"):  # (train.compile: recompiles after the warm-up, train/recompile_hook.py)
        parts.append(f"recompiled {r['compile_recompiles']}x")
    if r.get("compile_limit_hits"):
        parts.append(f"EAGER: {r['compile_limit_hits']} compiled region(s) past the recompile limit")
    if r.get("skipped_steps"):
        parts.append(f"skipped {r['skipped_steps']} (non-finite or spike)")
    if r.get("comm_bytes_per_step"):
        parts.append("comm/step " + " ".join(f"{d} {v / 2**20:.1f}MiB" for d, v in r["comm_bytes_per_step"].items()))
    if "grad_reduce_exposed_s" in r:
        parts.append(f"grad reduce {r['grad_reduce_calls']:.0f} calls, "
                     f"{1e3 * r['grad_reduce_exposed_s']:.1f} ms exposed")
    return " | ".join(parts)


def json_record(line: str) -> dict | None:
    """A JSONL line's record, or None for a line that is no JSON object (a write cut short)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_jsonl(path: Path, cut: list[int] | None = None) -> list[dict]:
    """The records of a JSONL file. A line that is no JSON object (a write cut short by a kill or a full disk)
    is left out; its line number goes to `cut`, when given, for the caller to say so."""
    records = []
    with Path(path).open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json_record(line)
            if record is not None:
                records.append(record)
            elif cut is not None:
                cut.append(number)
    return records


def run_flops_per_token(cfg, seq_len: int) -> float:
    """Model FLOPs per trained token of this run's step (MFU's numerator): the model's training, or with
    draft.target a draft's training against its frozen target (models/flops.py: the target's forward
    once, only the draft trained), which is not 3x the target's forward."""
    d = cfg.draft
    if not d.target:
        return train_flops_per_token(cfg.model, seq_len)
    return draft_train_flops_per_token(cfg.model, seq_len, kind=d.kind, layers=d.layers, block=d.block,
                                       vocab=d.vocab, kd=d.loss == "kd")


@dataclass
class _Interval:
    """What a metrics line averages over: the steps since the last line, less evaluation."""
    start: float
    comm_bytes: list[float]
    eval_bytes: list[float]
    steps: int = 0
    eval_s: float = 0.0
    save_blocking_s: float = 0.0  # seconds the loop waited for checkpoint saves
    tokens: int = 0               # trained in the interval (the stage's length decides a step's tokens)
    flops: float = 0.0            # model FLOPs of those tokens


class MetricsLogger:
    """The metrics of one job, on every rank (rank 0 writes them): a line every
    `metrics.log_interval` steps (and at the first and last), eval records, the MFU peak and the
    bytes sent per mesh dimension plus FSDP's closed-form volume."""

    def __init__(self, cfg, rt, device: torch.device, model, run_dir: Path, say=print):
        self.cfg, self.rt, self.device, self.say = cfg, rt, device, say
        self.path = Path(cfg.metrics.file) if cfg.metrics.file else run_dir / "metrics.jsonl"
        self.tensorboard_dir = run_dir / "tensorboard" if cfg.metrics.tensorboard else None
        self.writer: MetricsWriter | None = None
        # rank 0 reads (or, once per machine, calibrates) the peak while the others wait: a calibration
        # that ran beside other ranks' start-up would measure them, not the machine
        # (the ranks on this machine as the host budget counts them: a launcher without LOCAL_WORLD_SIZE ran every
        # rank here, not one, and the whole machine's peak per rank read MFU world x low)
        self.local_ranks = launcher_node_ranks(rt.world) if rt.world > 1 else 1
        # (a GPU's peak is that of the precision the run computes in: train.dtype = fp32 is not bf16's)
        self.dtype = resolve_dtype(cfg.train.dtype, device)  # (on CPU too: bf16 GEMMs have their own peak)
        self.peak, self.peak_source = rt.broadcast(
            device_peak(device, cfg.metrics.peak_tflops, self.local_ranks, self.dtype) if rt.is_main else None)
        self.peak_calibrated = device.type == "cpu" and not cfg.metrics.peak_tflops
        gather = 2 if gathers_in_bf16(device.type, cfg.train.dtype) else 4
        # the tensors as FSDP2 pads them (the dim it cuts to a multiple of its group): what its collectives carry
        d, in_blocks = rt.dims, {id(p) for p in model.layers.parameters()}
        groups = (1,) if d is None else (d.dp_shard * d.head * d.ctx, d.expert, d.expert_data)  # (None: no mesh)
        hpz = None if d is None else hpz_group(cfg, d)
        even = hpz is None  # (hpz: dim 0 everywhere, parallel/fsdp/shard.py)
        params = [(p.shape, ".experts." in n, id(p) not in in_blocks) for n, p in model.named_parameters()]
        target = getattr(model, "target", None)  # a draft run's frozen target (train/glide.py): FSDP2 on the same ranks
        # (a draft is sharded with FSDP2's default, dim 0 everywhere: parallel/parallelize.py parallelize_draft)
        carried = fsdp_carried(params, *groups, even=even and target is None)
        zero_pp = ZeroPP(frozenset(zero_pp_names(cfg)), cfg.parallel.zero_pp_block, node_size(cfg, rt.dims) or 0,
                         hpz or 0)  # (the bytes ZeRO++ really sends, not plain FSDP's)
        frozen = 0 if target is None else fsdp_carried([(p.shape, False, False) for p in target.parameters()],
                                                       groups[0], even=even)["total"]
        self.fsdp_bytes = fsdp_bytes_per_step(carried["total"], carried["root"], rt.dims, cfg.train.grad_accum, gather,
                                              cfg.memory.grad_sync, expert_params=carried["experts"],
                                              replicas_sync=cfg.train.data_parallel == "sync", zero_pp=zero_pp,
                                              frozen_params=frozen)
        self.flops_per_token = 0.0
        self.grad_timers = getattr(model, "grad_reduce_timers", [])  # parallel/fsdp/grad_buckets.py
        self.interval = self._new_interval()

    def describe_peak(self) -> str:
        return f"MFU against {self.peak_source}" + (f" ({self.peak / 1e12:.3f} TFLOP/s per rank)" if self.peak else "")

    def open(self, first_step: int = 1, tags: dict | None = None) -> None:
        """The loop starts at `first_step` (past 1 after a resume): the first line's interval starts here, not
        when the logger was made (what the Trainer set up after that, its data among it, is not the first
        step's time or bytes). `tags`: fields every record carries (MetricsWriter)."""
        self.interval = self._new_interval()
        if self.rt.is_main:
            self.writer = MetricsWriter(self.path, self.tensorboard_dir, first_step, tags)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def enter_stage(self, seq_len: int) -> None:
        """A stage's FLOPs per token, computed when the stage changes, not every step."""
        self.flops_per_token = run_flops_per_token(self.cfg, seq_len)

    def due(self, step: int) -> bool:
        return step % self.cfg.metrics.log_interval == 0 or step == self.cfg.train.steps or step == 1

    def stepped(self, tokens: int) -> None:
        self.interval.steps += 1
        self.interval.tokens += tokens
        self.interval.flops += tokens * self.flops_per_token

    def now(self) -> float:
        """time.perf_counter once the device's queued work is done (CUDA): a span that starts here (an
        evaluation's) does not take in the tail of training work launched before it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def saved(self, blocking_s: float) -> None:
        self.interval.save_blocking_s += blocking_s

    def evaluated(self, step: int, loss: float, seconds: float, bytes_before: list[float],
                  routing: str | None = None, by_store: dict[str, float] | None = None,
                  stage: dict | None = None) -> None:
        """An evaluation's record; its time and bytes are taken out of the current interval. `routing`:
        how the evaluation routed, where that depends on the step (DTS-Gate: models/moe.py
        eval_routing_note); `by_store`: a mix's loss of each store (train/evaluation.py), in the record
        and in the line after the blend's; `stage`: a staged run's stage and length, which its eval set is of."""
        if self.writer is not None:
            record = {"kind": "eval", "step": step, "loss": loss, **(stage or {}),
                      **({"by_store": by_store} if by_store else {})}
            self.writer.write({**record, **({"routing": routing} if routing else {})})
        stores = f" ({', '.join(f'{name} {x:.4f}' for name, x in by_store.items())})" if by_store else ""
        self.say(f"step {step:>5} | eval loss {loss:.4f}{stores}" + (f" | {routing}" if routing else ""))
        iv = self.interval
        iv.eval_s += seconds
        iv.eval_bytes = [e + a - b for e, a, b in zip(iv.eval_bytes, self.rt.comm_bytes(), bytes_before)]

    def line(self, step: int, loss: float, grad_norm: float, lr: float, extra: dict) -> None:
        """One metrics line for the job (throughput over the interval, memory and bytes max over
        ranks), then a new interval. `extra`: fields the loop knows (tokens so far, seq_len, elapsed)."""
        rt, iv = self.rt, self.interval
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - iv.start - iv.eval_s  # evaluation is not training
        tps, flops_per_s = iv.tokens / elapsed, iv.flops / elapsed
        mem, mem_kind = peak_memory_bytes(self.device)
        sent = [(a - b - e) / iv.steps for a, b, e in zip(rt.comm_bytes(), iv.comm_bytes, iv.eval_bytes)]
        reduce = grad_reduce_figures(self.grad_timers, iv.steps)
        stats = rt.max([mem, *sent, reduce.get("grad_reduce_exposed_s", 0.0)])
        if reduce:  # the step waits for the slowest rank's
            reduce["grad_reduce_exposed_s"] = stats[-1]
        stats = stats[:-1]
        per_dim = {d: v for d, v in zip(TRACKED_DIMS, stats[1:]) if v}
        if self.peak_calibrated and flops_per_s > rt.world * self.peak:
            self._raise_peak(flops_per_s / rt.world)
        record = {
            "kind": "train", "step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
            "tokens_per_s": tps, "tflops": flops_per_s / 1e12,
            "mfu": flops_per_s / (rt.world * self.peak) if self.peak else None,
            "memory_gib": stats[0] / 2**30, "memory_kind": mem_kind + (" max over ranks" if rt.world > 1 else ""),
            "comm_bytes_per_step": {**per_dim, **self.fsdp_bytes},
            **extra, **reduce, "world": rt.world,
        }
        if iv.save_blocking_s:
            record["checkpoint_blocking_s"] = iv.save_blocking_s
        if self.writer is not None:
            self.writer.write(record)
        self.say(format_line(record))
        self.interval = self._new_interval()

    def _new_interval(self) -> _Interval:
        now = self.rt.comm_bytes()
        return _Interval(start=time.perf_counter(), comm_bytes=now, eval_bytes=[0.0] * len(now))

    def _raise_peak(self, per_rank: float) -> None:
        """More FLOP/s than the cached CPU peak (calibrated while the machine was busy): the peak
        becomes what this run achieved, here and in the cache, so MFU never reads above 100%."""
        self.say(f"metrics: this run reaches {per_rank * self.local_ranks / 1e12:.3f} TFLOP/s on this machine, above "
                 f"its cached CPU peak of {self.peak * self.local_ranks / 1e12:.3f} ({precision_name(self.dtype)}, "
                 f"measured while it was busy); "
                 f"the cached peak is raised to it")
        self.peak = per_rank
        if self.rt.is_main:
            raise_cpu_peak(per_rank * self.local_ranks, self.dtype)
