"""metrics.profile_step: one step under torch.profiler, so that a short lease on a GPU says where a step's
time goes (which kernels, which kind), not only how long it took. The step runs as any other (its figures,
its update); the profiler's exit waits for the device, which a profiled step may.

Written to <run_dir>/profile/: each rank's Chrome trace (step<N>_rank<R>.json, for chrome://tracing or
Perfetto) and, from rank 0, step<N>_top.json: the ops that took the most self time on the device (CUDA
kernels; on CPU the aten ops' CPU time), each with its calls and share, and the totals by kind."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from .hooks import StepHook

TOP = 40  # rows of the table
# kinds by name, first match wins (kernel names on CUDA: cutlass/sm90 GEMMs, flash/fmha attention; aten names on CPU)
KINDS = (("communication", ("nccl", "gloo", "all_gather", "reduce_scatter", "all_reduce", "all_to_all")),
         ("copy", ("memcpy", "memset", "aten::copy_", "aten::to", "aten::_to_copy")),
         ("attention", ("flash", "fmha", "attention", "attn")),
         ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul",
                     "aten::linear", "grouped_mm")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in KINDS if any(_marks(m, low) for m in marks)), "other")


def _marks(mark: str, low: str) -> bool:
    """A kernel mark anywhere in the name; an aten op's the op itself or a variant of it (aten::addmm_,
    aten::to_dense), not an op that only starts with its letters (aten::topk is no aten::to)."""
    if mark.startswith("aten::"):
        return low == mark or low.startswith(mark + "_")
    return mark in low


def top_table(events, on_device: bool) -> dict:
    """The profile's key_averages as a table: rows by self time, descending (device time of the CUDA
    kernels when `on_device`, else CPU time of the ops), each with calls and share, and sums by kind."""
    rows = []
    for ev in events:
        if on_device:
            if ev.device_type != DeviceType.CUDA:
                continue
            us = getattr(ev, "self_device_time_total", None)
            us = ev.self_cuda_time_total if us is None else us
        else:
            us = ev.self_cpu_time_total
        if us > 0:
            rows.append({"name": ev.key, "calls": ev.count, "self_s": us / 1e6, "kind": kind_of(ev.key)})
    rows.sort(key=lambda r: r["self_s"], reverse=True)
    total = sum(r["self_s"] for r in rows)
    by_kind: dict[str, float] = {}
    for r in rows:
        r["share"] = r["self_s"] / total if total else 0.0
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0.0) + r["self_s"]
    return {"time": "device (CUDA kernels)" if on_device else "CPU (aten ops)", "total_self_s": total,
            "by_kind": {k: {"self_s": v, "share": v / total if total else 0.0}
                        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": rows[:TOP]}


def profile_call(fn, on_device: bool, rows: int = 15) -> dict:
    """fn() once under torch.profiler: its top_table, cut to `rows` (what a benchmark's JSON carries)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=acts) as prof:
        fn()
    table = top_table(prof.key_averages(), on_device)
    table["top"] = table["top"][:rows]
    return table


class ProfileStep(StepHook):
    """Profiles step `step` from its start to after its optimizer step."""

    def __init__(self, step: int, out_dir: Path, rank: int, device: torch.device, log):
        self.step, self.out_dir, self.rank, self.log = step, out_dir, rank, log
        self.on_device = device.type == "cuda"
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_device else [])
        self.active: profile | None = None

    def step_start(self, step: int) -> None:
        if step == self.step and self.active is None:
            self.active = profile(activities=self.activities)
            self.active.__enter__()

    def after_optimizer(self, step: int, applied: torch.Tensor) -> None:
        if self.active is not None and step == self.step:
            self._finish()

    def rolled_back(self) -> None:  # (a rollback before the step's end: the profile ends with what it holds)
        if self.active is not None:
            self._finish()

    def run_end(self) -> None:
        if self.active is not None:
            self._finish()

    def _finish(self) -> None:
        prof, self.active = self.active, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out_dir / f"step{self.step}_rank{self.rank}.json"))
        if self.rank != 0:
            return
        table = {"step": self.step, **top_table(prof.key_averages(), self.on_device)}
        path = self.out_dir / f"step{self.step}_top.json"
        path.write_text(json.dumps(table, indent=1) + "\n")
        kinds = ", ".join(f"{k} {v['share']:.0%}" for k, v in table["by_kind"].items())
        self.log(f"profile: step {self.step}, {table['total_self_s'] * 1e3:.1f} ms of {table['time']} self time: "
                 f"{kinds}; table in {path}")


def profile_hooks(cfg, run_dir: Path, rank: int, device: torch.device, log) -> list[StepHook]:
    """[ProfileStep] when metrics.profile_step names a step, else []."""
    step = cfg.metrics.profile_step
    return [ProfileStep(step, Path(run_dir) / "profile", rank, device, log)] if step else []
