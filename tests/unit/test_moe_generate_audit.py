"""Generation and scoring of Mixture-of-Experts models against transformers, and dropless generation.

- Random tiny Mixtral, Qwen2-MoE (a gated shared expert, norm_topk_prob false), Qwen3-MoE (norm_topk_prob
  true) and OLMoE checkpoints written by transformers: one batch of prompts of 16, 37, 300 and 1,500 tokens
  (a flat prefill, a prefill in chunks of 128, rows that decode past each other's ends) gives each prompt
  transformers' greedy tokens, its log-probabilities those of transformers' logits (fp32); the teacher-forced
  per-token NLL (eval score mode's) is transformers' log_softmax; routers tied exactly (a zero gate, gate
  rows shared by three experts) route as transformers does in prefill and decode (compile=True: eagerly, the
  same tokens); speculation with an MoE draft that disagrees now and then is transformers' greedy.
- A longctx MoE model with a capacity (moe.capacity_factor > 0) generates dropless, as eval scores it
  (docs/eval.md): a capacity is shared by the tokens of one call, so with it a prompt's tokens depended on
  the other prompts of its batch (finished rows included), on the prefill's chunks and on a verification's
  proposals (41% of the choices dropped in one `longctx generate` run of six prompts).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_moe import randomise  # noqa: E402

from longctx.config import load_config  # noqa: E402
from longctx.generate.drafters import drafter_for  # noqa: E402
from longctx.generate.engine import generate  # noqa: E402
from longctx.generate.speculative import speculative_generate  # noqa: E402
from longctx.models.hf import load_hf  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402
from longctx.models.moe import MoEFeedForward, moe_layers  # noqa: E402

ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
        "olmoe": "OlmoeForCausalLM"}
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
              max_position_embeddings=2048, tie_word_embeddings=False, hidden_act="silu", torch_dtype="float32",
              initializer_range=0.1, num_experts_per_tok=2, eos_token_id=None)
FAMILIES = {
    "mixtral": dict(model_type="mixtral", num_local_experts=8, intermediate_size=48, sliding_window=None,
                    rope_theta=1e6),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=6, moe_intermediate_size=32, intermediate_size=80,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, use_sliding_window=False),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, moe_intermediate_size=32, intermediate_size=80,
                      head_dim=32, norm_topk_prob=True),
    "olmoe": dict(model_type="olmoe", num_experts=4, intermediate_size=48, norm_topk_prob=False, num_key_value_heads=4),
}
LENGTHS = (16, 37, 300, 1500)
NEW = 16


def _prompt(n, seed, vocab=300):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_model(family, tmp_path, ties=False):
    """(hf:DIR, transformers' model) of a random two-layer checkpoint; `ties`: layer 0's gate zero (every
    expert tied for every token), layer 1's experts 1-3 sharing one gate row."""
    cfg = transformers.AutoConfig.for_model(**{**COMMON, "architectures": [ARCH[family]], **FAMILIES[family]})
    torch.manual_seed(3)
    model = randomise(transformers.AutoModelForCausalLM.from_config(cfg).float().eval())  # (far from ties)
    with torch.no_grad():
        if ties:
            gates = [p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]
            gates[0].zero_()
            gates[1][2:4] = gates[1][1]
    model.save_pretrained(tmp_path / family)
    return tmp_path / family, model


def _transformers_greedy(model, prompt, new=NEW):
    """transformers' greedy tokens and each one's log_softmax row (fp32). The attention mask is explicit:
    without it generate takes every token equal to pad_token_id for padding (a long random prompt holds some)."""
    t = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=new, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([x[0].float() for x in out.logits]).log_softmax(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_of_long_and_short_prompts_is_transformers_greedy_with_its_logprobs(tmp_path, family):
    d, ref = _hf_model(family, tmp_path)
    ours = load_hf(d)
    prompts = [_prompt(n, seed=n) for n in LENGTHS]
    got = generate(ours, prompts, max_new_tokens=[NEW, NEW - 5, NEW, NEW - 9], prefill_chunk=128, logprobs=3)
    for prompt, r in zip(prompts, got):
        tokens, lps = _transformers_greedy(ref, prompt, len(r.tokens))
        assert r.tokens == tokens, (len(prompt), r.tokens, tokens)
        chosen = lps.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (torch.tensor(r.logprobs) - chosen).abs().max().item() <= 1e-5
        top = lps.topk(3, dim=-1)
        assert [[i for i, _ in row] for row in r.top_logprobs] == top.indices.tolist()
        assert (torch.tensor([[v for _, v in row] for row in r.top_logprobs]) - top.values).abs().max() <= 1e-5
    # eval score mode's per-token NLL (the model's loss_reduction="tokens") against transformers' log_softmax
    t = torch.tensor([_prompt(300, seed=s) for s in (1, 2)])
    labels = torch.cat([t[:, 1:], torch.full((2, 1), -100)], dim=1)
    with torch.no_grad():
        nll = ours(t, torch.arange(300).expand(2, 300), None, labels=labels, loss_reduction="tokens")[:, :-1, 0]
        theirs = -ref(t).logits.double().log_softmax(-1)[:, :-1].gather(-1, t[:, 1:, None])[..., 0]
    assert (nll.double() - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_routers_choose_as_transformers_in_prefill_and_decode(tmp_path, family):
    d, ref = _hf_model(family, tmp_path, ties=True)
    ours = load_hf(d)
    prompts = [_prompt(n, seed=20 + n) for n in (16, 90, 400)]
    together = generate(ours, prompts, max_new_tokens=NEW, prefill_chunk=32)
    # compile=True: a MoE model decodes eagerly (docs/generate.md), the same tokens, no error
    compiled = generate(ours, prompts, max_new_tokens=NEW, prefill_chunk=32, compile=True)
    for prompt, r, c in zip(prompts, together, compiled):
        assert r.tokens == _transformers_greedy(ref, prompt)[0] == c.tokens


def test_speculation_with_moe_target_and_draft_is_transformers_greedy(tmp_path):
    """The draft: the target's weights with its routers perturbed, so it proposes the target's tokens
    for a while and then not (proposals kept and rejected in one run)."""
    d, ref = _hf_model("qwen2_moe", tmp_path)
    target, draft = load_hf(d), load_hf(d)
    with torch.no_grad():
        for layer in moe_layers(draft):
            layer.router.gate.weight.add_(torch.randn(layer.router.gate.weight.shape,
                                                      generator=torch.Generator().manual_seed(0)) * 0.5)
    prompt = _prompt(200, seed=9)
    tokens, lps = _transformers_greedy(ref, prompt, 24)
    for k in (1, 3):
        drafter = drafter_for(target, draft, len(prompt) + 24 + k + 2, 64, None, False)
        r = speculative_generate(target, drafter, prompt, max_new_tokens=24, k=k, prefill_chunk=64, logprobs=0)
        assert r.tokens == tokens
        assert 0 < sum(r.accepted) < sum(r.proposed)  # the run keeps some proposals and rejects others
        chosen = lps.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (torch.tensor(r.logprobs) - chosen).abs().max().item() <= 1e-5


def _capacity_model(capacity: float):
    cfg = load_config(overrides=["--model.preset=debug-moe", f"--model.moe.capacity_factor={capacity}"]).model
    model = build_model(cfg, seed=1).eval()
    with torch.no_grad():
        torch.manual_seed(0)
        for layer in moe_layers(model):  # routers of some conviction: tokens crowd onto favourite experts
            layer.router.gate.weight.normal_(0, 0.3)
    return model


class _Drops:
    """Counts the routed choices an MoE layer drops (Routing.kept False) while installed."""

    def __init__(self, monkeypatch):
        self.choices = self.dropped = 0
        route = MoEFeedForward.route

        def counting(layer, flat, chosen=None, kept=None):
            r = route(layer, flat, chosen, kept)
            self.choices += r.experts.numel()
            self.dropped += 0 if r.kept is None else int((~r.kept).sum())
            return r
        monkeypatch.setattr(MoEFeedForward, "route", counting)


def test_a_capacity_model_generates_dropless(monkeypatch):
    """The reference: the same weights without a capacity, each prompt alone. Before the fix a batch of
    five prompts gave two of them other tokens, and one prompt alone dropped choices in its prefill."""
    capped, dropless = _capacity_model(1.0), _capacity_model(0.0)
    dropless.load_state_dict(capped.state_dict())
    vocab = capped.cfg.vocab_size
    prompts = [_prompt(n, seed=10 + n, vocab=vocab) for n in (5, 9, 17, 33, 60)]
    alone = [generate(dropless, [p], max_new_tokens=16, logprobs=0)[0] for p in prompts]
    drops = _Drops(monkeypatch)
    together = generate(capped, prompts, max_new_tokens=[16, 4, 16, 9, 16], prefill_chunk=64, logprobs=0)
    chunked = generate(capped, [prompts[-1]], max_new_tokens=16, prefill_chunk=7)[0]
    drafter = drafter_for(capped, capped, 60 + 16 + 5, 64, None, False)
    speculated = speculative_generate(capped, drafter, prompts[-1], max_new_tokens=16, k=3, prefill_chunk=64)
    assert drops.choices > 0 and drops.dropped == 0, (drops.dropped, drops.choices)
    for r, ref in zip(together, alone):
        assert r.tokens == ref.tokens[:len(r.tokens)]
        assert max(abs(a - b) for a, b in zip(r.logprobs, ref.logprobs)) <= 1e-5
    assert chunked.tokens == alone[-1].tokens and speculated.tokens == alone[-1].tokens
    assert all(layer.capacity_factor == 1.0 for layer in moe_layers(capped))  # the model keeps its config
