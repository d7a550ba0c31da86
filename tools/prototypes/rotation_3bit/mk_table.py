# Build the results table (gap ratios vs RTN4-g32 in this harness) from results.jsonl
import json
R = {}
for l in open('results.jsonl'):
    r = json.loads(l); R[r['name']] = {**R.get(r['name'], {}), **{k: v for k, v in r.items() if v is not None}}
fp8 = R['rtn4_g32']['ppl_fp_of_this_model']; r4 = R['rtn4_g32']['ppl']
fp16 = R.get('fp32', {}).get('ppl16'); r416 = R['rtn4_g32'].get('ppl16')
for n, r in R.items():
    g8 = (r['ppl'] - fp8) / (r4 - fp8)
    g16 = (r['ppl16'] - fp16) / (r416 - fp16) if r.get('ppl16') and fp16 and r416 else None
    print(f"{n:24s} bpw {r['bpw']:.3f}  ppl8 {r['ppl']:8.3f}  x{g8:6.2f}  ppl16 {r.get('ppl16', float('nan')):8.3f}  x{(g16 or float('nan')):6.2f}  tq {r['tq']:.0f}s")
