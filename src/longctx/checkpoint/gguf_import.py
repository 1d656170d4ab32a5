"""`longctx checkpoint import FILE.gguf --out DIR`: a GGUF file -> a Hugging Face directory (`hf:DIR`).

llama.cpp's GGUF is how many small models are published (often quantized, often as the only
download). longctx reads Hugging Face directories, so the import reads the file with transformers'
own GGUF reader (it undoes llama.cpp's q/k row permutation and dequantizes every block type the
`gguf` package knows), keeps the plain model in fp32 or bf16, and writes it with save_pretrained
(safetensors, config.json, generation_config.json) and the tokenizer the file describes
(tokenizer.json, tokenizer_config.json, chat_template.jinja).

Everything that can be refused is refused before the weights are read: a missing or non-GGUF file,
missing packages, an output that exists, too little disk, an architecture longctx does not read
(its config goes through config/hf.py like any config.json), and RoPE scaling that transformers'
reader would drop without a word (a `rope_freqs` tensor: Llama 3.1-style factors; `rope.scaling.*`
keys and the older `rope.scale_linear`, which llama.cpp applies with no type key too), metadata that
does not describe the file's tensors (transformers would fill what it lacks with its defaults), sizes
its reader takes from its config classes instead of the file (a qwen3 head size, qwen2_moe and qwen3_moe
expert sizes), a shared-expert gate shape it would misread, and a tensor missing or of another shape (named). After
writing, longctx loads the directory and its logits are compared with transformers' on the same
weights, so an import that longctx would read differently is never renamed into place.
The directory is written under a temporary name beside DIR and renamed when complete.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import torch

from ..config.hf import HFFormatError
from ..durable import file_in_the_way, scratch_dir
from ..models.hf import config_from_hf, load_hf
from ..progress import phase, say
from .gguf_checks import (  # noqa: F401  (GGUFImportError: imported from here too)
    GGUFImportError,
    check_architecture,
    check_filled,
    check_rope,
    check_shared_gate,
    check_sizes_read,
    check_tensors,
    meta_model,
)

# what transformers needs to read a GGUF: the file format (gguf) and its loading hooks (accelerate)
REQUIRED_PACKAGES = ("transformers", "gguf", "accelerate")
CHECK_TOKENS = 16  # tokens of the logits check after writing
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class ImportResult:
    out: Path
    architecture: str
    layers: int
    parameters: int
    vocab_size: int
    dtype: str  # fp32 | bf16
    dtype_reason: str
    stored_types: dict[str, int]  # GGUF tensor type -> tensors of it
    tokenizer_files: list[str] = field(default_factory=list)
    tokenizer_note: str = ""
    max_logit_diff: float = 0.0
    seconds: float = 0.0


def gguf_source(source: str | Path) -> Path:
    """The .gguf file `source` names: a file, `hf:FILE.gguf`, or a directory holding exactly one .gguf."""
    path = Path(str(source).removeprefix("hf:")).expanduser()
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            names = ", ".join(p.name for p in found) or "none"
            raise GGUFImportError(f"{path} is a directory with {len(found)} .gguf files ({names}); name the one "
                                  f"to import: longctx checkpoint import {path}/NAME.gguf --out DIR.")
        path = found[0]
    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file. Pass a GGUF model file (e.g. model.Q8_0.gguf), a "
                              f"directory holding one, or hf:FILE.gguf.")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFImportError(f"{path} is not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF'). "
                              f"Pass a llama.cpp .gguf model file; a Hugging Face directory needs no import "
                              f"(pass hf:DIR to longctx directly).")
    if re.search(r"-\d{5}-of-\d{5}\.gguf$", path.name):
        raise GGUFImportError(f"{path.name} is one part of a split GGUF, which transformers does not read; merge "
                              f"the parts first (llama.cpp's `llama-gguf-split --merge FIRST-PART OUT.gguf`).")
    return path


def require_packages() -> None:
    missing = [name for name in REQUIRED_PACKAGES if find_spec(name) is None]
    if missing:
        raise GGUFImportError(f"importing a GGUF file needs the Python package(s) {', '.join(missing)} "
                              f"(transformers reads the file through them); install them with "
                              f"`pip install {' '.join(missing)}` (or `pip install -e .[test]`), then run again.")


def check_output(out: Path, source: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise GGUFImportError(f"--out {out} is a file; pass a directory to write (it is created).")
    blocker = file_in_the_way(out)
    if blocker is not None:
        raise GGUFImportError(f"--out {out} lies under {blocker}, which is a file, not a directory; pass a "
                              f"directory to write (it is created).")
    if source.resolve().is_relative_to(out.resolve()):
        raise GGUFImportError(f"--out {out} holds the file being imported ({source.name}); choose another "
                              f"directory (the import replaces --out's contents).")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise GGUFImportError(f"--out {out} exists and is not empty; choose another directory, or pass --force "
                              f"to replace it (everything in it is deleted once the import is complete).")


def read_header(path: Path):
    """(the gguf package's reader of `path`: memory-mapped, no tensor data read, its architecture)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        arch = reader.fields["general.architecture"].contents()
    except (KeyError, ValueError, IndexError) as e:
        raise GGUFImportError(f"{path} could not be read as GGUF ({type(e).__name__}: {e}); the file may be "
                              f"truncated (a partial download?) or written by a newer llama.cpp than the installed "
                              f"`gguf` package reads (pip install -U gguf).") from None
    return reader, arch


def check_disk(reader, out: Path, dtype: str) -> None:
    """Refuse before reading the weights when DIR's filesystem cannot hold them dequantized."""
    elements = sum(int(t.n_elements) for t in reader.tensors)
    need = elements * (2 if dtype == "bf16" else 4)
    parent = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(parent).free
    if free < need * 1.05:
        raise GGUFImportError(f"--out {out}: the imported weights need about {need / 2**30:.2f} GiB "
                              f"({elements:,} values in {dtype if dtype != 'auto' else 'fp32 at most'}) and "
                              f"{parent} has {free / 2**30:.2f} GiB free; free space or choose another --out.")


def read_config(path: Path):
    """transformers' config for the file (metadata only), checked by longctx's own config.json reader."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except KeyError as e:  # (a bare KeyError names only the key: 'llama.attention.head_count')
        raise GGUFImportError(f"transformers cannot read {path.name}: its metadata lacks the key {e} that "
                              f"transformers' GGUF reader needs (a file converted by another tool, or damaged); "
                              f"convert the model again with llama.cpp's convert_hf_to_gguf.py.") from None
    except (ValueError, NotImplementedError) as e:
        raise GGUFImportError(f"transformers cannot read {path.name}: {e}") from None
    try:
        config_from_hf(config.to_dict(), f"{path.name} (as transformers reads it)")
    except HFFormatError as e:
        raise GGUFImportError(f"{path.name} is a model longctx does not read: {e}") from None
    return config


def unread_tensors(model, reader, arch: str) -> list[str]:
    """GGUF tensors that transformers' reader has no parameter for (it skips them silently): a bias
    the config does not declare, say. Empty when this transformers has no such mapping to ask."""
    try:
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )
    except ImportError:  # (another transformers layout: the logits check still guards the result)
        return []
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    mapped = get_gguf_hf_weights_map(model, processor)
    # experts stacked in one tensor (blk.N.ffn_gate_exps.weight) are mapped without ".weight": the MoE processor
    # looks them up by that stem and fills the fused parameter itself (all of them read as dropped before)
    stacked = getattr(processor, "GGUF_MOE_WEIGHTS_PATTERN", None)

    def read(name: str) -> bool:
        found = stacked.fullmatch(name) if stacked is not None else None
        return name in mapped or (found is not None and found.groupdict().get("name") in mapped)

    return [t.name for t in reader.tensors if not read(t.name)]


def load_model(path: Path, reader, arch: str):
    """transformers' model of the file, every weight dequantized to fp32, nothing left unread."""
    import transformers

    # a plain model, whatever GGUF kernels are installed (transformers before 5.2x always dequantizes)
    plain = {"quantization_config": transformers.GgufConfig(dequantize=True)} if hasattr(
        transformers, "GgufConfig") else {}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True, output_loading_info=True,
        **plain)
    missing = sorted(info.get("missing_keys") or ())
    if missing or info.get("mismatched_keys"):
        raise GGUFImportError(f"{path.name} does not fill the model its metadata describes: missing "
                              f"{', '.join(missing[:4]) or 'nothing'}, mismatched "
                              f"{', '.join(map(str, list(info.get('mismatched_keys') or [])[:4])) or 'nothing'}.")
    unread = unread_tensors(model, reader, arch)
    if unread:
        raise GGUFImportError(f"{path.name} holds {len(unread)} tensor(s) that transformers' GGUF reader drops "
                              f"(e.g. {', '.join(unread[:4])}); the imported model would not be the file's.")
    check_finite(model, path)
    return model.eval()


def check_finite(model, path: Path) -> None:
    """Refuse weights that hold NaN or inf (a damaged download, a bad conversion): the logits check then failed
    comparing NaN with NaN and blamed longctx's reading ("Please report it") for the file's own values."""
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise GGUFImportError(f"{path.name} holds weights that are not finite numbers (NaN or inf) once dequantized, "
                              f"in {len(bad)} tensor(s): {', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}; a "
                              f"damaged file or a bad conversion. Download or convert the model again.")


def choose_dtype(model, dtype: str) -> tuple[str, str]:
    """(fp32 | bf16, why). auto: bf16 only when every weight is exactly a bf16 value (a BF16 file), so
    auto never changes a weight; fp16 and quantized blocks dequantize to values bf16 would round."""
    if dtype != "auto":
        return dtype, "as asked"
    exact = all(torch.equal(p, p.to(torch.bfloat16).float()) for p in model.parameters())
    return ("bf16", "every weight is exactly a bf16 value") if exact else (
        "fp32", "the dequantized weights are not all exact in bf16")


def check_tokens(vocab_size: int) -> torch.Tensor:
    """CHECK_TOKENS token ids spread over the vocabulary (one row), the input of the logits check."""
    return (torch.arange(CHECK_TOKENS) * 7919 % vocab_size).unsqueeze(0)


@torch.no_grad()
def longctx_difference(directory: Path, tokens: torch.Tensor, reference: torch.Tensor) -> float:
    """Max |longctx's logits - `reference`| on `tokens`, longctx reading `directory` in fp32."""
    return (load_hf(directory)(tokens).float() - reference).abs().max().item()


def write_tokenizer(path: Path, directory: Path, file_tokens: int | None = None) -> tuple[list[str], str]:
    """Save the tokenizer the file describes into `directory`: (files written, why none were). `file_tokens`: how
    many tokens the file lists (tokenizer.ggml.tokens), the ids a tokenizer of it may give."""
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name,
                                                               local_files_only=True)
    except (ValueError, KeyError, OSError) as e:  # the weights are still useful: say why and go on
        return [], (f"transformers could not build the file's tokenizer ({e}); pass --tokenizer "
                    f"tokenizer.json to longctx generate, or copy the model's tokenizer files into the directory")
    before = {p.name for p in directory.iterdir()}
    tokenizer.save_pretrained(directory)
    drop_invented_tokens(directory, file_tokens)
    return sorted({p.name for p in directory.iterdir()} - before), ""


def drop_invented_tokens(directory: Path, file_tokens: int | None) -> None:
    """Remove the added tokens that transformers' GGUF reader invents past the file's vocabulary (`file_tokens`; None:
    the file lists none, nothing removed): its byte-level (gpt2) tokenizer adds GPT-2's `<|endoftext|>` as id
    `file_tokens` when the file does not list it (a Llama 3 file, say). The model has no embedding row for that id,
    so the text "<|endoftext|>" crashed it (index out of range) and training refused the tokenizer as larger than
    model.vocab_size. tokenizer.json is written compact either way: the tokenizers library saves it indented, its
    merges one string a line, 9.7 MB where compact is 4.1 MB for a 140K-token BPE vocabulary, and every run that
    reads it parses the white space too."""
    tokenizer = directory / "tokenizer.json"
    if not tokenizer.is_file():
        return
    spec = json.loads(tokenizer.read_text(encoding="utf-8"))
    kept = [t for t in spec.get("added_tokens", []) if file_tokens is None or t["id"] < file_tokens]
    invented = {t["content"] for t in spec.get("added_tokens", [])} - {t["content"] for t in kept}
    if "added_tokens" in spec:
        spec["added_tokens"] = kept
    tokenizer.write_text(json.dumps(spec, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")
    if not invented:
        return
    settings = directory / "tokenizer_config.json"
    if settings.is_file():  # (a bos / eos / unk / pad token named as an invented one names none)
        config = json.loads(settings.read_text(encoding="utf-8"))
        config = {k: (None if isinstance(v, str) and v in invented else v) for k, v in config.items()}
        settings.write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")


def import_gguf(source: str | Path, out: str | Path, dtype: str = "auto", force: bool = False) -> ImportResult:
    """Write the model of a GGUF file as a Hugging Face directory `out` (atomically) and check that
    longctx reads it as transformers does. `dtype`: fp32, bf16, or auto (choose_dtype)."""
    started = time.perf_counter()
    if dtype not in (*DTYPES, "auto"):
        raise GGUFImportError(f"--dtype {dtype}: expected fp32, bf16 or auto.")
    # (absolute: --out . names the directory to rename, not '.', which no rename moves: the import failed at its end)
    path, out = gguf_source(source), Path(os.path.abspath(Path(out).expanduser()))
    check_output(out, path, force)
    require_packages()
    reader, arch = read_header(path)
    check_architecture(arch, path)
    check_rope(reader, arch, path)
    check_disk(reader, out, dtype)
    config = read_config(path)
    check_sizes_read(reader, config, arch, path)
    check_shared_gate(reader, config, arch, path)
    meta = meta_model(config)  # (shapes only, built once for both checks; None where transformers cannot)
    check_tensors(reader, config, arch, path, meta)
    check_filled(reader, config, arch, path, meta)
    stored: dict[str, int] = {}
    for t in reader.tensors:
        stored[t.tensor_type.name] = stored.get(t.tensor_type.name, 0) + 1
    out.parent.mkdir(parents=True, exist_ok=True)
    work = scratch_dir(out, "importing")
    try:
        with phase(f"importing {path.name}"):
            model = load_model(path, reader, arch)
            chosen, why = choose_dtype(model, dtype)
            parameters = sum(p.numel() for p in model.parameters())
            tokens = check_tokens(config.vocab_size)
            with torch.no_grad():  # transformers' logits of the weights as written, computed in fp32 (a cast
                for p in model.parameters():  # model's RoPE buffers would be bf16: round the weights alone)
                    p.copy_(p.to(DTYPES[chosen]))
                reference = model(tokens).logits.float()
            model.to(DTYPES[chosen]).save_pretrained(work)
            del model
            listed = reader.fields.get("tokenizer.ggml.tokens")
            copied, note = write_tokenizer(path, work, len(listed.data) if listed is not None else None)
            gc.collect()  # one model at a time: transformers' is freed before longctx's is read
            diff = longctx_difference(work, tokens, reference)
        bound = 1e-3 * max(1.0, reference.abs().max().item())  # a wrong read differs by ~the logits' size
        if not diff <= bound:
            raise GGUFImportError(f"longctx reads the imported {path.name} differently from transformers (logits "
                                  f"differ by up to {diff:.3g}, more than {bound:.3g}); nothing was written to "
                                  f"{out}. Please report it with the file's name.")
        _publish(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ImportResult(out, config.model_type, config.num_hidden_layers, parameters, config.vocab_size, chosen,
                        why, stored, copied, note, diff, time.perf_counter() - started)


def _publish(work: Path, out: Path) -> None:
    """Rename the finished `work` to `out`; an existing `out` (empty, or --force) is replaced whole."""
    mode = 0o777 & ~_umask()  # mkdtemp's 0700 and transformers' 0600 weights -> the usual permissions
    os.chmod(work, mode)
    for file in work.iterdir():
        os.chmod(file, mode & 0o666)
    if not out.exists():
        work.rename(out)
        return
    old = scratch_dir(out, "replaced")
    out.rename(old)  # (onto the empty directory made for it)
    work.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def summary_lines(result: ImportResult, source: str) -> list[str]:
    """What `longctx checkpoint import` prints: what was read, what was written, the check, what next."""
    stored = ", ".join(f"{n} {kind}" for kind, n in sorted(result.stored_types.items(), key=lambda kv: -kv[1]))
    tokenizer = (", ".join(result.tokenizer_files) if result.tokenizer_files else
                 f"none ({result.tokenizer_note})")
    return [
        f"imported {source} ({stored} tensors) in {result.seconds:.1f} s",
        f"  {result.architecture}: {result.layers} layers, {result.parameters:,} parameters, vocabulary "
        f"{result.vocab_size:,}; weights in {result.dtype} ({result.dtype_reason})",
        f"  tokenizer: {tokenizer}",
        f"  checked: longctx's logits on {CHECK_TOKENS} tokens equal transformers' (max abs difference "
        f"{result.max_logit_diff:.3g})",
        f"wrote {result.out}; use it as hf:{result.out}, e.g.",
        f"  longctx generate --checkpoint hf:{result.out} --prompt \"Hello\"",
    ]


def run(source: str, out: str | None, dtype: str | None, force: bool) -> int:
    """`longctx checkpoint import SOURCE --out DIR [--dtype fp32|bf16|auto] [--force]`."""
    if not out:
        raise GGUFImportError("longctx checkpoint import needs an output directory: "
                              "longctx checkpoint import FILE.gguf --out DIR.")
    say(f"importing {source} -> {out} (transformers' GGUF reader, then longctx's logits check)")
    result = import_gguf(source, out, dtype=dtype or "auto", force=force)
    print("\n".join(summary_lines(result, str(source))))
    return 0
