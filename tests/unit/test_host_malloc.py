"""job/host_malloc.py: on CPU, freed large blocks are kept for the next tensor of their size
instead of being unmapped and faulted in again (each case in a fresh process: mallopt is global)."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from longctx.job.host_malloc import keep_freed_blocks
setting = keep_freed_blocks() if sys.argv[1] == "keep" else "glibc"
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a step's large temporaries (64 MiB each), allocated, written and freed
    a = torch.empty(16384, 1024); a.fill_(1.0); b = torch.empty(16384, 1024); b.fill_(2.0); del a, b
for _ in range(8):  # glibc's heap settles in a few steps (a freed block may not fit the next one yet)
    step()
before = faults()
for _ in range(10):
    step()
print(faults() - before, setting, sep="|")
"""


def _faults(mode: str, **env) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    faults, setting = out.stdout.strip().rsplit("\n", 1)[-1].split("|")
    return int(faults), setting


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_kept_blocks_are_not_faulted_in_again():
    glibc, _ = _faults("glibc")
    kept, setting = _faults("keep")
    assert setting == "freed blocks up to 1 GiB kept for reuse"
    # once settled, glibc's default faults 10 x 2 x 64 MiB = 320K pages in again; kept: none
    assert glibc > 200_000 and kept < glibc / 20, (glibc, kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_a_threshold_set_by_the_user_is_left_alone():
    _, setting = _faults("keep", MALLOC_MMAP_THRESHOLD_="131072")
    assert setting == "environment (MALLOC_MMAP_THRESHOLD_=131072)"
