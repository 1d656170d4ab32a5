"""`longctx generate`'s flags (the command itself: generate/cli.py)."""

from __future__ import annotations

from .. import threads
from .cli import main
from .context_memory import add_flags as add_context_memory_flags
from .settings import DEFAULT_BATCH, DEFAULT_PREFILL_CHUNK, add_sampling_flags


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="continue prompts with a checkpoint (KV cache, one device or sharded over "
                                         "head x ctx ranks)",
                       allow_abbrev=False)
    p.add_argument("--checkpoint", required=True, metavar="DIR|hf:DIR",
                   help="a longctx checkpoint (a step-* directory, or a checkpoints directory for its latest) or "
                        "hf:DIR, a Hugging Face model directory")
    p.add_argument("--prompt", default=None, help="one prompt (text)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help='prompts, one {"prompt": ...} per line (blank lines skipped)')
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens per prompt at most (default: hf:DIR's generation_config.json, else 256)")
    add_sampling_flags(p)  # (unset flags take hf:DIR's generation_config.json values: generate/settings.py)
    p.add_argument("--min-new-tokens", type=int, default=0,
                   help="no EOS before this many new tokens (transformers' min_new_tokens; default 0)")
    p.add_argument("--compile", action="store_true",
                   help="decode through a compiled static-shape step (models/static_decode.py: torch.compile, CUDA "
                        "graphs on a GPU): the same tokens, less per-token overhead once its graphs are built "
                        "(seconds, once per run); one process; MoE models and a GliDe draft stay eager")
    p.add_argument("--ignore-eos", action="store_true",
                   help="EOS does not end a generation (it is kept as a token, as vLLM's ignore_eos)")
    p.add_argument("--seed", type=int, default=0,
                   help="the run's sampling seed: a prompt without its own \"seed\" field is seeded from it and "
                        "its index in the file, so its tokens never depend on the rest of the batch")
    p.add_argument("--num-samples", type=int, default=1, metavar="N",
                   help="N continuations per prompt, each its own JSON line with a \"sample\" index 0..N-1 "
                        "(default 1)")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="each new token's log-probability, and the N most likely (id, log-probability) per "
                        "position (0: the chosen token's only), under the distribution it was chosen from; one "
                        "per entry of \"tokens\" (a stop string's tokens included, its text cut)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop a prompt's generation when its text contains TEXT (repeatable; the text is cut "
                        "before it; no escapes are read: a newline is bash's $'\\n', not \"\\n\")")
    p.add_argument("--allow-extrapolation", action="store_true",
                   help="run prompts (and continuations) past the positions the model was trained on (a warning, "
                        "not an error; raising --model.max_seq_len alone never makes a model read further)")
    p.add_argument("--chat", action="store_true",
                   help="render each prompt with the tokenizer's chat template, as transformers' "
                        "apply_chat_template(add_generation_prompt=True) does: a --prompts line's \"messages\" "
                        "([{\"role\": ..., \"content\": ...}]), or the prompt as one user message")
    _add_output_flags(p)
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="prompt tokens per prefill call (memory grows with it, never with the prompt squared)")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH,
                   help=f"prompts decoded together (default {DEFAULT_BATCH}; one at a time with --draft or InfLLM)")
    p.add_argument("--nproc", type=int, default=1,
                   help="local processes through torchrun, the cache sharded over their --parallel.head x "
                        "--parallel.ctx layout (default 1; 2D when no degree is given)")
    p.add_argument("--threads", type=int, default=None, help=threads.HELP)
    p.add_argument("--tokenizer", default="",
                   help="'byte' or PATH/tokenizer.json; default: the checkpoint's (its manifest, or hf:DIR's "
                        "tokenizer.json)")
    _add_draft_flags(p)
    add_context_memory_flags(p)  # --context-memory infllm, --infllm-* (generate/context_memory.py)
    p.set_defaults(func=main)


def _add_output_flags(p) -> None:
    """Where the JSON lines go and what their text holds."""
    p.add_argument("--output", default="",
                   help="write the JSON lines here instead of stdout: to FILE.partial, renamed FILE once every line "
                        "is in (an existing FILE is replaced then, said in a note at the start)")
    p.add_argument("--echo", action="store_true",
                   help="each line's text starts with its prompt's (e.g. a draft's training text: the target's "
                        "own continuations, usable as data.corpus)")


def _add_draft_flags(p) -> None:
    """Speculative decoding's flags (--draft and what it takes)."""
    p.add_argument("--draft", default="", metavar="DIR|hf:DIR",
                   help="speculative decoding with this draft model (a smaller model of the same tokenizer and "
                        "vocabulary, its own KV cache): the output is the target's, token for token at "
                        "temperature 0, in distribution when sampling; one prompt at a time")
    p.add_argument("--speculate", type=int, default=4,
                   help="tokens the draft proposes per target pass (default 4); with --speculate-adaptive, the most")
    p.add_argument("--speculate-adaptive", action="store_true",
                   help="with --draft: choose each round's proposals, 1..--speculate, from the proposals kept so far "
                        "(the K of the most expected tokens per unit of cost; the output is the same, at T > 0 a "
                        "seed still gives the same tokens); with --cape, the depth of the tree's chain")
    p.add_argument("--draft-cost", type=float, default=None, metavar="C",
                   help="with --speculate-adaptive: a draft step's cost over one target pass (default: the ratio "
                        "of the two models' forward FLOPs per token)")
    p.add_argument("--verify-cost", type=float, default=None, metavar="W",
                   help="with --speculate-adaptive: a verification's cost per token past the first, in target passes "
                        "(default 0: a GPU's few-token verification costs one step; on a CPU it grows, e.g. 0.17). "
                        "Where no K pays, a round is a plain decoding step (K = 0)")
    p.add_argument("--confidence-stop", type=float, default=0.0, metavar="P",
                   help="with --draft: end a round's proposals after one the draft gives a probability below P "
                        "(fewer draft steps where it hesitates; 0 = always --speculate)")
    p.add_argument("--draft-window", type=int, default=None, metavar="N",
                   help="with a GliDe --draft: its own pass over the prompt covers the last N tokens only (its "
                        "cross-attention reads the target's cache of all of them); 0 = the whole prompt; default: "
                        "the sequence length the draft was trained on")
    p.add_argument("--cape", action="store_true",
                   help="with --draft: add alternatives where the draft is unsure (CaPE) and verify them as a tree "
                        "(greedy; one process or sharded)")
    p.add_argument("--cape-table", default="0.3:3,0.6:2,0.9:1,1:0", metavar="BOUND:N,...",
                   help="CaPE's alternatives by the draft's confidence: up to each bound, N of them; the bounds "
                        "ascend to 1 (default 0.3:3,0.6:2,0.9:1,1:0)")
