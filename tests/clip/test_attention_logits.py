"""``gaugeopt.max_attention_logits``: per-head maxima rebuilt from the records on each layer's real call,
against the scores the model itself forms (SDPA's or eager's arguments, ``logits_helpers``), in float64:
GQA/MQA, RoPE interleaved / split-half / partial, biases, learnable multipliers, QK-norm (GPT, Qwen3,
OLMo 2, Gemma 3), causal and padding masks, sliding windows, soft caps; the float64 replay check and
its power; refusals."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import gaugeopt
import zoo
from gaugeopt import GaugeError
from gaugeopt.clip import scores as scores_mod
from gaugeopt.clip.logits import LogitTracker, check_reader
from logits_helpers import eager_maxima, sdpa_maxima
from qk_norm_helpers import exact

SDPA_CASES = [
    ("gpt", False), ("gpt_nobias", False), ("gpt_gqa", False), ("gpt_mqa", False), ("gpt_rope_interleaved", False),
    ("gpt_rope_split_half_gqa", False), ("gpt_rope_partial_interleaved", False), ("gpt_rope_partial_split_half", False),
    ("gpt", True), ("gpt_rope_split_half_gqa", True), ("gpt_rope_interleaved", True),
    ("gpt_qknorm", False), ("gpt_qknorm_partial_interleaved", False), ("gpt_qknorm", True),
    ("hf_gpt2", False), ("hf_gpt2", True), ("hf_llama", False), ("hf_llama", True), ("hf_qwen2", False), ("hf_mistral", False),
    ("hf_qwen3", False), ("hf_olmo2", False), ("hf_gemma3", False), ("hf_mixtral", False), ("hf_phi3_partial", False),
    ("hf_gemma", False), ("hf_olmo", False),
    ("nanogpt", False),
]
IDS = [n + ("+lrm" if lrm else "") for n, lrm in SDPA_CASES]


def _maxima(case, model=None, sites=None, **kwargs) -> torch.Tensor:
    model = case.model if model is None else model
    sites = gaugeopt.find_attention(model) if sites is None else sites
    if case.name.startswith(("gpt", "nanogpt")):
        m = gaugeopt.max_attention_logits(model, case.inputs, sites=sites, **kwargs)
    else:
        m = gaugeopt.max_attention_logits(model, input_ids=case.inputs, sites=sites, **kwargs)
    return torch.stack([m[s.name] for s in sites])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name, lrm", SDPA_CASES, ids=IDS)
def test_maxima_equal_the_scores_sdpa_forms(name, lrm):
    case = zoo.build(name, lrm=lrm)
    sites = gaugeopt.find_attention(case.model)  # before the float64 norms: the adapters refuse a patched norm
    with exact(name):
        with sdpa_maxima() as seen:
            case.logits()
        got = _maxima(case, sites=sites)
    ref = torch.stack(seen)
    assert got.dtype == torch.float64 and got.shape == ref.shape == (len(seen), ref.shape[1])
    assert _rel(got, ref) <= 1e-12
    # not vacuous: the heads differ, and without the causal mask the maxima would be larger
    assert float(ref.std()) > 1e-3


def _padded(case, left: bool):
    ids = case.inputs.clone()
    mask = torch.ones_like(ids)
    if left:
        mask[0, :4] = 0
    else:
        mask[1, -5:] = 0
    return ids, mask


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2", "hf_qwen2"])
@pytest.mark.parametrize("left", [True, False], ids=["left_pad", "right_pad"])
def test_padding_masks(name, left):
    case = zoo.build(name)
    ids, mask = _padded(case, left)
    with sdpa_maxima() as seen:
        case.model(input_ids=ids, attention_mask=mask)
    ref = torch.stack(seen)
    got = gaugeopt.max_attention_logits(case.model, input_ids=ids, attention_mask=mask)
    got = torch.stack(list(got.values()))
    assert _rel(got, ref) <= 1e-12
    if left:  # control: real queries may not see the padded keys ahead of them, which changes the maxima
        assert _rel(_maxima(case), ref) > 1e-6


@pytest.mark.parametrize("name, family", [("hf_gemma2_softcap", "gemma2"), ("hf_llama_eager", "llama")])
def test_eager_kernel_with_mask_window_and_softcap(name, family):
    """Gemma 2 (eager: soft cap 5, sliding window 4 on every other layer) and Llama with the eager kernel and
    a right-padded batch's additive float mask: the maxima are the scores eager forms, before the soft cap.
    (Hugging Face's eager float64 forward turns a left-padded sequence into NaN: its padded rows see no key.)"""
    case = zoo.build("hf_llama" if name == "hf_llama_eager" else name)
    ids, mask = _padded(case, left=False)
    if name == "hf_llama_eager":
        case.model.config._attn_implementation = "eager"
    else:
        mask = None
    with eager_maxima(family) as seen:
        case.model(input_ids=ids, attention_mask=mask)
    got = torch.stack(list(gaugeopt.max_attention_logits(case.model, input_ids=ids, attention_mask=mask).values()))
    assert _rel(got, torch.stack(seen)) <= 1e-12
    if name == "hf_gemma2_softcap":
        assert float(got.max()) > 5.0  # above the cap: the maximum is the score before it


def test_torch_multihead_attention_masks():
    """nn.MultiheadAttention with a boolean attn_mask (True = masked) and a key_padding_mask."""
    case = zoo.build("torch_mha")
    site = gaugeopt.find_attention(case.model)[0]
    with torch.no_grad():
        x = case.model.emb(case.inputs)
    t = x.shape[1]
    attn_mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    pad = torch.zeros(x.shape[0], t, dtype=torch.bool)
    pad[1, -3:] = True
    with LogitTracker([site]) as tracker, torch.no_grad():
        case.model.attn(x, x, x, attn_mask=attn_mask, key_padding_mask=pad, need_weights=False)
    got = tracker.pop()[site.name]
    wq, bq = site.effective("q")
    wk, bk = site.effective("k")
    q = torch.einsum("btd,hcd->bhtc", x, wq) + bq[None, :, None]
    k = torch.einsum("btd,hcd->bhtc", x, wk) + bk[None, :, None]
    s = q @ k.transpose(-1, -2) / site.d_k**0.5
    allowed = ~attn_mask[None, None] & ~pad[:, None, None, :]
    ref = s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
    assert _rel(got, ref) <= 1e-12


def test_bf16_autocast_computes_in_float32():
    """Under bf16 autocast the hook sees bf16 inputs; the maxima are formed in float32 from them."""
    case = zoo.build("gpt_rope_split_half_gqa", dtype=torch.float32)
    sites = gaugeopt.find_attention(case.model)
    with LogitTracker(sites) as tracker, torch.autocast("cpu", dtype=torch.bfloat16), sdpa_maxima() as seen:
        case.logits()
    got = tracker.pop()
    assert all(v.dtype == torch.float32 for v in got.values())
    ref = torch.stack(seen).float()  # the bf16 kernel's own scores
    assert _rel(torch.stack(list(got.values())), ref) <= 2e-2  # bf16 q, k against float32 ones


def test_running_maximum_over_calls_and_grad_only():
    case = zoo.build("gpt_gqa")
    sites = gaugeopt.find_attention(case.model)
    other = torch.randint(0, zoo.VOCAB, case.inputs.shape, generator=torch.Generator().manual_seed(9))
    a = gaugeopt.max_attention_logits(case.model, case.inputs)
    b = gaugeopt.max_attention_logits(case.model, other)
    with LogitTracker(sites, grad_only=True) as tracker:
        case.model(case.inputs)
        case.model(other)
        with torch.no_grad():  # a validation forward: not read
            case.model(other * 0 + 1)
    both = tracker.pop()
    for s in sites:
        assert torch.equal(both[s.name], torch.maximum(a[s.name], b[s.name]))
        assert tracker.calls[s.name] == 2
    assert tracker.pop() == {}  # pop forgets


def test_certificate_copies_are_not_counted():
    """A copy of a hooked module (the certificate reruns copies) carries the hook but is not read."""
    case = zoo.build("gpt")
    sites = gaugeopt.find_attention(case.model)
    with LogitTracker(sites) as tracker:
        copy.deepcopy(sites[0].module)(torch.randn(1, 4, 32, dtype=torch.float64))
    assert tracker.calls == {}


def test_nan_weights_give_nan_not_a_number():
    case = zoo.build("gpt_gqa")
    gaugeopt.certify(case.model, case.inputs)  # proved while finite (a proof on a NaN forward is refused)
    site = gaugeopt.find_attention(case.model)[1]
    with torch.no_grad():
        site.q.weight.get()[2, 0, 0] = float("nan")
    m = gaugeopt.max_attention_logits(case.model, case.inputs, check=False)[site.name]
    assert torch.isnan(m[2]) and torch.isfinite(m[[0, 1, 3]]).all()


# ---------------------------------------------------------------------- the check and its power
def _broken(monkeypatch, kind, change):
    reader = scores_mod.READERS[kind]

    def wrong(site, args, kwargs):
        return change(reader(site, args, kwargs))

    monkeypatch.setitem(scores_mod.READERS, kind, wrong)


@pytest.mark.parametrize("fault", ["scale", "no_mask", "rope_sign", "no_softcap"])
def test_check_refuses_a_wrong_reconstruction(monkeypatch, fault):
    name = "hf_gemma2_softcap" if fault == "no_softcap" else "gpt_rope_split_half_gqa"
    case = zoo.build(name)
    kind = "hf_gemma2" if fault == "no_softcap" else "gpt"
    change = {
        "scale": lambda sc: dataclasses.replace(sc, scale=sc.scale * 1.01),
        "no_mask": lambda sc: dataclasses.replace(sc, allowed=None),
        "rope_sign": lambda sc: dataclasses.replace(sc, rope_q=(sc.rope_q[0], -sc.rope_q[1]), rope_k=(sc.rope_k[0], -sc.rope_k[1])),
        "no_softcap": lambda sc: dataclasses.replace(sc, softcap=None),
    }[fault]
    _broken(monkeypatch, kind, change)
    with pytest.raises(GaugeError, match="rebuilt from the record"):
        _maxima(case)


def test_check_passes_and_is_cached():
    case = zoo.build("gpt_rope_partial_split_half")
    site = gaugeopt.find_attention(case.model)[0]
    with LogitTracker([site]) as tracker:
        case.logits()
    assert len(tracker._pending) == 1
    tracker.pop()
    with LogitTracker([site]) as tracker:
        case.logits()
    assert tracker._pending == {}  # checked once per module and record structure
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    assert check_reader(site, (x,), {}) <= 1e-12


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("name", ["hf_bloom", "hf_t5", "hf_falcon_mha_alibi", "hf_opt"])
def test_families_without_a_reader_are_refused(name):
    case = zoo.build(name)
    with pytest.raises(GaugeError, match="does not read yet"):
        with LogitTracker(gaugeopt.find_attention(case.model)):
            case.logits()


def test_generation_cache_refused():
    case = zoo.build("hf_llama")
    out = case.model(input_ids=case.inputs[:, :6], use_cache=True)
    with pytest.raises(GaugeError, match="key/value cache"):
        gaugeopt.max_attention_logits(case.model, input_ids=case.inputs[:, 6:7], cache=out.past_key_values)


def test_layer_not_called_is_an_error():
    case = zoo.build("gpt")
    gaugeopt.certify(case.model, case.inputs)
    sites = gaugeopt.find_attention(case.model)
    with pytest.raises(GaugeError, match="never called"):
        gaugeopt.max_attention_logits(sites[0].module, torch.randn(1, 4, 32, dtype=torch.float64), sites=sites)
