"""The papers' procedures as written, for the errata tests (docs/errata.md): nothing here is gaugeopt's way.

* :func:`algorithm1_qr` — paper 000 Algorithm 1 (QR canonical slice), per head, in PyTorch layout
  (``W_Q[i] = (W_Q^{(i)})ᵀ``): ``W_Q^{(i)} = Q R`` with positive diagonal → ``A = R⁻¹``; likewise
  ``W_V``; then heads sorted by ``‖W_K^{(i)}‖_F`` descending. Biases travel covariantly
  (paper 000 Prop. 12), the output bias stays.
* :func:`algorithm3_merge` — paper 000 Algorithm 3 (000:1293–1311): Algorithm 1 on both models;
  Hungarian matching on ``D_ij = ‖W_Q1^(i) − W_Q2^(j)‖ + ‖W_K1^(i) − W_K2^(j)‖``; per head
  ``A_i = argmin ‖W_Q1^(i) − W_Q2^(i) A‖`` applied as ``(A_i, I_dv)``; average.
* :func:`paper003_rotation` — paper 003 §4.4 (003:150–158): one rotation ``g ∈ SO(d−1)`` fixing the
  all-ones vector, writers ``g·``, readers ``·gᵀ``, LayerNorms untouched, the tied head the rotated
  embedding.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import gaugeopt
from gaugeopt.transforms import act_qk, act_vo, permute_heads
from gaugeopt.flat.stream import find_stream


def algorithm1_qr(site) -> None:
    """Paper 000 Algorithm 1 on one site, in place (module docstring)."""
    wq, _ = site.effective("q")
    wv, _ = site.effective("v")
    A = torch.empty(site.h_kv, site.d_k, site.d_k, dtype=torch.float64)
    C = torch.empty(site.h_kv, site.d_v, site.d_v, dtype=torch.float64)
    for i in range(site.h):
        _, R = torch.linalg.qr(wq[i].mT)
        R = torch.sign(torch.diagonal(R))[:, None] * R
        A[i] = torch.linalg.inv(R)
        _, RV = torch.linalg.qr(wv[i].mT)
        RV = torch.sign(torch.diagonal(RV))[:, None] * RV
        C[i] = torch.linalg.inv(RV)
    act_qk(site, A)
    act_vo(site, C)
    wk, _ = site.effective("k")
    permute_heads(site, torch.argsort(wk.flatten(1).norm(dim=1), descending=True))


def algorithm3_merge(model_a: nn.Module, model_b: nn.Module) -> nn.Module:
    """Paper 000 Algorithm 3 as written (module docstring); returns the merged model."""
    from scipy.optimize import linear_sum_assignment

    a, b = copy.deepcopy(model_a), copy.deepcopy(model_b)
    for x, y in zip(gaugeopt.find_attention(a), gaugeopt.find_attention(b)):
        algorithm1_qr(x)
        algorithm1_qr(y)
        qa, ka = x.effective("q")[0], x.effective("k")[0]
        qb, kb = y.effective("q")[0], y.effective("k")[0]
        D = (qa[:, None] - qb[None]).flatten(2).norm(dim=2) + (ka[:, None] - kb[None]).flatten(2).norm(dim=2)
        _, col = linear_sum_assignment(D.numpy())
        permute_heads(y, torch.as_tensor(col))
        qb = y.effective("q")[0]
        act_qk(y, torch.stack([torch.linalg.lstsq(qb[i].mT, qa[i].mT).solution for i in range(y.h)]))
    merged = copy.deepcopy(a)
    sd_b = b.state_dict()
    with torch.no_grad():
        for k, t in merged.state_dict().items():
            if t.is_floating_point():
                t.copy_(0.5 * (t + sd_b[k]))
    return merged


def haar_rotation_fixing_ones(d: int, g: torch.Generator) -> torch.Tensor:
    """A Haar-random element of SO(d−1) acting on 1^⊥ (it fixes the all-ones vector)."""
    ones = torch.full((d, 1), d**-0.5, dtype=torch.float64)
    U = torch.linalg.qr(torch.cat([ones, torch.eye(d, dtype=torch.float64)[:, : d - 1]], 1))[0][:, 1:]
    Q, R = torch.linalg.qr(torch.randn(d - 1, d - 1, generator=g, dtype=torch.float64))
    Q = Q * torch.sign(torch.diagonal(R))[None, :]
    if torch.det(Q) < 0:
        Q[:, 0] = -Q[:, 0]
    return U @ Q @ U.T + ones @ ones.T


@torch.no_grad()
def paper003_rotation(model: nn.Module, R: torch.Tensor) -> None:
    """Paper 003's residual rotation as written, in place: embeddings and writers rotated, every reader
    ``W ← W Rᵀ``, LayerNorms untouched (a tied head is the rotated embedding)."""
    st = find_stream(model)
    for ref in (st.token_embedding, st.position_embedding):
        if ref is not None:
            ref.get().copy_(ref.get() @ R.T)
    for w in st.writers():
        W, b = w.read()
        w.write(R @ W, None if b is None else R @ b)
    for norm in st.norms():
        for r in st.readers(norm):
            W, _ = r.read()
            r.write(W @ R.T)


def gram_rank(columns: torch.Tensor, rtol: float = 1e-10) -> int:
    s = torch.linalg.svdvals(columns)
    return int((s > rtol * s[0]).sum())


def lemma27_min_singular_value(d: int = 6, n: int = 200, seed: int = 0) -> float:
    """The linearised equivariance ``LN(Mx) = M LN(x)`` at ``M = I + E`` over ``n`` random ``x``
    (generic ``γ, β``): smallest over largest singular value of the map ``E ↦ (J_x E x − E LN(x))_x``."""
    g = torch.Generator().manual_seed(seed)
    gamma = 1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    beta = 0.5 * torch.randn(d, generator=g, dtype=torch.float64)

    def ln(x):
        xc = x - x.mean(-1, keepdim=True)
        return gamma * xc / torch.sqrt((xc**2).mean(-1, keepdim=True)) + beta

    rows = []
    for x in torch.randn(n, d, generator=g, dtype=torch.float64):
        Jx = torch.autograd.functional.jacobian(ln, x)
        A = torch.einsum("ia,c->iac", Jx, x).reshape(d, d * d)
        A -= torch.einsum("ia,c->iac", torch.eye(d, dtype=torch.float64), ln(x)).reshape(d, d * d)
        rows.append(A)
    s = torch.linalg.svdvals(torch.cat(rows))
    return float(s[-1] / s[0])


def paper003_rotation_count(d: int) -> int:
    return (d - 1) * (d - 2) // 2


# ---------------------------------------------------------------------- per-head blocks in the papers' layout
def paper_heads(model: nn.Module, layer: int = 0) -> list[dict[str, torch.Tensor]]:
    """The heads of a bias-free gaugeopt ``GPT`` layer (multi-head attention) in the papers' layout, read
    straight from ``c_attn``/``c_proj`` (rows ``[q; k; v]``, ``d_k`` per head; ``c_proj`` columns per head):
    ``Q, K, V: (d, d_k)`` (``X W_Q``), ``O: (d_v, d)`` (paper 000's ``W_{O,i}``)."""
    attn = model.transformer.h[layer].attn
    W, P = attn.c_attn.weight.detach(), attn.c_proj.weight.detach()
    d, h = model.config.n_embd, model.config.n_head
    dk = d // h
    return [{"Q": W[i * dk:(i + 1) * dk].T, "K": W[d + i * dk:d + (i + 1) * dk].T,
             "V": W[2 * d + i * dk:2 * d + (i + 1) * dk].T, "O": P[:, i * dk:(i + 1) * dk].T} for i in range(h)]


@torch.no_grad()
def write_heads(model: nn.Module, heads: list[dict[str, torch.Tensor]], layer: int = 0) -> None:
    """Inverse of :func:`paper_heads`: write the blocks back into ``c_attn``/``c_proj``."""
    attn = model.transformer.h[layer].attn
    W, P = attn.c_attn.weight, attn.c_proj.weight
    d = model.config.n_embd
    dk = d // len(heads)
    for i, b in enumerate(heads):
        W[i * dk:(i + 1) * dk] = b["Q"].T
        W[d + i * dk:d + (i + 1) * dk] = b["K"].T
        W[2 * d + i * dk:2 * d + (i + 1) * dk] = b["V"].T
        P[:, i * dk:(i + 1) * dk] = b["O"].T


def head_generators(b: dict[str, torch.Tensor], sector: str) -> torch.Tensor:
    """The head's gauge generators, built from the definition (paper 000 Def. of ``G_max``): ``qk``:
    ``X ↦ (W_Q X, −W_K Xᵀ)``, ``vo``: ``Y ↦ (W_V Y, −Y W_O)``, one column per ``E_ab``, over the
    flattened ``(Q, K)`` or ``(V, O)`` blocks."""
    A, B = (b["Q"], b["K"]) if sector == "qk" else (b["V"], b["O"])
    n = A.shape[1]
    cols = []
    for a in range(n):
        for c in range(n):
            X = torch.zeros(n, n, dtype=A.dtype)
            X[a, c] = 1.0
            second = -B @ X.T if sector == "qk" else -X @ B
            cols.append(torch.cat([(A @ X).reshape(-1), second.reshape(-1)]))
    return torch.stack(cols, 1)


def least_squares_vertical(A: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of ``u`` onto ``span(A)`` (paper 004 Algorithm 1 with the dot product)."""
    return A @ torch.linalg.lstsq(A, u).solution


def algorithm2(b: dict[str, torch.Tensor], g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Paper 000 Algorithm 2 (000:1249–1279) on one head as written: the vertical part it removes.
    ``b``: the head's blocks, ``g``: the field's (same layout)."""
    pinv = torch.linalg.pinv
    X = pinv(b["Q"]) @ g["Q"]
    Y = -pinv(b["K"]) @ g["K"]
    Z = 0.5 * (X + Y.T)
    U = pinv(b["V"]) @ g["V"]
    V = -g["O"] @ pinv(b["O"])
    T = 0.5 * (U + V)
    return {"Q": b["Q"] @ Z, "K": -b["K"] @ Z.T, "V": b["V"] @ T, "O": -T @ b["O"]}


def adamw_update(model: nn.Module, steps: int = 3, seed: int = 0) -> tuple[dict, dict]:
    """``(update, point)``: the step AdamW takes after ``steps − 1`` steps on random tokens, and the
    parameters it starts from (copies)."""
    x = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        model(x, x.roll(-1, 1))[1].backward()
        opt.step()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, before


# ---------------------------------------------------------------------- paper 001 Definition 31
def _sym_power(S: torch.Tensor, p: float) -> torch.Tensor:
    w, U = torch.linalg.eigh(S)
    return (U * w**p) @ U.T


def definition31(heads: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Paper 001 Definition 31 (001:565–573) in the papers' layout: per head the symmetric positive
    definite ``A`` with ``(W_QA)ᵀ(W_QA) = (W_KA⁻ᵀ)ᵀ(W_KA⁻ᵀ)`` — ``AAᵀ = M`` with ``M P M = R``, the
    geometric mean of ``P⁻¹`` and ``R`` — and ``C = (W_VᵀW_V)^{-1/2}`` (``W_O ← C⁻¹W_O``), then heads
    sorted by ``‖W_Q‖_F`` descending."""
    out = []
    for b in heads:
        P, R = b["Q"].T @ b["Q"], b["K"].T @ b["K"]
        Ph, Pih = _sym_power(P, 0.5), _sym_power(P, -0.5)
        M = Pih @ _sym_power(Ph @ R @ Ph, 0.5) @ Pih
        A = _sym_power(M, 0.5)
        C = _sym_power(b["V"].T @ b["V"], -0.5)
        out.append({"Q": b["Q"] @ A, "K": b["K"] @ torch.linalg.inv(A).T, "V": b["V"] @ C,
                    "O": torch.linalg.inv(C) @ b["O"]})
    return sorted(out, key=lambda b: -float(b["Q"].norm()))


def definition31_defect(heads: list[dict[str, torch.Tensor]]) -> float:
    """How far ``heads`` are from Definition 31's conditions (largest relative residual)."""
    worst = 0.0
    for b in heads:
        P, R, G = b["Q"].T @ b["Q"], b["K"].T @ b["K"], b["V"].T @ b["V"]
        worst = max(worst, float((P - R).norm() / P.norm()), float((G - torch.eye(len(G), dtype=G.dtype)).norm()))
    norms = [float(b["Q"].norm()) for b in heads]
    return worst if norms == sorted(norms, reverse=True) else float("inf")


def definition31_residual_dimension(heads: list[dict[str, torch.Tensor]]) -> int:
    """Dimension of the gauge directions that keep Definition 31's equations at a canonical point: the
    null space of the linearised conditions ``X ↦ XᵀP + PX + XR + RXᵀ``, ``Y ↦ Y + Yᵀ`` (per head), by SVD."""
    total = 0
    for b in heads:
        P, R = b["Q"].T @ b["Q"], b["K"].T @ b["K"]
        for n, lin in ((P.shape[0], lambda X: X.T @ P + P @ X + X @ R + R @ X.T), (b["V"].shape[1], lambda Y: Y + Y.T)):
            cols = []
            for a in range(n):
                for c in range(n):
                    X = torch.zeros(n, n, dtype=P.dtype)
                    X[a, c] = 1.0
                    cols.append(lin(X).reshape(-1))
            s = torch.linalg.svdvals(torch.stack(cols, 1))
            total += int((s <= 1e-10 * s[0]).sum()) + (n * n - s.numel())
    return total


def random_gmax(heads: list[dict[str, torch.Tensor]], g: torch.Generator, orthogonal: bool = False,
                permute: bool = True):
    """A random element of ``G_max`` applied to per-head blocks: ``A, C`` per head (condition ≤ 4, or
    orthogonal), then a random head permutation (unless ``permute=False``)."""
    out = []
    for b in heads:
        n = b["Q"].shape[1]
        mats = []
        for _ in range(2):
            Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
            if orthogonal:
                mats.append(Q)
            else:
                Q2, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
                mats.append(Q @ torch.diag(0.5 + 1.5 * torch.rand(n, generator=g, dtype=torch.float64)) @ Q2)
        A, C = mats
        out.append({"Q": b["Q"] @ A, "K": b["K"] @ torch.linalg.inv(A).T, "V": b["V"] @ C, "O": torch.linalg.inv(C) @ b["O"]})
    perm = torch.randperm(len(out), generator=g).tolist() if permute else range(len(out))
    return [out[i] for i in perm]


def head_distance(a: list[dict], b: list[dict]) -> float:
    """Relative distance between two lists of head blocks, head by head (no re-ordering)."""
    num = sum(float((x[k] - y[k]).square().sum()) for x, y in zip(a, b) for k in "QKVO")
    den = sum(float(x[k].square().sum()) for x in a for k in "QKVO")
    return (num / den) ** 0.5


# ---------------------------------------------------------------------- Jacobians and generators by hand
def flat_params(model: nn.Module) -> tuple[list[str], list[torch.Size], torch.Tensor]:
    named = list(model.named_parameters())
    return [n for n, _ in named], [p.shape for _, p in named], torch.cat([p.detach().reshape(-1) for _, p in named])


def logits_jacobian(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(J, p)``: the Jacobian ``(positions, vocab, n_params)`` of the logits of every position of ``x``
    with respect to all parameters, and the softmax ``(positions, vocab)`` there."""
    from torch.func import functional_call, jacrev

    names, shapes, theta = flat_params(model)
    sizes = [s.numel() for s in shapes]

    def f(th):
        out = functional_call(model, {n: t.view(s) for n, t, s in zip(names, th.split(sizes), shapes)}, (x,))
        z = out.logits if hasattr(out, "logits") else out[0]
        return z.reshape(-1, z.shape[-1])

    J = jacrev(f)(theta)
    return J, torch.softmax(f(theta), -1)


def embed(model: nn.Module, field: dict[str, torch.Tensor]) -> torch.Tensor:
    """A parameter-shaped field (missing names are zero) as one flat vector in ``named_parameters`` order."""
    return torch.cat([field.get(n, torch.zeros_like(p)).reshape(-1) for n, p in model.named_parameters()])


def gpt_head_generators(model: nn.Module, sectors=("qk", "vo"), layer: int = 0) -> torch.Tensor:
    """Every head's ``qk``/``vo`` generators (:func:`head_generators`) of a bias-free ``GPT`` layer, as
    flat parameter vectors ``(n_params, h·(d_k² + d_v²))``."""
    heads = paper_heads(model, layer)
    pre = f"transformer.h.{layer}.attn."
    d, dk = model.config.n_embd, heads[0]["Q"].shape[1]
    cols = []
    for i, b in enumerate(heads):
        for sector in sectors:
            A = head_generators(b, sector)
            split = b["Q"].numel() if sector == "qk" else b["V"].numel()
            for c in A.T:
                w = torch.zeros(3 * d, d, dtype=torch.float64)
                o = torch.zeros(d, d, dtype=torch.float64)
                first, second = c[:split].reshape(d, dk), c[split:]
                if sector == "qk":
                    w[i * dk:(i + 1) * dk] = first.T
                    w[d + i * dk:d + (i + 1) * dk] = second.reshape(d, dk).T
                else:
                    w[2 * d + i * dk:2 * d + (i + 1) * dk] = first.T
                    o[:, i * dk:(i + 1) * dk] = second.reshape(dk, d).T
                cols.append(embed(model, {pre + "c_attn.weight": w, pre + "c_proj.weight": o}))
    return torch.stack(cols, 1)


def span_in_null(J: torch.Tensor, A: torch.Tensor, rtol: float = 1e-9) -> tuple[int, int]:
    """``(dim span A, dim(span A ∩ ker J))`` = ``(rank A, rank A − rank JA)``; ranks at ``rtol`` of the
    largest singular value (``J``'s for ``JA``): null directions sit at rounding level, ~1e-15."""
    def rank(M, scale):
        s = torch.linalg.svdvals(M)
        return int((s > rtol * scale).sum())

    Q = torch.linalg.svd(A, full_matrices=False)[0][:, : rank(A, float(torch.linalg.svdvals(A)[0]))]
    smax = float(torch.linalg.matrix_norm(J, 2))
    return Q.shape[1], Q.shape[1] - rank(J @ Q, smax)


# ---------------------------------------------------------------------- Hugging Face Llama by hand
def llama_groups(model: nn.Module, layer: int, group: int) -> tuple[nn.Module, list[int], int]:
    att = model.model.layers[layer].self_attn
    cfg = model.config
    dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rep = cfg.num_attention_heads // cfg.num_key_value_heads  # repeat_kv: key head j serves query heads j·rep …
    return att, list(range(group * rep, (group + 1) * rep)), dh


@torch.no_grad()
def llama_act_qk(model: nn.Module, A: torch.Tensor, layer: int = 0, group: int = 0) -> None:
    """``W_Q[i] ← AᵀW_Q[i]`` for the query heads of KV group ``group``, ``W_K[group] ← A⁻¹W_K[group]``
    (PyTorch layout: rows are head channels)."""
    att, heads, dh = llama_groups(model, layer, group)
    wq, wk = att.q_proj.weight, att.k_proj.weight
    for i in heads:
        wq[i * dh:(i + 1) * dh] = A.T @ wq[i * dh:(i + 1) * dh]
    wk[group * dh:(group + 1) * dh] = torch.linalg.inv(A) @ wk[group * dh:(group + 1) * dh]


def llama_qk_generators(model: nn.Module, layer: int = 0, group: int = 0) -> torch.Tensor:
    """The ``d_h²`` generators of ``GL(d_h)`` on one KV group (paper 003's ``H`` on keys and queries):
    ``δW_Q[i] = XᵀW_Q[i]``, ``δW_K = −X W_K`` for ``X = E_ab``."""
    att, heads, dh = llama_groups(model, layer, group)
    pre = f"model.layers.{layer}.self_attn."
    wq, wk = att.q_proj.weight.detach(), att.k_proj.weight.detach()
    cols = []
    for a in range(dh):
        for c in range(dh):
            X = torch.zeros(dh, dh, dtype=torch.float64)
            X[a, c] = 1.0
            dq, dk = torch.zeros_like(wq), torch.zeros_like(wk)
            for i in heads:
                dq[i * dh:(i + 1) * dh] = X.T @ wq[i * dh:(i + 1) * dh]
            dk[group * dh:(group + 1) * dh] = -X @ wk[group * dh:(group + 1) * dh]
            cols.append(embed(model, {pre + "q_proj.weight": dq, pre + "k_proj.weight": dk}))
    return torch.stack(cols, 1)


def _llama_stream(model: nn.Module):
    """(writers, readers by norm, embedding, head) of an untied ``LlamaForCausalLM``, by name."""
    m = model.model
    writers = [(f"model.layers.{i}.self_attn.o_proj.weight", l.self_attn.o_proj.weight) for i, l in enumerate(m.layers)]
    writers += [(f"model.layers.{i}.mlp.down_proj.weight", l.mlp.down_proj.weight) for i, l in enumerate(m.layers)]
    readers = []
    for i, l in enumerate(m.layers):
        readers.append((l.input_layernorm.weight, [(f"model.layers.{i}.self_attn.{p}_proj.weight", getattr(l.self_attn, f"{p}_proj").weight)
                                                   for p in "qkv"]))
        readers.append((l.post_attention_layernorm.weight, [(f"model.layers.{i}.mlp.{p}_proj.weight", getattr(l.mlp, f"{p}_proj").weight)
                                                            for p in ("gate", "up")]))
    readers.append((m.norm.weight, [("lm_head.weight", model.lm_head.weight)]))
    return writers, readers, ("model.embed_tokens.weight", m.embed_tokens.weight)


@torch.no_grad()
def llama_rotate(model: nn.Module, R: torch.Tensor, corrected: bool = True) -> None:
    """A rotation ``R`` of the residual stream of an untied HF Llama: embeddings and writers ``R·``; every
    reader ``W D Rᵀ D⁻¹`` (``D = diag γ`` of its norm; ``corrected=False``: ``W Rᵀ``, paper 003's rule)."""
    assert model.lm_head.weight is not model.model.embed_tokens.weight, "the head must be untied"
    writers, readers, (_, emb) = _llama_stream(model)
    emb.copy_(emb @ R.T)
    for _, w in writers:
        w.copy_(R @ w)
    for gamma, rs in readers:
        M = (gamma[:, None] * R.T) / gamma[None, :] if corrected else R.T
        for _, w in rs:
            w.copy_(w @ M)


def llama_rotation_generators(model: nn.Module) -> torch.Tensor:
    """The ``d(d−1)/2`` generators of :func:`llama_rotate` (corrected) at ``R = I``, one per ``E_ab − E_ba``."""
    writers, readers, (ename, emb) = _llama_stream(model)
    d = emb.shape[1]
    cols = []
    for a in range(d):
        for b in range(a + 1, d):
            Gm = torch.zeros(d, d, dtype=torch.float64)
            Gm[a, b], Gm[b, a] = 1.0, -1.0
            field = {ename: emb.detach() @ Gm.T}
            field.update({n: Gm @ w.detach() for n, w in writers})
            for gamma, rs in readers:
                g = gamma.detach()
                M = (g[:, None] * Gm.T) / g[None, :]
                field.update({n: w.detach() @ M for n, w in rs})
            cols.append(embed(model, field))
    return torch.stack(cols, 1)


def generic_rotation(d: int, g: torch.Generator) -> torch.Tensor:
    """A Haar-random element of ``SO(d)`` (it moves the all-ones vector)."""
    Q, R = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    Q = Q * torch.sign(torch.diagonal(R))[None, :]
    if torch.det(Q) < 0:
        Q[:, 0] = -Q[:, 0]
    return Q
