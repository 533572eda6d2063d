"""How well would `auto` decide for a shape its table lacks? Leave-one-model-out on the shipped tables.

For every entry, hide all entries of its model, predict fused-or-NCCL from what is left, and score
the prediction with the entry's measured times (fused counts only with the 2 % margin; a correct
"NCCL" costs 1.0x). Rules:

* ``flat``: fused from 1024 global rows (today's rule for unknown shapes);
* ``nearest``: the decision of the nearest entry of the same op in (log2 per-rank rows, log2 n,
  log2 k);
* ``nccl``: always NCCL.

``python benchmarks/experiments/auto_rule_eval.py [--out JSON]`` prints accuracy and the geomean time vs NCCL
per table.
"""

import glob
import json
import math
import os

MARGIN = 0.98
TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "megatron_flux", "tuning", "tables")


def evaluate(path):
    table = json.load(open(path))
    tp = table["tp"]
    entries = [dict(op=e["op"], m=e["m"], n=e["n"], k=e["k"], model=(e.get("notes") or {}).get("model"),
                    ratio=e["flux_ms"] / e["nccl_ms"]) for e in table["entries"]]

    def feat(e):
        rows = e["m"] // tp if e["op"] == "ag" else e["m"]
        return (math.log2(rows), math.log2(e["n"]), math.log2(e["k"]))

    def nearest(e):
        pool = [o for o in entries if o["op"] == e["op"] and o["model"] != e["model"]]
        return min(pool, key=lambda o: sum((a - b) ** 2 for a, b in zip(feat(o), feat(e))))

    rules = {"flat": lambda e: e["m"] >= 1024, "nearest": lambda e: nearest(e)["ratio"] <= MARGIN,
             "nccl": lambda e: False}
    out = {}
    for name, rule in rules.items():
        right = sum(rule(e) == (e["ratio"] <= MARGIN) for e in entries)
        log_cost = sum(math.log(e["ratio"] if rule(e) else 1.0) for e in entries)
        out[name] = (right, math.exp(log_cost / len(entries)))
    oracle = math.exp(sum(math.log(min(e["ratio"], 1.0)) for e in entries) / len(entries))
    return tp, len(entries), out, oracle


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the results as JSON")
    args = ap.parse_args(argv)
    record = {"command": "python benchmarks/experiments/auto_rule_eval.py" + (f" --out {args.out}" if args.out else ""),
              "margin": MARGIN, "tables": {}}
    for path in sorted(glob.glob(os.path.join(TABLES, "*.json"))):
        tp, n, out, oracle = evaluate(path)
        cells = ", ".join(f"{k}: {r}/{n} right, {g:.3f}x" for k, (r, g) in out.items())
        print(f"{os.path.basename(path)} (TP={tp}): {cells}; oracle {oracle:.3f}x")
        record["tables"][os.path.basename(path)] = {
            "tp": tp, "entries": n, "oracle_geomean_vs_nccl": oracle,
            "rules": {k: {"right": r, "geomean_vs_nccl": g} for k, (r, g) in out.items()}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
