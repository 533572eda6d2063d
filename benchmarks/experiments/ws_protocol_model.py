"""A randomized model of ``gluon_ws_gemm.py``'s barrier protocol (CPU, plain Python).

The Gluon kernel cannot run under Triton's interpreter, so its ring/handoff protocol is
checked here on a model: one loader, two MMA partitions, ``STAGES`` slots with ``ready`` /
``empty`` mbarriers (parity waits: a wait for parity P passes once the barrier's current phase
parity differs from P), TMA loads that land in random order, and an async MMA that keeps the
newest step in flight (``warpgroup_mma_wait(1)``). Random interleavings; each run fails on a
stale read (an MMA step sees another position's data in its slot), an overwrite (a load lands
in a slot an in-flight MMA still reads) or no progress (deadlock).

Without the handoff barriers most runs read stale data (partition 1 waits on tile 1's first
slot two phases early); with them none of the runs fails, also when the work items have uneven
lengths, some shorter than the ring (as stream-K parts run first would make them; in this
model items shorter than the ring broke nothing either, though the kernels' launchers still
require ``k_tiles >= STAGES``):

    python benchmarks/experiments/ws_protocol_model.py
"""
import random
import sys

class Bar:
    def __init__(s, count=1): s.count=count; s.phase=0; s.arrived=0; s.tx=0
    def arrive(s):
        s.arrived += 1; s._maybe()
    def _maybe(s):
        if s.arrived >= s.count and s.tx == 0:
            s.phase += 1; s.arrived = 0
    def passes(s, parity): return (s.phase & 1) != parity  # phase with that parity completed

def run(ntiles, k_tiles, S, seed, handoff=True):
    """``k_tiles``: K-steps per tile, or a list of each work item's K-steps (stream-K parts
    are shorter than a tile, possibly shorter than ``S``)."""
    rng = random.Random(seed)
    lens = k_tiles if isinstance(k_tiles, (list, tuple)) else [k_tiles] * ntiles
    starts = [sum(lens[:j]) for j in range(ntiles)]
    ready=[Bar() for _ in range(S)]; empty=[Bar() for _ in range(S)]; hand=[Bar(), Bar()]
    slot=[None]*S; reading={}  # slot -> position being read by an in-flight MMA
    inflight=[]  # pending load completions (s, pos)
    errors=[]
    def loader():
        pos=0
        for j in range(ntiles):
            for kk in range(lens[j]):
                s=pos%S
                while not empty[s].passes(((pos//S)&1)^1): yield
                ready[s].tx += 1; ready[s].arrive()  # arrive.expect_tx; completes when tx done
                inflight.append((s,pos)); pos+=1; yield
    def mma(C):
        for j in range(C, ntiles, 2):
            if handoff and j>0:
                while not hand[C].passes(((j-2+C)//2)&1): yield
            prev=None; pending=[]
            for kk in range(lens[j]):
                pos=starts[j]+kk; s=pos%S
                while not ready[s].passes((pos//S)&1): yield
                if slot[s]!=pos: errors.append(f"stale: mma{C} tile {j} pos {pos} slot {s} holds {slot[s]}"); return
                if handoff and kk==lens[j]-1: hand[1-C].arrive()
                reading[s]=pos; pending.append(s)
                yield
                # wait(1): all but the newest done
                while len(pending)>1:
                    d=pending.pop(0); reading.pop(d,None)
                if prev is not None: empty[prev].arrive()
                prev=s
                yield
            for d in pending: reading.pop(d,None)
            empty[prev].arrive(); yield
    agents=[loader(), mma(0), mma(1)]; done=[False]*3; steps=0
    while not all(done):
        steps+=1
        if steps>2_000_000: return ["deadlock (no progress)"]
        choices=[i for i in range(3) if not done[i]]
        if inflight and rng.random()<0.4:
            s,pos=inflight.pop(rng.randrange(len(inflight)))
            if s in reading: errors.append(f"overwrite: slot {s} read as {reading[s]} loaded with {pos}")
            slot[s]=pos; ready[s].tx-=1; ready[s]._maybe(); continue
        i=rng.choice(choices)
        try: next(agents[i])
        except StopIteration: done[i]=True
        if errors: return errors
    # flush
    return errors

#: (work items, K-steps per item or each item's list, ring slots): whole tiles, then the
#: stream-K parts first (stream_k=2) as items of uneven length, some shorter than the ring
CASES = ((5,4,4),(7,6,3),(4,8,4),(9,5,5),(3,4,4),(2,4,4),(1,5,3)) + tuple(
    (len(lens), lens, S) for lens, S in (([3,1,6,6,6],5),([1,2,5,5,5,5],5),([4,6,6,6],5),([2],3),
                                        ([1,1,4,4,4],4),([5,1,3,3],3),([1,4,4,4,4,4,4],5)))
bad=0
for handoff in (False, True):
    fails=0
    for seed in range(300):
        for ntiles,k_tiles,S in CASES:
            e=run(ntiles,k_tiles,S,seed,handoff)
            if e: fails+=1; 
            if e and handoff: print(handoff, ntiles,k_tiles,S,seed,e[:2]); bad+=1
    print("handoff" if handoff else "no handoff", "failing runs:", fails)
sys.exit(1 if bad else 0)
