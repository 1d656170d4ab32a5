"""`longctx generate`'s prompts: read (--prompt, or a --prompts JSONL file of "prompt" or, with --chat,
"messages" lines, each with an optional "id" and "seed"), the tokenizer that reads them (--tokenizer,
else the checkpoint's), rendered by the chat template where asked (data/chat_template.py), and turned into
token ids checked against the model: its vocabulary, and the positions it reaches
(config/positions.py), which also cap each prompt's new tokens. Every error is said before any weight
is read."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import ConfigError
from .loading import window_ways_out
from .settings import check_prompt_keys


def read_prompts(args) -> list[dict]:
    if (args.prompt is None) == (args.prompts is None):
        raise ConfigError("give the prompt as --prompt TEXT or --prompts FILE.jsonl (one of them).")
    if args.prompt is not None:
        return [{"text": args.prompt}]
    path = Path(args.prompts)
    _check_prompts_file(path, getattr(args, "nproc", 1))
    prompts, lines = [], {}
    # JSON Lines are separated by "\n" only: str.splitlines() also splits at U+2028, U+2029, U+0085 and
    # \x1c-\x1e, which JSON strings may hold unescaped (json.dumps(ensure_ascii=False) writes them so), and a
    # valid line holding one was refused as "not JSON" (_utf8_text has turned \r\n into \n)
    for n, line in enumerate(_utf8_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=_one_value_per_key)
        except _RepeatedKey as e:
            raise ConfigError(f"--prompts {path} line {n} gives the key {e} twice in one object; a JSON reader keeps "
                              f"one of the two (the last) without a word, so the line may not say what was meant. "
                              f"Give each key once.") from None
        except ValueError as e:
            raise ConfigError(f"--prompts {path} line {n} is not JSON ({e}); each line must be an object "
                              f"like {{\"prompt\": \"...\"}}.") from None
        if not isinstance(row, dict) or not (isinstance(row.get("prompt"), str) or "messages" in row):
            raise ConfigError(f"--prompts {path} line {n} has no \"prompt\" string; each line must be an object "
                              f"like {{\"prompt\": \"...\"}} (or, with --chat, {{\"messages\": [...]}}).")
        check_prompt_keys(row, f"--prompts {path} line {n}")
        _check_template_keys(row, f"--prompts {path} line {n}")
        if "messages" in row:
            _check_chat_row(row, args, f"--prompts {path} line {n}")
        if "seed" in row and (type(row["seed"]) is not int or not 0 <= row["seed"] < 2**63):
            raise ConfigError(f"--prompts {path} line {n}: \"seed\" must be an integer in [0, 2^63), got "
                              f"{row['seed']!r}.")
        # ("line": where the prompt is, for the errors said of it after the file is read: prompt_name)
        prompts.append({"text": row.get("prompt", ""), "line": n, **({"id": row["id"]} if "id" in row else {}),
                        **({"messages": row["messages"]} if "messages" in row else {})})
        prompts[-1].update({"seed": row["seed"]} if "seed" in row else {})
        # (an id by its JSON: 1 and "1" are two ids, as a reader of the output tells them apart; 1 and 1.0 one)
        if "id" in row:
            if _not_finite(row["id"]):  # (the output would write it as null: the id lost)
                key = json.dumps(row["id"], sort_keys=True, ensure_ascii=False)
                raise ConfigError(f"--prompts {path} line {n}: its \"id\" holds {key}, which is not JSON (NaN or "
                                  f"an infinite number) and no output line could carry; give it as a string or a "
                                  f"finite number.")
            key = json.dumps(_one_number_type(row["id"]), sort_keys=True, ensure_ascii=False)
            if bad := not_text(key):  # (the output line that carries it could not be written, after the generation)
                raise ConfigError(f"--prompts {path} line {n}: its \"id\" {bad}; give it as UTF-8 text.")
            lines.setdefault(key, []).append(n)
    if not prompts:
        raise ConfigError(f"--prompts {path} holds no prompt.")
    _check_unique_ids(path, lines)
    return prompts


class _RepeatedKey(ValueError):
    """A JSON object of a --prompts line gives one key twice (its repr, the message)."""


def _one_value_per_key(pairs: list) -> dict:
    """json.loads' object_pairs_hook: the object, refusing a key given twice ({"prompt": "a", "prompt": "b"}, which
    json.loads reads as its last value, the other prompt dropped silently), at any depth of the line."""
    row = {}
    for key, value in pairs:
        if key in row:
            raise _RepeatedKey(json.dumps(key, ensure_ascii=False))
        row[key] = value
    return row


def prompt_name(prompts: list[dict], i: int) -> str:
    """How errors and notes name prompt `i` of `prompts`: "the prompt" when it is the only one, else its number
    and, read from a --prompts file, its line there (blank lines are skipped, so the two may differ: the number
    alone sent a reader to the wrong line)."""
    if len(prompts) == 1:
        return "the prompt"
    line = prompts[i].get("line")
    return f"prompt {i + 1}" + (f" (--prompts line {line})" if line is not None else "")


def _check_prompts_file(path: Path, nproc: int) -> None:
    """--prompts names something to read: a file, or, on one process, a pipe (`--prompts /dev/stdin`, `<(...)`),
    which is read once (ranks each read the file: a pipe would be empty for all but the first)."""
    if path.is_file():
        return
    if not path.exists():
        raise ConfigError(f"--prompts {path}: no such file; pass a .jsonl file with one {{\"prompt\": ...}} per line.")
    if path.is_dir():
        raise ConfigError(f"--prompts {path} is a directory; pass a .jsonl file with one {{\"prompt\": ...}} per line.")
    if nproc > 1:
        raise ConfigError(f"--prompts {path} is not a regular file (a pipe?): with --nproc {nproc} every rank reads "
                          f"the prompts, and a pipe gives them once. Write them to a file and pass its path.")


def _not_finite(value) -> bool:
    """Whether a JSON value holds a NaN or infinite number at any depth (Python's json reads NaN, Infinity and
    1e999 as floats; strict JSON has none and generate's output writes them as null)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_not_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_not_finite(v) for v in value)
    return False


def _one_number_type(value):
    """An id's JSON value with each integral float as its int (1.0, 1e2, -0.0 -> 1, 100, 0), at any depth: JSON
    has one number type, and a reader of the output (Python's dict, JavaScript) takes 1 and 1.0 as one id, so
    they are one id to the repeat check too (strings and booleans are left as they are)."""
    if isinstance(value, float) and value.is_integer():  # (finite: _not_finite refused the others first)
        return int(value)
    if isinstance(value, dict):
        return {k: _one_number_type(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_one_number_type(v) for v in value]
    return value


def _utf8_text(path: Path) -> str:
    """The --prompts file's text, its line ends "\\n" (as read_text's newline mode makes them); bytes that are not
    UTF-8 are one error naming their line (a UnicodeDecodeError traceback before)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].decode("utf-8").replace("\r\n", "\n").replace("\r", "\n").count("\n") + 1
        raise ConfigError(f"--prompts {path} line {line} is not UTF-8 text (byte 0x{data[e.start]:02x} at byte "
                          f"{e.start} of the file); save the file as UTF-8.") from None
    # (a UTF-8 BOM, which Windows editors and PowerShell write, is no character of the first line: JSON's RFC
    # 8259 lets a parser ignore it, and the data builder drops it too; json.loads refused the line)
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def _check_unique_ids(path: Path, lines: dict) -> None:
    """Each "id" of a --prompts file (`lines`: an id's JSON -> the lines that hold it) on one line only: the
    output lines carry it to say which prompt each continues, which two prompts of one id would leave
    ambiguous (they may be in any order to whoever joins them back)."""
    twice = {key: at for key, at in lines.items() if len(at) > 1}
    if twice:
        said = "; ".join(f"id {key} on lines {', '.join(map(str, at))}" for key, at in list(twice.items())[:5])
        more = f" (and {len(twice) - 5} more)" if len(twice) > 5 else ""
        raise ConfigError(f"--prompts {path} gives one id to several prompts: {said}{more}. The output lines carry "
                          f"the id to say which prompt each continues; give each line its own \"id\" (or none).")


# what another API feeds a chat template beside the messages (a top-level system prompt: Alpaca-style and ShareGPT
# files; tools: OpenAI's API and transformers' apply_chat_template; documents: transformers'; vLLM's per-request
# template arguments): longctx renders "messages" alone, so such a line was answered without its system prompt or
# its tools, without a word. A line's other keys (its metadata) are left alone.
SYSTEM_KEYS = ("system", "system_prompt")
TEMPLATE_KEYS = ("tools", "documents", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")


def _check_template_keys(row: dict, where: str) -> None:
    """A --prompts line (`row`, at `where`) holding a chat template's input beside its messages (SYSTEM_KEYS,
    TEMPLATE_KEYS), which nothing would read."""
    system = [k for k in SYSTEM_KEYS if k in row]
    if system:
        raise ConfigError(f"{where} has {system[0]!r}, which longctx does not read: a system prompt is a message. "
                          f"Give the line as {{\"messages\": [{{\"role\": \"system\", \"content\": ...}}, "
                          f"{{\"role\": \"user\", \"content\": ...}}]}}, the system prompt as the first of "
                          f"\"messages\", rendered by the tokenizer's chat template (--chat).")
    other = [k for k in TEMPLATE_KEYS if k in row]
    if other:
        raise ConfigError(f"{where} has {other[0]!r}, which longctx does not read: it renders the chat template from "
                          f"the messages alone (tools and documents none, the generation prompt added), so the "
                          f"line would be answered without it. Drop it, or write what it says into the messages.")


def _check_chat_row(row: dict, args, where: str) -> None:
    from ..data.chat_template import check_messages

    if "prompt" in row:
        raise ConfigError(f"{where} has both \"prompt\" and \"messages\"; give one of them.")
    if not getattr(args, "chat", False):
        raise ConfigError(f"{where} has \"messages\": a conversation is turned into a prompt by the tokenizer's chat "
                          f"template; pass --chat.")
    check_messages(row["messages"], where)


def tokenizer_spec(args, cfg) -> str:
    """--tokenizer, else the checkpoint's; an error when neither names one, or when --tokenizer is not the
    one the checkpoint's weights were trained with (config/tokenizer.py checkpoint_tokenizer)."""
    from ..config.tokenizer import checkpoint_tokenizer, model_tokenizer

    spec = checkpoint_tokenizer(cfg.model.init_from, args.tokenizer, model_tokenizer(cfg.model.init_from))
    if spec is None:
        where = ("its directory has no tokenizer.json" if args.checkpoint.startswith("hf:") else
                 "its manifest records no tokenizer")
        raise ConfigError(f"--checkpoint {args.checkpoint}: {where}, so the prompt cannot be turned into the model's "
                          f"token ids. Pass --tokenizer PATH/tokenizer.json (the one the model was trained with), or "
                          f"--tokenizer byte for a model trained on bytes.")
    return spec


def tokenize_prompts(args, prompts: list[dict], spec: str, m, reach=None):
    """(the tokenizer, each prompt's limit of new tokens, notes): the prompts rendered by the chat
    template with --chat, then their token ids (into each one's "ids") checked against the model
    config `m` and the positions it reaches (`reach`: another, e.g. a context memory's
    (generate/context_memory.py); default the model's, config/positions.py model_reach)."""
    from ..config.positions import model_reach
    from ..config.tokenizer import unchecked_tokenizer
    from ..data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec)
    check_tokenizer_vocab(tokenizer, spec, m, f"--checkpoint {args.checkpoint}")
    if args.chat:
        apply_chat(prompts, spec)
    limits, notes = encode_prompts(args, prompts, tokenizer, spec, m, reach or model_reach(m))
    note = unchecked_tokenizer(args.checkpoint, args.tokenizer)
    return tokenizer, limits, [note, *notes] if note else notes


def check_tokenizer_vocab(tokenizer, spec: str, m, given_as: str = "") -> None:
    """The tokenizer (`spec`) of prompts to the model `m` (its ModelConfig, whose weights are m.init_from, given on
    the command line as `given_as`: default "--checkpoint INIT_FROM") writes no id past its vocabulary: its ids past
    the embedding are not the model's, whatever the prompt (generate and bench decode). The words are eval's
    (config/tokenizer.py vocab_refusal): the weights' own tokenizer past their vocabulary is no --tokenizer to pass."""
    from ..config.tokenizer import vocab_refusal

    if tokenizer.vocab_size > m.vocab_size:
        raise ConfigError(vocab_refusal(m.init_from, given_as or f"--checkpoint {m.init_from}", spec,
                                        tokenizer.vocab_size, m.vocab_size))


def check_prompt_ids(which: str, ids: list[int], spec: str, m) -> None:
    """A prompt's token ids (`which`: the prompt, said) within the vocabulary of the model `m`."""
    if max(ids) >= m.vocab_size:
        raise ConfigError(f"{which} has token id {max(ids)} but the model's vocabulary is {m.vocab_size}: the "
                          f"tokenizer {spec} is not the model's; pass the one it was trained with (--tokenizer).")


def apply_chat(prompts: list[dict], spec: str) -> str:
    """--chat: each prompt's text becomes its conversation (its "messages", or the prompt as one user
    message) rendered by the tokenizer's chat template; returns where the template came from."""
    from ..data.chat_template import load_chat_template

    template = load_chat_template(spec)
    for i, p in enumerate(prompts):
        try:
            p["text"] = template.render(p.get("messages") or [{"role": "user", "content": p["text"]}])
        except ConfigError as e:  # (which of a file's conversations: the template's words alone named none)
            if len(prompts) == 1:
                raise
            raise ConfigError(f"{prompt_name(prompts, i)}: {e}") from None
        p["chat"] = True
    return template.source


def with_turn_end(eos: list[int], spec: str, tokenizer) -> tuple[list[int], str]:
    """--chat's stop ids: the model's EOS ids `eos` and the tokenizer's eos_token (tokenizer_config.json's, the
    `eos_token` its chat template reads: transformers' tokenizer.eos_token), with the note saying it was added ('':
    it was among them). An instruct tokenizer's eos_token is the token that ends an assistant's turn (<|im_end|>,
    <|eot_id|>), which the model's generation_config.json or config.json may leave out (none there, or a base
    model's end of text only): the row then ran past the answer into a next turn the model made up. vLLM stops
    at the tokenizer's eos_token too."""
    from ..data.chat_template import load_chat_template, turn_end_id

    template = load_chat_template(spec)
    turn = turn_end_id(template, tokenizer)
    if turn is None or turn in eos:
        return eos, ""
    return [*eos, turn], (f"--chat: the tokenizer's eos_token {template.special_tokens['eos_token']} (id {turn}), "
                          f"which ends the chat template's turns, also ends a generation (the model's EOS ids {eos} "
                          f"leave it out)")


def encode_prompts(args, prompts: list[dict], tokenizer, spec: str, m, reach) -> tuple[list[int], list[str]]:
    """Each prompt's token ids (into its "ids"), checked against the model; returns each prompt's limit of
    new tokens (--max-new-tokens within the positions the model reaches) and the notes on the ones cut
    short. A prompt past that reach is refused, or with --allow-extrapolation said once."""
    from ..config.tokenizer import model_text_prefix
    from ..data.tokenizer import HFTokenizer

    # with the special tokens the model's training documents began with (e.g. BOS): for hf:DIR its Hugging
    # Face tokenizer's own, as transformers adds them; a longctx checkpoint's recorded text_prefix
    hf = args.checkpoint.startswith("hf:") and isinstance(tokenizer, HFTokenizer)
    prefix = [] if hf else model_text_prefix(args.checkpoint, tokenizer)
    limits, notes, past = [], [], []
    for i, p in enumerate(prompts):
        which = prompt_name(prompts, i)
        if not p["text"]:  # (--prompt '' said "the prompt is empty", of no flag)
            given = " (--prompt)" if len(prompts) == 1 and p.get("line") is None else ""
            raise ConfigError(f"{which}{given} is empty; give it some text to continue.")
        bad = not_text(p["text"])
        if bad:
            raise ConfigError(f"{which} {bad}; give it as UTF-8 text.")
        # (a rendered chat holds its special tokens already: none added, as transformers tokenizes it)
        add = not p.get("chat")
        if add and hf:
            ids = tokenizer.encode(p["text"], add_special_tokens=True)
        else:
            ids = [*(prefix if add else []), *tokenizer.encode(p["text"])]
        p["ids"] = [int(t) for t in ids]
        if not p["ids"]:
            raise ConfigError(f"{which} has no tokens after tokenization; give it some text to continue.")
        check_prompt_ids(which, p["ids"], spec, m)
        if len(p["ids"]) > reach.positions:
            if not args.allow_extrapolation:
                raise ConfigError(_past_reach(which, len(p["ids"]), reach, args.max_new_tokens, m.init_from))
            past.append(which)
        room = reach.positions - len(p["ids"])
        if room < args.max_new_tokens and not args.allow_extrapolation:
            notes.append(f"{which}: {len(p['ids']):,} tokens leave room for {room} new ones within the "
                         f"{reach.positions:,} positions the model reaches (not {args.max_new_tokens}); " +
                         (window_ways_out(reach.window, m.init_from) if reach.window else  # (no --allow-extrapolation)
                          "extend it with RoPE scaling to go further, or pass --allow-extrapolation"))
            limits.append(room)
        else:
            limits.append(args.max_new_tokens)
    if past:
        notes.append(f"{', '.join(past)} run past the {reach.positions:,} positions the model reaches "
                     f"({reach.said()}), as --allow-extrapolation asks: expect degraded text there")
    return limits, notes


def not_text(text: str) -> str | None:
    """What makes `text` no text (None: it is): a lone surrogate (U+D800-U+DFFF), which no tokenizer reads (a
    traceback from its encode) and no decoded text holds. It comes from bytes that are not UTF-8 on the command
    line (Python keeps them as U+DC80-U+DCFF) or a JSON escape such as \\ud800 without its pair."""
    try:
        text.encode("utf-8")  # (in C: a prompt may be megabytes; strict UTF-8 refuses exactly the surrogates)
    except UnicodeEncodeError as e:
        return (f"holds U+{ord(text[e.start]):04X} at character {e.start}, a lone surrogate, not a character (bytes "
                f"that are not UTF-8 on the command line, or a JSON escape such as \\ud800 without its pair)")
    return None


def _past_reach(which: str, n: int, reach, new_tokens: int, init_from: str = "") -> str:
    if reach.window:  # (no RoPE scaling moves a window, and past it check_window refuses --allow-extrapolation)
        return (f"{which} has {n:,} tokens, past the {reach.positions:,} positions the model reaches ({reach.said()}). "
                f"Use a shorter prompt; or {window_ways_out(reach.window, init_from)}.")
    return (f"{which} has {n:,} tokens, past the {reach.positions:,} positions the model reaches ({reach.said()}). "
            f"Raising --model.max_seq_len does not teach a model new positions. Use a shorter prompt; or extend it "
            f"with RoPE scaling, e.g. {reach.extension_flags(n + new_tokens)}; or pass --allow-extrapolation to run "
            f"it anyway.")
