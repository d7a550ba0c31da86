# Quantize SmolLM2-135M per a config; sequential (quantized inputs fed forward) Hessian collection.
import time, json, sys, torch
from lib import *


class Stop(Exception):
    pass


def meth_apply(W, H, spec):
    """spec: dict(m=rtn|rtn_mse|gptq|cb|cb_gptq|cbg, b, G). Returns (Wq, bits)."""
    R, K = W.shape
    m, b, G = spec['m'], spec.get('b', 3), spec.get('G', 32)
    if m == 'fp':
        return W, R * K * 32
    if m in ('rtn', 'rtn_mse'):
        return rtn(W, b, G, m == 'rtn_mse'), bits_uniform(R, K, b, G)
    if m == 'gptq':
        return gptq(W, H, b, G, mse=True, actorder=True), bits_uniform(R, K, b, G)
    if m in ('cb', 'cb_gptq'):
        wt = torch.diag(H).float().clamp_min(1e-8) if H is not None else torch.ones(K)
        C = kmeans_rows(W, wt, 2 ** b)
        Wq = cb_quant(W, C) if m == 'cb' else gptq(W, H, b, G, actorder=True, levels=C)
        return Wq, bits_codebook(R, K, b)
    if m in ('cb8_gptq', 'lm_gptq', 'lmg_gptq'):
        wt = torch.diag(H).float().clamp_min(1e-8)
        if m == 'cb8_gptq':
            C = i8_levels(kmeans_rows(W, wt, 2 ** b)); bits = R * (b * K + 8 * 2 ** b + 16)
        elif m == 'lm_gptq':
            C = lm_levels(W, wt); bits = R * (b * K + 16)
        else:
            C = lm_levels(W, wt, G); bits = bits_uniform(R, K, b, G)
        return gptq(W, H, b, G, actorder=True, levels=C), bits
    raise ValueError(m)


@torch.no_grad()
def quantize(model, table_spec, lin_spec, ncal=8, log=print):
    """table_spec: spec for the tied table; lin_spec: fn(name)->spec. Returns total bits, weights."""
    need_H = any(s['m'] not in ('fp', 'rtn', 'rtn_mse') for s in [table_spec] + [lin_spec(n) for n, _ in linears(model)])
    X = windows('/work/real/text/calib.txt', ncal)
    total_bits = 0; total_w = 0; report = {}
    mm = model.model
    # ---- table (head Hessian from the FP model's final normed states, through M) ----
    Hh = None
    if table_spec['m'] not in ('fp', 'rtn', 'rtn_mse'):
        Hh = torch.zeros(576, 576, dtype=torch.float64)
        def hk(mod, inp):
            nonlocal Hh
            x = (inp[0] @ mod.M).reshape(-1, 576).double(); Hh += x.T @ x
        h = model.lm_head.register_forward_pre_hook(hk)
        for w in X: model(w[None], use_cache=False)
        h.remove(); Hh /= X.numel()
    T = mm.embed_tokens.weight.data
    Tq, bt = meth_apply(T, Hh, table_spec)
    mm.embed_tokens.weight.data = Tq.contiguous()
    total_bits += bt; total_w += T.numel(); report['table'] = bt / T.numel()
    if not need_H:
        for n, lin in linears(model):
            Wq, bb = meth_apply(lin.weight.data, None, lin_spec(n))
            lin.weight.data = Wq; total_bits += bb; total_w += Wq.numel(); report[n] = bb / Wq.numel()
        return total_bits, total_w, report
    # ---- capture layer-0 inputs ----
    inps = []; kw = {}
    def pre(mod, args, kwargs):
        inps.append(args[0] if args else kwargs['hidden_states']); kw.update({k: v for k, v in kwargs.items() if k != 'hidden_states'})
        raise Stop
    h = mm.layers[0].register_forward_pre_hook(pre, with_kwargs=True)
    for w in X:
        try: model(w[None], use_cache=False)
        except Stop: pass
    h.remove()
    def run(L, xs):
        outs = []
        for x in xs:
            o = L(x, **kw); outs.append(o[0] if isinstance(o, tuple) else o)
        return outs
    for i, L in enumerate(mm.layers):
        a, m = L.self_attn, L.mlp
        groups = [[('q', a.q_proj), ('k', a.k_proj), ('v', a.v_proj)], [('o', a.o_proj)],
                  [('gate', m.gate_proj), ('up', m.up_proj)], [('down', m.down_proj)]]
        for grp in groups:
            lin0 = grp[0][1]; K = lin0.in_features
            H = torch.zeros(K, K, dtype=torch.float64); cnt = [0]
            def hk(mod, inp):
                x = inp[0].reshape(-1, K).double(); H.add_(x.T @ x); cnt[0] += x.shape[0]
            hh = lin0.register_forward_pre_hook(hk)
            run(L, inps); hh.remove(); H /= cnt[0]
            for nm, lin in grp:
                n = f'{i}.{nm}'
                Wq, bb = meth_apply(lin.weight.data, H, lin_spec(n))
                lin.weight.data = Wq.contiguous(); total_bits += bb; total_w += Wq.numel(); report[n] = bb / Wq.numel()
        inps = run(L, inps)
    return total_bits, total_w, report


def main(name, rot=False, seed=0, r2=False, keep=(), ncal=8, had=False, table=None, lin=None, n_eval=8, extra_bits=0, log_fp=True):
    t0 = time.time()
    model = load()
    if rot:
        rotate(model, seed=seed, r2=r2, keep=outlier_channels(model) if keep == 'auto' else keep, had=had)
        if not had:
            extra_bits += 576 * 576 * 16  # the head's extra dense matrix M stored as fp16 (Hadamard: two fast transforms + gamma, no storage counted)
    else:
        untie(model)
    p_fp = ppl(model, 8) if log_fp else None
    t1 = time.time()
    tb, tw, rep = quantize(model, table, lin, ncal=ncal)
    tq = time.time() - t1
    if n_eval == 16:
        p, p16 = ppl_8_16(model)
    else:
        p, p16 = ppl(model, n_eval), None
    bpw = (tb + extra_bits) / tw
    res = dict(name=name, bpw=round(bpw, 4), ppl=p, ppl16=p16, ppl_fp_of_this_model=p_fp, n_eval=n_eval, tq=round(tq, 1), wall=round(time.time() - t0, 1))
    print(json.dumps(res), flush=True)
    with open('results.jsonl', 'a') as f:
        f.write(json.dumps(res) + '\n')
    return res, rep
