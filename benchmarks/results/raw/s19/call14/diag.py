import torch, time
def trial(kernel_on_default, peer_prio):
    ks = torch.cuda.current_stream() if kernel_on_default else torch.cuda.Stream()
    peer = torch.cuda.Stream(priority=peer_prio)
    torch.cuda.synchronize()
    s0 = torch.cuda.Event(enable_timing=True); s1 = torch.cuda.Event(enable_timing=True)
    p0 = torch.cuda.Event(enable_timing=True); p1 = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(ks):
        s0.record(); torch.cuda._sleep(40_000_000); s1.record()
    with torch.cuda.stream(peer):
        p0.record(); torch.cuda._sleep(2_000_000); p1.record()
    torch.cuda.synchronize()
    return round(s0.elapsed_time(s1),2), round(s0.elapsed_time(p0),2), round(s0.elapsed_time(p1),2)
for kd in (True, False):
    for pr in (-1, 0):
        print("kernel_on_default", kd, "peer_prio", pr, "(kernel ms, peer start ms, peer end ms)", [trial(kd, pr) for _ in range(3)])
