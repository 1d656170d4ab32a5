"""An infeasible request on a device of a few MiB (test hardware, `--hw memory_gib=0.01`) read "needs 0.0 GiB
per GPU, 0.0 usable of 0.01" and "the least GPU memory any plan needs is 0.0 GiB per GPU (...; 0.0 GiB usable)":
the figures that say why it does not fit were rounded to 0.1 GiB. Below 1 GiB they keep 3 significant digits."""

import re

from longctx.cli import main as longctx_main
from longctx.planner.cost import gib_text


def test_the_reason_of_a_small_device_names_its_figures(capsys):
    argv = ["plan", "--model", "debug", "--gpus", "4", "--gpus-per-node", "2", "--seq-len", "8K", "--global-batch",
            "1", "--hardware", "h100", "--hw", "memory_gib=0.01", "--top", "1", "--no-write"]
    assert longctx_main(argv) == 2
    out, err = capsys.readouterr()
    text = " ".join((out + err).split())
    assert "0.0 GiB" not in text and "0.0 usable" not in text
    least = re.search(r"least GPU memory any plan needs is ([0-9.]+) GiB per GPU \(.*?; ([0-9.]+) GiB usable\)", text)
    assert least and float(least.group(1)) > float(least.group(2)) > 0
    assert re.search(r"needs 0\.0[1-9][0-9]* GiB per GPU, 0\.00[1-9][0-9]* usable of 0\.01", text)


def test_large_figures_keep_one_decimal():
    assert gib_text(73.6 * 2**30) == "73.6"
    assert gib_text(2**30) == "1.0"
    assert gib_text(0.0092 * 2**30) == "0.0092"
