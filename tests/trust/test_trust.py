"""Modified models: every gauge entry point refuses or stays exact, never a silent change.

Each modification below is one a user really makes to a supported model (HF Llama unless said): a
hook, a legacy weight norm, a shared or tied projection, an edited position embedding, a patched
helper, a replaced kernel, a wrapped forward, a subclass. For each one, every entry point either
raises :class:`~gaugeopt.GaugeError` (leaving the parameters untouched) or keeps the model's
output and every attention output to ≤ 1e-12 (float64); and a negative control shows that the
modification does change what a gauge action computes by ≥ 1e-3 once the checks are bypassed
(``gaugeopt.assume_certified(model, static_checks=False)``), so each refusal is earned.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn

import gaugeopt
import zoo
from gaugeopt import GaugeError
from gaugeopt.trust.invariance import randomize_parameters
from gaugeopt.adapters.find import find_attention

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

VALID_TOL = 1e-12
CONTROL_MIN = 1e-3
VOCAB, T = 61, 12


# ---------------------------------------------------------------------- models and measurements
def _llama(mha: bool = False) -> nn.Module:
    """A 2-layer float64 HF Llama with biases and GQA (or MHA), generic random weights."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4 if mha else 2, attention_bias=True,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    cfg.use_cache = False
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    randomize_parameters(model, torch.Generator().manual_seed(0))
    return model


IDS = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(3))


def _outputs(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and every attention module's output, in one forward (hooks only while measuring)."""
    outs: list[torch.Tensor] = []
    modules = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    handles = [m.register_forward_hook(lambda mod, a, o: outs.append(o[0].detach().clone())) for m in modules]
    try:
        with torch.no_grad():
            logits = model(input_ids=IDS).logits
    finally:
        for h in handles:
            h.remove()
    return logits, outs


def _change(ref: tuple, model: nn.Module) -> float:
    logits, outs = _outputs(model)
    return max([gaugeopt.relative_change(ref[0], logits)] + [gaugeopt.relative_change(a, b) for a, b in zip(ref[1], outs)])


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(before: list[torch.Tensor], model: nn.Module) -> bool:
    return all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


# ---------------------------------------------------------------------- the modifications
def _layer(model, i=0):
    return model.model.layers[i].self_attn


def k_hook_l2(model, mp):
    """Per-head L2 normalisation of the keys, as a forward hook on k_proj."""
    def hook(mod, args, out):
        return torch.nn.functional.normalize(out.unflatten(-1, (-1, 8)), dim=-1).flatten(-2)
    _layer(model).k_proj.register_forward_hook(hook)


def q_steering(model, mp):
    """An interpretability steering vector added to the queries."""
    steer = torch.randn(32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _layer(model).q_proj.register_forward_hook(lambda mod, args, out: out + steer)


def v_steering(model, mp):
    steer = torch.randn(16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    _layer(model, 1).v_proj.register_forward_hook(lambda mod, args, out: out + steer)


def o_pre_hook(model, mp):
    """A pre-hook on o_proj normalising each head's input: W_O no longer sees W_V's gauge covariantly."""
    def hook(mod, args):
        return (torch.nn.functional.normalize(args[0].unflatten(-1, (4, 8)), dim=-1).flatten(-2),)
    _layer(model).o_proj.register_forward_pre_hook(hook)


def weight_norm(model, mp):
    torch.nn.utils.weight_norm(_layer(model).q_proj)


def spectral_norm(model, mp):
    torch.nn.utils.spectral_norm(_layer(model).v_proj)


def shared_q(model, mp):
    _layer(model, 1).q_proj = _layer(model, 0).q_proj


def shared_k(model, mp):
    _layer(model, 1).k_proj = _layer(model, 0).k_proj


def shared_v(model, mp):
    _layer(model, 1).v_proj = _layer(model, 0).v_proj


def tied_o_v(model, mp):  # MHA model: o_proj and v_proj are both 32×32
    _layer(model).o_proj.weight = _layer(model).v_proj.weight


def tied_k_q(model, mp):  # MHA model
    _layer(model).k_proj = _layer(model).q_proj


def position_pre_hook(model, mp):
    """A pre-hook (with kwargs) that rolls the second half of cos/sin: planes no longer rotate."""
    def hook(mod, args, kwargs):
        cos, sin = kwargs["position_embeddings"]
        roll = lambda t: torch.cat([t[..., :4], t[..., 4:].roll(1, -1)], -1)  # noqa: E731
        return args, {**kwargs, "position_embeddings": (roll(cos), roll(sin))}
    _layer(model).register_forward_pre_hook(hook, with_kwargs=True)


def patched_rope(model, mp):
    """A patching library's RoPE: the same call, interleaved pairs instead of split-half."""
    def rope(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim)[..., ::2].repeat_interleave(2, -1), sin.unsqueeze(unsqueeze_dim)[..., ::2].repeat_interleave(2, -1)
        rot = lambda x: torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)  # noqa: E731
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin
    mp.setattr(modeling_llama, "apply_rotary_pos_emb", rope)


def replaced_kernel(model, mp):
    """Another kernel registered under "sdpa": it clamps queries and keys (a stability patch)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    def clamped(module, q, k, v, mask, **kw):
        return sdpa_attention_forward(module, q.clamp(-0.5, 0.5), k.clamp(-0.5, 0.5), v, mask, **kw)
    mp.setitem(AttentionInterface._global_mapping, "sdpa", clamped)


def wrapped_forward(model, mp):
    """LlamaAttention.forward wrapped with functools.wraps (name, module and docstring kept)."""
    orig = modeling_llama.LlamaAttention.forward

    @functools.wraps(orig)
    def forward(self, hidden_states, *args, **kwargs):
        out, w = orig(self, hidden_states, *args, **kwargs)
        return out + 0.1 * self.v_proj(hidden_states).repeat(1, 1, 2), w  # a value read without W_O
    mp.setattr(modeling_llama.LlamaAttention, "forward", forward)


def subclass(model, mp):
    """A subclass of LlamaAttention under a name without "attn": used to be skipped silently."""
    class Mixer(modeling_llama.LlamaAttention):
        pass
    _layer(model, 1).__class__ = Mixer


REFUSED = {
    "k_hook_l2": (k_hook_l2, False), "q_steering": (q_steering, False), "v_steering": (v_steering, False),
    "o_pre_hook": (o_pre_hook, False), "weight_norm": (weight_norm, False), "spectral_norm": (spectral_norm, False),
    "shared_q": (shared_q, False), "shared_k": (shared_k, False), "shared_v": (shared_v, False),
    "tied_o_v": (tied_o_v, True), "tied_k_q": (tied_k_q, True), "position_pre_hook": (position_pre_hook, False),
    "patched_rope": (patched_rope, False), "replaced_kernel": (replaced_kernel, False),
    "wrapped_forward": (wrapped_forward, False), "subclass": (subclass, False),
}


# ---------------------------------------------------------------------- the entry points
def _fix_steps(m):
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    from gaugeopt.integrations.steps import FixSteps

    FixSteps(every=1, mode="plain").watch(m, opt)
    opt.step()
    return m


def _projected_fix(m):
    opt = gaugeopt.GaugeOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m, project=None, fix_every=1,
                                  fix_kwargs={"mode": "plain"})
    opt.step()
    return m


def _projected_update(m):
    opt = gaugeopt.GaugeOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m)
    opt.step()
    return None


ENTRY_POINTS = {
    "random_gauge_transform": lambda m: gaugeopt.random_gauge_transform(m, "all", generator=0),
    "gauge_fix": lambda m: (gaugeopt.gauge_fix(m, torch.optim.AdamW(m.parameters()), mode="plain"), m)[1],
    "GaugeFixer": lambda m: (gaugeopt.GaugeFixer(m, vo=True, mode="plain")(), m)[1],
    "GaugeProjector": lambda m: gaugeopt.GaugeProjector(m).project({n: torch.ones_like(p) for n, p in m.named_parameters()}) and None,
    "GaugeOptimizer(fix_every)": _projected_fix,
    "GaugeOptimizer(project)": _projected_update,
    "step core (callbacks)": _fix_steps,
    "canonicalize": lambda m: gaugeopt.canonicalize(m).model,
    "equivalent": lambda m: gaugeopt.equivalent(m, m) and None,
    "merge": lambda m: gaugeopt.merge(m, m).merged,
    "gauge_dimension": lambda m: gaugeopt.gauge_dimension(m) and None,
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_entry_point_refuses_a_modified_model_and_writes_nothing(name, monkeypatch):
    modify, mha = REFUSED[name]
    model = _llama(mha)
    modify(model, monkeypatch)
    for what, op in ENTRY_POINTS.items():
        m = model  # refused ops write nothing, so one model serves all (weight_norm cannot even be deep-copied)
        before = _params(m)
        with pytest.raises(GaugeError) as err:
            op(m)
        assert _same(before, m), f"{name}/{what}: a refusal wrote to the model"
        msg = str(err.value)
        assert any(w in msg for w in ("docs/trust.md", "find_attention", "certify")), (what, msg[:300])


@pytest.mark.parametrize("name", sorted(set(REFUSED) - {"subclass"}))
def test_negative_control_the_modification_breaks_the_gauge_once_the_checks_are_bypassed(name, monkeypatch):
    """What the refusals prevent: with every check bypassed, a random valid action of the stock record
    changes the modified model's function by ≥ 1e-3."""
    modify, mha = REFUSED[name]
    model = _llama(mha)
    stock_sites = find_attention(model)
    modify(model, monkeypatch)
    try:
        sites = find_attention(model)
    except GaugeError:  # refused when the records are built (a replaced kernel): the stock records, then
        sites = stock_sites
    ref = _outputs(model)
    gaugeopt.assume_certified(model, static_checks=False, sites=sites)
    with pytest.warns(RuntimeWarning, match="assumed, not proved"):
        gaugeopt.random_gauge_transform(model, ("qk", "vo"), generator=0, sites=sites)
    assert _change(ref, model) >= CONTROL_MIN


def test_the_stock_model_stays_exact_through_every_entry_point():
    """The positive side: the same entry points on the unmodified model keep the function."""
    model = _llama()
    ref = _outputs(model)
    for what, op in ENTRY_POINTS.items():
        m = copy.deepcopy(model)
        out = op(m)
        if out is not None:
            assert _change(ref, out) <= VALID_TOL, what


# ---------------------------------------------------------------------- attributes the forward does not read
def _neox(rotary_pct: float = 0.5) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, rotary_pct=rotary_pct, max_position_embeddings=64,
                                     attn_implementation="sdpa")
    model = transformers.GPTNeoXForCausalLM(cfg).double().eval()
    randomize_parameters(model, torch.Generator().manual_seed(0))
    return model


def _falcon(alibi: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    alibi=alibi, new_decoder_architecture=False, multi_query=False, bias=True,
                                    attn_implementation="sdpa")
    model = transformers.FalconForCausalLM(cfg).double().eval()
    randomize_parameters(model, torch.Generator().manual_seed(0))
    return model


@pytest.mark.parametrize("case", ["neox_rotary_ndims", "falcon_alibi_flipped"])
def test_records_follow_what_the_forward_reads_not_stale_attributes(case):
    """GPT-NeoX rotates as many channels as its rotary embedding has (its rotary_ndims is never read);
    Falcon takes ALiBi or RoPE from FalconModel.use_alibi (config.alibi edited later changes nothing).
    The records follow the forward: every action stays exact. Negative control: the record the edited
    attribute would give changes the function."""
    if case == "neox_rotary_ndims":
        model = _neox()
        for layer in model.gpt_neox.layers:
            layer.attention.rotary_ndims = 8  # the whole head; the rotary embedding still rotates 4 channels
        site = find_attention(model)[0]
        assert (site.rope.kind, site.rope.rotary_dim) == ("split_half", 4)
        wrong = [copy.copy(s) for s in find_attention(model)]
        for s in wrong:
            s.rope = gaugeopt.RopeSpec("split_half", 8)
    else:
        model = _falcon(alibi=False)
        model.config.alibi = True  # the model keeps use_alibi=False: RoPE
        site = find_attention(model)[0]
        assert site.rope.active and not site.fixed_head_order
        wrong = [copy.copy(s) for s in find_attention(model)]
        for s in wrong:
            s.rope = gaugeopt.RopeSpec()
    ref = (model(input_ids=IDS).logits.detach(), [])
    moved = gaugeopt.random_gauge_transform(copy.deepcopy(model), ("qk", "vo"), generator=0)
    assert gaugeopt.relative_change(ref[0], moved(input_ids=IDS).logits) <= VALID_TOL
    gaugeopt.assume_certified(model, sites=wrong)
    with pytest.warns(RuntimeWarning, match="assumed"):
        gaugeopt.random_gauge_transform(model, ("qk",), generator=0, sites=wrong)
    assert gaugeopt.relative_change(ref[0], model(input_ids=IDS).logits) >= CONTROL_MIN


# ---------------------------------------------------------------------- apply_lrm and hooks
def test_apply_lrm_carries_hooks_and_their_handles():
    model = _llama()
    calls = []
    handle = _layer(model).k_proj.register_forward_hook(lambda m, a, o: calls.append(1) or o * 1.5)
    ref = _outputs(model)
    gaugeopt.apply_lrm(model)
    assert type(_layer(model).k_proj).__name__ == "LRMLinear"
    assert _change(ref, model) == 0.0 and calls  # the hook runs on the converted layer: same function
    with pytest.raises(GaugeError, match=r"k_proj: forward hook .* may change what the module computes"):
        gaugeopt.gauge_fix(model)
    handle.remove()  # the user's handle still removes it
    assert not _layer(model).k_proj._forward_hooks
    assert gaugeopt.gauge_fix(model).max_drift_after < 1e-6


def test_apply_lrm_refuses_a_legacy_weight_norm():
    model = _llama()
    torch.nn.utils.weight_norm(_layer(model).q_proj)
    with pytest.raises(GaugeError, match=r"q_proj carries a legacy WeightNorm hook"):
        gaugeopt.apply_lrm(model)


def test_apply_lrm_keeps_a_shared_module_shared():
    model = _llama()
    _layer(model, 1).q_proj = _layer(model, 0).q_proj
    gaugeopt.apply_lrm(model)
    assert _layer(model, 1).q_proj is _layer(model, 0).q_proj


# ---------------------------------------------------------------------- what the static checks let pass
def test_a_read_only_hook_is_proved_with_the_module_and_a_writing_one_fails_the_proof():
    model = _llama()
    seen = []

    @gaugeopt.read_only_hook
    def log(mod, args, out):
        seen.append(float(out.norm()))

    _layer(model).k_proj.register_forward_hook(log)
    ref = _outputs(model)
    moved = gaugeopt.random_gauge_transform(copy.deepcopy(model), "all", generator=0)
    assert _change(ref, moved) <= VALID_TOL and seen

    @gaugeopt.read_only_hook  # a lie: it writes; the certificate, run with the hook in place, catches it
    def liar(mod, args, out):
        return out + 1.0

    _layer(model, 1).q_proj.register_forward_hook(liar)
    with pytest.raises(GaugeError, match=r"certify: layer model\.layers\.1\.self_attn .* sector qk"):
        gaugeopt.gauge_fix(model)


def test_global_module_hooks_are_refused():
    model = _llama()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        with pytest.raises(GaugeError, match="a global module hook"):
            gaugeopt.gauge_fix(model)
    finally:
        handle.remove()
    gaugeopt.gauge_fix(model)


def test_a_parametrization_is_refused():
    model = _llama()

    class Double(nn.Module):
        def forward(self, x):
            return 2 * x

    torch.nn.utils.parametrize.register_parametrization(_layer(model).q_proj, "weight", Double())
    with pytest.raises(GaugeError, match=r"weight of this ParametrizedLinear is parametrized"):
        gaugeopt.gauge_fix(model)


def test_patched_qk_norm_is_refused():
    model = zoo.build("hf_qwen3").model

    def norm(self, x):  # forgets the gain
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    cls = type(model.model.layers[0].self_attn.q_norm)
    saved = cls.forward
    cls.forward = norm
    try:
        with pytest.raises(GaugeError, match=r"q_norm: Qwen3RMSNorm\.forward is .*norm"):
            gaugeopt.gauge_fix(model)
    finally:
        cls.forward = saved


def test_meta_model_is_a_gauge_error_not_a_raw_crash():
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_llama().config)
    for op in (gaugeopt.gauge_fix, gaugeopt.GaugeProjector, gaugeopt.canonicalize, gaugeopt.random_gauge_transform):
        with pytest.raises(GaugeError, match="meta device"):
            op(model)


# ---------------------------------------------------------------------- changes after set-up
def test_surgery_after_a_fixer_is_built_is_followed():
    """The fixer plans on the model it was given; a layer replaced later is found, proved and fixed —
    not the detached one."""
    model = _llama()
    fixer = gaugeopt.GaugeFixer(model, mode="plain")
    fresh = copy.deepcopy(_layer(model, 1))
    with torch.no_grad():
        fresh.q_proj.weight.mul_(4.0)
        fresh.q_proj.bias.mul_(4.0)
        fresh.k_proj.weight.div_(4.0)
        fresh.k_proj.bias.div_(4.0)
    model.model.layers[1].self_attn = fresh
    ref = _outputs(model)
    report = fixer()
    assert report.max_drift_before > 1.0 and gaugeopt.qk_drift(model, mode="plain") <= 1e-6  # the live layer
    assert _change(ref, model) <= VALID_TOL


def test_surgery_with_a_hook_after_set_up_is_refused_at_the_next_use():
    model = _llama()
    opt = gaugeopt.GaugeOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, project=None, fix_every=1)
    opt.step()
    q_steering(model, None)
    before = _params(model)
    with pytest.raises(GaugeError, match="may change what the module computes"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_records_given_by_hand_that_left_the_model_are_refused():
    model = _llama()
    sites = find_attention(model)
    fixer = gaugeopt.GaugeFixer(model, sites=sites, mode="plain")
    model.model.layers[0].self_attn = copy.deepcopy(_layer(model, 0))
    with pytest.raises(GaugeError, match="no longer in the model"):
        fixer()


def test_a_helper_patched_after_the_proof_is_caught_at_the_next_use(monkeypatch):
    model = _llama()
    fixer = gaugeopt.GaugeFixer(model, mode="plain")
    fixer()
    patched_rope(model, monkeypatch)
    with pytest.raises(GaugeError, match="apply_rotary_pos_emb"):
        fixer()


# ---------------------------------------------------------------------- frozen tensors, non-finite values, bf16
from gaugeopt.models import GPT, GPTConfig  # noqa: E402


def _gpt(lrm: bool = True, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, rope="split_half"))
    if lrm:
        gaugeopt.apply_lrm(model)
    model = model.to(dtype)
    randomize_parameters(model, torch.Generator().manual_seed(0))
    return model


def _train(model, opt, steps: int = 3, hook=None) -> None:
    x = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        loss = model(x, x)[1]
        loss.backward()
        if hook is not None:
            hook(model)
        opt.step()
        opt.zero_grad()


def test_projected_wrapper_never_moves_frozen_tensors():
    """requires_grad=False tensors handed to the optimizer anyway (the usual AdamW(model.parameters())):
    bit-identical after projected steps; the projection leaves out the gauge directions through them.
    Negative control: the projection of the same step over every direction moves them."""
    model = _gpt()
    frozen = {n: p for n, p in model.named_parameters() if n.startswith("transformer.h.0.attn.c_attn")}
    for p in frozen.values():
        p.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in frozen.items()}
    opt = gaugeopt.GaugeOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, sectors="all")
    _train(model, opt)
    assert all(torch.equal(before[n], p) for n, p in frozen.items())
    assert any("transformer.h.0.attn" in f for f in opt.projector.frozen)
    assert opt.last_vertical_fraction > 0.01  # the other layers were projected

    from gaugeopt.projection.step import remove_vertical_update_, snapshot

    everything = gaugeopt.GaugeProjector(model, "all")  # trainable_only=False: what the wrapper used to do
    at = snapshot(everything, model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 1e-2)
    remove_vertical_update_(everything, model, at)
    assert any(not torch.equal(before[n], p) for n, p in frozen.items())


def test_gauge_fix_leaves_frozen_pairs_unless_asked():
    model = _gpt()
    site = find_attention(model)[0]
    with torch.no_grad():
        site.q.row_mult.get().mul_(3.0)
    site.q.row_mult.param.requires_grad_(False)
    kept = site.q.row_mult.param.detach().clone()
    report = gaugeopt.gauge_fix(model)
    assert torch.equal(site.q.row_mult.param, kept) and report.frozen == [
        "transformer.h.0.attn (qk: transformer.h.0.attn.c_attn.row_mults.0)"]
    report = gaugeopt.gauge_fix(model, rescale_frozen=True)
    assert not torch.equal(site.q.row_mult.param, kept) and report.max_drift_after < 1e-6


def _nan_count(tensors) -> int:
    return sum(int(torch.isnan(t).sum()) for t in tensors)


def test_one_nan_gradient_entry_is_not_spread_by_the_projection():
    """Plain AdamW turns one NaN gradient entry into one NaN weight; the projected wrapper must do no worse,
    say so (warning, nonfinite_steps) and report the step's vertical fraction as NaN, not 0."""
    def poison(model):
        next(p for n, p in model.named_parameters() if "c_attn.weight" in n).grad[0, 0] = float("nan")

    plain = _gpt(lrm=False)
    wrapped = copy.deepcopy(plain)
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), steps=1, hook=poison)
    opt = gaugeopt.GaugeOptimizer(torch.optim.AdamW(wrapped.parameters(), lr=1e-2), wrapped)
    with pytest.warns(RuntimeWarning, match="not projected"):
        _train(wrapped, opt, steps=1, hook=poison)
    assert _nan_count(plain.parameters()) == 1
    assert _nan_count(wrapped.parameters()) == 1
    assert opt.nonfinite_steps == 1 and opt.state_dict()["gauge_projected"]["nonfinite_steps"] == 1
    assert opt.last_vertical_fraction != opt.last_vertical_fraction  # NaN


def test_one_nan_weight_is_left_alone_by_gauge_fix():
    """One NaN weight in a plain model: the fix leaves that slot alone (no NaN spreads to the head or to
    Adam's state), warns and counts it; the other groups are fixed."""
    model = _gpt(lrm=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, steps=2)
    site = find_attention(model)[0]
    with torch.no_grad():
        site.q.weight.get()[0, 0, 0] = float("nan")
    with pytest.raises(GaugeError, match="NaN or infinite values .* nothing can be proved"):
        gaugeopt.gauge_fix(model, opt, mode="plain")  # not proved yet: a proof needs a finite forward
    proved = _gpt(lrm=False)  # the same structure, proved while finite: the proof stamps travel with copies
    gaugeopt.gauge_fix(proved)
    model = copy.deepcopy(proved)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, steps=2)
    site = find_attention(model)[0]
    with torch.no_grad():
        site.q.weight.get()[0, 0, 0] = float("nan")
    states = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    assert _nan_count(states) == 0
    with pytest.warns(RuntimeWarning, match="NaN or infinite weight"):
        report = gaugeopt.gauge_fix(model, opt, mode="plain")
    assert _nan_count(model.parameters()) == 1 and _nan_count(states) == 0
    assert report.nonfinite_groups == 1 and report.as_dict()["gaugefix/nonfinite_groups"] == 1.0
    assert report.max_drift_after < 1e-6  # over the finite slots, every other group balanced


def test_bf16_report_is_the_drift_of_the_stored_weights():
    """A bf16 model: the drift the report gives after a fix is the one measured on the stored weights
    (rounding to bf16 leaves ~1e-3, which a drift computed from the factors would hide)."""
    model = _gpt(lrm=False, dtype=torch.bfloat16)
    site = find_attention(model)[1]
    with torch.no_grad():
        site.q.weight.get().mul_(3.0)
    report = gaugeopt.gauge_fix(model, mode="plain")
    stored = gaugeopt.qk_drift(model, mode="plain", granularity="plane")
    assert report.max_drift_before > 1.0
    assert report.max_drift_after == pytest.approx(stored, rel=1e-5, abs=0.0)
    assert report.max_drift_after > 1e-5  # what bf16 rounding leaves, not the factors' 1e-8
    assert report.rounding_floor == torch.finfo(torch.bfloat16).eps and report.limited_by_rounding


def test_random_gauge_transform_defaults_to_each_sites_own_qk_gauge():
    """The default kinds used to refuse every QK-norm model ('qk' is not its gauge); now they mean each
    layer's own Q/K gauge — the gains under a QK-norm — with V/O and head permutations."""
    case = zoo.build("hf_qwen3")
    with pytest.raises(GaugeError, match="kind 'qk' does not apply"):  # asked for explicitly: still refused
        gaugeopt.random_gauge_transform(case.copy(), ("qk", "vo"), generator=0)
    from qk_norm_helpers import float64_norms

    with float64_norms():
        moved = gaugeopt.random_gauge_transform(case.copy(), generator=0)
        assert gaugeopt.relative_change(case.logits(), case.logits(moved)) <= VALID_TOL
    gains = [(n, p) for n, p in moved.named_parameters() if "q_norm" in n]
    assert any(not torch.equal(p, dict(case.model.named_parameters())[n]) for n, p in gains)  # the gains moved
