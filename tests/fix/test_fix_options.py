"""One options object for the fix (gaugeopt.fix.options.FixOptions): every entry point validates it
the same way, reads it the same way, and gives the same fix whether the options come as keyword
arguments, as one object, or as both."""

from __future__ import annotations

import copy

import pytest
import torch

import gaugeopt
from gaugeopt import GaugeError
from gaugeopt.fix.drift import drift_table
from gaugeopt.fix.gaugefix import GaugeFixer
from gaugeopt.fix.options import FIELDS, FixOptions
from gaugeopt.fix.plan import plan_pairs
from gaugeopt.integrations.steps import FixSteps
from gaugeopt.models import GPT, GPTConfig

VOCAB, T = 32, 12

BAD = [  # (field, value, what the message says)
    ("granularity", "row", "granularity='row' is not one of"),
    ("vo_granularity", "plane", "vo_granularity='plane' is not one of"),
    ("mode", "lrn", "mode='lrn' is not one of"),
    ("unknown_state", "ignore", "unknown_state='ignore' is not one of"),
    ("backend", "cuda", "backend='cuda' is not one of"),
    ("transport_state", "yes", "transport_state='yes' must be True or False"),
    ("vo", 1, "vo=1 must be True or False"),
    ("rescale_frozen", None, "rescale_frozen=None must be True or False"),
    ("eps", 0.0, "eps=0.0 must be > 0"),
    ("product_decay", 1.0, "product_decay=1.0 must be in"),
    ("product_decay", "0.1", "product_decay='0.1' must be in"),
    ("product_max", -1.0, "product_max=-1.0 must be > 0"),
]


def _model(seed=0, rope="split_half"):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, rope=rope)
    return gaugeopt.apply_lrm(GPT(cfg))


def _trained(seed=0, steps=3):
    """A model with drift in both gauges and an AdamW holding state of every tensor."""
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (4, T), generator=g)
        model(x, x.roll(-1, 1))[1].backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _wrapper(options=None, **fields):
    model = _model()
    return gaugeopt.GaugeOptimizer(torch.optim.AdamW(model.parameters()), model, project=None, fix_every=1,
                                   fix_kwargs={"options": options, **fields} if options is not None else fields)


def _entry_points():
    """Each entry point that takes the fix's options, as ``build(options=..., **fields)``."""
    pts = {
        "FixOptions": lambda options=None, **kw: FixOptions(**kw) if options is None else options.replace(**kw),
        "gauge_fix": lambda **kw: gaugeopt.gauge_fix(None, **kw),
        "GaugeFixer": lambda **kw: GaugeFixer(None, **kw),
        "FixSteps": lambda **kw: FixSteps(every=1, **kw),
        "GaugeOptimizer": _wrapper,
    }
    try:
        from gaugeopt.integrations.transformers import GaugeFixCallback
        pts["GaugeFixCallback"] = lambda **kw: GaugeFixCallback(every=1, **kw)
    except ImportError:
        pass
    try:
        from gaugeopt.integrations.lightning import GaugeFix
        pts["GaugeFix"] = lambda **kw: GaugeFix(every=1, **kw)
    except ImportError:
        pass
    return pts


ENTRY_POINTS = _entry_points()


@pytest.mark.parametrize("where", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("field,value,message", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_every_entry_point_refuses_a_wrong_option_naming_it_before_reading_the_model(where, field, value, message):
    """gauge_fix(None, ...) and GaugeFixer(None, ...) have no model: the options are refused before that
    is noticed; the callbacks refuse at construction, not at setup or at step N."""
    with pytest.raises(GaugeError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ENTRY_POINTS[where](**{field: value})


@pytest.mark.parametrize("where", sorted(ENTRY_POINTS))
def test_every_entry_point_refuses_a_name_that_is_not_an_option(where):
    with pytest.raises(TypeError, match="unexpected keyword argument 'granularty'"):
        ENTRY_POINTS[where](granularty="head")


def test_a_valid_call_passes_every_entry_point_check():
    """Negative control of the two tests above: the same entry points accept valid options (the
    model-free ones then refuse for want of a model, and say so)."""
    for where, build in ENTRY_POINTS.items():
        if where in ("gauge_fix", "GaugeFixer"):
            with pytest.raises(GaugeError, match="pass a model"):
                build(granularity="head", vo=True, options=FixOptions(eps=1e-9))
        else:
            build(granularity="head", vo=True, options=FixOptions(eps=1e-9))


def test_options_must_be_a_fix_options():
    with pytest.raises(GaugeError, match="options=.*must be a gaugeopt.fix.options.FixOptions"):
        gaugeopt.gauge_fix(_model(), options={"vo": True})


def test_the_object_is_frozen_a_mapping_of_its_fields_and_replaces_by_validating():
    opts = FixOptions(granularity="head", vo=True, product_max=2.0)
    assert dict(opts) == opts.as_dict() and list(opts.as_dict()) == list(FIELDS)
    assert {**opts}["product_max"] == 2.0 and opts["vo"] is True and opts.kinds == ("qk", "vo")
    with pytest.raises(KeyError):
        opts["every"]
    with pytest.raises(AttributeError):
        opts.vo = False  # frozen
    assert opts.replace(vo=False).kinds == ("qk",) and opts.vo  # a copy
    with pytest.raises(GaugeError, match="product_decay"):
        opts.replace(product_decay=2.0)
    assert FixOptions(**dict(opts)) == opts


def _fix_result(how, seed=0):
    model, opt = _trained(seed)
    report = how(model, opt)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    return report, params, state


def _same(a, b) -> bool:
    _, pa, sa = a
    _, pb, sb = b
    return all(torch.equal(pa[n], pb[n]) for n in pa) and all(
        torch.equal(v, sb[n][k]) for n in sa for k, v in sa[n].items())


def test_keywords_an_options_object_and_both_give_the_same_fix_and_other_options_another():
    opts = FixOptions(granularity="head", vo=True, product_max=0.5)
    ways = {
        "keywords": lambda m, o: gaugeopt.gauge_fix(m, o, granularity="head", vo=True, product_max=0.5),
        "positional granularity": lambda m, o: gaugeopt.gauge_fix(m, o, "head", vo=True, product_max=0.5),
        "options": lambda m, o: gaugeopt.gauge_fix(m, o, options=opts),
        "options and keywords": lambda m, o: gaugeopt.gauge_fix(m, o, options=opts.replace(vo=False), vo=True),
        "fixer": lambda m, o: GaugeFixer(m, o, options=opts)(),
    }
    results = {name: _fix_result(how) for name, how in ways.items()}
    ref = results.pop("keywords")
    assert ref[0].max_drift_before > 1e-3 and any(p.kind == "vo" for p in ref[0].pairs)
    for name, res in results.items():
        assert _same(res, ref), name
    # negative controls: the check sees a change of any one option
    for other in (dict(granularity="plane"), dict(vo=False), dict(product_max=None)):
        assert not _same(_fix_result(lambda m, o: gaugeopt.gauge_fix(m, o, options=opts.replace(**other))), ref), other


def test_keywords_replace_the_fields_of_the_options_they_come_with():
    fixer = GaugeFixer(_model(), options=FixOptions(granularity="head", vo=True), granularity="plane", eps=1e-6)
    assert fixer.options == FixOptions(granularity="plane", vo=True, eps=1e-6)
    assert {p.granularity for p in fixer.plans if p.kind == "qk"} == {"plane"}


def test_fix_steps_and_its_callbacks_pass_every_option_to_their_fixer():
    """The callbacks take every field now (eps, backend, rescale_frozen too) and build their fixer from
    the same object: a frozen r_K is rescaled with rescale_frozen=True, left out without."""
    for rescale_frozen in (False, True):
        model, opt = _trained()
        site = gaugeopt.find_attention(model)[0]
        site.k.row_mult.param.requires_grad_(False)
        fix = FixSteps(every=1, options=FixOptions(granularity="head"), rescale_frozen=rescale_frozen).watch(model, opt)
        assert fix._fixer.options is fix.options and fix.options.rescale_frozen is rescale_frozen
        report = fix._fixer_for(opt)()
        assert bool(report.frozen) is not rescale_frozen


def test_the_trainer_callback_stores_every_option_and_is_rebuilt_from_them():
    pytest.importorskip("transformers")
    from gaugeopt.integrations.transformers import GaugeFixCallback

    cb = GaugeFixCallback(every=7, options=FixOptions(vo=True, eps=1e-9), mode="plain", prefix="g/")
    args = cb.state()["args"]
    assert {k: args[k] for k in FIELDS} == cb.options.as_dict() and args["every"] == 7 and args["prefix"] == "g/"
    rebuilt = GaugeFixCallback(**args)
    assert rebuilt.options == cb.options and rebuilt.state() == cb.state()
    # arguments a checkpoint of an earlier release stored (no eps, backend, rescale_frozen) still build it
    old = {k: v for k, v in args.items() if k not in ("eps", "backend", "rescale_frozen")}
    assert GaugeFixCallback(**old).options == cb.options.replace(eps=1e-12)


def test_the_optimizer_wrapper_takes_the_options_as_an_object_or_a_dict():
    def run(fix_kwargs):
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=3e-2)
        opt = gaugeopt.GaugeOptimizer(inner, model, project=None, fix_every=2, fix_kwargs=fix_kwargs)
        g = torch.Generator().manual_seed(0)
        for _ in range(4):
            x = torch.randint(0, VOCAB, (4, T), generator=g)
            model(x, x.roll(-1, 1))[1].backward()
            opt.step()
            opt.zero_grad()
        assert opt.fixer.options == opt.fix_options
        return opt.fix_options, {n: p.detach().clone() for n, p in model.named_parameters()}

    o1, p1 = run({"granularity": "head", "vo": True})
    o2, p2 = run(FixOptions(granularity="head", vo=True))
    o3, p3 = run({"granularity": "plane"})
    assert o1 == o2 == FixOptions(granularity="head", vo=True)
    assert all(torch.equal(p1[n], p2[n]) for n in p1)
    assert not all(torch.equal(p1[n], p3[n]) for n in p1)  # negative control
    # a wrong option is refused at construction, with or without fix_every
    model = _model()
    with pytest.raises(GaugeError, match="granularity='row'"):
        gaugeopt.GaugeOptimizer(torch.optim.AdamW(model.parameters()), model, fix_kwargs={"granularity": "row"})


def test_drift_metrics_measure_at_the_slots_of_the_options_given():
    model, _ = _trained()
    sites = gaugeopt.find_attention(model)
    opts = FixOptions(granularity="plane", vo=True, vo_granularity="channel")
    by_options = drift_table(None, sites, options=opts)
    by_keywords = drift_table(None, sites, kinds=("qk", "vo"), granularity="plane", vo_granularity="channel")
    assert [(t.kind, t.granularity) for t in by_options] == [(t.kind, t.granularity) for t in by_keywords]
    assert all(torch.equal(a.drift, b.drift) for a, b in zip(by_options, by_keywords))
    assert {t.granularity for t in drift_table(None, sites)} == {"head"}  # the paper's metric by default
    assert gaugeopt.qk_drift(model, options=opts) == gaugeopt.qk_drift(model, granularity="plane")
    assert gaugeopt.qk_drift(model, options=opts) > gaugeopt.qk_drift(model)  # finer slots: a larger max
    assert gaugeopt.vo_drift(model, options=opts) == gaugeopt.vo_drift(model, granularity="channel")
    with pytest.raises(TypeError, match="unexpected keyword argument 'vo'"):
        drift_table(model, vo=True)  # kinds says what is measured
    plans = plan_pairs(sites, opts)
    assert [p.kind for p in plans] == ["qk", "vo"] * len(sites)


def test_a_fix_steps_copy_keeps_its_options():
    fix = FixSteps(every=3, vo=True)
    assert copy.deepcopy(fix).options == fix.options


@pytest.mark.parametrize("call", [
    lambda **kw: plan_pairs([], **kw),
    lambda **kw: drift_table(None, [], **kw),
    lambda **kw: gaugeopt.qk_drift(None, [], **kw),
], ids=["plan_pairs", "drift_table", "qk_drift"])
def test_plan_and_drift_validate_the_fields_they_read_through_the_same_object(call):
    """The fields a plan or a drift metric reads are checked by FixOptions (the same message as every
    other entry point); a field they do not read is a TypeError naming it, not silently ignored."""
    with pytest.raises(GaugeError, match="granularity='row' is not one of"):
        call(granularity="row")
    with pytest.raises(GaugeError, match="mode='lrn' is not one of"):
        call(mode="lrn")
    with pytest.raises(TypeError, match="unexpected keyword argument 'transport_state'"):
        call(transport_state=False)
    call(granularity="head", mode="plain")  # the control: valid fields pass


def test_every_field_is_documented_in_the_docstring_and_the_docs_table():
    """docs/gaugefix.md has one table row per field, with the field's default; FixOptions' docstring
    describes each field. A new field without documentation fails here."""
    import dataclasses
    import pathlib
    import re

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "gaugefix.md").read_text()
    doc = doc.split("\n## Options\n")[1].split("\n## ")[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| `?([^|`]+?)`? \|", doc, flags=re.M))
    defaults = {f.name: f.default for f in dataclasses.fields(FixOptions)}
    assert list(rows) == list(FIELDS)
    for name, default in defaults.items():
        assert rows[name] == (repr(default).replace("'", '"')), (name, rows[name])
    attributes = FixOptions.__doc__.split("Attributes:")[1]
    assert all(re.search(rf"^\s+{name}: \S", attributes, flags=re.M) for name in FIELDS)
