"""train.data_parallel's rules: CO2 (step/co2.py) needs replicas to average over, sane outer
settings, and the parts of a run it composes with; each problem says what to change."""

from __future__ import annotations

from .schema import Config


def data_parallel_problems(cfg: Config) -> list[str]:
    t, p = cfg.train, cfg.parallel
    if t.data_parallel != "co2":
        return []
    problems = []
    if p.dp_replicate < 2:
        problems.append(f"train.data_parallel = co2 averages the parameter change of parallel.dp_replicate "
                        f"replicas, and dp_replicate is {p.dp_replicate}: set parallel.dp_replicate to the number "
                        f"of replicas (e.g. 2 on 4 ranks: 2 replicas of 2 FSDP ranks each), or train.data_parallel "
                        f"= sync.")
    if t.co2_local_steps < 1:
        problems.append(f"train.co2_local_steps must be at least 1 (local steps per round), got {t.co2_local_steps}.")
    if not 0 <= t.co2_sync_steps < t.steps:
        problems.append(f"train.co2_sync_steps must be in [0, train.steps = {t.steps}) (synchronous steps before the "
                        f"local rounds; 0 = none), got {t.co2_sync_steps}: a run of only synchronous steps is "
                        f"train.data_parallel = sync.")
    if not 0 <= t.co2_overlap_steps <= t.co2_local_steps:
        problems.append(f"train.co2_overlap_steps must be in 1..train.co2_local_steps = {t.co2_local_steps} (steps "
                        f"after a round end at which its average is merged; 0 = co2_local_steps), got "
                        f"{t.co2_overlap_steps}.")
    if t.co2_outer_lr <= 0:
        problems.append(f"train.co2_outer_lr must be positive (1 = plain averaging), got {t.co2_outer_lr}.")
    if not 0 <= t.co2_outer_momentum < 1:
        problems.append(f"train.co2_outer_momentum must be in [0, 1), got {t.co2_outer_momentum}.")
    for key in ("co2_momentum_clip", "co2_staleness_penalty"):
        if getattr(t, key) < 0:
            problems.append(f"train.{key} must be >= 0 (0 = off), got {getattr(t, key)}.")
    if cfg.memory.model_states != "device":
        problems.append(f"train.data_parallel = co2 keeps its outer state beside the weights on the device; "
                        f"memory.model_states = {cfg.memory.model_states} is not supported with it yet: use "
                        f"memory.model_states = device, or train.data_parallel = sync.")
    if t.on_nonfinite == "rollback":
        problems.append("train.data_parallel = co2 with train.on_nonfinite = rollback: a rollback would have to "
                        "rewind every replica's outer state as well, which is not built; use skip or stop.")
    if cfg.draft.target:  # (parallelize_draft shards the draft over every replica: it crashed at set-up)
        problems.append(f"train.data_parallel = co2 with a draft (draft.target = {cfg.draft.target}): the draft is "
                        f"sharded over all the replicas as under sync (parallel/parallelize.py parallelize_draft), "
                        f"which CO2's local rounds do not support yet; use train.data_parallel = sync.")
    return problems
