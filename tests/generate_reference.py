"""An independent reference of greedy generation (tests/unit/test_generate_fuzz116.py): the model's full
forward over the whole sequence each step (no cache), the step-1 processors written from their documentation
(generate/sampling.py, transformers'), the argmax, and the end rules as generate/engine.py and the CLI
describe them: an EOS ends a row and is not kept; else the token is kept, then a stop string in the row's
text or the limit ends it. The row's text is the whole decoded less the prompt's decoding (transformers'
text-generation pipeline), a stop's line cut where the first stop string begins. Also a Llama-like
tokenizer (pieces, byte fallback, a first-space strip, special tokens) to read texts with."""

from __future__ import annotations

import torch

from longctx.data.tokenizer import ByteTokenizer
from longctx.generate.sampling import GREEDY, Sampling

TIE = 1e-4  # two best logits closer than this: rounding may flip the argmax
BYTES = ByteTokenizer()  # ids < 256 are bytes; 256.. decode to nothing (silent tokens inside a text)


def sentencepiece_like(directory) -> object:
    """A Llama-like tokenizer.json (longctx's HFTokenizer of it): pieces with SentencePiece's '▁', byte
    fallback tokens <0x00>..<0xFF> (a byte run that is no UTF-8 reads U+FFFD), a decoder that strips the
    first space, and special tokens that decode to nothing; 290 ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    from longctx.data.tokenizer import load_tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["\u2581", *map(chr, range(97, 123)), "\u00e9", "\u2581a", "\u2581t", "th"]:
        vocab[piece] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "a"), ("\u2581", "t"), ("t", "h")], unk_token="<unk>",
                             byte_fallback=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    t.add_special_tokens([AddedToken(x, special=True) for x in ("<unk>", "<s>", "</s>")])
    t.save(str(directory / "tokenizer.json"))
    return load_tokenizer(str(directory / "tokenizer.json"))


def text_after(tok, prompt: list[int], tokens: list[int]) -> str:
    """The text `tokens` add after `prompt`: the whole decoded less the prompt's decoding (transformers'
    text-generation pipeline), the tokens alone where the prompt's text is no prefix of the whole."""
    head, whole = tok.decode(prompt), tok.decode([*prompt, *tokens])
    return whole[len(head):] if whole.startswith(head) else tok.decode(tokens)


def _processed(logits: torch.Tensor, prompt, out, sampling: Sampling, eos) -> torch.Tensor:
    """Step 1 of the processors, written from their documentation (fp64)."""
    logits = logits.double().clone()
    p = sampling.repetition_penalty
    if p != 1.0:
        for t in set(prompt) | set(out):
            logits[t] = logits[t] * p if logits[t] < 0 else logits[t] / p
    for t in set(out):
        logits[t] -= sampling.presence_penalty + sampling.frequency_penalty * out.count(t)
    if len(out) < sampling.min_new_tokens:
        for e in eos:
            logits[e] = float("-inf")
    return logits


def reference(model, prompt: list[int], limit: int, sampling: Sampling = GREEDY, eos=(), stops=(), tok=BYTES):
    """(tokens, finish reason) of greedy decoding by full forwards; reason None: the next step was a
    near-tie (the tokens are the sure prefix)."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(limit):
            logits = model(torch.tensor([[*prompt, *out]]))[0, -1]
            top = torch.topk(_processed(logits, prompt, out, sampling, eos), 2)
            if float(top.values[0] - top.values[1]) < TIE:
                return out, None
            token = int(top.indices[0])
            if token in eos:
                return out, "eos"
            out.append(token)
            if any(s in text_after(tok, prompt, out) for s in stops):
                return out, "stop"
    return out, "length"


def expected_line(tok, prompt, tokens, reason, stops) -> dict:
    text = text_after(tok, prompt, tokens)
    if reason == "stop":
        text = text[:min(i for i in (text.find(s) for s in stops) if i >= 0)]
    return {"tokens": tokens, "text": text, "finish_reason": reason}
