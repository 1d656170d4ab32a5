"""The train.compile step hook (hooks.py): the compiled blocks' recompilations, said in the run's lines.

A compiled region (a block's `pre` / `post`, models/compile.py) compiles its first graphs in the job's first step
and its no-grad ones in the first evaluation; that is the warm-up, and stays quiet. Any compile of a region
after that means a guard of its graphs failed: a new shape (a new stage's length) or, every step, a Python value
the compiled code reads that changes (DTS-Gate's step did: commit 7a0a500), which after torch._dynamo's recompile
limit (8) leaves the region running eagerly for the rest of the run (models/recompiles.py). Each such compile is
a line naming the region, the guard dynamo says failed and what to do, and counts in the metrics line's
`compile_recompiles` (since the last line, max over ranks); a region refused by the limit is a WARNING line and
counts in `compile_limit_hits` (since the job started), on every line after, so a run that lost its compiled speed
says so wherever its metrics are read. Only rank 0 prints: another rank's recompiles (a shape only it sees) travel
to rank 0 at the next metrics line, beside the collective that line makes anyway (an object gather more only at a
line where some rank has a cause it has not sent before), and are said there once per cause (a function and the
guard that failed; one rank 0 said itself is not said again), naming the ranks that had it; rank 0's own lines
name no rank (the same shapes reach every rank of a data-parallel job: "on rank 0" read as rank 0 alone).
ZeRO++'s compiled int8 kernels (parallel.zero_pp_kernels, compiled at set-up) are watched the same way, with or
without train.compile.

Not an error: past the limit the region runs as train.compile=false runs it, with the same numbers and at eager
speed (its recompiles, at most the limit's, are spent), so stopping the run would only lose its progress to reach
what it is doing now; the fix (the code, or --train.compile=false) needs a restart either way, which the
WARNING line asks for; what was wrong was the silence (docs/running.md, "train.compile: recompiles").
"""

from __future__ import annotations

from ..models.recompiles import RecompileWatch, recompile_limit
from .hooks import StepHook


def recompile_hooks(cfg, rt, device_type: str, log=print) -> list[StepHook]:
    """[RecompileHook] in a run that compiles (train.compile; ZeRO++'s compiled int8 kernels), else []."""
    settings = compile_settings(cfg, device_type)
    return [RecompileHook(rt, settings, log)] if settings else []


def compile_settings(cfg, device_type: str) -> list[tuple[str, str]]:
    """(setting, the flag that turns it off) of each part of this run that torch.compile compiles."""
    from ..job.checks import zero_pp_names
    from ..parallel.fsdp.quantized import use_compiled

    out = [("train.compile", "--train.compile=false")] if cfg.train.compile else []
    if {"qwz", "qgz"} & set(zero_pp_names(cfg)) and use_compiled(cfg.parallel.zero_pp_kernels, device_type):
        out.append(("parallel.zero_pp_kernels", "--parallel.zero_pp_kernels=eager"))
    return out


class RecompileHook(StepHook):
    """`settings`: compile_settings' (the first names the lines; each one's flag is said as a way out)."""

    def __init__(self, rt, settings: list[tuple[str, str]], log=print):
        self.rt, self.log = rt, log
        self.name = settings[0][0]
        self.off = " or ".join(flag for _, flag in settings)
        self.watch = RecompileWatch()  # (what compiled before the run's steps, a warm-up of another part, is not ours)
        self.recompiles = 0  # since the last metrics line, after the warm-up
        self._eager: set[str] = set()  # the functions past the recompile limit (since the job started)
        self._per_function: dict[str, int] = {}  # recompiles said so far, per region
        self._steps_seen = self._evals_seen = 0
        self._said = False  # a recompile line said already (the first explains)
        self._rank = getattr(rt, "rank", 0)
        self._unsent: list[tuple[str, tuple]] = []  # (another rank) its reads' new causes, for rank 0 to say
        self._causes: set[tuple] = set()  # (rank 0) the causes said; (another rank) the causes sent to rank 0

    def after_optimizer(self, step: int, applied) -> None:
        self._steps_seen += 1
        self._read(f"at step {step}", warm_up=self._steps_seen == 1)

    def eval_note(self) -> str | None:  # (after each evaluation: its compiles)
        self._evals_seen += 1
        self._read("in an evaluation", warm_up=self._evals_seen == 1)
        return None

    def log_fields(self, step: int, last: bool) -> dict:
        recompiles, hits, unsent = self.rt.max([float(self.recompiles), float(len(self._eager)),
                                                float(len(self._unsent))])
        if unsent:  # (every rank: the max is the same on all)
            self._say_other_ranks(self.rt.gather(self._unsent))
        self.recompiles, self._unsent = 0, []
        return {"compile_recompiles": int(recompiles), **({"compile_limit_hits": int(hits)} if hits else {})}

    def _read(self, when: str, warm_up: bool) -> None:
        """The recompiles since the last read: a WARNING line per limit hit; after the warm-up, one line for the
        others (a new shape recompiles several nested functions at once: a MoE layer's a dozen)."""
        recompiles = self.watch.take()
        for r in recompiles:
            if r.limit_hit and r.function not in self._eager:  # (a function refused again, from another caller: once)
                self._eager.add(r.function)
                self._note(when, (r,), lambda where, r=r: limit_hit_line(self.name, self.off, r, when, where))
        plain = [r for r in recompiles if not r.limit_hit]
        if warm_up or not plain:
            return
        self.recompiles += len(plain)
        for r in plain:
            self._per_function[r.function] = self._per_function.get(r.function, 0) + 1
        n, first = self._per_function[plain[0].function], not self._said
        self._note(when, tuple(plain), lambda where: recompile_line(self.name, plain, when, n, first, where))
        self._said = True

    def _note(self, when: str, recompiles: tuple, line) -> None:
        """Rank 0 says `line(where)` at once; another rank keeps the causes it has not sent yet for the next metrics
        line's gather (_say_other_ranks)."""
        if self._rank == 0:
            self.log(line(""))  # (unnamed: a shape rank 0 sees, every rank of a data-parallel job sees too)
            self._causes.update(map(_cause, recompiles))
            return
        new = tuple(r for r in recompiles if _cause(r) not in self._causes)
        if new:
            self._causes.update(map(_cause, new))
            self._unsent.append((when, new))

    def _say_other_ranks(self, sent: list) -> None:
        """On rank 0, from every rank's unsent reads (`sent`, by rank): a line per read with a cause not said yet,
        naming the ranks that sent its first such cause (a new shape recompiles the same functions on each)."""
        if self._rank != 0:
            return
        ranks: dict[tuple, list[int]] = {}
        for rank, reads in enumerate(sent):
            for _, recompiles in reads:
                for r in recompiles:
                    ranks.setdefault(_cause(r), []).append(rank)
        for reads in sent:
            for when, recompiles in reads:
                new = [r for r in recompiles if _cause(r) not in self._causes]
                if not new:
                    continue
                self._causes.update(map(_cause, new))
                who = sorted(set(ranks[_cause(new[0])]))
                where = f" on rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}"
                if new[0].limit_hit:
                    self.log(limit_hit_line(self.name, self.off, new[0], when, where))
                    continue
                self.log(recompile_line(self.name, new, when, 1, not self._said, where))
                self._said = True


def _cause(r) -> tuple:
    """What a recompile line is said once for: the function and the guard that failed (a limit hit: the function)."""
    return (r.function, r.limit_hit, "" if r.limit_hit else r.reason)


def recompile_line(name: str, plain: list, when: str, n: int, first: bool, where: str = "") -> str:
    """One read's recompiles (not limit hits) in a line: the functions, the first one's guard and, for one function,
    its recompile count `n` so far; the run's `first` such line says what recompiles may lead to; `where`: the
    rank(s), " on rank 1", in a job of several."""
    functions = list(dict.fromkeys(r.function for r in plain))  # (in order, once each)
    if len(functions) == 1:
        what = functions[0] + f" compiled again{where} {when}" + (f", its recompile {n}" if n > 1 else "")
    else:
        listed = ", ".join(functions[:6]) + (", ..." if len(functions) > 6 else "")
        what = f"{len(functions)} functions compiled again{where} {when} ({len(plain)} compiles: {listed})"
    guard = f"the guard that failed{' (of the first)' if len(functions) > 1 else ''}: {plain[0].reason}"
    if not first:
        return f"{name}: {what}; {guard}"
    return (f"{name}: {what}; {guard}. Once is a new shape or mode; again every step, a function reaches "
            f"torch._dynamo's recompile limit ({recompile_limit()} compiles) and then runs eagerly for the rest of "
            f"the run. compile_recompiles in the metrics counts them; TORCH_LOGS=recompiles prints dynamo's every "
            f"reason.")


def limit_hit_line(name: str, off: str, r, when: str, where: str = "") -> str:
    return (f"{name}: WARNING: {r.function} reached torch._dynamo's recompile limit ({recompile_limit()} "
            f"compiles){where} {when} and runs EAGERLY from here to the end of the run: the same numbers, without the "
            f"compiled speed (compile_limit_hits in the metrics). The guard that failed: {r.reason}. The usual cause "
            f"is a value the compiled code reads that changes every step (a Python number: make it a tensor, or run "
            f"that function eagerly, ops/eager.py eager_under_compile); {off} runs it eagerly from the start (the "
            f"same numbers, no compile time spent), or raise torch._dynamo.config."
            f"recompile_limit where the recompiles are a few more than it.")
