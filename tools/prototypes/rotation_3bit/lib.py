# Shared harness of the rotation / 3-bit prototype: load, perplexity, rotation, RTN / GPTQ / codebook quantizers, bit counting.
import math, time, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM, AutoTokenizer

HF = '/work/real/smollm2/hf'
tok = AutoTokenizer.from_pretrained(HF)


def load():
    m = AutoModelForCausalLM.from_pretrained(HF, torch_dtype=torch.float32)
    m.eval()
    return m


def windows(path, n, L=512):
    ids = tok(open(path).read(), add_special_tokens=False)['input_ids']
    return torch.tensor(ids[:n * L]).view(n, L)


@torch.no_grad()
def ppl(model, n=8):
    W = windows('/work/real/text/eval.txt', n)
    nll = []
    for w in W:
        lg = model(w[None]).logits[0].double()
        lp = F.log_softmax(lg[255:511], -1)
        nll.append(-lp.gather(1, w[256:512, None]).squeeze(1))
    return math.exp(torch.cat(nll).mean().item())


@torch.no_grad()
def ppl_8_16(model):
    W = windows('/work/real/text/eval.txt', 16)
    nll = []
    for w in W:
        lp = F.log_softmax(model(w[None]).logits[0].double()[255:511], -1)
        nll.append(-lp.gather(1, w[256:512, None]).squeeze(1))
    return math.exp(torch.cat(nll[:8]).mean().item()), math.exp(torch.cat(nll).mean().item())


# ---------------- bit counting ----------------
def bits_uniform(rows, K, b, G):
    ng = -(-K // G)
    return rows * (b * K + 8 * ng + 16 * (-(-ng // 8)))


def bits_codebook(rows, K, b, G=None):
    # per-row 2^b fp16 levels; optionally int8 group scales too
    extra = 0 if G is None else bits_uniform(rows, K, 0, G)
    return rows * (b * K + 16 * 2 ** b) + extra


# ---------------- scales ----------------
def q_scales(s, ns=8):
    """int8 scale codes with one fp16 super-scale per ns groups (s: [rows, ngroups], signed)."""
    R, ng = s.shape
    pad = (-ng) % ns
    sp = F.pad(s, (0, pad)).view(R, -1, ns)
    ss = (sp.abs().amax(-1, keepdim=True) / 127).half().float().clamp_min(1e-12)
    q = (sp / ss).round().clamp(-127, 127) * ss
    return q.view(R, -1)[:, :ng]


def group_scales(W, b, G, mse=False, grid=None):
    """Signed absmax scale (the extreme value maps to -2^(b-1)), optionally MSE-searched shrink.
    Returns per-group scale [rows, ngroups] after int8 scale quantization."""
    R, K = W.shape
    ng = -(-K // G)
    Wg = F.pad(W, (0, ng * G - K)).view(R, ng, G)
    idx = Wg.abs().argmax(-1, keepdim=True)
    ext = Wg.gather(-1, idx).squeeze(-1)
    s0 = ext / -(2 ** (b - 1))
    s0 = torch.where(s0 == 0, torch.full_like(s0, 1e-8), s0)
    if not mse:
        return q_scales(s0)
    lo, hi = -(2 ** (b - 1)), 2 ** (b - 1) - 1
    best = torch.full_like(s0, float('inf')); bs = s0.clone()
    for f in (grid or [1 - 0.02 * i for i in range(26)]):
        s = s0 * f
        e = ((Wg / s[..., None]).round().clamp(lo, hi) * s[..., None] - Wg).pow(2).sum(-1)
        better = e < best
        best = torch.where(better, e, best); bs = torch.where(better, s, bs)
    return q_scales(bs)


def rtn(W, b, G, mse=False):
    R, K = W.shape
    s = group_scales(W, b, G, mse)
    se = s.repeat_interleave(G, 1)[:, :K]
    lo, hi = -(2 ** (b - 1)), 2 ** (b - 1) - 1
    return (W / se).round().clamp(lo, hi) * se


# ---------------- GPTQ ----------------
def gptq(W, H, b, G, mse=True, actorder=True, blocksize=128, damp=0.01, levels=None):
    """Static-group GPTQ (scales from the original W so groups stay consecutive K columns).
    levels: optional per-row codebook [rows, L] (non-uniform grid; then b/G unused for scales)."""
    W = W.clone().double(); H = H.clone().double()
    R, K = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1; W[:, dead] = 0
    if levels is None:
        s = group_scales(W.float(), b, G, mse).double()
        se = s.repeat_interleave(G, 1)[:, :K]
        lo, hi = -(2 ** (b - 1)), 2 ** (b - 1) - 1
    perm = torch.argsort(torch.diag(H), descending=True) if actorder else torch.arange(K)
    W = W[:, perm]; H = H[perm][:, perm]
    if levels is None:
        se = se[:, perm]
    H += torch.eye(K, dtype=H.dtype) * damp * torch.diag(H).mean()
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    lv = None if levels is None else levels.double()
    for i1 in range(0, K, blocksize):
        i2 = min(i1 + blocksize, K)
        W1 = W[:, i1:i2].clone(); Q1 = torch.zeros_like(W1); E1 = torch.zeros_like(W1)
        Hi = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[:, i]; d = Hi[i, i]
            if lv is None:
                sc = se[:, i1 + i]
                q = (w / sc).round().clamp(lo, hi) * sc
            else:
                l2 = lv if lv.dim() == 2 else lv[:, int(perm[i1 + i]) // G]
                q = l2.gather(1, (w[:, None] - l2).abs().argmin(1, keepdim=True)).squeeze(1)
            Q1[:, i] = q
            e = (w - q) / d
            W1[:, i:] -= e[:, None] * Hi[i, i:][None]
            E1[:, i] = e
        Q[:, i1:i2] = Q1
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    return Q[:, inv].float()


# ---------------- per-row weighted k-means codebook ----------------
def kmeans_rows(W, wt, L=8, iters=25):
    """W [R,K], wt [K] (importance per input column) -> levels [R,L]."""
    R, K = W.shape
    qs = torch.linspace(0.5 / L, 1 - 0.5 / L, L)
    C = torch.quantile(W, qs, dim=1).T.contiguous()  # [R,L]
    wt = wt[None].expand(R, K)
    for _ in range(iters):
        a = (W[:, :, None] - C[:, None, :]).abs().argmin(-1)  # [R,K]
        num = torch.zeros(R, L).scatter_add_(1, a, W * wt)
        den = torch.zeros(R, L).scatter_add_(1, a, wt)
        C = torch.where(den > 0, num / den.clamp_min(1e-20), C)
    return C.half().float()


def cb_quant(W, C):
    return C.gather(1, (W[:, :, None] - C[:, None, :]).abs().argmin(-1))


# ---------------- rotation ----------------
class RotHead(nn.Module):
    """logits = (x @ M) @ T^T ; T is the (tied) table shared with the embedding."""
    def __init__(self, emb, M):
        super().__init__(); self.emb = emb; self.register_buffer('M', M)

    def forward(self, x):
        return F.linear(x @ self.M, self.emb.weight)


def hadamard(n):
    """Hadamard matrix for n = 4 * 12^a * 2^b via Paley (q=11) and Sylvester Kronecker factors."""
    def paley12():
        q = 11; sq = {(i * i) % q for i in range(1, q)}
        chi = lambda a: 0 if a % q == 0 else (1 if a % q in sq else -1)
        Qm = torch.tensor([[chi(j - i) for j in range(q)] for i in range(q)], dtype=torch.float64)
        S = torch.zeros(12, 12, dtype=torch.float64); S[0, 1:] = 1; S[1:, 0] = -1; S[1:, 1:] = Qm
        return S + torch.eye(12, dtype=torch.float64)
    H = torch.ones(1, 1, dtype=torch.float64)
    while n % 12 == 0 and n > 1:
        H = torch.kron(H, paley12()); n //= 12
    while n > 1:
        assert n % 2 == 0
        H = torch.kron(H, torch.tensor([[1., 1.], [1., -1.]], dtype=torch.float64)); n //= 2
    return H


def random_had(n, seed):
    g = torch.Generator().manual_seed(seed)
    D = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    H = hadamard(n) / math.sqrt(n)
    assert torch.allclose(H @ H.T, torch.eye(n, dtype=torch.float64), atol=1e-10)
    return D[:, None] * H


def random_orth(n, seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, n, generator=g, dtype=torch.float64)
    Q, R = torch.linalg.qr(A)
    return (Q * torch.sign(torch.diag(R))[None]).contiguous()


@torch.no_grad()
def outlier_channels(model, thr=10.0, n=2):
    """Residual channels whose RMS exceeds thr x the median channel RMS at any layer (calib text)."""
    X = windows('/work/real/text/calib.txt', n)
    o = model(X, output_hidden_states=True, use_cache=False)
    S = set()
    for h in o.hidden_states[1:]:
        r = h.reshape(-1, h.shape[-1]).pow(2).mean(0).sqrt()
        S |= set((r > thr * r.median()).nonzero().flatten().tolist())
    return sorted(S)


def rotate(model, seed=0, r2=False, keep=(), had=False):
    """Fold RMSNorm gammas into the readers, rotate the residual stream by Q (float64 math).
    Tie kept: table T = E Q (shared); head gets one extra dense 576x576 M = Q^T diag(gf) Q."""
    mm = model.model
    d = mm.config.hidden_size
    keep = list(keep); rest = [j for j in range(d) if j not in keep]
    Q = torch.eye(d, dtype=torch.float64)
    Q[torch.tensor(rest)[:, None], torch.tensor(rest)[None]] = (random_had if had else random_orth)(len(rest), seed)
    km = torch.zeros(d, dtype=torch.bool); km[keep] = True  # kept channels: unrotated, gamma stays in the norm
    E = mm.embed_tokens.weight.double()
    T = (E @ Q).float()
    for L in mm.layers:
        a, m = L.self_attn, L.mlp
        g1 = L.input_layernorm.weight.double().clone(); g2 = L.post_attention_layernorm.weight.double().clone()
        g1[km] = 1; g2[km] = 1
        for lin in (a.q_proj, a.k_proj, a.v_proj):
            lin.weight.data = ((lin.weight.double() * g1[None]) @ Q).float()
        for lin in (m.gate_proj, m.up_proj):
            lin.weight.data = ((lin.weight.double() * g2[None]) @ Q).float()
        for lin in (a.o_proj, m.down_proj):
            lin.weight.data = (Q.T @ lin.weight.double()).float()
        for nw in (L.input_layernorm.weight, L.post_attention_layernorm.weight):
            nw.data[~km] = 1.0
        if r2:  # per-head rotation of v_proj outputs / o_proj inputs (heads share v via GQA)
            hd = a.head_dim; nkv = model.config.num_key_value_heads; nh = model.config.num_attention_heads
            Rh = random_orth(hd, seed + 1000)
            Wv = a.v_proj.weight.double().view(nkv, hd, d)
            a.v_proj.weight.data = torch.einsum('ji,hjd->hid', Rh, Wv).reshape(nkv * hd, d).float()
            Wo = a.o_proj.weight.double().view(d, nh, hd)
            a.o_proj.weight.data = torch.einsum('ohj,ji->ohi', Wo, Rh).reshape(d, nh * hd).float()
    gf = mm.norm.weight.double()
    M = (Q.T * gf[None]) @ Q
    mm.norm.weight.data.fill_(1.0)
    mm.embed_tokens.weight = nn.Parameter(T)
    model.lm_head = RotHead(mm.embed_tokens, M.float())
    return model


def untie(model):
    """Non-rotated model: make lm_head a RotHead with M = I, sharing the table (same math)."""
    mm = model.model
    model.lm_head = RotHead(mm.embed_tokens, torch.eye(mm.config.hidden_size))
    return model


def linears(model):
    out = []
    for i, L in enumerate(model.model.layers):
        a, m = L.self_attn, L.mlp
        out += [(f'{i}.q', a.q_proj), (f'{i}.k', a.k_proj), (f'{i}.v', a.v_proj), (f'{i}.o', a.o_proj),
                (f'{i}.gate', m.gate_proj), (f'{i}.up', m.up_proj), (f'{i}.down', m.down_proj)]
    return out


# ---------------- Lloyd-Max Gaussian grid (shared, normalized) x per-row or per-group scale ----------------
LM3 = torch.tensor([-2.1520, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1520])


def lm_levels(W, wt, G=None):
    """Per-row (G None: fp16 row scale) or per-group (int8 scale codes + fp16 super-scale) scale
    times the fixed 8-level Lloyd-Max grid; scale searched for the least wt-weighted error."""
    R, K = W.shape
    if G is None:
        Wg = W[:, None, :]; wg = wt[None, None, :]
    else:
        ng = -(-K // G); Wg = F.pad(W, (0, ng * G - K)).view(R, ng, G); wg = F.pad(wt, (0, ng * G - K)).view(1, ng, G)
    s0 = Wg.abs().amax(-1) / 2.152
    best = torch.full_like(s0, float('inf')); bs = s0.clone()
    for f in [1 - 0.025 * i for i in range(30)]:
        s = s0 * f
        lv = s[..., None] * LM3
        q = lv.gather(-1, (Wg[..., None] - lv[..., None, :]).abs().argmin(-1))
        e = ((q - Wg) ** 2 * wg).sum(-1)
        b = e < best; best = torch.where(b, e, best); bs = torch.where(b, s, bs)
    bs = bs.half().float() if G is None else q_scales(bs)
    lv = bs[..., None] * LM3
    return lv[:, 0] if G is None else lv


def i8_levels(C):
    sc = (C.abs().amax(1, keepdim=True) / 127).half().float()
    return (C / sc).round() * sc
