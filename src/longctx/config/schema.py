"""The run configuration's shape: one dataclass per section, every knob with its default, help
text and choices (the model presets: presets.py).

Every knob a user can turn lives here, under the same name in TOML, on the command line, in code
and in the docs. `model.preset` is special: it fills every model field the user did not set
explicitly, so `--model.preset llama3-8b --model.layers 2` is the 8B shape with two layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .layer_lists import moe_layer_ids
from .presets import MODEL_PRESETS

RECOMPUTE_POLICIES = ("none", "full", "selective")  # memory.recompute
MODEL_STATE_TIERS = ("device", "host_optimizer", "host")  # memory.model_states


def _opt(default, help: str, choices: Sequence[Any] | None = None, key: str | None = None,
         words: Sequence[str] = ()):
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if words:
        meta["words"] = tuple(words)  # strings a number field also accepts (e.g. "auto")
    if key is not None:
        meta["key"] = key  # the config/CLI name when it is not a valid Python identifier
    return field(default=default, metadata=meta)


MOE_ROUTERS = ("softmax", "switch", "sigmoid", "sinkhorn", "dts")  # model.moe.router
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
MOE_AUX_LOSS_SCOPES = ("per_layer_mean", "per_layer_sum", "pooled")  # model.moe.aux_loss_scope


@dataclass
class ModelConfig:
    preset: str = _opt("debug", "named shape that fills every model field not set explicitly; 'hf' = the shapes "
                                "of model.init_from's config.json (set by init_from, not by hand)",
                       choices=tuple(MODEL_PRESETS) + ("hf",))
    family: str = _opt("llama", "architecture family (what export writes): llama, mistral, qwen2, qwen3, and the "
                                "Mixture-of-Experts ones mixtral, qwen2_moe, qwen3_moe, olmoe",
                       choices=("llama", "mistral", "qwen2", "qwen3") + MOE_FAMILIES)
    dim: int = _opt(128, "hidden size")
    layers: int = _opt(4, "number of transformer blocks")
    heads: int = _opt(4, "attention (query) heads")
    kv_heads: int = _opt(2, "key/value heads (grouped-query attention); must divide heads")
    head_dim: int = _opt(0, "per-head size; 0 means dim // heads")
    ffn_dim: int = _opt(384, "SwiGLU hidden size")
    vocab_size: int = _opt(320, "embedding rows; must cover the tokenizer's vocabulary")
    norm_eps: float = _opt(1e-5, "RMSNorm epsilon")
    qkv_bias: bool = _opt(False, "bias on the q, k, v projections (Qwen2, or attention_bias=true)")
    out_bias: bool = _opt(False, "bias on the attention output projection (attention_bias=true outside Qwen2)")
    qk_norm: bool = _opt(False, "RMSNorm on q and k before RoPE (Qwen3, Qwen3-MoE, OLMoE)")
    qk_norm_span: str = _opt("head", "what the q/k RMSNorm normalises: head (each head's vector: Qwen3, Qwen3-MoE) "
                                     "or all (the whole q or k projection, every head together: OLMoE)",
                             choices=("head", "all"))
    rope_theta: float = _opt(10000.0, "RoPE base frequency")
    rope_scaling: str = _opt("none", "RoPE frequency scaling: none, linear (positions / factor), llama3 (Llama 3.1 "
                                     "bands) or yarn (NTK-by-parts with attention scaling)",
                             choices=("none", "linear", "llama3", "yarn"))
    rope_factor: float = _opt(8.0, "rope scaling factor (linear, llama3, yarn)")
    rope_low_freq_factor: float = _opt(1.0, "llama3 rope scaling: low_freq_factor")
    rope_high_freq_factor: float = _opt(4.0, "llama3 rope scaling: high_freq_factor")
    rope_original_max_len: int = _opt(8192, "llama3 and yarn rope scaling: original_max_position_embeddings")
    rope_beta_fast: float = _opt(32.0, "yarn rope scaling: beta_fast (rotations where extrapolation ends)")
    rope_beta_slow: float = _opt(1.0, "yarn rope scaling: beta_slow (rotations where interpolation starts)")
    rope_mscale: float = _opt(0.0, "yarn rope scaling: mscale (0 = unset)")
    rope_mscale_all_dim: float = _opt(0.0, "yarn rope scaling: mscale_all_dim (0 = unset)")
    rope_attention_factor: float = _opt(0.0, "yarn rope scaling: attention_factor on cos/sin; 0 = derived from "
                                        "factor (0.1 ln(factor) + 1)")
    rope_truncate: bool = _opt(True, "yarn rope scaling: round the correction range to whole dimensions")
    rope_ms_poe: bool = _opt(False, "Ms-PoE (multi-scale positional encoding, generate and eval only): each kv head's "
                                    "RoPE positions divided by its own ratio in [rope_ms_poe_min, rope_ms_poe_max], "
                                    "for better recall of the middle of a prompt within the trained window "
                                    "(models/ms_poe.py); longctx train refuses it")
    rope_ms_poe_min: float = _opt(1.2, "Ms-PoE: the ratio of the most position-aware kv head (>= 1)")
    rope_ms_poe_max: float = _opt(1.8, "Ms-PoE: the ratio of the least position-aware kv head (>= rope_ms_poe_min)")
    rope_ms_poe_order: str = _opt("attention", "Ms-PoE: how kv heads are ranked for their ratios: attention (by the "
                                               "share of outlier attention weights on a fixed probe, measured once at "
                                               "load) or index (ratios rise with the kv head's index)",
                                  choices=("attention", "index"))
    rope_ms_poe_skip_layers: int = _opt(2, "Ms-PoE: the first layers that keep plain RoPE (the paper keeps 2)")
    tie_embeddings: bool = _opt(False, "share the input embedding with the LM head")
    padding_idx: int = _opt(-1, "token id whose embedding row gets no gradient (torch's nn.Embedding padding_idx; hf: "
                                "imports set config.json's pad_token_id, as transformers' embedding does); -1 = none")
    max_seq_len: int = _opt(131072, "longest sequence the model is meant for (recorded in exports)")
    init_std: float = _opt(0.02, "std of the normal initialisation")
    init_from: str = _opt("", "start from weights: '' (random), 'hf:DIR' (a local Hugging Face directory of Llama, "
                              "Mistral, Qwen2, Qwen3, or the MoE Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; its "
                              "config.json becomes this [model]) or DIR (a longctx checkpoint, "
                              "or a checkpoints directory for its latest: the weights only, a new run); extension keys "
                              "such as rope_theta or rope_scaling apply on top")

    # [model.moe]: Mixture-of-Experts feed-forwards (models/moe.py); moe.experts = 0 is a dense model
    moe_experts: int = _opt(0, "routed experts per MoE layer; 0 = a dense model (every layer a SwiGLU of ffn_dim)",
                            key="moe.experts")
    moe_top_k: int = _opt(2, "experts each token is routed to", key="moe.top_k")
    moe_router: str = _opt("softmax", "routing function: softmax (top-k of a softmax: GShard, Mixtral, Qwen), switch "
                                      "(top-1, the Switch Transformer), sigmoid (sigmoid scores with group-limited "
                                      "top-k: DeepSeek-V3), sinkhorn (balanced assignment by Sinkhorn iterations: "
                                      "S-BASE), dts (DTS-Gate: dense at first, annealed to top-k)",
                           choices=MOE_ROUTERS, key="moe.router")
    moe_expert_dim: int = _opt(0, "SwiGLU hidden size of each routed expert; 0 = ffn_dim", key="moe.expert_dim")
    moe_shared_experts: int = _opt(0, "shared experts every token goes through (DeepSeek, Qwen2-MoE), run as one "
                                      "SwiGLU of shared_dim", key="moe.shared_experts")
    moe_shared_dim: int = _opt(0, "SwiGLU hidden size of the shared experts together; 0 = shared_experts x "
                                  "expert_dim", key="moe.shared_dim")
    moe_shared_gate: bool = _opt(False, "a sigmoid gate on the shared experts' output (Qwen2-MoE)",
                                 key="moe.shared_gate")
    moe_dense_layers: str = _opt("", "layers that keep a dense SwiGLU of ffn_dim, e.g. \"0\" or \"0,1\" or \"0-2\" "
                                     "(DeepSeek's first dense layers, Qwen2-MoE's mlp_only_layers)",
                                 key="moe.dense_layers")
    moe_capacity_factor: float = _opt(0.0, "expert capacity, x an even share of the micro-batch's tokens (any layout); "
                                           "tokens over it pass the residual (dropped, counted); 0 = dropless",
                                      key="moe.capacity_factor")
    moe_aux_loss: float = _opt(0.0, "weight of the load-balancing loss (Switch/GShard: experts x sum of load "
                                    "fraction x mean probability; over the MoE layers as moe.aux_loss_scope says)",
                               key="moe.aux_loss")
    moe_aux_loss_scope: str = _opt("per_layer_mean", "how the MoE layers' balancing losses combine: per_layer_mean "
                                   "(each layer's, load fractions summing to 1, averaged: 1 = even), per_layer_sum "
                                   "(summed: Megatron-LM), pooled (transformers' load_balancing_loss_func: choices "
                                   "and probabilities pooled, a token's k choices each counted: top_k = even)",
                                   choices=MOE_AUX_LOSS_SCOPES, key="moe.aux_loss_scope")
    moe_z_loss: float = _opt(0.0, "weight of the router z-loss (mean squared log-sum-exp of the router logits)",
                             key="moe.z_loss")
    moe_bias_update_rate: float = _opt(0.0, "aux-loss-free balancing (DeepSeek-V3): after each optimizer step every "
                                            "expert's selection bias moves this much toward an even load; 0 = off",
                                       key="moe.bias_update_rate")
    moe_norm_topk: bool = _opt(True, "renormalise the chosen experts' weights to sum to 1, at any top_k (at "
                                     "top-1 the weight is then 1; Mixtral, Qwen3-MoE; false for OLMoE, Qwen2-MoE); "
                                     "the switch router ignores it (its weight is the probability)",
                               key="moe.norm_topk")
    moe_groups: int = _opt(1, "sigmoid router: expert groups (DeepSeek-V3's n_group)", key="moe.groups")
    moe_topk_groups: int = _opt(1, "sigmoid router: groups a token may pick its experts from", key="moe.topk_groups")
    moe_route_scale: float = _opt(1.0, "factor on the routing weights (DeepSeek's routed_scaling_factor)",
                                  key="moe.route_scale")
    moe_dts_steps: int = _opt(1000, "dts router: optimizer steps over which the gate goes from every expert to "
                                    "top_k", key="moe.dts_steps")
    moe_dts_temperature: float = _opt(2.0, "dts router: softmax temperature at step 0, annealed to 1",
                                      key="moe.dts_temperature")
    moe_dts_eval: str = _opt("schedule", "dts router in evaluation: schedule (route as training does at the step "
                                         "reached: in the warm-up, more experts at a higher temperature), top_k "
                                         "(top_k experts at temperature 1, as the schedule ends)",
                             choices=("schedule", "top_k"), key="moe.dts_eval")
    moe_sinkhorn_iters: int = _opt(8, "sinkhorn router: normalisation iterations before the balanced assignment",
                                   key="moe.sinkhorn_iters")

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def resolved_expert_dim(self) -> int:
        return self.moe_expert_dim or self.ffn_dim

    @property
    def resolved_shared_dim(self) -> int:
        return self.moe_shared_dim or self.moe_shared_experts * self.resolved_expert_dim

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """The layers whose feed-forward is a Mixture of Experts (all but moe.dense_layers)."""
        return moe_layer_ids(self.layers, self.is_moe, self.moe_dense_layers)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.heads

    @property
    def label(self) -> str:
        """How logs and plans name the model: its preset, or its family and directory."""
        if self.preset == "hf" or self.init_from:
            return f"{self.family} {self.init_from.removeprefix('hf:')}"
        return self.preset


@dataclass
class ParallelConfig:
    dp_replicate: int = _opt(1, "HSDP replica groups (data parallel, model states replicated)")
    dp_shard: int = _opt(-1, "FSDP shard degree over data ranks; -1 = whatever the world size leaves")
    head: int = _opt(1, "head-parallel (Ulysses all-to-all) degree")
    ctx: int = _opt(1, "context-parallel (ring attention) degree")
    window: int = _opt(0, "Double-Ring inner ring size; 0 = plain ring; must divide ctx")
    placement: str = _opt("head-first", "which group's ranks are adjacent", choices=("head-first", "ctx-first"))
    seq_balance: str = _opt("docs", "how a sequence with documents is cut over the head x ctx ranks for balance: "
                                    "docs (balance each context rank's visible query-key pairs) or zigzag (balance "
                                    "a plain causal mask)", choices=("docs", "zigzag"))
    expert: int = _opt(1, "expert-parallel degree of the MoE layers, folded over the same ranks as data x head x "
                          "ctx: groups of `expert` adjacent ranks split the experts between them and exchange tokens "
                          "by all-to-all; the expert weights are sharded over the groups (expert data parallel); "
                          "must divide model.moe.experts and the world size")
    expert_pipeline_chunks: int = _opt(1, "parallel.expert > 1: each MoE layer's all-to-alls and experts run in this "
                                          "many chunks, the transfers of one under the experts of another (FSMoE's "
                                          "schedule, parallel/expert/pipeline.py); 1 = one after another; 0 = "
                                          "chosen by an online profile of the first steps (logged)")
    expert_replicas: int = _opt(0, "parallel.expert > 1: copy slots per rank for hot experts (FlexMoE): part of a "
                                   "hot expert's rows run on cooler ranks, placed from the router's counts "
                                   "(parallel/expert/placement.py); 0 = every expert on its owner only")
    expert_ranks_per_node: int = _opt(0, "parallel.expert > 1: hierarchical dispatch over nodes of this many ranks "
                                          "(a token's row crosses to a node once, however many of its experts "
                                          "are there; parallel/expert/hierarchy.py); 0 = flat all-to-all")
    expert_placement_window: int = _opt(10, "parallel.expert_replicas > 0: optimizer steps of router counts behind "
                                            "each placement; re-placed at the end of every window (logged)")
    zero_pp: str = _opt("", "ZeRO++ for slow links between nodes, a comma-separated set (docs/parallelism.md): hpz "
                             "(after each unit's forward its weights stay sharded within the node, so backward's "
                             "all-gathers never leave it), qwz (weights all-gathered as int8 blocks with an fp32 "
                             "scale each, the fp32 weights untouched), qgz (gradients reduce-scattered as int8 "
                             "blocks, within the node first); '' = off")
    zero_pp_block: int = _opt(512, "parallel.zero_pp's qwz and qgz: elements per quantization block (one fp32 "
                                   "scale each: 4 / block bytes per element on top of the int8)")
    zero_pp_kernels: str = _opt("auto", "qwz and qgz's int8 kernels: compiled (torch.compile, one fused pass: the "
                                        "eager values, bit for bit on CPU), eager, or auto (compiled on CUDA; eager "
                                        "on CPU, where compiling needs a C++ compiler and seconds per process)")
    ranks_per_node: int = _opt(0, "ranks per node, for parallel.zero_pp's hpz and qgz; 0 = the launcher's "
                                  "(LOCAL_WORLD_SIZE, or every rank when the job runs on one machine)")
    hpz_ranks: int = _opt(0, "hpz: the ranks a unit stays sharded over after its forward; 0 = a node's. Smaller (a "
                             "divisor of it) keeps backward's gathers on a faster level inside the node, for a larger "
                             "copy (Frontier's three levels: e.g. 2 for the two GCDs of an MI250X)")
    grad_bucket_blocks: int = _opt(1, "transformer blocks per FSDP unit, i.e. per gradient reduce-scatter (and "
                                      "parameter all-gather): 1 = one per block; 0 = chosen by the cost model "
                                      "(parallel/fsdp/grad_buckets.py, logged)")
    timeout_s: float = _opt(300.0, "seconds a collective may wait before the job fails (a rank died or hangs)")


@dataclass
class TrainConfig:
    steps: int = _opt(300, "optimizer steps")
    global_batch: int = _opt(4, "sequences per optimizer step over the whole job (every data-parallel rank and "
                                "micro-batch together), so a config means the same training under any layout")
    grad_accum: int = _opt(1, "micro-batches per optimizer step; each is global_batch / grad_accum sequences")
    seq_len: int = _opt(512, "tokens per sequence")
    lr: float = _opt(3e-3, "peak learning rate; a run from model.init_from that gives none takes 2e-5 (fine-tuning)")
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of lr (the decay's floor, at the last step)")
    warmup_steps: int = _opt(20, "linear warmup steps")
    lr_schedule: str = _opt("cosine", "the decay's shape after the warmup, to lr x min_lr_ratio at the last step; "
                            "constant = train.lr after the warmup", choices=("cosine", "linear", "1-sqrt", "constant"))
    lr_decay_fraction: float = _opt(1.0, "the share of train.steps the decay takes, at the run's end; below 1 the "
                                         "lr holds at train.lr until then (warmup-stable-decay, WSD)")
    weight_decay: float = _opt(0.1, "AdamW weight decay, on matrices only (embeddings, projections, routers, experts): "
                                      "not on norms or biases (every 1-D parameter)")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    eps: float = _opt(1e-8, "AdamW epsilon")
    grad_clip: float = _opt(1.0, "max global gradient norm; 0 disables clipping")
    loss_weighting: str = _opt("token", "how a step's loss averages its labels: token (the mean over the step's "
                                        "trained tokens) or sequence (LongAlign's loss weighting: each trained "
                                        "sequence of the step, a packed sample's document such as a conversation, "
                                        "counts once, as the mean over its own labels, so a long answer weighs no "
                                        "more than a short one; evaluation stays per token; docs/data.md)",
                               choices=("token", "sequence"))
    on_nonfinite: str = _opt("skip", "a step whose loss or gradient norm is not finite, or whose loss spikes "
                                     "(train.spike_factor): 'skip' (its update is not applied, decided on the device; "
                                     "counted in the metrics), 'stop' (not applied, and the run stops at the next read "
                                     "naming the step) or 'rollback' (not applied; the run reloads the last checkpoint "
                                     "and skips the data from it to the bad step, recorded beside the checkpoints: no "
                                     "resume replays it)", choices=("skip", "stop", "rollback"))
    skip_limit: int = _opt(10, "with skip: this many bad steps in a row stop the run, saving nothing; 0 = no limit")
    spike_factor: float = _opt(0.0, "a step whose loss exceeds this many times the median of the last "
                                    "train.spike_window steps' losses is a spike, handled as train.on_nonfinite says "
                                    "(e.g. 3 with rollback); 0 = no spike check")
    spike_window: int = _opt(32, "steps whose losses give the spike check's running median (it starts when full)")
    seed: int = _opt(0, "seed for weights, data order and everything else random")
    device: str = _opt("auto", "where to train", choices=("auto", "cpu", "cuda"))
    dtype: str = _opt("auto", "compute precision: auto = bf16 autocast on a GPU with native bf16 (Ampere on), "
                      "fp32 elsewhere", choices=("auto", "fp32", "bf16"))
    stages: str = _opt("", "progressive lengths: SEQ_LEN:STEPS[:GLOBAL_BATCH],... e.g. \"1024:200:16,4096:100:4\" "
                           "(200 steps of 16 sequences of 1024 tokens, then 100 steps of 4 of 4096; without a batch, "
                           "train.global_batch); sets train.steps (the sum) and train.seq_len (the last stage's); each "
                           "stage reads its own store built from data.corpus; '' = one length")
    data_parallel: str = _opt("sync", "how the parallel.dp_replicate replicas agree: sync (gradients averaged every "
                                      "step) or co2 (CO2: each replica takes train.co2_local_steps local steps, "
                                      "then the average of its parameter change travels while the next round "
                                      "runs, applied one round late with outer momentum; docs/parallelism.md)",
                              choices=("sync", "co2"))
    co2_local_steps: int = _opt(4, "train.data_parallel = co2: local optimizer steps per round (CO2's tau)")
    co2_sync_steps: int = _opt(0, "train.data_parallel = co2: the run's first N optimizer steps are synchronous "
                                  "(the replicas' gradients averaged, as under sync), and the local rounds start "
                                  "from the weights they reach (post-local SGD); 0 = local rounds from step 1")
    co2_overlap_steps: int = _opt(0, "train.data_parallel = co2: steps after a round end at which its average is "
                                     "merged (1..co2_local_steps; the all-reduce hides under them, and a replica "
                                     "keeps that much progress of its own beside the average); 0 = "
                                     "co2_local_steps (CO2's full overlap)")
    co2_outer_lr: float = _opt(1.0, "train.data_parallel = co2: outer learning rate on the averaged round change "
                                    "(1 with no momentum = plain parameter averaging, one round late)")
    co2_outer_momentum: float = _opt(0.0, "train.data_parallel = co2: outer momentum on the averaged round change")
    co2_momentum_clip: float = _opt(0.0, "train.data_parallel = co2: the outer momentum's norm (over the weights "
                                         "CO2 averages: the whole model, less the experts' under expert "
                                         "parallelism, which stay synchronous) is clipped to this; 0 = no clipping")
    co2_staleness_penalty: float = _opt(0.0, "train.data_parallel = co2: the staleness gap penalty lambda: a "
                                             "replica restarts each round from the outer model plus its own "
                                             "not-yet-averaged change scaled by 1 / (1 + lambda); 0 = no penalty")
    compile: bool = _opt(False, "torch.compile each block's token-wise parts (norms, projections, RoPE, MLP, "
                                "residuals); the attention core stays eager")
    deterministic: bool = _opt(False, "bitwise-reproducible steps on a GPU: torch.use_deterministic_algorithms (an "
                                      "op without a deterministic kernel raises, named), cuDNN deterministic, "
                                      "CUBLAS_WORKSPACE_CONFIG; slower there (CPU steps are deterministic already)")
    eval_interval: int = _opt(50, "evaluate on the held-out split every N steps; 0 disables")
    eval_batches: int = _opt(4, "global batches (of train.global_batch sequences) per evaluation, whatever the "
                                "layout and grad_accum, so the eval loss means the same under any of them")
    run_dir: str = _opt("", "where config, metrics and plots go; '' = runs/<time>")


@dataclass
class DataConfig:
    corpus: str = _opt("stdlib", "'stdlib' (the Python standard library's own sources) or a directory of text files")
    tokenizer: str = _opt("auto", "'auto' (the model's own: model.init_from's tokenizer.json or its manifest's; else "
                                  "data.path's; else byte), 'byte', or a path to a Hugging Face tokenizer.json (which "
                                  "must be the model's own when starting from weights)")
    eval_fraction: float = _opt(0.02, "fraction of documents held out for evaluation")
    doc_mask: bool = _opt(True, "attend only within a document and restart positions at each one")
    max_docs: int = _opt(0, "use at most this many documents; 0 = all")
    path: str = _opt("", "a store built by `longctx data build` (its seq_len must equal train.seq_len), or several "
                         "comma-separated (a weighted mix: data.weights); '' = build one from data.corpus on first "
                         "use, cached in $LONGCTX_CACHE or ~/.cache/longctx")
    weights: str = _opt("", "the mix's weight of each store of data.path, comma-separated, e.g. \"0.7,0.3\" "
                            "(normalised); '' = in proportion to each store's training samples")
    strategy: str = _opt("auto", "packing when building from data.corpus; auto = concat below 2048 tokens (nearly "
                                 "every document is longer than a sample), datasculpt from 2048 up",
                         choices=("auto", "datasculpt", "bfd", "concat"))
    dedup: str = _opt("minhash", "duplicate removal when building from data.corpus",
                      choices=("minhash", "exact", "none"))
    workers: int = _opt(1, "processes for the parallel stages when building from data.corpus")
    dp_balance: bool = _opt(True, "give data-parallel ranks samples of balanced estimated cost (a*s^2 + b*s)")
    synthetic: str = _opt("", "retrieval mixture in the training samples: TASK:FRACTION, e.g. \"passkey:0.2\" turns "
                              "a seeded fifth of them into pass-key sequences scored on their answer (task passkey "
                              "or needle, the same prompts `longctx eval` scores); '' = none")


@dataclass
class MemoryConfig:
    recompute: str = _opt("none", "activation recomputation policy", choices=RECOMPUTE_POLICIES)
    # a number, or the word "auto" until train/model.py measures and decides it (MemoryPolicy.from_config
    # takes only the number)
    offload_fraction: float | str = _opt(0.0, "fraction of each block's saved tokens moved to host memory (needs "
                                   "recompute=selective or full); 'auto' (with recompute=selective) picks it from "
                                   "host-link bandwidth, block forward time and free host memory", words=("auto",))
    offload_skip_last: int = _opt(1, "the last K blocks are never offloaded")
    block_chunk: int = _opt(0, "tokens per chunk of each block's token-wise parts (norms, projections, MLP; "
                            "FPDT-style), so their intermediates never exist for all of a rank's tokens; needs "
                            "recompute=selective or full; 0 = whole blocks")
    attention_chunk: int = _opt(0, "tokens per chunk of the attention core (FPDT-style): each query chunk meets the "
                                "key chunks it can see, merged by log-sum-exp, so the kernels' working set is one "
                                "chunk pair; every ring block is processed so too; 0 = all of a rank's tokens at once")
    expert_chunk: int = _opt(0, "MoE: rows of routed tokens the experts run at a time, each piece recomputed in "
                                "backward, so the experts' intermediates stay bounded however skewed the routing "
                                "(under parallel.expert a rank may receive every token of its group); 0 = all at once")
    attention_offload: bool = _opt(False, "keep the attention core's saved q, k, v, out, lse chunks in host memory "
                                   "from forward to backward, fetched one chunk ahead; needs attention_chunk > 0")
    loss_chunk: int = _opt(4096, "tokens per chunk of the LM head + cross-entropy when a rank holds more tokens "
                           "than this (logits [tokens, vocab] never exist); 0 = never chunk")
    grad_sync: str = _opt("step", "with train.grad_accum > 1 under FSDP: reduce gradients once per step (step: least "
                          "traffic, but each rank holds its unsharded fp32 gradients between micro-batches) or after "
                          "every micro-batch (micro_batch: no extra memory)", choices=("step", "micro_batch"))
    model_states: str = _opt("device", "where the model states (fp32 weights, gradients, AdamW moments) live: device; "
                             "host_optimizer: weights on the device, their fp32 masters, gradients and moments in host "
                             "memory, each gradient sent there as its backward ends, AdamW on the host (ZeRO-Offload); "
                             "host: FSDP2's CPU offload, the weights too, each unit's brought to the device for its "
                             "forward and backward (on one process a one-rank FSDP job)", choices=MODEL_STATE_TIERS)


@dataclass
class CheckpointConfig:
    dir: str = _opt("", "checkpoint directory; '' = <run_dir>/checkpoints")
    interval: int = _opt(0, "save every N steps and at the last step; 0 = no periodic saves")
    final: bool = _opt(True, "save the last step (weights, optimizer and data position: generate reads it, a "
                             "resume continues it) when the run ends, whatever checkpoint.interval says; false with "
                             "checkpoint.interval 0 saves nothing")
    keep: int = _opt(2, "complete checkpoints kept")
    async_save: bool = _opt(False, "write checkpoints in the background", key="async")
    resume: str = _opt("none", "'auto' (latest complete checkpoint), 'none', or a checkpoint path; `longctx train` "
                               "then continues the run: its saved config.toml, with the command line on top")
    allow_changes: bool = _opt(False, "on resume, allow changing the model or the data, or turning saving off "
                                      "(checkpoint.interval 0); refused otherwise, since they are rarely meant")
    on_save_error: str = _opt("stop", "a save that fails (a full disk, an unwritable directory): 'stop' the run, or "
                                      "'warn' and train on; either way the partial save is removed and the "
                                      "previous checkpoint stays the latest", choices=("stop", "warn"))
    on_signal: str = _opt("SIGTERM,SIGUSR1", "signals on which a run that saves checkpoints finishes its step, "
                                             "saves it and exits with code 75 (requeue); '' = none")
    exit_after_minutes: float = _opt(0.0, "stop at the first step boundary this many minutes after the command began "
                                          "(data build, set-up included), save that step and exit with code 75 "
                                          "(requeue), as on a signal: a scheduler's time limit less a save's time and "
                                          "a step's; 0 = no limit")

    @property
    def saves_or_resumes(self) -> bool:
        """Whether the run has a checkpoint manager: it saves (interval, final) or resumes. A manager also
        saves on a signal or the time limit (train/watch.py), where a co2 run copies its own state."""
        return bool(self.interval or self.final or self.resume != "none")



@dataclass
class MetricsConfig:
    log_interval: int = _opt(10, "print and record a metrics line every N steps")
    file: str = _opt("", "JSONL metrics file; '' = <run_dir>/metrics.jsonl")
    tensorboard: bool = _opt(False, "also write TensorBoard events to <run_dir>/tensorboard")
    plots: bool = _opt(True, "write PNG plots into the run directory at the end")
    peak_tflops: float = _opt(0.0, "one rank's peak for MFU in TFLOP/s (a GPU's; on CPU a rank's share of the "
                                   "machine's); 0 = known GPU table or measured CPU GEMM")
    progress: bool = _opt(True, "show a progress bar")
    profile_step: int = _opt(0, "profile this step (1-based) with torch.profiler: <run_dir>/profile/ gets each rank's "
                                "Chrome trace and rank 0's table of the ops and kernels that took the most device time "
                                "(CPU time on CPU), by kind (matmul, attention, copy, communication, other); 0 = none")


DRAFT_LOSSES = ("ce", "kd")  # draft.loss


@dataclass
class DraftConfig:
    """[draft]: train a GliDe or Clover draft model (models/glide.py, models/clover.py; train/glide.py,
    train/glide.py) against a frozen target."""
    kind: str = _opt("glide", "glide: layers reading the target's KV cache (models/glide.py); clover: an Augmenting "
                              "Block over the target's final hidden states and regressive steps (models/clover.py; "
                              "one rank, one device to decode)", choices=("glide", "clover"))
    target: str = _opt("", "'' = a normal run; DIR (a longctx checkpoint, or a checkpoints directory for its latest) "
                           "or hf:DIR: train a GliDe draft against this frozen target, whose model config and "
                           "tokenizer the run takes (it sets model.init_from); only the draft is optimised and saved")
    layers: int = _opt(1, "GliDe draft layers; layer i cross-attends to the target's keys and values of its layer "
                          "L - layers + i (1..the target's layers)")
    loss: str = _opt("ce", "ce: next-token cross-entropy on the labels; kd: cross-entropy of the draft's "
                           "distribution against the target's (both at draft.kd_temperature), on the labelled tokens",
                     choices=DRAFT_LOSSES)
    block: int = _opt(4, "speculation length the block-stale mask trains for: a token at position p of its document "
                         "sees the target's keys of that document before p // block * block")
    kd_temperature: float = _opt(1.0, "softmax temperature of both distributions under draft.loss = kd")
    init: str = _opt("random", "random: the draft's weights drawn from train.seed; target: draft layer i starts as a "
                               "copy of target layer L - layers + i (its attention and MLP; the cross-attention's "
                               "query and output projections from that layer's), the final norm as the target's: "
                               "a draft that starts where the target ends learns in fewer steps",
                     choices=("random", "target"))
    vocab: int = _opt(0, "0 = the target's vocabulary; N: the draft proposes only the N tokens its training data "
                         "uses most, through those rows of the target's LM head (EAGLE-3's reduced draft vocabulary: "
                         "a cheaper draft step; verification, by the target, stays lossless)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
