"""tools.tune.retune: a re-search of shapes a table holds replaces those entries."""

import json

import pytest

from megatron_flux.kernels.version import KERNEL_VERSION
from megatron_flux.tools.tune import retune as R
from megatron_flux.tuning.schema import TuningFileError, load_table, validate_table

from test_tune_add import entry, table


def test_replaces_what_the_run_holds_keeps_the_rest_and_says_so(tmp_path):
    confirmed = dict(entry("ag", 512, 256, 4096, 1.0, 2.0), notes={"confirmed": True})
    old = validate_table(table([confirmed, entry("rs", 256, 512, 4096, 0.9, 1.0)],
                               search={"searched": True, "retimed_by": {"benches": ["b.json"]}}),
                         "shipped.json")
    run = validate_table(table([entry("ag", 512, 256, 4096, 0.8, 2.0, block_n=64),
                                entry("ag", 512, 256, 8192, 1.5, 3.0, block_n=64)],
                               source="megatron-flux tune --m-set all"), "grid.json")
    new = R.retune_table(old, run, "grid.json")
    got = {(e.op, e.n, e.k, e.m): e for e in new.entries}
    assert len(got) == 3
    replaced = got[("ag", 512, 256, 4096)]
    assert (replaced.flux_ms, replaced.config.block_n) == (0.8, 64)
    assert replaced.notes["tuned_by"] == "grid.json" and "confirmed" not in replaced.notes
    kept = got[("rs", 256, 512, 4096)]
    assert kept.flux_ms == 0.9 and "tuned_by" not in (kept.notes or {})
    assert got[("ag", 512, 256, 8192)].notes["tuned_by"] == "grid.json"
    search = new.extra["search"]
    assert search["retuned_by"] == [{"tune": "grid.json", "source": run.source, "replaced": 1, "added": 1}]
    assert search["retimed_by"] == {"benches": ["b.json"]}  # the table's own record is kept
    # through the command line
    for name, obj in (("t.json", table([entry("ag", 512, 256, 4096, 1.0, 2.0)])),
                      ("r.json", table([entry("ag", 512, 256, 4096, 0.7, 2.0)]))):
        (tmp_path / name).write_text(json.dumps(obj))
    assert R.main([str(tmp_path / "t.json"), str(tmp_path / "r.json"), str(tmp_path / "out.json")]) == 0
    (e,) = load_table(str(tmp_path / "out.json")).entries
    assert e.flux_ms == 0.7


@pytest.mark.parametrize("over, field", [({"tp": 4}, "tp"), ({"kernel_version": KERNEL_VERSION + 1}, "kernel_version")])
def test_refuses_a_run_from_another_machine_or_kernel(over, field):
    old = validate_table(table([entry("ag", 512, 256, 4096, 1.0, 2.0)]), "shipped.json")
    run = validate_table(table([entry("ag", 512, 256, 4096, 0.5, 2.0)], **over), "other.json")
    with pytest.raises(TuningFileError, match=field):
        R.retune_table(old, run, "other.json")
