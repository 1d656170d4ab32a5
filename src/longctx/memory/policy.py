"""MemoryPolicy: the [memory] settings that decide what a rank holds, as one frozen value.

The analytic counts (memory/accounting.py `estimate_activations`, memory/transients.py), the
planner's cost model and its search all take this one object instead of the settings one by one.
It is the [memory] table with `offload_fraction` resolved to a number; `from_config` builds it
from a config, `to_config` writes the table back (what a plan's config carries). How the policies
are applied to a model is memory/apply_policy.py.

`MemoryPolicy()` is "no memory technique": nothing recomputed, offloaded or chunked (the config's
defaults chunk the loss; `from_config` reads them as given).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MemoryConfig


@dataclass(frozen=True)
class MemoryPolicy:
    recompute: str = "none"           # activation recomputation: none | full | selective
    offload_fraction: float = 0.0     # requires full or selective
    offload_skip_last: int = 1
    loss_chunk: int = 0               # tokens per chunk of the LM head + loss; 0 = full logits
    block_chunk: int = 0              # tokens per chunk of the blocks' token-wise parts; 0 = whole
    attention_chunk: int = 0          # tokens per chunk of the attention core; 0 = all of a rank's tokens
    attention_offload: bool = False   # the attention core's kept state in host memory (with attention_chunk)
    grad_sync: str = "step"           # with grad_accum > 1: gradients reduced once per step, or per micro_batch
    expert_chunk: int = 0             # MoE: rows of routed tokens the experts run (and recompute) at a time

    @classmethod
    def from_config(cls, memory: MemoryConfig) -> MemoryPolicy:
        """The policy of a config's [memory] table. offload_fraction 'auto' is decided at run time
        (memory/auto.py, on the real block): resolve it before asking for the policy."""
        if memory.offload_fraction == "auto":
            raise ValueError("memory.offload_fraction is 'auto': resolve it (memory/auto.py) before building a "
                             "MemoryPolicy, or give a number")
        return cls(recompute=memory.recompute, offload_fraction=float(memory.offload_fraction),
                   offload_skip_last=memory.offload_skip_last, loss_chunk=memory.loss_chunk,
                   block_chunk=memory.block_chunk, attention_chunk=memory.attention_chunk,
                   attention_offload=memory.attention_offload, grad_sync=memory.grad_sync,
                   expert_chunk=memory.expert_chunk)

    def to_config(self) -> dict:
        """The [memory] table of a config that runs this policy."""
        return {"recompute": self.recompute, "offload_fraction": float(self.offload_fraction),
                "offload_skip_last": self.offload_skip_last, "loss_chunk": self.loss_chunk,
                "block_chunk": self.block_chunk, "attention_chunk": self.attention_chunk,
                "attention_offload": self.attention_offload, "grad_sync": self.grad_sync,
                "expert_chunk": self.expert_chunk}

    @property
    def attention_offloaded(self) -> bool:
        """Whether the attention core's kept state is in host memory: attention_offload acts only
        on a chunked core (attention_chunk > 0)."""
        return self.attention_offload and bool(self.attention_chunk)

    def describe(self) -> str:
        """Short form for tables: 'selective+off0.5 bc16K ac64K lc4K ahost'."""
        text = self.recompute
        if self.offload_fraction:
            text += f"+off{self.offload_fraction:g}"
            if self.offload_skip_last != 1:
                text += f" skip{self.offload_skip_last}"
        for tag, n in (("bc", self.block_chunk), ("ac", self.attention_chunk), ("lc", self.loss_chunk)):
            if n:
                text += f" {tag}{n // 1024}K" if n >= 1024 else f" {tag}{n}"
        if self.attention_offload:
            text += " ahost"
        if self.grad_sync != "step":
            text += " gs-micro"
        return text
