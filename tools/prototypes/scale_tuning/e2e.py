# End-to-end scale tuning after GPTQ (prototype): codes fixed, each group's scale trained to bring the quantized
# model's next-token distributions back to FP32's (KL on calibration text), then stored as int8 under fp16
# super-scales as before. Question: does it take the 3.0-bits-per-weight mix (every layer 3-bit, the tied
# table 2-bit, rotated GPTQ, normal grid, group 64: 3.37x RTN's gap through the exporter) under 2x?
#   /work/real/venv/bin/python e2e.py NAME [--head-bits 2] [--epochs 4] [--ncal 32] [--lr 2e-3] [--norms]
import argparse, json, math, os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'rotation_3bit'))
import torch, torch.nn as nn, torch.nn.functional as F
import torch.nn.utils.parametrize as P
import quant
from lib import bits_uniform, q_scales, gptq, windows, linears, rotate, load

torch.set_num_threads(int(os.environ.get('THREADS', '2')))
GRID = {2: torch.tensor([-3., -1., 1., 3.]), 3: torch.tensor([-8., -5., -3., -1., 1., 3., 5., 8.]),
        4: torch.arange(-8., 8.)}  # the product's normal grids (contract.NORMAL_LEVELS_2/3); 4-bit uniform
RECORDS = []  # (U [R, K] level per weight, S [R, ng] scale per group, G), in quant.quantize's order


def grid_levels(W, wt, b, G):
    """Per-group scale (int8 under fp16 super-scales) x the width's grid, searched for the least wt-weighted error."""
    R, K = W.shape
    L = GRID[b]
    ng = -(-K // G); Wg = F.pad(W, (0, ng * G - K)).view(R, ng, G); wg = F.pad(wt, (0, ng * G - K)).view(1, ng, G)
    s0 = Wg.abs().amax(-1) / L.abs().max()
    s0 = torch.where(s0 == 0, torch.full_like(s0, 1e-8), s0)
    best = torch.full_like(s0, float('inf')); bs = s0.clone()
    for f in [1 - 0.025 * i for i in range(30)]:
        s = s0 * f
        lv = s[..., None] * L
        q = lv.gather(-1, (Wg[..., None] - lv[..., None, :]).abs().argmin(-1))
        e = ((q - Wg) ** 2 * wg).sum(-1)
        bb = e < best; best = torch.where(bb, e, best); bs = torch.where(bb, s, bs)
    return q_scales(bs)


def meth(W, H, spec):
    R, K = W.shape
    b, G = spec['b'], spec['G']
    wt = torch.diag(H).float().clamp_min(1e-8)
    S = grid_levels(W, wt, b, G)
    lv = S[..., None] * GRID[b]
    Wq = gptq(W, H, b, G, actorder=True, levels=lv)
    Se = S.repeat_interleave(G, 1)[:, :K]
    U = GRID[b][((Wq / Se)[..., None] - GRID[b]).abs().argmin(-1)]
    assert torch.allclose(U * Se, Wq, rtol=1e-4, atol=1e-6)
    RECORDS.append((U, S, G))
    return Wq, bits_uniform(R, K, b, G)


class Scaled(nn.Module):
    """weight = (S0 * exp(theta)) per group x U (codes' levels), theta trained."""
    def __init__(self, U, S, G):
        super().__init__()
        self.register_buffer('U', U); self.register_buffer('S0', S); self.G = G
        self.theta = nn.Parameter(torch.zeros_like(S))

    def scales(self):
        return self.S0 * torch.exp(self.theta)

    def forward(self, _):
        K = self.U.shape[1]
        return self.scales().repeat_interleave(self.G, 1)[:, :K] * self.U


def record(res):
    print(json.dumps(res), flush=True)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results.jsonl'), 'a') as f:
        f.write(json.dumps(res) + '\n')


@torch.no_grad()
def logprobs(model, X):
    return [F.log_softmax(model(w[None], use_cache=False).logits[0].float(), -1).half() for w in X]


@torch.no_grad()
def score(model, X, ref):
    nll = []; kl = []
    for w, lr in zip(X, ref):
        lp = F.log_softmax(model(w[None], use_cache=False).logits[0].double(), -1)
        nll.append(-lp[255:511].gather(1, w[256:512, None]).squeeze(1))
        pr = lr.double()[255:511]
        kl.append((pr.exp() * (pr - lp[255:511])).sum(-1))
    return math.exp(torch.cat(nll[:8]).mean().item()), math.exp(torch.cat(nll).mean().item()), torch.cat(kl).mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('name'); ap.add_argument('--head-bits', type=int, default=2); ap.add_argument('--bits', type=int, default=3)
    ap.add_argument('--G', type=int, default=64); ap.add_argument('--epochs', type=int, default=4)
    ap.add_argument('--ncal', type=int, default=32); ap.add_argument('--gptq-cal', type=int, default=8)
    ap.add_argument('--lr', type=float, default=2e-3); ap.add_argument('--norms', action='store_true')
    ap.add_argument('--seed', type=int, default=0); ap.add_argument('--refit', action='store_true')
    a = ap.parse_args()
    t0 = time.time()
    model = load()
    rotate(model, seed=a.seed, had=True)
    model.lm_head.M = model.lm_head.M.detach()  # rotate() built M from the norm's weight with autograd on
    for p in model.parameters():
        p.requires_grad_(False)
    allc = windows('/work/real/text/calib.txt', a.ncal + 4)
    Xc, Xv = allc[:a.ncal], allc[a.ncal:]          # train / held-out calibration windows
    Xe = windows('/work/real/text/eval.txt', 16)
    ref_c, ref_v, ref_e = logprobs(model, Xc), logprobs(model, Xv), logprobs(model, Xe)
    fp = score(model, Xe, ref_e)
    print('fp32 (rotated)', fp, f'{time.time() - t0:.0f}s', flush=True)
    hs, ls = dict(m='gptq', b=a.head_bits, G=a.G), lambda n: dict(m='gptq', b=a.bits, G=a.G)
    if a.refit:
        import copy
        from refit import quantize_refit
        tb, tw = quantize_refit(model, copy.deepcopy(model), meth, hs, ls, windows('/work/real/text/calib.txt', a.gptq_cal), RECORDS)
    else:
        quant.meth_apply = meth
        tb, tw, _ = quant.quantize(model, hs, ls, ncal=a.gptq_cal)
    bpw = (tb + 576 * 576 * 8 + 16 * 576) / tw  # + the head's fold (576 x 576 at 8 bits, as the exporter's FOLD_BITS)
    tq = time.time() - t0
    mm = model.model
    mods = [mm.embed_tokens] + [lin for _, lin in linears(model)]
    assert len(mods) == len(RECORDS)
    sc = []
    for mod, (U, S, G) in zip(mods, RECORDS):
        P.register_parametrization(mod, 'weight', Scaled(U, S, G)); sc.append(mod.parametrizations.weight[0])
    params = [s.theta for s in sc]
    if a.norms:
        for L in mm.layers:
            for nw in (L.input_layernorm.weight, L.post_attention_layernorm.weight):
                nw.requires_grad_(True); params.append(nw)
    model.eval()
    before = score(model, Xe, ref_e); vb = score(model, Xv, ref_v)[2]
    print(json.dumps(dict(stage='gptq', bpw=round(bpw, 4), ppl8=before[0], ppl16=before[1], kl=before[2], val_kl=vb, t=round(tq))), flush=True)
    if a.epochs == 0:  # GPTQ (and --refit) only
        res = dict(name=a.name, bpw=round(bpw, 4), fp32_ppl16=fp[1], gptq_ppl8=before[0], gptq_ppl16=before[1],
                   gptq_kl=before[2], gptq_val_kl=vb, args=vars(a), wall=round(time.time() - t0))
        return record(res)
    opt = torch.optim.Adam(params, lr=a.lr)
    steps = a.epochs * len(Xc); sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g = torch.Generator().manual_seed(0)
    for ep in range(a.epochs):
        tl = 0.0
        for i in torch.randperm(len(Xc), generator=g).tolist():
            lp = F.log_softmax(model(Xc[i][None], use_cache=False).logits[0].float(), -1)
            pr = ref_c[i].float()
            loss = (pr.exp() * (pr - lp)).sum(-1).mean()
            opt.zero_grad(); loss.backward(); opt.step(); sched.step(); tl += loss.item()
        print(json.dumps(dict(epoch=ep, train_kl=tl / len(Xc), val_kl=score(model, Xv, ref_v)[2], t=round(time.time() - t0))), flush=True)
    with torch.no_grad():  # stored form: trained scales back to int8 codes under fp16 super-scales
        for s in sc:
            S = q_scales(s.scales()); s.S0.copy_(S); s.theta.zero_()
    after = score(model, Xe, ref_e)
    res = dict(name=a.name, bpw=round(bpw, 4), fp32_ppl16=fp[1], gptq_ppl16=before[1], gptq_kl=before[2],
               tuned_ppl8=after[0], tuned_ppl16=after[1], tuned_kl=after[2], args=vars(a), wall=round(time.time() - t0))
    record(res)


if __name__ == '__main__':
    main()
