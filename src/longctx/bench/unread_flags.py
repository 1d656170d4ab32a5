"""The flags of a `longctx bench` command that the run it was asked for does not read, refused before any work.

Each of these commands measures one of several things, and each thing reads its own flags: `bench generate
--device cuda` without --compile timed the transformers comparison on the CPU and printed its figures (rc 0),
`bench moe --cluster 2x4 --dim 1024` ran the preset's width, `bench memory --doc-len 512` (read by --max-seq's
probes only) measured the tables with --docs documents, `bench decode --prompts F --lengths 8K` decoded F's
prompts at their own lengths. A flag left at its default is no mistake.
"""

from __future__ import annotations

import argparse

# per command: (flags that only one kind of run reads, a test of the parsed flags true when the asked run is not
# that kind, what to say)
_RULES = {
    "generate": [
        (("preset", "device"), lambda a: a.compile == "false",
         "read only with --compile true|both (the compiled decode of a preset model); without it bench generate "
         "times a random Llama against transformers on the CPU (its shape: --dim, --layers, ...)"),
        (("dim", "layers", "heads", "kv_heads", "ffn_dim", "vocab", "memory_lengths", "sharded", "sharded_lengths"),
         lambda a: a.compile != "false",
         "shape or extend the comparison against transformers, which --compile does not run (it decodes the "
         "--preset model: pick its shape there)"),
    ],
    "moe": [
        (("model", "layers", "tokens", "hardware", "inter_ratio", "slowdown", "link_scale", "chunks",
          "no_emulation", "zipf", "replicas"), lambda a: not a.cluster,
         "read only with --cluster NODESxRANKS (the emulated-cluster benchmark)"),
        (("dim", "experts", "top_k", "expert_dim", "seq_len", "memory_seq_len", "routing", "skew_share",
          "threads", "seed", "device", "profile", "grouped", "malloc"), lambda a: bool(a.cluster),
         "not read by --cluster, whose ranks run the --model preset's MoE layers on --tokens tokens each"),
        (("memory_seq_len", "grouped", "malloc", "threads"), lambda a: not a.cluster and a.device == "cuda",
         "read only on the CPU (--device cpu); the GPU run times the kernel, the loop and the dense layer itself"),
        (("profile",), lambda a: not a.cluster and a.device == "cpu",
         "profiles the layer's kernels on a GPU only (--device cuda)"),
    ],
    "memory": [
        (("budget", "doc_len", "max_seq_step", "max_seq_hi", "malloc_mmap_threshold"),
         lambda a: not a.max_seq and not a.probe,
         "read only by --max-seq's search for the longest sequence (the per-length tables pack --docs documents "
         "in each sequence)"),
        (("attention_offload",), lambda a: not a.attention_chunk,
         "keeps the attention core's chunks in host memory, so it needs --attention-chunk N (as "
         "memory.attention_offload needs memory.attention_chunk)"),
    ],
    "decode": [
        (("cape_table",), lambda a: a.cape == "false", "read only with --cape true|both (CaPE's tree)"),
        (("lengths", "samples", "data"), lambda a: bool(a.prompts),
         "choose prompts from a corpus, which --prompts replaces (its lines are the prompts)"),
    ],
    "attention": [
        (("seq_balance", "causal_reference", "storage_tracker"), lambda a: a.docs is None,
         "read only with --docs (packed documents)"),
    ],
}


def unread_flags(command: str, module, args) -> list[str]:
    """Problems (arg_checks' sentences) for each set of `command`'s flags given where its run does not read them;
    `module`: the command's module (its add_arguments declares the defaults)."""
    rules = _RULES.get(command, ())
    if not rules:
        return []
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    out = []
    for names, unread, why in rules:
        if not unread(args):
            continue
        given = [_said(name, getattr(args, name)) for name in names
                 if getattr(args, name, None) != parser.get_default(name)]
        if given:
            out.append(f"{', '.join(given)}: {why}; drop {'it' if len(given) == 1 else 'them'}")
    return out


def _said(name: str, value) -> str:
    flag = name.replace("_", "-")
    if isinstance(value, bool):  # (--profile; --no-causal-reference)
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag} {value!r}" if value == "" else f"--{flag} {value}"
