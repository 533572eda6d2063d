"""Would `auto`'s estimate for shapes no table lists choose better with other settings? CPU only.

Leave-one-shape-family-out on the shipped tables and the held-out benchmarks of
``megatron_flux.tools.auto_eval``, scored like it, for two families of variants:

* ``wave_scaling``: each neighbour's flux/NCCL ratio scaled by the shape's wave quantisation
  over the neighbour's, ``(q_shape / q_neighbour) ** alpha`` with
  ``q = estimate.wave_work(...) * SMs / (m * n)`` of the entry's own config (alpha 0 is the
  shipped estimate);
* ``constants``: ``M_WEIGHT``, ``ROW_SHIFT`` and ``K_NEAREST`` over a small grid.

``PYTHONPATH=.:benchmarks/experiments python benchmarks/experiments/estimate_variants.py --out OUT.json``
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

from megatron_flux.tools import auto_eval as A
from megatron_flux.tuning import estimate as E
from megatron_flux.tuning import registry, schema

HELD_OUT = ["benchmarks/results/bench-h200x2-2026-11-27-unseen-b.json",
            "benchmarks/results/bench-h200x2-2026-11-28-unseen-c.json",
            "benchmarks/results/bench-h200x2-2026-11-28-unseen-d.json"]
MARGIN = 0.02


def _q(op, cfg, m, n, k, tp, sms):
    return E.wave_work(op, cfg, m, n, k, tp, sms) * sms / (m * n)


class WaveScaled(E.Estimator):
    """The shipped estimate with each neighbour's ratio scaled by the wave quantisation of the
    entry's own config on its own shape over the neighbour's."""

    def __init__(self, points, op, tp, sms, alpha):
        self.op, self.tp, self.sms, self.alpha = op, tp, sms, alpha
        super().__init__(points)

    def predict(self, m, n, k, exclude=None, cfg=None):
        pool = self.points if exclude is None else [p for p in self.points if p.family != exclude]
        near = [p for _, p in E.nearest(pool, m / E.ROW_SHIFT, n, k)[:self.k_nearest]]
        if not near:
            return None
        q = _q(self.op, cfg, m, n, k, self.tp, self.sms) if cfg is not None else None
        logs = [math.log(p.ratio * ((q / _q(self.op, p.config, p.m, p.n, p.k, self.tp, self.sms)) ** self.alpha
                                    if q is not None else 1.0)) for p in near]
        return math.exp(sum(logs) / len(logs)), tuple(near)

    def leave_out(self):
        return [(p, (lambda r: None if r is None else r[0])(
            self.predict(p.m, p.n, p.k, exclude=p.family, cfg=p.config))) for p in self.points]

    def decide(self, m, n, k, margin, cfg=None):
        allow = self.allowance(margin)
        pred = None if allow is None else self.predict(m, n, k, cfg=cfg)
        if pred is None:
            return None
        return E.Estimate(pred[0] * allow < 1.0 - margin, pred[0], allow, pred[1])


def _scores(records):
    return A.score(records, "estimate", MARGIN)


def wave_scaling(tables, alphas):
    out = {}
    for t in tables:
        for alpha in alphas:
            records = []
            for op, points in A._points(t).items():
                for fam in sorted({p.family for p in points}):
                    est = WaveScaled([p for p in points if p.family != fam], op, t.tp, t.sms, alpha)
                    for p in (p for p in points if p.family == fam):
                        got = est.decide(p.m, p.n, p.k, MARGIN, cfg=p.config)
                        fused = got.fused if got is not None else E.size_rule(op, p.m, t.tp)
                        records.append({"ratio": p.ratio, "choice": {"estimate": fused}})
            out[f"{t.path.split('/')[-1]} alpha={alpha}"] = _scores(records)
    return out


def constants(tables, benches, h200_tp2):
    saved = (E.M_WEIGHT, E.ROW_SHIFT, E.K_NEAREST)
    out = {}
    try:
        for mw, rs, kn in itertools.product((1.0, 2.0, 3.0), (1.5, 2.0), (2, 3)):
            E.M_WEIGHT, E.ROW_SHIFT, E.K_NEAREST = mw, rs, kn
            loo = [_scores(A.leave_out_choices(t, MARGIN)) for t in tables]
            held = [_scores(A.held_out_choices(h200_tp2, b, HELD_OUT, MARGIN)) for b, _ in benches]
            out[f"M_WEIGHT={mw} ROW_SHIFT={rs} K_NEAREST={kn}"] = {
                "leave_out_right": sum(s["right"] for s in loo),
                "leave_out_fused_slower": sum(s["fused_slower_than_nccl"] for s in loo),
                "leave_out_worst": max(s["worst_vs_nccl"] for s in loo),
                "held_out_right": sum(s["right"] for s in held),
                "held_out_fused_slower": sum(s["fused_slower_than_nccl"] for s in held),
                "held_out_worst": max(s["worst_vs_nccl"] for s in held)}
    finally:
        E.M_WEIGHT, E.ROW_SHIFT, E.K_NEAREST = saved
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    tables = [schema.load_table(f) for f in registry.shipped_table_files()]
    h200_tp2 = next(t for t in tables if t.tp == 2 and t.gpu.startswith("h200"))
    benches = [(json.load(open(b)), b) for b in HELD_OUT]
    result = {"what": __doc__.split("\n\n")[0], "command": " ".join(["python"] + sys.argv),
              "tables": [os.path.basename(f) for f in registry.shipped_table_files()],
              "margin": MARGIN, "held_out": HELD_OUT,
              "shipped": {"M_WEIGHT": E.M_WEIGHT, "ROW_SHIFT": E.ROW_SHIFT, "K_NEAREST": E.K_NEAREST},
              "wave_scaling": wave_scaling(tables, (0.0, 0.5, 1.0)),
              "constants": constants(tables, benches, h200_tp2)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for part in ("wave_scaling", "constants"):
        for name, s in result[part].items():
            print(part, name, s)


if __name__ == "__main__":
    main()
