"""What the commands that read a model's weights (generate, eval; a draft's training, of its target) say the model
is: `model_line` -> "debug (0.87M parameters), runs/a/checkpoints step 30".

The name is the one the checkpoint records: its preset (with the shape keys the run changed from it, "debug with
layers 2"), or for weights that started from a Hugging Face directory their family and that directory; hf:DIR itself
keeps ModelConfig.label ("qwen3 /models/Qwen3-0.6B"). The folder alone ("llama runs/a/checkpoints", the label of any
checkpoint) said neither what model it was nor which of its steps was read. The parameter count is the caller's
(costs/model_states.py params_text, a floor above this one), so that every caller counts alike.
"""

from __future__ import annotations

from .checkpoint_paths import read_step
from .fields import fields_by_key
from .hf import initial_hf, model_defaults
from .presets import MODEL_PRESETS
from .schema import ModelConfig
from .weight_shapes import shape_differences

MOST_CHANGES = 3  # shape keys said beside a preset's name; past them the preset names another model: the family


def model_line(m: ModelConfig, spec: str, params: str) -> str:
    """The model of the weights `spec` (a longctx checkpoint, or hf:DIR) read as `m`, in words: its name
    (model_name), `params` (e.g. "0.87M parameters") and, for a checkpoint, the step read (weights_read)."""
    where = weights_read(spec)
    return f"{model_name(m)} ({params})" + (f", {where}" if where else "")


def model_name(m: ModelConfig) -> str:
    """What model `m` is (module docstring): hf:DIR's label, "FAMILY started from hf:DIR" for weights trained
    from one, else its preset ("PRESET with KEY VALUE, ..." where its shape was changed), or its family."""
    if m.init_from.startswith("hf:"):
        return m.label
    if m.preset == "hf":  # (a checkpoint of a run that started from Hugging Face weights)
        origin = initial_hf(m.init_from)
        return f"{m.family} started from {origin}" if origin else m.family
    if m.preset not in MODEL_PRESETS:
        return m.family
    own = {**model_defaults(), **MODEL_PRESETS[m.preset]}
    given = {key: getattr(m, f.name) for key, f in fields_by_key(ModelConfig).items()}
    changed = {k: mine for k, (_, mine) in shape_differences(own, given).items()}
    if own.get("family") != m.family:
        changed = {"family": m.family, **changed}
    if not changed:
        return m.preset
    if len(changed) > MOST_CHANGES:
        return f"a {m.family} of its own shape"
    return f"{m.preset} with " + ", ".join(f"{k} {v}" for k, v in changed.items())


def weights_read(spec: str) -> str:
    """Which weights of the longctx checkpoint `spec` were read: "runs/a/checkpoints step 30" (and why, where
    `latest` named a step that is missing or incomplete); '' for hf:DIR or where there is none."""
    read = read_step(spec)
    if read is None:
        return ""
    step, note = read
    return f"{spec} step {step}" + (f" ({note})" if note else "")


def count_words(n: int) -> str:
    """A parameter count in words, as every model line writes one (costs/model_states.py params_text too): '0.23M',
    '8.03B'."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
