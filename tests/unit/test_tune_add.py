"""tools.tune.add: a later tuning run's entries for the shapes a table lacks."""

import json

import pytest

from megatron_flux.kernels.config import GemmConfig
from megatron_flux.kernels.version import KERNEL_VERSION
from megatron_flux.tools.tune import add as A
from megatron_flux.tuning.schema import TuningFileError, load_table, validate_table

CFG = GemmConfig(128, 128, 64, 4, 4, 8).to_dict()


def table(entries, **over):
    obj = {"format": "megatron-flux-tuning", "version": 1, "gpu": {"name": "NVIDIA H200", "sms": 132},
           "tp": 2, "dtype": "bf16", "source": "megatron-flux tune --m-set all", "kernel_version": KERNEL_VERSION,
           "search": {"searched": True}, "entries": entries}
    obj.update(over)
    return obj


def entry(op, n, k, m, flux, nccl, **cfg):
    return {"op": op, "n": n, "k": k, "m": m, "config": dict(CFG, **cfg), "tuned": True,
            "flux_ms": flux, "nccl_ms": nccl}


def test_adds_only_the_shapes_the_table_lacks_and_keeps_its_own(tmp_path):
    old = validate_table(table([entry("ag", 512, 256, 4096, 1.0, 2.0)]), "shipped.json")
    run = validate_table(table([entry("ag", 512, 256, 4096, 0.5, 2.0, block_n=64),
                                entry("ag", 512, 256, 8192, 1.5, 3.0, block_n=64),
                                entry("rs", 256, 512, 4096, 0.9, 1.0)],
                               source="megatron-flux tune --shapes ag:512:256 rs:256:512 --ms 4096 8192"),
                         "tune.json")
    new = A.add_tuned(old, [(run, "tune.json")])
    got = {(e.op, e.n, e.k, e.m): e for e in new.entries}
    assert len(got) == 3
    kept = got[("ag", 512, 256, 4096)]
    assert (kept.flux_ms, kept.config.block_n) == (1.0, 128) and "tuned_by" not in (kept.notes or {})
    added = got[("ag", 512, 256, 8192)]
    assert (added.flux_ms, added.config.block_n, added.tuned) == (1.5, 64, True)
    assert added.notes["tuned_by"] == "tune.json"
    assert new.extra["search"]["added_by"] == [{"tune": "tune.json", "source": run.source, "entries": 2,
                                                "kept": 1}]
    assert new.extra["search"]["searched"] is True and new.source == old.source
    # through the command line, written as a valid table
    paths = []
    for name, obj in (("t.json", table([entry("ag", 512, 256, 4096, 1.0, 2.0)])),
                      ("r.json", table([entry("rs", 256, 512, 4096, 0.9, 1.0)]))):
        (tmp_path / name).write_text(json.dumps(obj))
        paths.append(str(tmp_path / name))
    assert A.main(paths + [str(tmp_path / "out.json")]) == 0
    assert len(load_table(str(tmp_path / "out.json")).entries) == 2


@pytest.mark.parametrize("over, field", [({"tp": 4}, "tp"), ({"gpu": {"name": "NVIDIA H100", "sms": 132}}, "gpu.name"),
                                         ({"kernel_version": KERNEL_VERSION + 1}, "kernel_version"),
                                         ({"dtype": "fp16"}, "dtype")])
def test_refuses_a_run_from_another_machine_or_kernel(over, field):
    old = validate_table(table([entry("ag", 512, 256, 4096, 1.0, 2.0)]), "shipped.json")
    run = validate_table(table([entry("ag", 512, 256, 8192, 1.5, 3.0)], **over), "tune.json")
    with pytest.raises(TuningFileError, match=field):
        A.add_tuned(old, [(run, "tune.json")])


def test_a_run_that_adds_nothing_is_an_error():
    old = validate_table(table([entry("ag", 512, 256, 4096, 1.0, 2.0)]), "shipped.json")
    run = validate_table(table([entry("ag", 512, 256, 4096, 0.5, 2.0)]), "tune.json")
    with pytest.raises(TuningFileError, match="adds nothing"):
        A.add_tuned(old, [(run, "tune.json")])
