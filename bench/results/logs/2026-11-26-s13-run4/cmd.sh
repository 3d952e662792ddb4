export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m zipfile -e .carry/x/ranks-ll.whl /tmp/site && export PYTHONPATH=/tmp/site || exit 1
N=$(command -v ncu || ls /usr/local/cuda*/bin/ncu | head -1); K="--profile-from-start off -k regex:ll_(dispatch|combine) -f"
P="python3 bench/ll_ncu.py --warmup 5"
$N $K --section WarpStateStats --section SourceCounters --section LaunchStats --section SpeedOfLight --sampling-interval 1 -o /tmp/f $P >$OUT/a.log 2>&1
$N -i /tmp/f.ncu-rep --page details --csv >$OUT/fine-details.csv
for k in dispatch combine; do $N -i /tmp/f.ncu-rep --page source --csv -k regex:ll_$k --print-source sass | gzip >$OUT/fs-$k.csv.gz; done
for m in "none none" "all none" "none base"; do set -- $m; $N $K --section SpeedOfLight --cache-control $1 --clock-control $2 -o /tmp/w $P >>$OUT/a.log 2>&1; echo "== $m" >>$OUT/warm.csv; $N -i /tmp/w.ncu-rep --page raw --csv --metrics gpu__time_duration.sum,sm__cycles_active.avg,gpc__cycles_elapsed.avg.per_second >>$OUT/warm.csv; done
python3 - >$OUT/graph.log 2>&1 <<'EOF'
import torch,tempfile,json,torch.distributed as D,deep_ep_rs as R
from torch.profiler import profile,ProfilerActivity as A
D.init_process_group("gloo",init_method="file://"+tempfile.mkdtemp()+"/s",rank=0,world_size=1)
h,k,e=7168,8,288;c='cuda'
def tm(g,r=200):
 s,t=torch.cuda.Event(True),torch.cuda.Event(True);s.record()
 for _ in range(r):g.replay()
 t.record();torch.cuda.synchronize();return s.elapsed_time(t)*1e3/r
def cap(f):
 f();torch.cuda.synchronize();g=torch.cuda.CUDAGraph()
 with torch.cuda.graph(g):f()
 tm(g,20);return g
z=torch.zeros(4,dtype=torch.long,device=c)
for m in(1,2,6):print('fills',m,tm(cap(lambda:[z.fill_(0) for _ in range(m)])))
for n in(1,128):
 b=R.Buffer(D.group.WORLD,0,R.Buffer.get_low_latency_rdma_size_hint(n,h,1,e),low_latency_mode=True,explicitly_destroy=True)
 x=torch.randn(n,h,dtype=torch.bfloat16,device=c);i=(torch.randn(n,e,device=c).abs()+1).topk(k,dim=-1).indices;w=torch.rand(n,k,device=c)
 d=lambda:b.low_latency_dispatch(x,i,n,e,use_fp8=True,topk_weights=w)
 y=b.low_latency_dispatch(x,i,n,e,use_fp8=False,topk_weights=w)[0].clone();o=torch.empty(n,h,dtype=torch.bfloat16,device=c)
 for nm,f in(('disp',d),('step',lambda:b.low_latency_combine(y,i,w,d()[2],out=o))):
  g=cap(f);print(n,nm,'us',tm(g))
  with profile(activities=[A.CUDA]) as p:
   for _ in range(3):g.replay()
   torch.cuda.synchronize()
  p.export_chrome_trace('/tmp/t.json');v=sorted([v for v in json.load(open('/tmp/t.json'))['traceEvents'] if v.get('cat')=='kernel'],key=lambda v:v['ts'])
  for a,q in zip(v,v[1:]+[0]):print(n,nm,a['name'][:40],a['dur'],q and round(q['ts']-a['ts']-a['dur'],2))
 b.destroy()
EOF
