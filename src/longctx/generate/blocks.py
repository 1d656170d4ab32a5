"""Plain decoding through the compiled step in blocks: up to BLOCK tokens per row per round, with no host
read between them; the decode loop (generate/loop.py) reads a block's tokens once and takes them one by one.

Why: a small model's compiled decode step is a few hundred microseconds of device work, but a host read
per token (the loop's `tolist` for EOS, stop strings and streaming; sampling's finiteness check; a
blocking copy of the step's positions) makes the host wait for the device every token, so the device then
waits for the host's Python and launches. In a block:
- each step's model call, LM head and choice (greedy argmax, or the inverse CDF of the row's uniform) are
  one compiled graph (`next_token`; a CUDA graph on a GPU); its only input from the host is the positions
  (one non-blocking copy, models/cached_attention.py to_device), and its token feeds the next step on the
  device;
- sampling's uniforms for the whole block come from each row's host generator at once (the same stream,
  one float64 per step, as one draw per step gives), and a row whose distribution is not finite is chosen
  as UNCHOSEN and raised at the block's read (sampling.check_chosen), not checked per token;
- with penalties or min_new_tokens (sampling.Processors: state that follows every token) the model call
  alone is compiled (models/static_decode.py) and the processing runs eagerly per step, on the device.
The tokens are those of one step per round: a row takes its block's tokens in order and ends where it
ended (EOS, a stop, its limit); the tokens after that were computed and are ignored, as a finished row's
are in any round. A block never runs past the longest limit, so the cache's room is as before. What
changes: streaming (`on_token`) sees a block's tokens together, and a row that ends inside a block has
the block's time in its decode time. The eager path decodes one token per round (the reference)."""

from __future__ import annotations

import torch

from ..models.static_decode import CompiledStep, static_hidden_states
from .contracts import Cache, Round
from .sampling import Processors, Sampling, greedy_choice, inverse_cdf, process

BLOCK = 16  # decode steps between host reads: 1/16 of a read per token, at most 15 steps past a row's end


def next_token(model, tokens, positions, k_cache, v_cache, uniforms, sampling: Sampling, keep: bool):
    """One plain decode step with static shapes, compiled whole: each row's last token [b] at its
    `positions` [b, 1] (its slot too) -> (the next tokens [b] long, the processed logits [b, vocab] fp32
    when `keep`, else None). `uniforms` [b] float64 (sampling; None greedy)."""
    among = torch.ones(1, 1, dtype=torch.bool, device=tokens.device)
    tokens = _embeddable(tokens)
    hidden = static_hidden_states(model, tokens[:, None], positions, positions, positions[:, 0], among,
                                  k_cache, v_cache, True)
    processed = process(model.logits(hidden[:, 0]), sampling)
    chosen = greedy_choice(processed) if sampling.greedy else inverse_cdf(processed, uniforms)
    return chosen, (processed if keep else None)


def _embeddable(tokens: torch.Tensor) -> torch.Tensor:
    """Tokens fed to the next step: an UNCHOSEN row's (-1: no distribution) as token 0. Its error is raised
    at the block's read (or the row had ended: its tokens are ignored); fed as is, the embedding's lookup
    failed first (a GPU's device-side assert, which leaves the process's CUDA context unusable)."""
    return tokens.clamp(min=0)


def block_size(cache: Cache, steps_left: int) -> int:
    """Steps the next block may take: up to BLOCK and the steps left, each a call the compiled step
    handles (the cache's spare last slot stays free); 0: none (decode one step the usual way)."""
    step = getattr(cache, "fast", None)
    if not isinstance(step, CompiledStep):
        return 0
    room = cache.k.shape[3] - 1 - int(cache.lengths.max())  # (each step appends one token to every row)
    return max(0, min(BLOCK, steps_left, room))


def block_uniforms(generators, steps: int, device) -> torch.Tensor:
    """[steps, rows] float64: each row's next `steps` uniforms from its host generator (one draw of
    `steps` is the stream of `steps` draws of one), step-major so that a step's row is contiguous."""
    values = torch.stack([torch.rand((steps,), dtype=torch.float64, generator=g) for g in generators], dim=1)
    return values if torch.device(device).type == "cpu" else values.pin_memory().to(device, non_blocking=True)


def decode_block(model, cache: Cache, chosen: torch.Tensor, steps: int, sampling: Sampling, generators,
                 processors: Processors | None, keep: bool) -> Round:
    """`steps` decode steps from each row's last token `chosen` [rows], no host read among them: the
    Round of their tokens [rows, steps] (and processed logits [rows, steps, vocab] when `keep`), the
    processors' state following every token (`followed`)."""
    rows, device = chosen.shape[0], chosen.device
    tokens = torch.empty(steps, rows, dtype=torch.long, device=device)  # step-major: step j's row contiguous
    kept = torch.empty(steps, rows, model.cfg.vocab_size, device=device) if keep else None
    uniforms = None if sampling.greedy else block_uniforms(generators, steps, device)
    for j in range(steps):
        u = None if uniforms is None else uniforms[j]
        if processors is None:
            token, processed = _fused_step(model, cache, chosen, u, sampling, keep)
        else:
            # (the compiled forward, cache.fast)
            logits = model(_embeddable(chosen)[:, None], cache=cache)[:, -1].float()
            processed = process(logits, sampling, processors)
            token = greedy_choice(processed) if sampling.greedy else inverse_cdf(processed, u)
            processors.chosen(token)
        tokens[j] = token  # (a copy: a CUDA graph's output is overwritten by its next replay)
        if keep:
            kept[j] = processed
        chosen = tokens[j]
    return Round(tokens.T, None if kept is None else kept.transpose(0, 1), followed=processors is not None)


def _fused_step(model, cache: Cache, chosen: torch.Tensor, u, sampling: Sampling, keep: bool):
    """One step through `next_token`, compiled by the cache's step: the cache's bookkeeping as the model's
    cached forward keeps it (begin: the positions; end: the rows hold the token)."""
    step = cache.begin(1, chosen.device)
    ok = False
    try:
        out = cache.fast.launch(next_token, chosen.device, 1, model, chosen, step.positions, cache.k, cache.v, u,
                                sampling, keep)
        ok = True
    finally:
        cache.end(ok)
    return out

