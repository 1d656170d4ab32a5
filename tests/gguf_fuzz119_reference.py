"""Reference for the GGUF import audit (tests/unit/test_gguf_fuzz119.py): random tiny GGUF files written with the
`gguf` package's GGUFWriter, and what a correct import must produce from them, read back from the file's bytes with
GGUFReader and gguf.quants.dequantize alone (not transformers' GGUF reader, which the import itself uses).

llama.cpp's q/k row order is undone here from the GGUF convention, not from any importer's code: for the llama
architecture, convert_hf_to_gguf.py stores the rows of each head's q (and k) projection so that the two halves of
the rotate-half RoPE pairs (Hugging Face rows r and r + head_dim / 2) sit next to each other (GGUF rows 2r, 2r + 1),
because ggml's default RoPE rotates adjacent pairs. qwen2 / qwen3 files use the NeoX RoPE and keep Hugging Face's
order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

# block sizes: every quantized row must be a whole number of blocks (32 values for the legacy quants)
QUANTS = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
FAMILIES = ["llama", "llama", "qwen2", "qwen3"]  # (llama twice: the permuted family matters most)
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet (byte 0 to 255), as a byte-level BPE vocabulary lists it."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he", "a t", "Ġ c", "Ġc at"]
BASE_TOKENS = byte_symbols() + ["Ġt", "he", "Ġthe", "at", "Ġc", "Ġcat", "<s>", "</s>"]


@dataclass
class Draw:
    """One random tiny model, as a GGUF file describes it."""
    seed: int
    family: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    vocab: int
    tie: bool
    rope_theta: float
    norm_eps: float
    context: int
    rope_scaling: dict = field(default_factory=dict)  # metadata key suffix -> value ({} none)
    types: dict = field(default_factory=dict)  # GGUF tensor name -> GGMLQuantizationType

    @property
    def tokens(self) -> list[str]:
        return BASE_TOKENS + [f"tok{i}" for i in range(self.vocab - len(BASE_TOKENS))]


def draw(seed: int) -> Draw:
    r = random.Random(seed)
    family = FAMILIES[seed % len(FAMILIES)]
    kv_heads = r.choice([1, 2, 4])
    heads = kv_heads * r.choice([1, 2, 4])
    # qwen3's GGUF reader takes Qwen3Config's head size 128 whatever the file says (docs/checkpoints.md)
    head_dim = 128 if family == "qwen3" else r.choice([8, 16, 32])
    hidden = 32 * r.randint(1, 3) if family == "qwen3" else heads * head_dim
    hidden = max(hidden, 32)
    if family != "qwen3" and hidden != heads * head_dim:  # (llama / qwen2 files carry no separate head size)
        head_dim = hidden // heads
    scaling = r.choice([{}, {}, {}, {"rope.scaling.type": "none"}, {"rope.scaling.type": "linear",
                        "rope.scaling.factor": 4.0}, {"rope.scaling.type": "yarn", "rope.scaling.factor": 2.0}])
    d = Draw(seed, family, r.randint(1, 2), heads, kv_heads, head_dim, hidden, 32 * r.randint(1, 4),
             len(BASE_TOKENS) + r.randint(0, 60), r.random() < 0.5, r.choice([10000.0, 500000.0, 1e6, 12345.0]),
             r.choice([1e-5, 1e-6, 3e-6]), r.choice([128, 256, 4096]), scaling)
    for name, shape in shapes(d).items():
        # llama.cpp keeps 1-D tensors (norms) in F32; matrices get any type whose blocks divide the row
        d.types[name] = Q.F32 if len(shape) == 1 else r.choice(QUANTS)
    return d


def shapes(d: Draw) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> its shape in numpy order (rows, columns), as Hugging Face stores the weight."""
    out = {"token_embd.weight": (d.vocab, d.hidden), "output_norm.weight": (d.hidden,)}
    if not d.tie:
        out["output.weight"] = (d.vocab, d.hidden)
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    for i in range(d.layers):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (d.hidden,), b + "attn_q.weight": (q, d.hidden),
                b + "attn_k.weight": (kv, d.hidden), b + "attn_v.weight": (kv, d.hidden),
                b + "attn_output.weight": (d.hidden, q), b + "ffn_norm.weight": (d.hidden,),
                b + "ffn_gate.weight": (d.ffn, d.hidden), b + "ffn_up.weight": (d.ffn, d.hidden),
                b + "ffn_down.weight": (d.hidden, d.ffn)}
        if d.family == "qwen2":
            out |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
        if d.family == "qwen3":
            out |= {b + "attn_q_norm.weight": (d.head_dim,), b + "attn_k_norm.weight": (d.head_dim,)}
    return out


def to_gguf_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face q/k rows -> llama.cpp's: within each head, row r of the first half and row r of the second
    half become GGUF rows 2r and 2r + 1."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def from_gguf_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k rows -> Hugging Face's (the inverse of to_gguf_rows): GGUF rows 2r, 2r + 1 of a head go
    back to rows r and r + head_dim / 2."""
    out = np.empty_like(w)
    head = w.shape[0] // heads
    for h in range(heads):
        block = w[h * head:(h + 1) * head]
        out[h * head:h * head + head // 2] = block[0::2]
        out[h * head + head // 2:(h + 1) * head] = block[1::2]
    return out


def write(d: Draw, path, drop=(), reshape=None, arch=None) -> dict[str, np.ndarray]:
    """Write `d` as a GGUF file; returns the Hugging Face-order fp32 weights it was made from (before quantizing).
    drop: tensor names left out; reshape: {name: shape} stored with another shape; arch: another architecture."""
    rng = np.random.default_rng(d.seed)
    w = gguf.GGUFWriter(str(path), arch or d.family)
    _metadata(w, d, arch or d.family)
    made = {}
    for name, shape in shapes(d).items():
        shape = (reshape or {}).get(name, shape)
        value = (rng.uniform(0.5, 1.5, shape) if len(shape) == 1 and "bias" not in name
                 else rng.normal(0, 0.2, shape)).astype(np.float32)
        made[name] = value
        if name in drop:
            continue
        stored = value
        if d.family == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            stored = to_gguf_rows(value, d.heads if "attn_q" in name else d.kv_heads)
        kind = d.types.get(name, Q.F32)
        if kind == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(stored))
        elif kind == Q.F16:
            w.add_tensor(name, stored.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(stored, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return made


def _metadata(w, d: Draw, arch: str) -> None:
    w.add_name(f"fuzz {d.seed}")
    w.add_block_count(d.layers)
    w.add_context_length(d.context)
    w.add_embedding_length(d.hidden)
    w.add_feed_forward_length(d.ffn)
    w.add_head_count(d.heads)
    w.add_head_count_kv(d.kv_heads)
    if d.family == "qwen3":
        w.add_key_length(d.head_dim)
        w.add_value_length(d.head_dim)
    else:
        w.add_rope_dimension_count(d.head_dim)
    w.add_rope_freq_base(d.rope_theta)
    w.add_layer_norm_rms_eps(d.norm_eps)
    for suffix, value in d.rope_scaling.items():
        key = f"{arch}.{suffix}"
        w.add_string(key, value) if isinstance(value, str) else w.add_float32(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(d.tokens)
    w.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in d.tokens])  # 3: control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(d.tokens.index("<s>"))
    w.add_eos_token_id(d.tokens.index("</s>"))


def hf_name(name: str) -> str:
    stem, kind = name.rsplit(".", 1)
    if stem in TOP:
        return f"{TOP[stem]}.{kind}"
    _, i, module = stem.split(".", 2)
    return f"model.layers.{i}.{next(hf for hf, g in LAYER.items() if g == module)}.{kind}"


def expected(d: Draw, path) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict a correct import of the file at `path` holds (fp32), read from its bytes."""
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        value = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        value = value.reshape(tuple(int(n) for n in reversed(t.shape)))  # GGUF lists dimensions fastest first
        if d.family == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            value = from_gguf_rows(value, d.heads if ".attn_q." in t.name else d.kv_heads)
        out[hf_name(t.name)] = torch.from_numpy(value.copy())
    if d.tie:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def reference_model(d: Draw, state: dict[str, torch.Tensor]):
    """transformers' own model class for the family, built from the draw's numbers (not from the file's config)
    and loaded with `state`."""
    import transformers

    extra = {"head_dim": d.head_dim} if d.family in ("llama", "qwen3") else {}
    cfg = transformers.AutoConfig.for_model(
        d.family, vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=d.ffn, num_hidden_layers=d.layers,
        num_attention_heads=d.heads, num_key_value_heads=d.kv_heads, rms_norm_eps=d.norm_eps,
        max_position_embeddings=d.context, rope_theta=d.rope_theta, tie_word_embeddings=d.tie, **extra)
    if d.family == "qwen3":
        cfg.head_dim = d.head_dim
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model
