"""Writes that survive a power loss, not only a crash of the process.

A rename publishes data atomically for readers, but after a power loss the file system may hold the
new name with the old (or no) contents: the data must reach the disk (fsync) before the rename that
publishes it, and the directory holding the new name after it. Checkpoints and the packed-data store
publish this way. Before any work, commands check that their outputs can be written where asked
(file_in_the_way, check_output_path), not after it.
"""

from __future__ import annotations

import fcntl
import glob
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from .errors import ConfigError


def fsync_path(path: Path) -> None:
    """Flush a file's data (or a directory's entries) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scratch_dir(out: Path, verb: str) -> Path:
    """A new hidden directory beside `out` (`.OUT.VERB-HOST@NS-PID-xxxx`) for work renamed onto it when
    done, after removing those that runs on this host whose process is gone left: an export or import
    killed outright (SIGKILL, the OOM killer) otherwise left its partial copy, up to the model's size,
    hidden beside OUT for good. A live process's (another export into the same place) and another
    host's (a shared file system) are kept, and so are another PID namespace's (containers that share
    the host's name and the output volume: their PIDs mean nothing here). A PID reused since is taken
    for the run's: its directory is kept, never a live one removed."""
    prefix = f".{out.name}.{verb}-{_host_tag()}-"
    for old in out.parent.glob(glob.escape(prefix) + "*"):
        # exactly PID-xxxx after the prefix: "node-2"'s `.OUT.VERB-node-2-PID-xxxx` also starts with node's
        pid = re.fullmatch(r"(\d+)-[^-]+", old.name[len(prefix):])
        if pid and not _process_alive(int(pid[1])):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=out.parent))


def _host_tag() -> str:
    """This host's name and, where Linux says it, its PID namespace (`HOST@NS`): the scope in which the
    PIDs of scratch_dir's names are this process's to check."""
    host = socket.gethostname()
    try:
        return f"{host}@{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # (no /proc: macOS)
        return host


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return True


def publish(tmp: Path, final: Path) -> None:
    """Rename `tmp` (a file or a directory whose files are synced already) to `final`, durably: its
    entries before the rename, the parent's after it."""
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


def write_text_durably(path: Path, text: str) -> None:
    """Replace `path`'s contents with `text` atomically and durably (a temporary file, synced, renamed)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        publish(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # (a full disk: no half-written file left behind)
        raise


def file_in_the_way(directory: Path) -> Path | None:
    """The file that keeps `directory` from being made (`directory` itself, or the nearest existing of its
    parents when that is a file), else None. Commands check it before their work: otherwise they fail
    only where they create the directory, after reading weights or training a step."""
    directory = Path(directory).expanduser()
    nearest = next((p for p in (directory, *directory.parents) if p.exists()), None)
    return nearest if nearest is not None and not nearest.is_dir() else None


def check_output_path(flag: str, path: str, inputs: dict, create_parents: bool = False,
                      renames: bool = False) -> None:
    """An output file (`flag` `path`; '' = stdout) that can be written once the work is done: not a
    directory, in a directory that exists (or, `create_parents`, that can be made: no file on the way),
    and none of the command's `inputs` ({flag: path}), which it would write over. A symlink is written through
    (open(), generate's FILE.partial beside its file), so its file's directory is checked; `renames`: the
    writer renames a temporary over the path itself (write_text_durably): a link is replaced, so the link's own
    directory is checked, and that directory must take a new file even where the path is a writable file."""
    if not path:
        return
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; pass the path of a file to write, e.g. {out / 'out.json'}.")
    said, real = path, Path(os.path.realpath(out))
    if out.is_symlink() and not renames and not written_in_place(out):
        # open() writes the file the link names, and generate's FILE.partial goes beside that file: its directory
        # is the one that must exist and take a file (a link into a missing directory failed after the work)
        out, create_parents, said = real, False, f"{path} (a link to {real})"
    blocked = file_in_the_way(out.parent)
    if blocked is not None or (not create_parents and not out.parent.is_dir()):
        where = f"{blocked} is a file, not a directory" if blocked is not None else f"{out.parent} does not exist"
        raise ConfigError(f"{flag} {said} cannot be written: {where}. Create the directory first, or pass another "
                          f"path.")
    # (a device, /dev/null, /dev/stdout: opened as it is, where it is, in a directory no file may be made in)
    if out.parent.is_dir() and not (out.exists() and written_in_place(out)):
        _check_writable(flag, said, out, renames)
    for name, given in inputs.items():
        same = given and (out.resolve() == Path(given).resolve() or
                          (out.exists() and Path(given).exists() and os.path.samefile(out, given)))
        if same:
            raise ConfigError(f"{flag} {path} is also {name} {given}: writing there would destroy that. Pass "
                              f"another path.")


def written_in_place(path) -> bool:
    """Whether an output path is opened and written where it is, never through a temporary renamed over it: no
    regular file (a device, a pipe), or one under /dev or /proc, itself or where its link points (/dev/null,
    /dev/stdout redirected to a file, /proc/self/fd/N), which a rename would replace. /dev/shm is a file system
    of regular files like any other: its outputs are published by rename too."""
    out = Path(path)
    if out.exists() and not out.is_file():
        return True
    return any(str(p).startswith(("/dev/", "/proc/")) and not str(p).startswith("/dev/shm/")
               for p in (out.absolute(), Path(os.path.realpath(out))))


def new_file_error(directory: Path) -> OSError | None:
    """Why `directory` takes no new file, or None when it does: tried with a file created and removed, as
    permissions, a read-only mount or a full quota are only known by trying (os.access answers for none of them
    exactly)."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".longctx-probe-")
    except OSError as e:
        return e
    os.close(fd)
    os.unlink(probe)
    return None


def _check_writable(flag: str, path: str, out: Path, renames: bool) -> None:
    """`out`'s directory takes a new file (the output, or its temporary beside it), else the open failed after the
    command's work. An existing file this process may write, in a directory that takes none, is written in place
    (generate/output.py partial_path), as it was before outputs had temporaries: not by a rename over it."""
    error = new_file_error(out.parent)
    if error is None or (not renames and out.is_file() and os.access(out, os.W_OK)):
        return
    raise ConfigError(f"{flag} {path} cannot be written: no file can be created in {out.parent} "
                      f"({error.strerror}). Pass a path in a directory you can write to.")


class DirectoryInUse(Exception):
    """Another process holds the directory's lock (lock_directory)."""


def lock_directory(directory) -> int | None:
    """An exclusive lock on `directory` itself (flock, not blocking): the descriptor that holds it (closing it lets
    go), or None on a file system without such locks (NFS mounts commonly: the caller goes on unguarded). No file is
    left behind, and a killed process never holds it. DirectoryInUse where another process holds it (data build's
    --out, a training run's directories: data/builder/pipeline.py, train/run_lock.py)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirectoryInUse(str(directory)) from None
    except OSError:
        os.close(fd)
        return None
    return fd
