"""bench memory's per-policy allocator peak on a GPU (`peak_allocated_bytes`), checked on the CPU with a
stand-in allocator: it is the policy's own step, not that step plus the other policies' models the
benchmark keeps alive for its timing round."""

import argparse
import types
import weakref

import torch

from longctx.bench import memory as bench


def _weights(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


class _FakeCuda:
    """An allocator whose peak is the bytes of every model built so far that is still alive."""

    def __init__(self):
        self.models = []

    def track(self, model):
        self.models.append(weakref.ref(model))
        return model

    def max_memory_allocated(self, device=None):
        return sum(_weights(ref()) for ref in self.models if ref() is not None)

    def reset_peak_memory_stats(self, device=None):
        pass

    def synchronize(self, device=None):
        pass


class _TorchOnAFakeGpu:
    """bench.memory's `torch`: the real one, but a "cuda" device (type only) and the fake allocator."""

    def __init__(self, cuda):
        self.cuda = cuda

    def device(self, name):
        return types.SimpleNamespace(type=name)

    def __getattr__(self, name):
        return getattr(torch, name)


def test_each_policys_gpu_peak_leaves_out_the_other_policies_models(monkeypatch):
    cuda = _FakeCuda()
    build, batch = bench._build, bench._batch
    monkeypatch.setattr(bench, "torch", _TorchOnAFakeGpu(cuda))
    monkeypatch.setattr(bench, "_build", lambda cfg, policy, fraction, args, dims, mesh, device:
                        cuda.track(build(cfg, policy, fraction, args, dims, mesh, torch.device("cpu"))))
    monkeypatch.setattr(bench, "_batch", lambda *a, **k: batch(*a[:-1], torch.device("cpu"), **k))
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--device=cuda", "--layers=1", "--policies=none,full,selective", "--time-steps=1",
                         "--loss-chunk=64"])
    out = bench.measure(args, 64)
    one_model = _weights(build(bench._model_cfg(args), "none", 0.0, args, None, None, torch.device("cpu")))
    peaks = {name: entry["peak_allocated_bytes"] for name, entry in out["policies"].items()}
    assert peaks == {"none": one_model, "full": one_model, "selective": one_model}
