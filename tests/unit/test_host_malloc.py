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


JOIN = """
import sys
from longctx.config import load_config
from longctx.job import host_malloc
from longctx.job.join import join_job
join_job(load_config(None, ["--model.preset=debug", "--train.device=cpu", f"--memory.model_states={sys.argv[1]}"]),
         training=sys.argv[2] == "train")
print(host_malloc._applied)
"""
KEPT, RETURNED = "freed blocks up to 1 GiB kept for reuse", "freed blocks over 128 KiB returned to the kernel"


@pytest.mark.parametrize("tier,entry,setting", [("device", "train", KEPT), ("host_optimizer", "train", RETURNED),
                                                ("host", "train", RETURNED), ("host", "generate", KEPT)])
def test_only_the_host_tiers_training_returns_freed_blocks(tier, entry, setting):
    # a training run of the host tiers plans host memory: what the heap would keep beyond the live bytes is
    # not its to spend; generation and eval (which hold no optimizer states) keep the faster setting
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", JOIN, tier, entry], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == setting


RSS = """
import sys, torch
from longctx.job import host_malloc
setting = {"keep": host_malloc.keep_freed_blocks, "return": host_malloc.return_freed_blocks,
           "glibc": lambda: "glibc"}[sys.argv[1]]()
def rss():  # anonymous resident bytes: the heap's and the mmapped blocks', not the code pages the first op maps
    with open("/proc/self/statm") as f:
        resident, shared = (int(v) for v in f.read().split()[1:3])
        return (resident - shared) * 4096
base = rss()
for _ in range(4):  # 8 MiB tensors, under the dynamic threshold's 32 MiB ceiling, between long-lived small ones
    held = []
    for _ in range(8):
        a = torch.ones(2 << 20); held.append(torch.ones(1024)); del a
print(rss() - base, setting, sep="|")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_returned_blocks_leave_the_rss():
    def grown(mode):
        out = subprocess.run([sys.executable, "-c", RSS, mode], capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")})
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.strip().splitlines()[-1].split("|")[0])

    # glibc's dynamic threshold keeps an 8 MiB block in the heap after its first free; returned: none kept
    assert grown("glibc") > 7 << 20 and grown("keep") > 7 << 20
    assert grown("return") < 2 << 20
