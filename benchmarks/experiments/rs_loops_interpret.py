"""Check every ``rs_loops.py`` variant on the CPU, under Triton's interpreter (no GPU).

Per shape (``m_local``, N, K, simulated grid) and epilogue split, each variant runs twice in a
row (counters must return to zero) as rank 0 of 2 and must produce ``a[:m_local] @ w.T`` plus
slot 1 (or without it for the ``READ = 0`` variants), push ``a[m_local:] @ w.T`` into slot 0,
leave the error word clear and, with signals, raise the owner's flag (to the call's epoch, 1;
without them it keeps the wiring's pre-set value). fp16 (the interpreter's
numpy has no bf16). Prints one line per case and exits non-zero on any failure.

    PYTHONPATH=. python benchmarks/experiments/rs_loops_interpret.py
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import rs_loops  # noqa: E402
from megatron_flux.bench.kernel_vs_cublas import rs_on_one_gpu  # noqa: E402
from megatron_flux.kernels.config import GemmConfig  # noqa: E402


def main():
    cfgs = [GemmConfig(block_m=16, block_n=32, block_k=16, num_stages=1, num_warps=4, group_m=2,
                       epilogue_split=s) for s in (1, 2)]
    bad = 0
    for m_local, n, k, sms in [(48, 64, 48, 5), (40, 96, 32, 3), (16, 32, 16, 8), (64, 64, 32, 64)]:
        torch.manual_seed(0)
        a = torch.randn(2 * m_local, k, dtype=torch.float16)
        w = torch.randn(n, k, dtype=torch.float16)
        full = a.float() @ w.t().float()
        slot1 = torch.randn(m_local, n).half()
        for cfg in cfgs:
            for name, v in rs_loops.VARIANTS.items():
                err = torch.zeros(4, dtype=torch.int32)
                launch, out, data = rs_on_one_gpu(a, w, 2, err, rs_loops.launcher(v), num_sms=sms)
                flags = launch.buffers[2]
                data[1].copy_(slot1)
                for _ in range(2):
                    out.fill_(float("nan"))
                    launch(cfg)
                ref = full[:m_local] + (0 if v["READ"] == 0 else slot1.float())
                e_out = float((out.float() - ref).norm() / ref.norm())
                e_push = float((data[0].float() - full[m_local:]).norm() / full[m_local:].norm())
                f = flags.tolist()
                ok = (e_out < 2e-3 and e_push < 2e-3 and err.tolist() == [0] * 4
                      and f[0] == (1 if v["SYNC"] else 1 << 30) and f[2:] == [0])
                bad += not ok
                print(m_local, n, k, sms, f"epi{cfg.epilogue_split}", name,
                      "ok" if ok else f"FAIL out {e_out:.3g} push {e_push:.3g} err {err.tolist()} "
                                      f"flags {f}", flush=True)
    print("failures:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
