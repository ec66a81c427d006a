"""``gaugeopt.muon_param_groups``: Muon for the blocks' hidden matrices, AdamW for embeddings, head,
gains and biases — checked against listings written out by hand per family, and run: Muon beside
AdamW trains a Hugging Face Llama with learnable multipliers and a fix transports both states."""

from __future__ import annotations

import pytest
import torch

import gaugeopt
import zoo
from gaugeopt.errors import GaugeError


def _split(model) -> dict[str, set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = gaugeopt.muon_param_groups(model)
    assert [g["name"] for g in muon] in ([], ["hidden"])
    out = {g["name"]: {names[id(p)] for p in g["params"]} for g in muon + adamw}
    listed = [n for g in out.values() for n in g]
    assert len(listed) == len(set(listed))  # each tensor in one group
    assert set(listed) == {n for n, p in model.named_parameters() if p.requires_grad}  # and every one somewhere
    return out


@pytest.mark.parametrize("lrm", [False, True])
def test_hf_llama_against_a_hand_listing(lrm):
    model = zoo.build("hf_llama", 0, lrm=lrm).model
    split = _split(model)
    params = dict(model.named_parameters())
    assert split["hidden"] == {n for n, p in params.items() if p.dim() == 2 and n.startswith("model.layers.")}
    assert len(split["hidden"]) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert split["embeddings"] == {"model.embed_tokens.weight"} and split["head"] == {"lm_head.weight"}
    assert split["scalars"] == {n for n, p in params.items() if p.dim() == 1}  # norms, biases (and r, c)
    # control: the usual one-liner, "every matrix to Muon", also hands Muon the embedding table and the head
    naive = {n for n, p in params.items() if p.dim() == 2}
    assert naive - split["hidden"] == {"model.embed_tokens.weight", "lm_head.weight"}


FAMILIES = {  # name: (embeddings, head, hidden matrices per block, hidden_nd)
    "gpt": ({"transformer.wte.weight", "transformer.wpe.weight"}, set(), 4, set()),  # tied head: the table
    "hf_gpt2": ({"transformer.wte.weight", "transformer.wpe.weight"}, set(), 4, set()),  # Conv1D, tied
    "torch_mha": ({"emb.weight"}, {"head.weight"}, 2, set()),  # one attention, in no list: its own block
    "timm_vit": ({"cls_token", "pos_embed", "patch_embed.proj.weight"}, {"head.weight"}, 4, set()),
    "torchtitan_separate": ({"tok_embeddings.weight"}, {"lm_head.weight"}, 7, set()),  # layers: a ModuleDict
    "hf_t5": ({"shared.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
               "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"}, set(), None, set()),
    "hf_mixtral": ({"model.embed_tokens.weight"}, {"lm_head.weight"}, None,
                   {f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("gate_up_proj", "down_proj")}),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_families_against_hand_listings(name):
    embeddings, head, per_block, hidden_nd = FAMILIES[name]
    model = zoo.build(name, 0).model
    split = _split(model)
    assert split.get("embeddings", set()) == embeddings
    assert split.get("head", set()) == head
    assert split.get("hidden_nd", set()) == hidden_nd
    assert all(dict(model.named_parameters())[n].dim() == 2 for n in split["hidden"])
    if per_block is not None:
        blocks = len(gaugeopt.find_attention(model))
        assert len(split["hidden"]) == per_block * blocks
    if name == "hf_t5":  # nested lists: the block is encoder.block.i (attention and MLP), not its layer.0
        assert "encoder.block.0.layer.1.DenseReluDense.wi.weight" in split["hidden"]
        assert "decoder.block.1.layer.2.DenseReluDense.wo.weight" in split["hidden"]


def test_muon_beside_adamw_on_a_hugging_face_llama():
    torch.manual_seed(0)
    model = zoo.build("hf_llama", 1, lrm=True).model.float().train()
    model.model.layers[1].mlp.down_proj.weight.requires_grad_(False)  # frozen: in no group
    muon_groups, adamw_groups = gaugeopt.muon_param_groups(model)
    for g in adamw_groups:
        g["lr"] = {"embeddings": 3e-2, "head": 3e-3}.get(g["name"], 1e-2)
    muon, adamw = torch.optim.Muon(muon_groups, lr=2e-2), torch.optim.AdamW(adamw_groups)
    assert "model.layers.1.mlp.down_proj.weight" not in _split(model)["hidden"]
    x = zoo.build("hf_llama", 1).inputs
    losses = []
    for _ in range(6):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        muon.step(); adamw.step(); muon.zero_grad(); adamw.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert all(p in {q for g in muon.param_groups for q in g["params"]} for g in muon_groups for p in g["params"])
    report = gaugeopt.gauge_fix(model, [muon, adamw])  # r_Q, r_K are AdamW's: their moments move there
    assert report.transported and not report.left


def test_refusals():
    with pytest.raises(GaugeError, match="expected the model"):
        gaugeopt.muon_param_groups(list(zoo.build("gpt", 0).model.parameters()))
    with pytest.raises(GaugeError, match="no attention"):
        gaugeopt.muon_param_groups(torch.nn.Sequential(torch.nn.Linear(4, 4)))
