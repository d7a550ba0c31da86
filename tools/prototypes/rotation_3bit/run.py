# usage: run.py NAME [NAME...]  (presets below); appends to results.jsonl
import sys
from quant import main
def U(m, b, G): return dict(m=m, b=b, G=G)
P = {
 'fp32':          dict(table=U('fp',0,0), lin=lambda n: U('fp',0,0)),
 'rtn4_g32':      dict(table=U('rtn',4,32), lin=lambda n: U('rtn',4,32)),
 'rtn3_g32':      dict(table=U('rtn',3,32), lin=lambda n: U('rtn',3,32)),
 'rtn3mse_g32':   dict(table=U('rtn_mse',3,32), lin=lambda n: U('rtn_mse',3,32)),
 'gptq3_g64':     dict(table=U('gptq',3,64), lin=lambda n: U('gptq',3,64)),
 'gptq3_g128':    dict(table=U('gptq',3,128), lin=lambda n: U('gptq',3,128)),
 'rot_rtn3_g32':  dict(rot=True, table=U('rtn',3,32), lin=lambda n: U('rtn',3,32)),
 'rot_rtn3mse_g128': dict(rot=True, table=U('rtn_mse',3,128), lin=lambda n: U('rtn_mse',3,128)),
 'rot_gptq3_g64': dict(rot=True, table=U('gptq',3,64), lin=lambda n: U('gptq',3,64)),
 'rot_gptq3_g128':dict(rot=True, table=U('gptq',3,128), lin=lambda n: U('gptq',3,128)),
 'rot2_gptq3_g128':dict(rot=True, r2=True, table=U('gptq',3,128), lin=lambda n: U('gptq',3,128)),
 'cb3':           dict(table=U('cb',3,0), lin=lambda n: U('cb',3,0)),
 'cb3_gptq':      dict(table=U('cb_gptq',3,0), lin=lambda n: U('cb_gptq',3,0)),
 'rot_cb3_gptq':  dict(rot=True, table=U('cb_gptq',3,0), lin=lambda n: U('cb_gptq',3,0)),
 'rotS_rtn3_g32':  dict(rot=True, keep='auto', table=U('rtn',3,32), lin=lambda n: U('rtn',3,32)),
 'rotS_rtn3mse_g128': dict(rot=True, keep='auto', table=U('rtn_mse',3,128), lin=lambda n: U('rtn_mse',3,128)),
 'rotS_gptq3_g128':dict(rot=True, keep='auto', table=U('gptq',3,128), lin=lambda n: U('gptq',3,128)),
 'rotS_gptq3_g64': dict(rot=True, keep='auto', table=U('gptq',3,64), lin=lambda n: U('gptq',3,64)),
 'rotS2_gptq3_g128':dict(rot=True, keep='auto', r2=True, table=U('gptq',3,128), lin=lambda n: U('gptq',3,128)),
 'rotS_cb3_gptq':  dict(rot=True, keep='auto', table=U('cb_gptq',3,0), lin=lambda n: U('cb_gptq',3,0)),
 'rotS_gptq4_g128':dict(rot=True, keep='auto', table=U('gptq',4,128), lin=lambda n: U('gptq',4,128)),
 'rot_gptq3_g128_tabfp':dict(rot=True, table=U('fp',0,0), lin=lambda n: U('gptq',3,128)),
 'rot_gptq3_g128_s1':dict(rot=True, seed=1, table=U('gptq',3,128), lin=lambda n: U('gptq',3,128)),
 'rot_gptq3_g128_tab4':dict(rot=True, table=U('gptq',4,128), lin=lambda n: U('gptq',3,128)),
 'rot_gptq3_g128_c32':dict(rot=True, ncal=32, table=U('gptq',3,128), lin=lambda n: U('gptq',3,128)),
 'rot_mix_tab4_up2':dict(rot=True, table=U('gptq',4,128), lin=lambda n: U('gptq',2,128) if n.endswith('.up') else U('gptq',3,128)),
 'rot_gptq3_g256':dict(rot=True, table=U('gptq',3,192), lin=lambda n: U('gptq',3,256 if n.endswith('.down') else 192)),
 'rot_cb3i8_gptq':dict(rot=True, table=U('cb8_gptq',3,0), lin=lambda n: U('cb8_gptq',3,0)),
 'rot_lm3_gptq':  dict(rot=True, table=U('lm_gptq',3,0), lin=lambda n: U('lm_gptq',3,0)),
 'rot_lmg3_g128_gptq':dict(rot=True, table=U('lmg_gptq',3,128), lin=lambda n: U('lmg_gptq',3,128)),
 'had_lmg3_g128_gptq':dict(rot=True, had=True, table=U('lmg_gptq',3,128), lin=lambda n: U('lmg_gptq',3,128)),
 'had_gptq3_g128':dict(rot=True, had=True, table=U('gptq',3,128), lin=lambda n: U('gptq',3,128)),
 'had_lmg3_g192_gptq':dict(rot=True, had=True, table=U('lmg_gptq',3,192), lin=lambda n: U('lmg_gptq',3,256 if n.endswith('.down') else 192)),
 'had_lmg3_g128_gptq_s1':dict(rot=True, had=True, seed=1, table=U('lmg_gptq',3,128), lin=lambda n: U('lmg_gptq',3,128)),
}
import os
n_eval = int(os.environ.get('NEVAL', '8'))
for name in sys.argv[1:]:
    main(name, n_eval=n_eval, **P[name])
