"""What transformers' GGUF reader would read otherwise than the file says, refused before the weights are read
(checkpoint/gguf_import.py runs them): RoPE scaling it drops, metadata that does not describe the file's tensors
(it fills what a file lacks with its config class's defaults), sizes it takes from its config classes instead of
the file, and a shared-expert gate shape it misreads. Each error names the key and the way out (the model's
Hugging Face release, or a conversion again).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError


class GGUFImportError(UserError, ValueError):
    """A GGUF file, an output directory or a setup that the import refuses; the message says the fix."""

    exit_code = 2


# llama.cpp's architecture names of the families longctx reads (config/hf_families.py) that transformers' GGUF reader
# reads too: any other is refused before transformers reads the file's metadata
IMPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")


def check_architecture(arch: str, path: Path) -> None:
    """Refuse an architecture the installed `gguf` package has no tensor names for (transformers' reader maps a
    file's tensors through them and raised NotImplementedError (a traceback) only once loading had begun. A file
    stating `mistral` is one: llama.cpp writes Mistral 7B-style models as `llama` (Mistral 3 ones as
    `mistral3`, which gguf-py names but transformers' reader refuses), and gguf-py has no `mistral`), and one
    longctx does not import (IMPORTED_ARCHITECTURES)."""
    from importlib.metadata import version

    import gguf

    if arch not in set(gguf.MODEL_ARCH_NAMES.values()):
        raise GGUFImportError(f"{path.name} states general.architecture = {arch!r}, which the installed gguf package "
                              f"({version('gguf')}) has no tensor names for, so "
                              f"transformers' GGUF reader cannot read its tensors. llama.cpp writes Llama-style "
                              f"models (Mistral 7B's too) as 'llama': convert the model again with llama.cpp's "
                              f"convert_hf_to_gguf.py, or use its Hugging Face release (hf:DIR).")
    if arch not in IMPORTED_ARCHITECTURES:
        # (transformers' reader failed on some with a bare KeyError, 'qwen35.attention.key_length', on others
        # after building the config; neither named the way out)
        raise GGUFImportError(f"{path.name} states general.architecture = {arch!r}, which longctx does not import: "
                              f"it imports GGUF files of {', '.join(IMPORTED_ARCHITECTURES)} (llama.cpp writes "
                              f"Mistral 7B-style models as 'llama'). If longctx reads the model's family in a "
                              f"Hugging Face release (docs/checkpoints.md), pass hf:DIR of that release instead.")


def check_rope(reader, arch: str, path: Path) -> None:
    """Refuse RoPE scaling that transformers' GGUF reader does not carry into config.json: the model
    would load, with other frequencies than it was trained with."""
    found = _rope_scaling(reader, arch)
    if found:
        raise GGUFImportError(f"{path.name} {found}, which transformers' GGUF reader leaves out of config.json: the "
                              f"imported model would compute with other RoPE frequencies than the ones it was trained "
                              f"with. Use the model's Hugging Face release (config.json + safetensors) instead: pass "
                              f"hf:DIR to longctx.")


def _rope_scaling(reader, arch: str) -> str | None:
    """What of the file's RoPE scaling llama.cpp applies, said for the error; None: none."""
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        return "holds rope_freqs.weight (per-frequency RoPE factors: Llama 3.1-style scaling)"
    key = f"{arch}.rope.scaling.type"
    kind = reader.fields[key].contents() if key in reader.fields else None
    if kind not in (None, "none", ""):
        return f"sets {key} = {kind!r}"
    # llama.cpp scales without a type key too: it takes the type as linear and the factor from rope.scaling.factor
    # or the older rope.scale_linear (0: not set), and multiplies cos and sin by rope.scaling.attn_factor (with
    # type none it never scales)
    for suffix, identity in (("rope.scaling.factor", (0.0, 1.0)), ("rope.scale_linear", (0.0, 1.0)),
                             ("rope.scaling.attn_factor", (1.0,))):
        name = f"{arch}.{suffix}"
        if name in reader.fields and (kind != "none" or suffix == "rope.scaling.attn_factor"):
            value = float(reader.fields[name].contents())
            if value not in identity:
                return f"sets {name} = {value:g} (llama.cpp applies it; a factor with no {key} scales linearly)"
    return None


def check_filled(reader, config, arch: str, path: Path, model) -> None:
    """transformers fills what a file's metadata lacks with its config class's defaults (a llama file
    without hyperparameters reads as a 32-layer Llama of 6.6B parameters) and finds the weights missing
    only after building that model in fp32 (26 GB, minutes). Refuse a file whose tensors hold fewer values
    than the model its metadata describes has parameters, counted on the meta device (no memory)."""
    if model is None:  # (load_model's own check follows)
        return
    need = sum(p.numel() for p in model.parameters())
    have = sum(int(t.n_elements) for t in reader.tensors)
    if need > have:
        raise GGUFImportError(f"{path.name}'s metadata does not describe its tensors: as transformers reads it, it is "
                              f"a model of {need:,} parameters ({_sizes(config)}), and the file holds {have:,} "
                              f"values{_defaults_note(reader, arch)}. Convert the model again with llama.cpp's "
                              f"convert_hf_to_gguf.py, or use its Hugging Face release (hf:DIR).")


def _sizes(config) -> str:
    return (f"{config.num_hidden_layers} layers, hidden size {config.hidden_size}, "
            f"vocabulary {config.vocab_size:,}")


def _defaults_note(reader, arch: str) -> str:
    """The size keys the metadata lacks, which transformers fills with its config class's defaults."""
    keys = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count", "context_length")
    lacks = [f"{arch}.{k}" for k in keys if f"{arch}.{k}" not in reader.fields]
    return f"; it lacks {', '.join(lacks)}, which transformers fills with its defaults" if lacks else ""


# sizes that transformers' GGUF reader takes from its config class for some families whatever the file says:
# metadata key (after "ARCH.") -> (the config attribute it sets instead, the weights that depend on it)
SIZE_KEYS = {"attention.key_length": ("head_dim", "attention"),
             "expert_feed_forward_length": ("moe_intermediate_size", "expert"),
             "expert_shared_feed_forward_length": ("shared_expert_intermediate_size", "shared-expert")}


def check_sizes_read(reader, config, arch: str, path: Path) -> None:
    """Refuse a file whose sizes are not the ones transformers reads: its qwen3 reader ignores attention.key_length
    (Qwen3Config's head_dim 128), its qwen2moe / qwen3moe readers the expert sizes (Qwen2MoeConfig's 1408 and 5632,
    Qwen3MoeConfig's 768). Such a file was refused as metadata that "does not describe its tensors" with advice
    (convert again) that no conversion follows, or, of larger sizes, failed inside transformers (a size mismatch)."""
    for suffix, (attr, part) in SIZE_KEYS.items():
        key = f"{arch}.{suffix}"
        read = getattr(config, attr, None)
        if attr == "head_dim" and not read:
            read = config.hidden_size // config.num_attention_heads
        if key not in reader.fields or read is None:
            continue
        stated = int(reader.fields[key].contents())
        if stated != read:
            raise GGUFImportError(f"{path.name} sets {key} = {stated}, but transformers' GGUF reader takes {attr} "
                                  f"{read} for {arch} (it does not read that key), so it cannot read the file's "
                                  f"{part} weights. Use the model's Hugging Face release instead (pass hf:DIR to "
                                  f"longctx).")


def check_shared_gate(reader, config, arch: str, path: Path) -> None:
    """Refuse a shared-expert gate that transformers' reader would shape wrongly: its qwen2moe reader adds a leading
    dimension to the gate, which older llama.cpp conversions wrote 1-D (hidden,); current ones write it as
    transformers' own (1, hidden), which then fails inside transformers (a size mismatch) after the model is built.
    The reader is asked what it makes of the stored shape, so a transformers that takes both forms passes."""
    want = (1, config.hidden_size)  # Qwen2MoeSparseMoeBlock.shared_expert_gate: Linear(hidden, 1)
    for t in reader.tensors:
        if not t.name.endswith(".ffn_gate_inp_shexp.weight"):
            continue
        stored = tuple(int(n) for n in reversed(t.shape))  # (the reader hands tensors over in numpy order)
        read = processed_shape(config, arch, t.name, stored)
        if read is not None and read != want:
            raise GGUFImportError(f"{path.name} stores {t.name} as {stored} (as current llama.cpp conversions write "
                                  f"the shared-expert gate), and transformers' GGUF reader makes it {read} where "
                                  f"the model's is {want}: it reads only the 1-D form ({config.hidden_size},) of "
                                  f"older conversions. Use the model's Hugging Face release instead (pass hf:DIR "
                                  f"to longctx).")


def processed_shape(config, arch: str, name: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape transformers' GGUF tensor processor for `arch` turns a `shape` tensor named `name` into (a zero
    array of it, nothing read from the file); None when this transformers has no such processor to ask."""
    import numpy as np

    try:
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
    except ImportError:
        return None
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    return tuple(processor.process(weights=np.zeros(shape, np.float32), name=name).weights.shape)


def meta_model(config):
    """transformers' model of `config` on the meta device (shapes, no memory); None when it cannot build one."""
    import transformers

    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, RuntimeError, NotImplementedError):
        return None


def check_tensors(reader, config, arch: str, path: Path, model) -> None:
    """Refuse a file whose tensors are not the ones its metadata's model has, naming them: a tensor of another shape
    failed inside transformers (a RuntimeError pointing at its load report) after every weight was dequantized, and
    a missing one was refused only by the parameter count of check_filled, which names no tensor. Tensors are
    matched through transformers' own name map; experts stacked in one tensor (MoE) are left to load_model."""
    try:
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )
    except ImportError:
        return
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    if model is None or getattr(processor, "GGUF_MOE_WEIGHTS_PATTERN", None) is not None:
        return
    try:
        mapped = get_gguf_hf_weights_map(model, processor)
    except NotImplementedError:
        return
    want = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wrong, found = [], set()
    for t in reader.tensors:
        hf = mapped.get(t.name)
        if hf not in want:
            continue
        found.add(hf)
        stored = tuple(int(n) for n in reversed(t.shape))  # (GGUF lists dimensions fastest first)
        if stored != want[hf]:
            wrong.append(f"{t.name} {stored} where {hf} is {want[hf]}")
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    names = {hf: name for name, hf in mapped.items()}
    missing = [names.get(hf, hf) for hf in want if hf not in found and hf not in tied]
    if wrong or missing:
        said = "; ".join(filter(None, [wrong and f"has {len(wrong)} tensor(s) of another shape than its metadata's "
                                                 f"model: {', '.join(wrong[:4])}",
                                       missing and f"lacks {len(missing)} tensor(s): {', '.join(missing[:4])}"]))
        raise GGUFImportError(f"{path.name}'s metadata does not describe its tensors: as transformers reads it "
                              f"({_sizes(config)}{_defaults_note(reader, arch)}), the file {said}. The file is "
                              f"damaged or its metadata incomplete: download or convert the model again (llama.cpp's "
                              f"convert_hf_to_gguf.py), or use its Hugging Face release (hf:DIR).")
