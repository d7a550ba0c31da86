# Closed-form scale refit (prototype): codes fixed by GPTQ, each row's group scales solved by least squares so the
# quantized layer fed the quantized model's inputs X_q reproduces the FP32 layer fed FP32's inputs X_f:
#   min_s || X_q (Q s) - X_f w ||^2   ->   (Q^T Hqq Q) s = Q^T Hqf w,   Hqq = X_q^T X_q, Hqf = X_q^T X_f.
# Numpy-friendly (no gradients): the exporter could do it from one more calibration pass.
import torch


def refit_scales(U, S, G, Hqq, Hqf, W, ridge=1e-3):
    """U [R, K] code levels, S [R, ng] scales, W [R, K] FP32 weight; returns new S (float)."""
    R, K = U.shape
    ng = S.shape[1]
    pad = ng * G - K
    Ud = torch.nn.functional.pad(U.double(), (0, pad))
    Hq = torch.nn.functional.pad(Hqq.double(), (0, pad, 0, pad))
    Hf = torch.nn.functional.pad(Hqf.double(), (0, pad, 0, 0))
    T = torch.einsum('khg,rhg->rkh', Hq.view(ng * G, ng, G), Ud.view(R, ng, G))       # [R, K', ng]
    A = (Ud.view(R, ng, G, 1) * T.view(R, ng, G, ng)).sum(2)                          # [R, ng, ng]
    HW = torch.nn.functional.pad(W.double() @ Hf.T, (0, 0))                           # [R, K'] = (Hqf w_r)
    b = (Ud * HW).view(R, ng, G).sum(-1)                                              # [R, ng]
    d = torch.diagonal(A, dim1=1, dim2=2)
    lam = ridge * d.mean(-1, keepdim=True).clamp_min(1e-12)
    A = A + torch.diag_embed(lam.expand(-1, ng))
    b = b + lam * S.double()
    return torch.linalg.solve(A, b).float()


class _Stop(Exception):
    pass


def _layer_inputs(model, X):
    mm = model.model; inps = []; kw = {}
    def pre(mod, args, kwargs):
        inps.append(args[0] if args else kwargs['hidden_states']); kw.update({k: v for k, v in kwargs.items() if k != 'hidden_states'})
        raise _Stop
    h = mm.layers[0].register_forward_pre_hook(pre, with_kwargs=True)
    for w in X:
        try: model(w[None], use_cache=False)
        except _Stop: pass
    h.remove()
    return inps, kw


@torch.no_grad()
def quantize_refit(model, fp_model, meth, head_spec, lin_spec, X, records, refit=True, log=print):
    """As quant.quantize (sequential, quantized inputs fed forward), and after GPTQ each layer's scales are refit
    against FP32's outputs on FP32's inputs. meth(W, H, spec) -> (Wq, bits) appends (U, S, G) to records."""
    from lib import linears
    mm, fm = model.model, fp_model.model
    Hh = torch.zeros(576, 576, dtype=torch.float64)
    def hk(mod, inp):
        nonlocal Hh
        x = (inp[0] @ mod.M).reshape(-1, 576).double(); Hh += x.T @ x
    h = model.lm_head.register_forward_pre_hook(hk)
    for w in X: model(w[None], use_cache=False)
    h.remove(); Hh /= X.numel()
    T = mm.embed_tokens.weight.data
    Tq, bt = meth(T, Hh, head_spec)
    mm.embed_tokens.weight.data = Tq.contiguous()
    total_bits, total_w = bt, T.numel()
    inps, kw = _layer_inputs(model, X)
    finps, fkw = _layer_inputs(fp_model, X)
    def run(L, xs, k):
        return [(lambda o: o[0] if isinstance(o, tuple) else o)(L(x, **k)) for x in xs]
    for i, (L, FL) in enumerate(zip(mm.layers, fm.layers)):
        a, m = L.self_attn, L.mlp
        fa, fmlp = FL.self_attn, FL.mlp
        groups = [[('q', a.q_proj, fa.q_proj), ('k', a.k_proj, fa.k_proj), ('v', a.v_proj, fa.v_proj)],
                  [('o', a.o_proj, fa.o_proj)], [('gate', m.gate_proj, fmlp.gate_proj), ('up', m.up_proj, fmlp.up_proj)],
                  [('down', m.down_proj, fmlp.down_proj)]]
        for grp in groups:
            K = grp[0][1].in_features
            xq, xf = [], []
            hq = grp[0][1].register_forward_pre_hook(lambda mod, inp: xq.append(inp[0].reshape(-1, K).double()))
            hf = grp[0][2].register_forward_pre_hook(lambda mod, inp: xf.append(inp[0].reshape(-1, K).double()))
            run(L, inps, kw); run(FL, finps, fkw); hq.remove(); hf.remove()
            Xq, Xf = torch.cat(xq), torch.cat(xf)
            Hqq = Xq.T @ Xq / len(Xq); Hqf = Xq.T @ Xf / len(Xq)
            for nm, lin, flin in grp:
                Wq, bb = meth(lin.weight.data, Hqq, lin_spec(f'{i}.{nm}'))
                if refit:
                    U, S, G = records[-1]
                    S2 = refit_scales(U, S, G, Hqq, Hqf, flin.weight.data)
                    from lib import q_scales
                    S2 = q_scales(S2)
                    records[-1] = (U, S2, G)
                    Wq = S2.repeat_interleave(G, 1)[:, :U.shape[1]] * U
                lin.weight.data = Wq.contiguous(); total_bits += bb; total_w += Wq.numel()
        inps = run(L, inps, kw); finps = run(FL, finps, fkw)
    return total_bits, total_w
