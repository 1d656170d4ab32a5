"""The async save's machinery (checkpoint/manager.py): DCP's staging buffers, kept from one save to the
next, and the one background thread per rank that hashes and commits each save off the training loop."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import torch


def reusable_stager():
    """A DCP stager that copies into host buffers it keeps for the next save (pinned on CUDA)."""
    try:  # the staging API is newer than our oldest supported torch
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # older torch: DCP's own default staging
        return None
    cuda = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=cuda))


def host_copies(state):
    """`state` with every tensor in host memory cloned, for a torch without DefaultStager: its async_save
    stages by `.to("cpu")`, which copies nothing already there (a CPU run's states, the host tiers' master
    weights and moments), so the background write would read tensors the next steps change in place."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t,
                    state)


class Worker:
    """One daemon thread, started once, that runs jobs in the order they are submitted. Submitting is
    a queue put: starting a thread per save kept the training loop waiting several ms for the new
    thread to get the GIL from DCP's busy writer thread. A daemon, so that a job stuck in a
    collective with a dead rank never keeps the process from exiting."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn, *args) -> Future:
        done: Future = Future()
        self._jobs.put((done, fn, args))
        return done

    def _run(self) -> None:
        while True:
            done, fn, args = self._jobs.get()
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits for the job
                done.set_exception(e)


def silence_single_process_save() -> None:
    """DCP's "assuming the intent is to save in a single process" UserWarning, which a single-process async save
    (no_dist=True: that intent stated) raised from DCP's own executor thread after manager.py's silencing context
    was left: ignored from then on, that message only (filterwarnings replaces an identical filter)."""
    import warnings

    warnings.filterwarnings("ignore", message=r"torch\.distributed is .*assuming the intent is to save in a single "
                            r"process", category=UserWarning)
