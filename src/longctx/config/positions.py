"""How many positions a model's weights can be trusted with: what they were trained on, and what a
RoPE scaling stretches that to. `longctx generate` refuses a prompt past it (unless the user asks to
extrapolate), and training records it in each checkpoint's manifest (`trained_positions`).

`model.max_seq_len` is not evidence of anything: it is a number the user may raise at will, and a
model trained on 64 positions does not read position 100 because a config says 4096. So the reach is
built from what the weights saw:
- trained: a longctx checkpoint's recorded `trained_positions` (the longest sequence any stage of its
  runs trained on, and its start's reach); a Hugging Face model's `max_position_embeddings` (times
  its factor for a linear scaling, whose configs give the length before it, as vLLM reads them); a
  checkpoint written before the record existed: its max_seq_len (the old rule, never stricter).
- a yarn scaling reaches original x factor, as vLLM counts it: a YaRN-scaled model's longer prompts
  run (a llama3 config's max_position_embeddings is its scaled length already: vLLM stretches it by
  nothing, and neither does this). Not on top of a longctx record, which is that
  reach already where a run stretched its start; a run that trained under the scaling from scratch
  learned its tables at the lengths it saw, not at the original length it names.
- a scaling the user adds (or changes) at generation time stretches the unscaled length the weights
  learned: original x factor for yarn / llama3 when the original is at most that length (past it, nothing:
  see covered_positions), trained x factor for linear.
Ms-PoE (model.rope_ms_poe, models/ms_poe.py) divides positions by ratios >= 1: every position stays
inside the window, so it moves no reach; its rules (and its refusal in training) are here too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError
from .hf_rope import linear_positions, linear_reach
from .schema import ModelConfig

_ROPE_KEYS = ("rope_scaling", "rope_factor", "rope_original_max_len")
_WITH_ORIGINAL = ("yarn", "llama3")  # scalings that name the length they stretch


def scaled_reach(m: ModelConfig) -> int:
    """original x factor for yarn, else 0. (Not llama3: vLLM takes a llama3 model's max_position_embeddings
    as it is, and Llama-3.2's x 32 over 8,192 would read 262,144 for the 131,072 it was trained to.)"""
    if m.rope_scaling == "yarn":
        return int(m.rope_original_max_len * m.rope_factor)
    return 0


def unscaled_positions(m: ModelConfig, trained: int) -> int:
    """The length the weights learned before `m`'s own scaling stretched it. For linear, the largest length
    whose stretch (linear_reach) is not past `trained` (hf_rope.linear_positions): int(trained / factor) was
    one short for a non-integer factor (a config.json's 4,096 x 3.3 reads 13,516, and 13,516 / 3.3 gave 4,095),
    so a changed scaling stretched 4,095 and a yarn original of 4,096 was called past what the weights learned."""
    if m.rope_scaling in _WITH_ORIGINAL:
        return min(trained, m.rope_original_max_len)
    if m.rope_scaling == "linear":
        return linear_positions(trained, m.rope_factor)
    return trained


def _same_rope(a: ModelConfig, b: ModelConfig) -> bool:
    return all(getattr(a, k) == getattr(b, k) for k in _ROPE_KEYS)


def idle_original(now: ModelConfig, own: ModelConfig, trained: int) -> int:
    """The original length of a yarn / llama3 scaling that `now` adds or changes over `own` when it lies past
    the length the weights learned unscaled, else 0. Such a scaling stretches nothing: yarn / llama3 leave
    the wavelengths shorter than the original (nearly) unscaled, trusting that the weights turned through
    them, so with the default 8,192 over weights trained on 2,048 those between turn to angles never trained."""
    if _same_rope(now, own) or now.rope_scaling not in _WITH_ORIGINAL:
        return 0
    return now.rope_original_max_len if now.rope_original_max_len > unscaled_positions(own, trained) else 0


def covered_positions(now: ModelConfig, own: ModelConfig, trained: int, recorded: bool = False) -> int:
    """Positions `now` (the weights' config with the user's overrides) can be trusted with, for weights
    whose own config is `own` and that trained on `trained` positions. `recorded`: `trained` is a longctx
    checkpoint's trained_positions, already the reach under `own`'s RoPE (its start's reach included)."""
    if _same_rope(now, own):
        # (a record is not stretched again: a run that learned its scaled tables from scratch, e.g. the
        # llama3-1b preset's llama3 x 32 over 8,192 trained on 2,048, reached 262,144 by original x factor)
        return trained if recorded else max(trained, scaled_reach(own))
    base = unscaled_positions(own, trained)
    if idle_original(now, own, trained):
        return base
    if now.rope_scaling in _WITH_ORIGINAL:
        return max(base, int(now.rope_original_max_len * now.rope_factor))
    if now.rope_scaling == "linear":
        return int(base * now.rope_factor)
    return base


@dataclass(frozen=True)
class TrainedPositions:
    positions: int      # how many positions the weights trained on
    own: ModelConfig    # the weights' own [model], before any override
    source: str         # where `positions` comes from, said in messages
    recorded: bool = False  # a longctx manifest's trained_positions (covered_positions' `recorded`)


def trained_positions(init_from: str) -> TrainedPositions:
    """What the weights of `init_from` (hf:DIR or a longctx checkpoint) trained on."""
    from .hf import checkpoint_manifest, hf_dir, model_config, read_hf_config, resolve_init_from
    from .hf_families import with_family_defaults

    values, trained = {"init_from": init_from}, None
    if init_from.startswith("hf:"):
        hf = read_hf_config(hf_dir(init_from))
        # what the weights trained on is max_position_embeddings, not the max_seq_len a window below it makes the
        # default (Mistral-7B-v0.1's 4,096 of 32,768: config/hf.py default_max_seq_len); model_reach caps at it
        # (and not model.max_seq_len's default either: that is the reach, x a linear factor already)
        trained = int(with_family_defaults(hf)["max_position_embeddings"])
    fields, _ = resolve_init_from(values)
    own = model_config(fields)
    if init_from.startswith("hf:"):
        trained = trained or own.max_seq_len
        if own.rope_scaling == "linear":
            return TrainedPositions(linear_reach(trained, own.rope_factor), own, "its config.json's "
                                    "max_position_embeddings x its linear RoPE factor")
        return TrainedPositions(trained, own, "its config.json's max_position_embeddings")
    path, manifest = checkpoint_manifest(init_from)
    recorded = manifest.get("trained_positions")
    if recorded:
        return TrainedPositions(int(recorded), own, f"the trained_positions its manifest records ({path})", True)
    return TrainedPositions(own.max_seq_len, own, f"its max_seq_len (its manifest, {path}, predates the record of "
                                                   f"trained positions)")


def run_start_positions(init_from: str, model: ModelConfig) -> int:
    """The reach a training run starts from: 0 from scratch, else its start's reach under the run's
    own RoPE settings (an extension run stretches what its start learned)."""
    if not init_from:
        return 0
    start = trained_positions(init_from)
    return covered_positions(model, start.own, start.positions, start.recorded)


@dataclass(frozen=True)
class Reach:
    """How far a model (its weights and the run's RoPE settings) can be trusted, and from what."""
    positions: int  # covered_positions
    trained: int    # what the weights trained on (TrainedPositions.positions)
    unscaled: int   # what they learned before their own RoPE scaling: what a new scaling stretches
    source: str
    window: int = 0  # the sliding window of the config.json the weights started from, when it caps `positions`
    idle_original: int = 0  # idle_original(): a scaling's original length past `unscaled`, stretching nothing

    @property
    def scaled(self) -> bool:
        """A RoPE scaling stretches `trained` to `positions`."""
        return self.positions > self.trained

    def said(self) -> str:
        said = f"trained on {self.trained:,}: {self.source}"
        if self.window:
            return said + (f"; capped at the {self.window:,}-token sliding window its config.json gives attention: "
                           f"longctx attends to every earlier position, the same as the window only within it")
        if self.idle_original:
            return said + (f"; model.rope_original_max_len {self.idle_original:,} is past the {self.unscaled:,} "
                           f"positions the weights learned unscaled, so the RoPE scaling stretches none of them (its "
                           f"original length must be at most {self.unscaled:,})")
        return said + (", stretched by its RoPE scaling" if self.scaled else "")

    def extension_flags(self, length: int) -> str:
        """The --model.* flags of a yarn scaling that covers `length` positions (original = unscaled, so
        original x factor >= length: covered_positions of the result passes)."""
        factor = max(2, -(-length // self.unscaled))
        return (f"--model.rope_scaling=yarn --model.rope_factor={factor} "
                f"--model.rope_original_max_len={self.unscaled}")


def model_reach(m: ModelConfig) -> Reach:
    """The reach of the model `m` describes (its init_from's weights, with `m`'s RoPE settings)."""
    from .hf import initial_hf_config
    from .hf_families import family_window

    weights = trained_positions(m.init_from)
    positions = covered_positions(m, weights.own, weights.positions, weights.recorded)
    # a windowed Mistral / Mixtral (its window at or past the length it was loaded at, or the load refuses it)
    # attends within the window in transformers; longctx attends fully, which is the same only up to it
    window = family_window(initial_hf_config(m.init_from) or {}) or 0
    window = window if 0 < window < positions else 0
    return Reach(min(positions, window or positions), weights.positions,
                 unscaled_positions(weights.own, weights.positions), weights.source, window,
                 idle_original(m, weights.own, weights.positions))


def rope_scaling_problems(m: ModelConfig) -> list[str]:
    """model.rope_scaling's settings that cannot hold (config/rules.py asks them with the model's other rules)."""
    problems = []
    if m.rope_scaling != "none" and m.rope_factor <= 0:
        problems.append(f"model.rope_factor must be positive, got {m.rope_factor}.")
    elif m.rope_scaling != "none" and m.rope_factor < 1:  # (transformers only warns; every formula takes >= 1)
        problems.append(f"model.rope_factor = {m.rope_factor} is below 1: it is the extended context over the "
                        f"original (model.rope_original_max_len x factor positions), so {m.rope_scaling} scaling "
                        f"would shorten the context it is meant to lengthen ({m.rope_scaling} stretches positions "
                        f"past the trained ones). Give a factor of at least 1 (e.g. 4 for 4x the original length), "
                        f"or model.rope_scaling=none.")
    if m.rope_scaling in ("llama3", "yarn") and m.rope_original_max_len <= 0:
        problems.append(f"model.rope_original_max_len must be positive, got {m.rope_original_max_len}.")
    if m.rope_scaling == "yarn" and not 0 < m.rope_beta_slow < m.rope_beta_fast:
        problems.append(f"yarn rope scaling needs 0 < model.rope_beta_slow ({m.rope_beta_slow}) < "
                        f"model.rope_beta_fast ({m.rope_beta_fast}).")
    for key in ("rope_mscale", "rope_mscale_all_dim"):  # (YaRN's 0.1 x mscale x ln(factor) + 1: >= 1 for m >= 0)
        if m.rope_scaling == "yarn" and getattr(m, key) < 0:  # (below, the attention factor divided by 0 or flipped)
            problems.append(f"model.{key} must be >= 0 (0 = unset; DeepSeek's yarn configs give 0.707 or 1), got "
                            f"{getattr(m, key)}: YaRN's attention factor takes 0.1 x {key.split('_', 1)[1]} x "
                            f"ln(model.rope_factor) + 1 of it, which a negative value brings below 1, to 0 (a "
                            f"division by zero) or below it.")
    if m.rope_scaling == "yarn" and m.rope_attention_factor < 0:  # (on cos and sin: its sign cancels in q.k)
        problems.append(f"model.rope_attention_factor = {m.rope_attention_factor} would scale q.k as "
                        f"{-m.rope_attention_factor} does (it multiplies cos and sin), and config.json refuses it: "
                        f"give a positive factor, or 0 to derive it from model.rope_factor and the mscales.")
    return problems


def ms_poe_problems(m: ModelConfig) -> list[str]:
    """What is wrong with model.rope_ms_poe's settings (models/ms_poe.py), one sentence with its fix
    each; nothing when Ms-PoE is off."""
    if not m.rope_ms_poe:
        return []
    problems = []
    if not 1 <= m.rope_ms_poe_min <= m.rope_ms_poe_max:
        problems.append(f"model.rope_ms_poe needs 1 <= model.rope_ms_poe_min <= model.rope_ms_poe_max (positions are "
                        f"divided by ratios in that range: below 1 they would leave the trained window), got min "
                        f"{m.rope_ms_poe_min} and max {m.rope_ms_poe_max}; the paper uses 1.2 and 1.8.")
    if not 0 <= m.rope_ms_poe_skip_layers < m.layers:
        problems.append(f"model.rope_ms_poe_skip_layers must be in [0, model.layers = {m.layers}) so that Ms-PoE "
                        f"applies to some layer, got {m.rope_ms_poe_skip_layers}; the paper keeps 2.")
    return problems


MS_POE_SETTINGS = ("rope_ms_poe_min", "rope_ms_poe_max", "rope_ms_poe_order", "rope_ms_poe_skip_layers")


def unread_ms_poe_settings(m: ModelConfig, given: dict) -> str | None:
    """The refusal of Ms-PoE settings given on the command line (`given`: its --model.* keys, parse_overrides'
    "model") while model.rope_ms_poe is off, where nothing reads them: the run would decode with plain RoPE, not
    the positions asked for (a key at its default changes nothing and is no mistake). None when each applies.
    Asked of the command line's keys, not of the config: a checkpoint's saved config may carry them unread."""
    if m.rope_ms_poe:
        return None
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    unread = [f"--model.{key}={given[key]}" for key in MS_POE_SETTINGS
              if key in given and getattr(m, key) != defaults[key]]
    if not unread:
        return None
    one = len(unread) == 1
    return (f"{', '.join(unread)} {'sets' if one else 'set'} Ms-PoE, which is off (model.rope_ms_poe is false), so "
            f"{'it does' if one else 'they do'} nothing and the run would read plain RoPE positions: add "
            f"--model.rope_ms_poe=true, or drop {'it' if one else 'them'}.")


def refuse_ms_poe_in_training(m: ModelConfig) -> None:
    """`longctx train` with model.rope_ms_poe: one error before any work (Ms-PoE is a position option
    of generation and evaluation: the weights never trained with it)."""
    if m.rope_ms_poe:
        raise ConfigError("model.rope_ms_poe is a position option for longctx generate and longctx eval (training-"
                          "free: it divides each head's RoPE positions at inference); longctx train does not train "
                          "with it. Drop --model.rope_ms_poe for training, and set it when generating or evaluating.")
