"""train.dtype auto is decided in one place (job/devices.computes_in_bf16) for autocast, FSDP's gathers and
the host budget: bf16 only on a card that computes it natively (compute capability 8.0 on). On a V100 or T4,
torch emulates bf16 (slower than fp32); auto picked it there, and each of the three decided on its own."""

import pytest
import torch

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.job.checks import check_layout
from longctx.job.devices import computes_in_bf16, resolve_dtype
from longctx.parallel.fsdp.shard import gathers_in_bf16, mixed_precision
from longctx.train.host_budget import rank_host_bytes

CUDA = torch.device("cuda")


def card(monkeypatch, *, native: bool, started: bool = True):
    """Pretend this process has a CUDA card (native bf16 or not) whose CUDA has (not) started."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: started)


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_only_on_a_card_with_native_bf16_and_every_user_agrees(monkeypatch, native):
    card(monkeypatch, native=native)
    want = torch.bfloat16 if native else torch.float32
    assert resolve_dtype("auto", CUDA) == want
    assert gathers_in_bf16("cuda", "auto") is native
    assert mixed_precision("cuda", "auto").param_dtype == (torch.bfloat16 if native else None)
    # what was asked for explicitly is kept, emulated or not
    assert resolve_dtype("bf16", CUDA) == torch.bfloat16 and gathers_in_bf16("cuda", "bf16")
    assert resolve_dtype("fp32", CUDA) == torch.float32 and not gathers_in_bf16("cuda", "fp32")


def test_cpu_is_fp32_under_auto_and_bf16_when_asked():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert not gathers_in_bf16("cpu", "bf16")  # (FSDP on CPU gathers fp32: autocast casts at the op)


def host_bytes(dtype: str) -> float:
    cfg = load_config("configs/debug.toml", [f"--train.dtype={dtype}", "--train.device=cuda",
                                             "--memory.model_states=host", "--memory.recompute=full",
                                             "--memory.offload_fraction=1.0"])
    return rank_host_bytes(cfg, check_layout(cfg, 1), "cuda", 1, 1e12)["total"]


def test_the_host_budget_counts_the_dtype_the_ranks_will_use(monkeypatch):
    card(monkeypatch, native=False)  # a rank's process, CUDA started: a V100 trains auto in fp32
    assert host_bytes("auto") == host_bytes("fp32") > host_bytes("bf16")
    card(monkeypatch, native=True)
    assert host_bytes("auto") == host_bytes("bf16") < host_bytes("fp32")


def test_the_launcher_does_not_start_cuda_to_ask(monkeypatch):
    card(monkeypatch, native=False, started=False)

    def started_cuda(including_emulation=True):
        raise AssertionError("the launcher started CUDA (its context would hold GPU memory through the run)")

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", started_cuda)
    assert host_bytes("auto") == host_bytes("bf16")  # a native card is counted on
    assert computes_in_bf16("auto", "cuda", start_cuda=False)


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ConfigError, match="expected auto, fp32 or bf16"):
        computes_in_bf16("fp16", "cuda")
