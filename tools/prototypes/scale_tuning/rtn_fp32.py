# RTN 4-bit g32 with float32 scales (MatMulNBits' own rule: the group's extreme weight maps to -8), table included.
import sys, os, json
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'rotation_3bit'))
import torch
from lib import load, untie, linears, ppl_8_16
torch.set_num_threads(2)
def rtn(W, G=32):
    R, K = W.shape; Wg = W.view(R, K // G, G)
    ext = Wg.gather(-1, Wg.abs().argmax(-1, keepdim=True))
    s = ext / -8; s = torch.where(s == 0, torch.ones_like(s), s)
    return ((Wg / s).round().clamp(-8, 7) * s).view(R, K)
m = load(); untie(m)
with torch.no_grad():
    m.model.embed_tokens.weight.data = rtn(m.model.embed_tokens.weight.data)
    for _, l in linears(m): l.weight.data = rtn(l.weight.data)
print(json.dumps(dict(name='rtn4_g32_fp32scales', ppl8_16=ppl_8_16(m))))
