"""Model check of branch ll-fixed-cost's parallel counting pass and warp routing (kernels/ll_dispatch.cu)
against the serial code they replace: the same counts, slots, per-rank lists and message slots for
random ids (duplicates, -1, out of range, masked ranks, overflow). A Python model of the lanes,
not the kernel: the kernel itself is checked by the LL GPU suite.  python3 bench/ll_routing_model.py
"""
import random
def serial(ids, N, K, E, R, T, mask, t_begin, t_end):
    El=E//R
    s_total=[0]*E; s_before=[0]*E; s_rct=[0]*R; s_rc=[0]*R
    for tok in range(N):
        dm=0
        for k in range(K):
            e=ids[tok*K+k]
            if e<0 or e>=E or mask[e//El]: continue
            s_total[e]+=1
            if tok<t_begin: s_before[e]+=1
            dm|=1<<(e//El)
        for d in range(R):
            if dm>>d&1:
                s_rct[d]+=1
                if tok<t_begin: s_rc[d]+=1
    out=[]
    for tok in range(t_begin,t_end):
        dm=0; s_n=[0]*R; ent={d:[] for d in range(R)}
        for k in range(K):
            e=ids[tok*K+k]
            if e<0 or e>=E or mask[e//El]: continue
            d=e//El; l=e%El; slot=s_before[e]; s_before[e]+=1
            dm|=1<<d
            if slot>=T: continue
            ent[d].append((l<<16)|slot); s_n[d]+=1
        msg={}
        for d in range(R):
            if dm>>d&1: msg[d]=s_rc[d]; s_rc[d]+=1
        out.append((dm, tuple(tuple(ent[d]) for d in range(R)), tuple(s_n), tuple(sorted(msg.items()))))
    return s_total, out, s_rct

def parallel(ids, N, K, E, R, T, mask, t_begin, t_end):
    El=E//R
    s_total=[0]*E; s_before=[0]*E; s_rct=[0]*R; s_rc=[0]*R
    kp = 1 if K<=1 else 1<<((K-1).bit_length())
    per_warp=32//kp
    W=8
    for warp in range(W):
        t0=warp*per_warp
        while t0<N:
            bits=[0]*32; entry=[False]*32; toks=[0]*32
            for lane in range(32):
                tok=t0+lane//kp; k=lane%kp
                en= tok<N and k<K
                entry[lane]=en; toks[lane]=tok
                if en:
                    e=ids[tok*K+k]
                    if 0<=e<E and not mask[e//El]:
                        s_total[e]+=1
                        if tok<t_begin: s_before[e]+=1
                        bits[lane]=1<<(e//El)
            o=1
            while o<kp:
                bits=[bits[l]|bits[l^o] for l in range(32)]
                o<<=1
            for lane in range(32):
                if entry[lane] and lane%kp==0:
                    dm=bits[lane]
                    for d in range(R):
                        if dm>>d&1:
                            s_rct[d]+=1
                            if toks[lane]<t_begin: s_rc[d]+=1
            t0+=W*per_warp
    out=[]
    for tok in range(t_begin,t_end):
        lanes=range(32)
        E_=[ids[tok*K+l] if l<K else -1 for l in lanes]
        inr=[0<=e<E for e in E_]
        ei=[e if r else 0 for e,r in zip(E_,inr)]
        d_=[x//El for x in ei]
        routed=[inr[l] and not mask[d_[l]] for l in lanes]
        key=[ei[l] if routed[l] else -1-l for l in lanes]
        same_e=[sum(1<<m for m in lanes if key[m]==key[l]) for l in lanes]
        before=[s_before[ei[l]] if routed[l] else 0 for l in lanes]
        below=[(1<<l)-1 for l in lanes]
        slot=[before[l]+bin(same_e[l]&below[l]).count('1') for l in lanes]
        for l in lanes:
            if routed[l] and (same_e[l]&below[l])==0: s_before[ei[l]]=before[l]+bin(same_e[l]).count('1')
        dm=0
        for l in lanes:
            if routed[l]: dm|=1<<d_[l]
        kept=[routed[l] and slot[l]<T for l in lanes]
        keyd=[d_[l] if kept[l] else -1-l for l in lanes]
        same_d=[sum(1<<m for m in lanes if keyd[m]==keyd[l]) for l in lanes]
        s_n=[0]*R; ent={d:{} for d in range(R)}
        for l in lanes:
            if kept[l]:
                pos=bin(same_d[l]&below[l]).count('1')
                ent[d_[l]][pos]=((ei[l]%El)<<16)|slot[l]
                if (same_d[l]&below[l])==0: s_n[d_[l]]=bin(same_d[l]).count('1')
        msg={}
        for d in range(R):
            if dm>>d&1: msg[d]=s_rc[d]; s_rc[d]+=1
        out.append((dm, tuple(tuple(ent[d][i] for i in range(len(ent[d]))) for d in range(R)), tuple(s_n), tuple(sorted(msg.items()))))
    return s_total, out, s_rct

random.seed(1)
for it in range(3000):
    R=random.choice([1,2,4,8]); El=random.choice([1,2,3,8,36]); E=R*El
    K=random.randint(0,16); N=random.randint(0,70); T=random.randint(1,20)
    mask=[random.random()<0.2 for _ in range(R)]
    ids=[random.choice([-1,-2,E,E+5]+list(range(E))*3) if random.random()<0.3 else random.randrange(E) for _ in range(N*K)]
    G=random.randint(1,5); per=(N+G-1)//G if N else 0
    b=random.randrange(G); tb=min(N,b*per); te=min(N,tb+per)
    a1=serial(ids,N,K,E,R,T,mask,tb,te); a2=parallel(ids,N,K,E,R,T,mask,tb,te)
    assert a1==a2, (it,R,E,K,N,T)
print("ok")
