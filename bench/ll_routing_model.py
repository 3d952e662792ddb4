"""Model check of the LL dispatch send's parallel counting pass and warp routing (kernels/ll_dispatch.cu)
against the serial code they replace: the same counts, slots, per-destination lists and message
slots for random ids (duplicates, -1, out of range, masked ranks, overflow). `parallel_lists`
models the destination lists of docs/RANKS.md step 5 (any R up to 256, no bitmask), which the
combine receive's partial-sum rank list shares. (The rank-bitmask lanes that came before them
are gone from the kernels, and their model with them.) A Python model of the lanes, not the kernel: the kernel itself is checked by the LL
GPU suite.  python3 bench/ll_routing_model.py
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

def as_lists(out, R):
    """serial()'s per-token (dm, ents by rank, s_n by rank, msgs) as destination lists, ascending."""
    res=[]
    for dm, ents, s_n, msgs in out:
        m=dict(msgs)
        res.append(tuple((d, ents[d], s_n[d], m[d]) for d in range(R) if dm>>d&1))
    return res

def popc(x): return bin(x).count('1')

def dest_index(lanes, valid, d_):
    """Every lane's index among the distinct ranks of the valid lanes (match_any, ballot of the
    groups' first lanes, then a count over them of smaller ranks), and the number of them."""
    key=[d_[l] if valid[l] else -1-l for l in lanes]
    same=[sum(1<<m for m in lanes if key[m]==key[l]) for l in lanes]
    first=[valid[l] and (same[l]&((1<<l)-1))==0 for l in lanes]
    firsts=[l for l in lanes if first[l]]
    idx=[sum(1 for f in firsts if d_[f]<d_[l]) for l in lanes]
    return idx, first, len(firsts)

def parallel_lists(ids, N, K, E, R, T, mask, t_begin, t_end):
    El=E//R
    s_total=[0]*E; s_before=[0]*E; s_rct=[0]*R; s_rc=[0]*R
    kp = 1 if K<=1 else 1<<((K-1).bit_length())
    per_warp=32//kp
    W=8
    for warp in range(W):
        t0=warp*per_warp
        while t0<N:
            dest=[-1]*32; toks=[0]*32
            for lane in range(32):
                tok=t0+lane//kp; k=lane%kp; toks[lane]=tok
                if tok<N and k<K:
                    e=ids[tok*K+k]
                    if 0<=e<E and not mask[e//El]:
                        s_total[e]+=1
                        if tok<t_begin: s_before[e]+=1
                        dest[lane]=e//El
            key=[-1-l if dest[l]<0 else (l//kp)*256+dest[l] for l in range(32)]
            for lane in range(32):
                same=sum(1<<m for m in range(32) if key[m]==key[lane])
                if dest[lane]>=0 and (same&((1<<lane)-1))==0:
                    s_rct[dest[lane]]+=1
                    if toks[lane]<t_begin: s_rc[dest[lane]]+=1
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
        below=[(1<<l)-1 for l in lanes]
        before=[s_before[ei[l]] if routed[l] else 0 for l in lanes]
        slot=[before[l]+popc(same_e[l]&below[l]) for l in lanes]
        for l in lanes:
            if routed[l] and (same_e[l]&below[l])==0: s_before[ei[l]]=before[l]+popc(same_e[l])
        idx, first_d, ndst = dest_index(lanes, routed, d_)
        kept=[routed[l] and slot[l]<T for l in lanes]
        keyd=[d_[l] if kept[l] else -1-l for l in lanes]
        same_d=[sum(1<<m for m in lanes if keyd[m]==keyd[l]) for l in lanes]
        s_n=[0]*16; s_ent=[[None]*16 for _ in range(16)]; s_dst=[None]*16; s_msg=[None]*16
        for l in lanes:
            if kept[l]:
                pos=popc(same_d[l]&below[l])
                s_ent[idx[l]][pos]=((ei[l]%El)<<16)|slot[l]
                if (same_d[l]&below[l])==0: s_n[idx[l]]=popc(same_d[l])
        for l in lanes:
            if first_d[l]:
                s_dst[idx[l]]=d_[l]; s_msg[idx[l]]=s_rc[d_[l]]; s_rc[d_[l]]+=1
        out.append(tuple((s_dst[i], tuple(s_ent[i][:s_n[i]]), s_n[i], s_msg[i]) for i in range(ndst)))
    return s_total, out, s_rct

def partial_ranks(ids_tok, E, El, mask):
    """Combine receive (partial sums): the token's distinct unmasked expert ranks, ascending."""
    lanes=range(32)
    e=[ids_tok[l] if l<len(ids_tok) else -1 for l in lanes]
    e=[-1 if 0<=x<E and mask[x//El] else x for x in e]
    valid=[0<=x<E for x in e]
    d_=[x//El if v else 0 for x,v in zip(e,valid)]
    idx, first, n = dest_index(lanes, valid, d_)
    part=[None]*n
    for l in lanes:
        if first[l]: part[idx[l]]=d_[l]
    return part

random.seed(2)
for it in range(1500):
    R=random.choice([1,2,4,8,16,37,64,256]); El=random.choice([1,2,3,8,36]); E=R*El
    if E>2048: El=max(1,2048//R); E=R*El
    K=random.randint(0,16); N=random.randint(0,70 if R<=8 else 40); T=random.randint(1,20)
    mask=[random.random()<0.2 for _ in range(R)]
    ids=[random.choice([-1,-2,E,E+5]+list(range(E))*3) if random.random()<0.3 else random.randrange(E) for _ in range(N*K)]
    G=random.randint(1,5); per=(N+G-1)//G if N else 0
    b=random.randrange(G); tb=min(N,b*per); te=min(N,tb+per)
    tot,out,rct=serial(ids,N,K,E,R,T,mask,tb,te)
    assert (tot,as_lists(out,R),rct)==parallel_lists(ids,N,K,E,R,T,mask,tb,te), (it,R,E,K,N,T)
    for tok in range(N):
        row=ids[tok*K:(tok+1)*K]
        want=sorted({x//El for x in row if 0<=x<E and not mask[x//El]})
        assert partial_ranks(row,E,El,mask)==want, (it,tok)
print("ok")
