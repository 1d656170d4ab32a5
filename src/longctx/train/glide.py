"""GliDe draft training: `longctx train --config configs/glide.toml --draft.target DIR`.

With draft.target set, the model the Trainer optimises is `GlideTraining`: a GliDe draft
(models/glide.py) trained against a frozen target, whose model config and tokenizer the run takes
(config/load.py sets model.init_from to the target).

- The target (a Llama: requires_grad False, eval) is parallelised like a trained model (2D
  sequence-parallel attention in the run's head x ctx layout, FSDP2 over the same ranks; no
  recompute policy, nothing is saved for a backward) and runs forward under no_grad once per
  micro-batch. The attention core of each layer the draft reads (`draft.target_layers`, its last
  `draft.layers`) is wrapped so the keys and values Block.pre produced (after RoPE: what a cache
  holds; this rank's shard of them) are captured on the way: no extra target forward.
- Block-stale cross-attention: a query at document-relative position p of document d sees the
  target's keys of document d at positions below p // block * block (block = draft.block, the
  speculation length): exactly the cache as of the last verification at decode time. A query
  that sees none (the first block of each document) gets 0.
- Under head x ctx, the captured K/V of those layers, with each key's position and document id, are
  all-gathered over the head x ctx ranks (parallel/context/sequence.py gather_shards, through comm.py; no
  gradient: the target is frozen), sorted into sequence order, and each rank's queries attend to
  them with the mask from the global document-relative positions: exact, and simple. Its cost: per
  draft layer, every rank holds that target layer's K and V for the WHOLE sequence during the step
  (2 x S x kv_heads x head_dim values per row, in the compute dtype, plus two int64 per key), not
  1 / (head x ctx) of it; a ring over ctx, as the self-attention has, is future work.
- Embedding and LM head are the target's, frozen: full copies taken once from its (sharded)
  weights and held as buffers (`FrozenHead`: vocab x dim per rank, one tensor when tied); FSDP does
  not unshard a root's parameters outside its forward, so the target's own cannot be called here.
  Not saved: a draft checkpoint holds the draft's own weights only.
- Loss: `ce` the next-token cross-entropy on the labels (summed; the Trainer normalises as for any
  model), `kd` the cross-entropy of the draft's distribution against the target's (both at
  draft.kd_temperature) on the labelled tokens; both chunked over tokens by memory.loss_chunk
  (ops/loss.py), so neither model's [tokens, vocab] logits exist at once.
- draft.kind = clover (`CloverTraining`, models/clover.py): the same frame, the draft reading the
  target's final-normed hidden states (the kd teacher, computed anyway) instead of captured K/V, its
  states models/clover.py's chain_states (each position's as its round's chain computes it,
  teacher-forced: `block` passes over the sequence); the record's kind "clover". One rank: the chain
  reads the whole sequence's states and no head x ctx layout is built for it (config/draft_rules.py
  refuses one; data ranks are refused by the builder, before the target is read); no recompute.
- Only the draft's parameters are optimised and checkpointed (the target is not a submodule); the
  manifest's `draft` record names the target (its resolved path and model config) and the draft's
  layers, block and loss. checkpoint/glide.py reads such checkpoints back for generation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..checkpoint.identity import weights_identity
from ..config import Config, to_dict
from ..config.draft_rules import clover_ranks_problem
from ..config.hf import hf_dir
from ..errors import ConfigError
from ..job.runtime import Runtime
from ..models.clover import CloverDraft
from ..models.glide import GlideDraft, block_stale_limit, sequence_codes
from ..models.llama import Llama, build_model
from ..models.shards import write_full
from ..ops.loss import IGNORE, lm_head_distill_loss, lm_head_loss, take_rows
from ..parallel.fsdp.shard import materialize
from ..parallel.parallelize import parallelize, parallelize_draft
from .weights import load_weights


class FrozenHead(nn.Module):
    """The target's input embedding and LM head, frozen: full tensors held as buffers that are not
    saved (state_dict leaves them out). The draft reads them as it reads a target's (`tok_embeddings`,
    `lm_head_weight`)."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("embed", embed, persistent=False)
        self.tied = lm_head is None
        if not self.tied:
            self.register_buffer("lm_head", lm_head, persistent=False)

    def tok_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed if self.tied else self.lm_head


class _Capture:
    """A target layer's attention core that also leaves its (k, v) in `sink[index]`."""

    def __init__(self, core, sink: dict, index: int):
        self.core, self.sink, self.index = core, sink, index

    def __call__(self, q, k, v, doc_ids):
        self.sink[self.index] = (k, v)
        return self.core(q, k, v, doc_ids)


class GlideTraining(nn.Module):
    """A GliDe draft and its frozen target, as one model for the Trainer: forward(tokens, positions,
    doc_ids, labels, loss_reduction) like Llama's. Its parameters, state dict and FSDP units are the
    draft's alone (`draft.*`); the target is held outside the module tree."""

    def __init__(self, draft: GlideDraft, target: Llama, head: FrozenHead, *, loss: str = "ce", block: int = 4,
                 kd_temperature: float = 1.0, record: dict | None = None):
        super().__init__()
        if loss not in ("ce", "kd"):
            raise ValueError(f"draft.loss must be ce or kd, got {loss!r}")
        self.draft, self.head = draft, head
        object.__setattr__(self, "target", target)  # not a submodule: never optimised, saved or sharded with the draft
        self.loss, self.block, self.kd_temperature = loss, block, kd_temperature
        self.checkpoint_record = record  # the manifest's `draft` entry (CheckpointManager)
        self.kv_gather = None  # under head x ctx: gathers a local sequence shard over the ranks (parallelize_draft)
        self.loss_chunk = 0    # tokens per chunk of the LM head + loss (memory.loss_chunk)
        self._captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in draft.target_layers:
            attention = target.layers[i].attention
            attention.core = _Capture(attention.core, self._captured, i)

    @property
    def layers(self) -> nn.ModuleList:
        """The draft's layers (what metrics count as blocks)."""
        return self.draft.layers

    def forward(self, tokens, positions=None, doc_ids=None, labels=None, loss_reduction="mean", real=None,
                scored=None):
        """The draft's logits [b, n, vocab] without labels; with labels its loss (draft.loss), summed
        over the valid labels (`"sum"`) or averaged (`"mean"`); `scored` as the target's forward takes it
        (models/llama.py): the head over the labelled rows only."""
        b, n = tokens.shape
        if positions is None:
            positions = torch.arange(n, device=tokens.device).expand(b, n)
        teacher, kv, key_pos, key_doc = self._target(tokens, positions, doc_ids)
        x = self.draft.hidden_states(self.head, tokens, positions, kv, block_stale_limit(positions, self.block),
                                     doc_ids=doc_ids, key_positions=key_pos, key_doc_ids=key_doc)
        if labels is None:
            return self.draft.logits(self.head, x)
        return self.draft_loss(x, teacher, labels, loss_reduction, scored)

    def draft_loss(self, x, teacher, labels, loss_reduction, scored=None):
        """draft.loss on the draft's last states x [b, n, dim] (before its final norm), against the
        target's final-normed states `teacher` (kd) or the labels (ce), chunked (memory.loss_chunk); with
        `scored` (ops/loss.py scored_rows) over those rows only, every other row's label being ignored."""
        weight = self.draft.head_weight(self.head)  # (a reduced vocabulary's rows: models/draft_vocab.py)
        x, teacher, labels = x.flatten(0, 1), teacher.flatten(0, 1), labels.flatten()
        if scored is not None:  # (checked as the target's loss checks them: no scored label left out)
            x, labels, _ = take_rows(scored, x, labels, None)
            teacher = teacher.index_select(0, scored) if self.loss == "kd" else teacher  # (ce reads no teacher)
        labels = self._scored(labels)
        if loss_reduction not in ("sum", "mean"):
            raise ValueError(f"a GliDe draft's loss_reduction is sum or mean, got {loss_reduction!r}")
        norm = (self.draft.norm.weight, self.draft.norm.eps)
        if self.loss == "kd":
            total = lm_head_distill_loss(x, weight, teacher, labels, temperature=self.kd_temperature,
                                         chunk=self.loss_chunk, norm=norm)
        else:
            total = lm_head_loss(x, weight, labels, chunk=self.loss_chunk, reduction="sum", norm=norm)
        if loss_reduction == "sum":
            return total
        return total / (labels != IGNORE).sum().clamp(min=1)

    def _scored(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels as the loss scores them: with a reduced vocabulary and ce, indices into it, IGNORE
        where a label is outside it (kd scores every valid label, against the renormalised teacher)."""
        if self.draft.vocab is not None and self.loss == "ce":
            return self.draft.vocab.labels(labels, IGNORE, self.head.lm_head_weight.shape[0])
        return labels

    def scored_label_count(self, labels: torch.Tensor) -> torch.Tensor | None:
        """How many of `labels` the loss scores (a 0-d tensor on their device, no host read), or None when
        it scores every valid label. The trainer divides a step's summed loss by the labels scored over the
        global step (train/trainer.py): with draft.vocab and draft.loss = ce the labels outside the
        vocabulary are not scored, and counting them would scale the loss (and each step's gradient) by
        the step's in-vocabulary share."""
        if self.draft.vocab is None or self.loss != "ce":
            return None
        return (self._scored(labels) != IGNORE).sum()

    @torch.no_grad()
    def _target(self, tokens, positions, doc_ids):
        """The target's forward: its final-normed hidden states (the teacher of kd), and per draft layer
        the captured (k, v) [b, kv_heads, S, d] with the keys' positions and document ids [b, S]
        (gathered over the head x ctx ranks and sorted into sequence order under a layout)."""
        self._captured.clear()
        try:
            teacher = self.target(tokens, positions, doc_ids, hidden=True)
        finally:
            reshard = getattr(self.target, "reshard", None)
            if reshard is not None:  # FSDP keeps a root's parameters gathered after forward, for a backward
                reshard()            # that a frozen target never runs (its blocks reshard in their post-forward)
        kv = [self._captured.pop(i) for i in self.draft.target_layers]
        self._captured.clear()
        if self.kv_gather is None:
            return teacher, [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in kv], positions, doc_ids
        gather = self.kv_gather
        key_pos = gather(positions)
        key_doc = None if doc_ids is None else gather(doc_ids)
        order = torch.argsort(sequence_codes(key_doc, key_pos), dim=1)
        rows = torch.arange(order.shape[0], device=order.device)[:, None]
        key_pos = key_pos[rows, order]
        key_doc = None if key_doc is None else key_doc[rows, order]
        kv = [(gather(k)[rows, order].transpose(1, 2), gather(v)[rows, order].transpose(1, 2)) for k, v in kv]
        return teacher, kv, key_pos, key_doc


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value on this rank (gathered from its shards under FSDP), detached."""
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def target_path(source: str) -> Path:
    """The directory draft.target names, resolved (a checkpoints directory: its latest checkpoint)."""
    if source.startswith("hf:"):
        return hf_dir(source).resolve()
    from ..config.checkpoint_paths import resolve_checkpoint

    return resolve_checkpoint(source, Path(source)).resolve()


def pin_target(cfg: Config, rt: Runtime) -> Config:
    """cfg with draft.target as the one checkpoint it names now, resolved on rank 0 for every rank (hf:DIR as
    given). A `<run>/checkpoints` target names its latest step, which moves on while that run saves: resolved
    by each rank as it loads and again for the draft's record, a save landing meanwhile made the record name a
    step the draft never read (generate then refused the draft beside the target it learned from and took it
    beside the newer one), and ranks could load shards of two steps into one target."""
    from ..job.runtime import on_main

    d = cfg.draft
    if d.target.startswith("hf:"):
        return cfg
    step = on_main(rt, lambda: str(target_path(d.target)), "resolving draft.target")
    return dataclasses.replace(cfg, draft=dataclasses.replace(d, target=step))


@torch.no_grad()
def init_from_target(draft: GlideDraft, target: Llama) -> None:
    """draft.init = target: each draft layer a copy of the target layer it reads (its attention norm, attention
    and MLP; the cross-attention's norm, query and output projections from that layer's attention: at the
    start it attends to that layer's keys and values as the layer itself does), the final norm the
    target's. Each target weight is gathered whole, one at a time, and each rank writes its own shard of it."""
    def copy(dst: nn.Module, src: nn.Module) -> None:
        theirs = dict(src.named_parameters())
        for name, p in dst.named_parameters():
            write_full(p, _full(theirs[name]))

    for layer, i in zip(draft.layers, draft.target_layers):
        block = target.layers[i]
        copy(layer.self_norm, block.attention_norm)
        copy(layer.cross_norm, block.attention_norm)
        copy(layer.self_attention, block.attention)
        copy(layer.ffn_norm, block.ffn_norm)
        copy(layer.feed_forward, block.feed_forward)
        write_full(layer.cross_q.weight, _full(block.attention.wq.weight))
        write_full(layer.cross_o.weight, _full(block.attention.wo.weight))
    copy(draft.norm, target.norm)


def token_counts(cfg: Config, rt: Runtime, log=print) -> torch.Tensor:
    """How often each token id occurs in the documents of the run's training split [model.vocab_size] (the
    store built first if it is not yet: every rank counts the same store, so every rank picks the same
    vocabulary). A sample's padding (the pad token repeated after its segments) is not counted: it is no
    text and no label reads it, yet a store of short documents in long samples is mostly padding, which
    counted made the pad token the 'most frequent' and the reported coverage a share of padding. Of
    instruction data only the answers are counted: the tokens the draft proposes and is trained on. A data mix
    (data.path = 'A,B'): every store's counts, summed; with data.weights (shares of samples, docs/data.md) each
    store's per train sample times its weight: the mix of tokens the run trains on (store_mix.mix_line)."""
    from ..config.data_mix import parse_weights, store_paths
    from .setup import store_path

    stores, sizes = [], []
    for root in map(Path, store_paths(store_path(cfg, log, rt))):  # (a data mix: each of its stores)
        stores.append(np.zeros(cfg.model.vocab_size, dtype=np.int64))
        sizes.append(_count_store(root, stores[-1]))
    weights = parse_weights(cfg.data.weights)
    if not weights:  # (in proportion to each store's samples: as if the stores were one)
        return torch.from_numpy(np.sum(stores, axis=0))
    # (a weight is a share of the samples drawn: a store's tokens per sample times it)
    return torch.from_numpy(sum(w * c / max(n, 1) for w, c, n in zip(weights, stores, sizes)))


def _count_store(root: Path, counts: np.ndarray) -> int:
    """token_counts of one store, added to `counts`; returns its train samples."""
    from ..data.store import S_LENGTH, S_SAMPLE, load_split, read_manifest
    from ..data.trained_spans import part_trained_spans, trained_token_mask

    total = 0
    for part in read_manifest(root)["parts"]:
        split = load_split(root, part, "train")
        if split is None:
            continue
        samples, seq_len = split.tokens.shape
        total += samples
        spans = part_trained_spans(root, part)  # (instruction data: its answers only)
        # a sample's segments are contiguous from offset 0: its real tokens are the first sum(lengths)
        real = np.bincount(split.segments[:, S_SAMPLE], weights=split.segments[:, S_LENGTH], minlength=samples)
        rows = max(1, (1 << 24) // max(1, seq_len))  # ~16M tokens read at a time, not a whole part
        for r in range(0, samples, rows):
            tokens = np.asarray(split.tokens[r:r + rows])
            held = np.arange(seq_len)[None] < real[r:r + rows, None]
            trained = trained_token_mask(spans, part, split, r, r + rows)
            if trained is not None:
                held &= trained
            counts += np.bincount(tokens[held], minlength=counts.size)[:counts.size]
    return total


def frozen_target(cfg: Config, device: torch.device, rt: Runtime, log=print) -> tuple[Llama, FrozenHead, Path]:
    """The target built on meta, parallelised, materialised and loaded from draft.target (each rank its
    shards), frozen; its embedding and LM head as full frozen buffers; the path it was read from."""
    d = cfg.draft
    # the target saves nothing for a backward: no recompute policy, no offload (attention chunks stay)
    frozen = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, recompute="none", offload_fraction=0.0,
                                                                 block_chunk=0, attention_offload=False))
    target = build_model(cfg.model, device="meta")
    target.requires_grad_(False)
    target = parallelize(target, rt.dims, frozen, rt.mesh, device.type)
    materialize(target, frozen, device)
    path = load_weights(target, d.target, rt, log, "draft.target")
    target.requires_grad_(False)
    target.eval()
    note = past_target_reach(cfg)
    if note:
        log(note)
    tied = target.output is None
    head = FrozenHead(_full(target.tok_embeddings.weight), None if tied else _full(target.output.weight))
    return target, head, path


def past_target_reach(cfg: Config) -> str:
    """A note when the draft trains on sequences longer than the frozen target reaches: the target's K/V
    and distribution there are extrapolation, and generate refuses such prompts without
    --allow-extrapolation; '' otherwise."""
    from ..config.positions import model_reach
    from .stages import stages_of

    longest = max(s.seq_len for s in stages_of(cfg))  # (train.seq_len, or the longest stage's)
    reach = model_reach(dataclasses.replace(cfg.model, init_from=cfg.draft.target)).positions  # (scalings too)
    if longest <= reach:
        return ""
    return (f"note: the draft trains on {longest:,}-token sequences, past the {reach:,} positions its target "
            f"{cfg.draft.target} reaches: the target's keys, values and distribution there are extrapolated "
            f"(longctx generate refuses such prompts without --allow-extrapolation); --train.seq_len {reach} "
            f"trains it where the target is trusted.")


def choose_draft_vocab(model, cfg: Config, rt: Runtime, log=print) -> None:
    """draft.vocab > 0: the draft's vocabulary from its training data's counts (models/draft_vocab.py), in
    a draft run that starts at step 1. The Trainer asks once it knows: a resumed draft's vocabulary is its
    checkpoint's (the ids are a saved buffer), and counting was a pass over the whole store on every start."""
    if cfg.draft.target and cfg.draft.vocab:
        draft = model.draft
        covered = draft.vocab.set_from_counts(token_counts(cfg, rt, log).to(draft.vocab.ids.device))
        log(f"draft: its vocabulary is the {cfg.draft.vocab:,} tokens of {cfg.model.vocab_size:,} its training data "
            f"uses most, {covered:.1%} of the tokens it trains on (draft.vocab)")


def draft_record(cfg: Config, kind: str) -> dict:
    """The manifest's `draft` record: the kind, the target by path, config and identity
    (checkpoint/identity.py: decoding refuses another target of the same shape), the draft's settings."""
    d = cfg.draft
    target = {"path": str(target_path(d.target)), "model": to_dict(cfg)["model"],
              "identity": weights_identity(d.target)}
    return {"kind": kind, "target": target, "layers": d.layers, "vocab": d.vocab, "init": d.init, "block": d.block,
            "loss": d.loss, "kd_temperature": d.kd_temperature,
            "seq_len": cfg.train.seq_len}  # (decoding's default draft window: the length it trained on)


def build_glide_training(cfg: Config, device: torch.device, rt: Runtime, log=print) -> GlideTraining:
    """The frozen target (frozen_target); the draft built on the meta device, parallelised
    (parallel/parallelize.py parallelize_draft), then materialised: each rank fills its own shards of the
    values one process draws from train.seed (or copies from the target with draft.init = target).
    draft.kind = clover: build_clover_training's instead."""
    if cfg.draft.kind == "clover":
        return build_clover_training(cfg, device, rt, log)
    cfg = pin_target(cfg, rt)  # (loaded and recorded: the same step)
    d = cfg.draft
    target, head, path = frozen_target(cfg, device, rt, log)
    # built on the meta device and sharded first, then each rank fills only its shards (as the target): a
    # whole draft on every rank was a transient the size of the model this run trains
    with torch.device("meta"):
        draft = GlideDraft(cfg.model, d.layers, d.vocab)
    record = draft_record(cfg, "glide")
    model = GlideTraining(draft, target, head, loss=d.loss, block=d.block, kd_temperature=d.kd_temperature,
                          record=record)
    parallelize_draft(model, rt.dims, cfg, rt.mesh, device.type)
    materialize(draft, cfg, device)
    draft.init_weights(cfg.train.seed)
    if d.init == "target":
        init_from_target(draft, target)
    log(f"draft: a {d.layers}-layer GliDe draft (reading target layers {draft.target_layers}, block {d.block}, "
        f"loss {d.loss}) against the frozen target {path}")
    return model


# ------------------------------------------------------------------------------------------------
# Clover (draft.kind = clover)


class CloverTraining(GlideTraining):
    """A Clover draft and its frozen target, as one model for the Trainer (GlideTraining's frame:
    parameters, state dict and optimizer are the draft's alone, `draft.*`)."""

    @property
    def layers(self) -> nn.ModuleList:
        """The draft's block (what metrics count as blocks): its Augmenting Block."""
        return nn.ModuleList([self.draft.aug])

    def forward(self, tokens, positions=None, doc_ids=None, labels=None, loss_reduction="mean", real=None,
                scored=None):
        """The draft's logits [b, n, vocab] without labels; with labels its loss (draft.loss)."""
        b, n = tokens.shape
        if positions is None:
            positions = torch.arange(n, device=tokens.device).expand(b, n)
        teacher = self._target(tokens, positions, doc_ids)[0]
        x = self.draft.chain_states(self.head, tokens, positions, teacher, self.block, doc_ids)
        if labels is None:
            return self.draft.logits(self.head, x)
        return self.draft_loss(x, teacher, labels, loss_reduction, scored)


def build_clover_training(cfg: Config, device: torch.device, rt: Runtime, log=print) -> CloverTraining:
    """The frozen target (train/glide.py frozen_target), a Clover draft initialised from train.seed
    (draft.vocab's ids from the data once the run knows it starts: choose_draft_vocab), on one rank."""
    problem = clover_ranks_problem(cfg, rt.world)  # (preflight refused it before launch; a torchrun job: here)
    if problem:
        raise ConfigError(problem)
    cfg = pin_target(cfg, rt)  # (loaded and recorded: the same step)
    d = cfg.draft
    target, head, path = frozen_target(cfg, device, rt, log)
    draft = CloverDraft(cfg.model, d.vocab).to(device)
    draft.init_weights(cfg.train.seed)
    model = CloverTraining(draft, target, head, loss=d.loss, block=d.block, kd_temperature=d.kd_temperature,
                           record=draft_record(cfg, "clover"))
    model.loss_chunk = cfg.memory.loss_chunk
    params = sum(p.numel() for p in draft.parameters())
    log(f"draft: a Clover draft ({params:,} parameters, block {d.block}, loss {d.loss}) against the frozen target "
        f"{path}")
    return model
