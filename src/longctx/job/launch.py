"""Starting and joining the processes of a job.

`longctx train` runs under torchrun (`torchrun --nproc-per-node N -m longctx train ...`) or starts
torchrun itself with `--nproc N` (PyTorch's launcher, standalone rendezvous on this machine).
Inside a worker, `init_distributed` joins the process group: NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import sys
import weakref

import torch
import torch.distributed as dist

from ..env_vars import ERROR_DIR_ENV  # (set by job/relaunch.py in the ranks it starts: errors go there)
from ..errors import ConfigError, UserError
from . import watchdog


def under_launcher() -> bool:
    """True inside a worker started by torchrun (or any launcher that sets the env:// variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_launcher_env(rendezvous: bool = True) -> tuple[int, int]:
    """(RANK, WORLD_SIZE) of the env:// variables a launcher set, checked before any wait: a rank outside
    the world waited on the rendezvous until the store's timeout (and its retries), a missing
    MASTER_ADDR / MASTER_PORT or a non-number ended in torch's traceback."""
    def integer(name: str) -> int:
        text = os.environ.get(name, "")
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"the launcher's {name} must be an integer, got {text!r}.") from None

    world, rank = integer("WORLD_SIZE"), integer("RANK")
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} must be in [0, WORLD_SIZE={world}) (as torchrun sets them); check the "
                          f"variables your launcher sets.")
    # the node's ranks (torchrun's LOCAL_WORLD_SIZE: host-memory sharing, hpz / qgz's node): checked here, where
    # a non-number was int()'s traceback in the layout check and a LOCAL_RANK past it went unnoticed
    node = integer("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ else None
    if node is not None and not 1 <= node <= world:
        raise ConfigError(f"LOCAL_WORLD_SIZE={node} (the ranks on this node) must be in [1, WORLD_SIZE={world}]; "
                          f"check the variables your launcher sets.")
    if "LOCAL_RANK" in os.environ:
        local = integer("LOCAL_RANK")
        if not 0 <= local < (node or world):
            raise ConfigError(f"LOCAL_RANK={local} must be in [0, "
                              + (f"LOCAL_WORLD_SIZE={node})" if node else f"WORLD_SIZE={world})")
                              + " (as torchrun sets them); check the variables your launcher sets.")
    if world > 1 and rendezvous:  # (the command checks it: a test's mocked process group has none)
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
        if missing:
            raise ConfigError(f"WORLD_SIZE={world} ranks meet at MASTER_ADDR:MASTER_PORT, but {' and '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not set: start the ranks with torchrun, or "
                              f"`longctx train --nproc {world}`, or set them.")
        port = integer("MASTER_PORT")
        if not 1 <= port <= 65535:  # (torch's ValueError traceback; 0: a port rank 0 picks, its peers never learn)
            raise ConfigError(f"MASTER_PORT={port} is not a TCP port: it must be in [1, 65535], the same on every "
                              f"rank; choose a free one (torchrun's default is 29500).")
        _check_master_resolves(os.environ["MASTER_ADDR"], port)
    return rank, world


def _check_master_resolves(address: str, port: int) -> None:
    """A MASTER_ADDR that no resolver knows (a mistyped host name) waited out the rendezvous's timeout and
    its retries (about 2.4x parallel.timeout_s) before torch's error: refused at once. Only a name that does
    not exist is refused; a resolver that is down for now (EAI_AGAIN) is left to the rendezvous's retries."""
    try:
        socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno not in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return
        if address.startswith("[") and address.endswith("]"):  # (torch's TCPStore takes no brackets either)
            raise ConfigError(f"MASTER_ADDR={address!r} is an IPv6 address in brackets, which a host variable takes "
                              f"without (the brackets belong in a HOST:PORT endpoint): set MASTER_ADDR="
                              f"{address[1:-1]}.") from None
        raise ConfigError(f"MASTER_ADDR={address!r} does not resolve on this machine ({e.strerror}): the ranks "
                          f"would wait out the rendezvous's timeout for a host that does not exist. Set it to "
                          f"rank 0's host name or IP address, the same on every rank (`hostname -I` on that "
                          f"node).") from None


def refuse_scheduler_tasks() -> None:
    """A process that no torchrun started, in a Slurm job step of several tasks (`srun -n 8 longctx train`,
    or `srun -N 2 longctx train --nproc 8`): every task would run a whole job of its own, N copies of one
    run writing into the same run directory. longctx reads torchrun's variables, not Slurm's, so one
    clear error instead, with the commands that work. So is half of torchrun's pair (_refuse_half_a_launch)."""
    _refuse_half_a_launch()
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")  # (srun's: the batch script itself has no step tasks)
    if not tasks.isdigit() or int(tasks) <= 1:
        return
    raise ConfigError(
        f"this process is task {os.environ.get('SLURM_PROCID', '?')} of {tasks} that srun started "
        f"(SLURM_STEP_NUM_TASKS={tasks}), but no launcher set RANK and WORLD_SIZE: each task would run a "
        f"job of its own. Start one task per node running torchrun (`srun --ntasks-per-node 1 torchrun "
        f"--nnodes $SLURM_NNODES --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:29400 -m longctx "
        f"...`), or one task on one node (`srun -n 1 longctx ... --nproc G`), or export RANK, WORLD_SIZE, "
        f"LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each task from Slurm's variables. (One "
        f"shell of such a step, as `srun -n 2 --pty bash` opens, running one job: unset SLURM_STEP_NUM_TASKS.)")


def _refuse_half_a_launch() -> None:
    """WORLD_SIZE without RANK, or RANK without WORLD_SIZE (a launcher script that exports one of the pair): this
    process is not a rank (under_launcher), so it ran a whole job of its own, as did each of its peers, all into
    the same run directory, without a word. WORLD_SIZE=1 or RANK=0 alone means one job: that still runs."""
    given = {name: os.environ[name] for name in ("WORLD_SIZE", "RANK") if name in os.environ}
    if len(given) != 1 or given in ({"WORLD_SIZE": "1"}, {"RANK": "0"}):
        return
    (name, value), = given.items()
    missing = "RANK" if name == "WORLD_SIZE" else "WORLD_SIZE"
    raise ConfigError(
        f"{name}={value} is set but {missing} is not: a launcher's ranks have both (torchrun sets RANK, WORLD_SIZE, "
        f"LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT), and without {missing} this process would run "
        f"a whole job of its own, as would each of its peers. Set {missing} in each process (with MASTER_ADDR and "
        f"MASTER_PORT), start the ranks with torchrun, or unset {name} to run one job here (`--nproc N` starts N "
        f"local ranks).")


def launched_by_us() -> bool:
    """This process is a rank that `longctx ... --nproc N` started (its launcher already spoke)."""
    return ERROR_DIR_ENV in os.environ


def default_nproc(device: str) -> int:
    """CPU: 4 ranks (head 2 x ctx 2 by default); GPU: every local GPU."""
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 4


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its launcher dies.

    If the launcher is killed (SIGKILL, OOM killer), torchrun cannot stop its workers, and orphaned
    workers would go on training and writing checkpoints that nobody asked for."""
    if not sys.platform.startswith("linux"):
        return

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def backend_for(device_type: str, host_states: bool = False) -> str:
    """The process group's backend: NCCL on GPUs, gloo on CPU. host_states (memory.model_states = host:
    FSDP2's CPU offload, whose gradients are CPU tensors): on GPUs gloo too, for CPU tensors (the gradient
    norm's all-reduce under clipping), as FSDP2 asks of CPU offload; NCCL carries no CPU tensor."""
    if device_type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if host_states else "nccl"


def init_distributed(device_type: str, timeout_s: float, host_states: bool = False) -> tuple[int, int]:
    """Join (or reuse) the default process group (backend_for); returns (rank, world size)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not under_launcher() or check_launcher_env(rendezvous=False)[1] == 1:
        return 0, 1
    die_with_parent()
    if device_type == "cuda":
        torch.cuda.set_device(local_cuda_device())
    backend = backend_for(device_type, host_states)
    # parallel.timeout_s is enforced by the hang watchdog (watchdog.py), which says where each rank
    # was; the groups' own timeouts are a backstop behind it
    watchdog.set_group_timeout(timeout_s)
    try:
        dist.init_process_group(backend, timeout=watchdog.group_timeout())
    except (dist.DistStoreError, dist.DistNetworkError) as e:  # (a peer that never came, an unreachable master)
        world = os.environ["WORLD_SIZE"]
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        if "EADDRINUSE" in str(e) or "address already in use" in str(e):  # (at once: no wait, no peer asked)
            raise UserError(f"rank 0 cannot listen at {where}: MASTER_PORT is in use on this machine (another job, "
                            f"or a rank of an earlier run still alive); choose a free port.") from None
        raise UserError(f"the {world} ranks did not all meet at {where} within the process group's timeout "
                        f"({watchdog.group_timeout()}, parallel.timeout_s and its grace): start every rank with "
                        f"the same WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and check that this machine reaches "
                        f"the master. ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    global _CREATED
    _CREATED = _recorded()
    # a job that ends in an error leaves by exit: NCCL's communicators are released there
    if "nccl" in backend:
        atexit.register(_destroy_process_group)
    return dist.get_rank(), dist.get_world_size()


def local_cuda_device() -> int:
    """This rank's GPU: LOCAL_RANK (torchrun's; 0 without one), one of the devices this process sees.

    More ranks on a node than visible GPUs (`--nproc 8` on 4 GPUs, or CUDA_VISIBLE_DEVICES naming
    fewer) is refused here with the fix, before CUDA's "invalid device ordinal" on some ranks."""
    index, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if count and not 0 <= index < count:  # (no device at all: resolve_device refused train.device cuda)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigError(
            f"this rank's LOCAL_RANK is {index}, but it sees {count} CUDA device{'s' if count != 1 else ''}"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            + f": train.device cuda runs one rank per GPU, so start at most {count} ranks on this node "
              f"(--nproc {count}, or torchrun --nproc-per-node {count}), or make more GPUs visible.")
    return index


_CREATED = False  # the default group init_distributed made, weakly (then finish_distributed ends it), or False


def _recorded():  # (weakly: a stale record is no group's; the default one is never None once made)
    return False if dist.group.WORLD is None else weakref.ref(dist.group.WORLD)


def _ours() -> bool:  # (the group now is that one, not one a program made after ending ours itself)
    return bool(_CREATED) and dist.is_initialized() and _CREATED() is dist.group.WORLD


def init_one_rank_group(device_type: str, host_states: bool = True) -> None:
    """A process group of this process alone, for what needs one at world 1 (FSDP2, under
    memory.model_states = host: its CPU offload is FSDP's); ended by finish_distributed like a
    launched job's. Its store is in memory: nothing listens on a port."""
    global _CREATED
    if dist.is_initialized():
        return
    dist.init_process_group(backend_for(device_type, host_states), store=dist.HashStore(), rank=0, world_size=1)
    _CREATED = _recorded()


def finish_distributed() -> None:
    """End the process groups init_distributed created, after a job that succeeded: every rank first
    waits for the others, so that no rank tears down connections a slower one is still using, then
    all groups are destroyed in order. Left to interpreter exit instead, the teardown of gloo's
    groups aborted a rank after a finished run ("terminate called without an active exception",
    about 1 run in 10 at 4 ranks). A group someone else created (tests, an embedding program) is
    theirs to end."""
    global _CREATED
    if _ours():
        from . import comm  # collectives go through comm (tests/unit/test_boundaries.py)

        comm.barrier()
        _destroy_process_group()
    _CREATED = False


def end_one_rank_group() -> None:
    """After a job in this process, failed or finished (train() calls it either way): end the one-rank
    group init_one_rank_group made, so that a program which runs jobs in process (an embedding
    program, a notebook, a test) starts the next one as it started the first; left, a job after an
    error made its own group fail with "trying to initialize the default process group twice", and
    after a finished one reused a group nobody owned. It has no peer to wait for; a launched job's
    groups are left to finish_distributed or its exit instead, since a barrier there could wait for
    the rank that failed. A group the program made itself is not ours (_ours) and stays."""
    global _CREATED
    if _ours() and dist.get_world_size() == 1:
        _destroy_process_group()
        _CREATED = False


def release_groups() -> None:
    """Free the process groups' C++ objects while the interpreter is whole. A destroyed gloo group
    still referenced from a cache or a reference cycle (a model's meshes) is otherwise freed by the
    interpreter's final collection, when its worker threads can no longer take the GIL to release
    their tensors: the rank then aborts after a finished run ("terminate called without an active
    exception", seen about once in a CI suite, in a 2-rank `longctx train`)."""
    import gc

    from . import comm

    comm.forget_meshes()
    gc.collect()


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
        release_groups()


def new_gloo_group():
    """A gloo process group over every rank, apart from the default one: for background work (async
    checkpoint writes) whose collectives must never interleave with the training loop's."""
    return dist.new_group(backend="gloo", timeout=watchdog.group_timeout())
