"""A resume that toggles data.dp_balance was refused as a change of "the data" unless --checkpoint.allow_changes,
though balancing only permutes each micro-batch's rows over the data-parallel ranks (data/balance.py): the loss and
the gradients are sums over the whole micro-batch. It is accepted now, said among the changes, and the resumed
run trains every step (and every micro-step) on the same samples as the run it continues."""

import numpy as np
import pytest

from longctx.config import load_config
from longctx.config.resume import load_run_config
from longctx.data.loader import SampleSet
from longctx.train.stages import StagedLoader


@pytest.fixture
def saved_run(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text('[data]\ndp_balance = true\n[train]\nseq_len = 128\n[model]\npreset = "debug"\n')
    return run


@pytest.mark.parametrize("given", ["false", "true"])
def test_a_resume_toggling_dp_balance_is_accepted(saved_run, given):
    cfg, resumed = load_run_config(None, [f"--train.run_dir={saved_run}", "--checkpoint.resume=auto",
                                          f"--data.dp_balance={given}"], False)
    assert cfg.data.dp_balance is (given == "true")
    assert resumed.changes == ([] if given == "true" else ["data.dp_balance true -> false"])


class _Costed(SampleSet):
    """n samples of varied cost (never read: read_local names their indices)."""

    def __init__(self, n, seq_len):
        self.n, self.seq_len, self.doc_mask = n, seq_len, False
        self.real_tokens = np.random.default_rng(3).integers(1, seq_len + 1, n).astype(np.float64)
        self.sq_tokens = self.real_tokens ** 2

    def __len__(self):
        return self.n


DATA = _Costed(37, 64)


def _loader(balance: bool):
    cfg = load_config(None, ["--train.seq_len=64", "--train.eval_interval=0", "--train.global_batch=8",
                             "--train.grad_accum=2", "--train.seed=5", f"--data.dp_balance={str(balance).lower()}"])
    return StagedLoader(cfg, lambda c: (DATA, None), dp=2, read_ahead=False,
                        read_local=lambda samples, idx: (list(idx), len(idx)))


def _steps(loader, steps):
    """Per step: its micro-batches' rows, in order."""
    out = []
    for step in steps:
        loader.enter(step)
        out.append([idx for idx, _ in loader.step_batches(step)])
    return out


@pytest.mark.parametrize("before", [True, False])
def test_a_resume_toggling_dp_balance_trains_each_step_on_the_same_samples(before):
    steps = 12
    reference = _steps(_loader(before), range(1, steps + 1))
    for cut in (1, 4, 7):
        first = _loader(before)
        seen = _steps(first, range(1, cut + 1))
        state = first.state_dict()
        resumed = _loader(not before)
        resumed.load_state_dict(state)
        rest = _steps(resumed, range(cut + 1, steps + 1))
        together = seen + rest
        assert [[sorted(m) for m in s] for s in together] == [[sorted(m) for m in s] for s in reference], cut
    # (and the balance did apply: the rows of the same samples come in another order)
    assert _steps(_loader(True), range(1, steps + 1)) != _steps(_loader(False), range(1, steps + 1))
