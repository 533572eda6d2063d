"""Kernel knobs that were removed (``REMOVED_FIELDS``): tables and configs written before name
them at the one value they always took, which loads; any other value is refused, naming the
file, the field and that the knob was removed."""

import dataclasses
import json

import pytest

from megatron_flux.kernels.config import REMOVED_FIELDS, GemmConfig
from megatron_flux.tuning import schema

CONFIG = {"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 4, "num_warps": 4}


def _table(config):
    return {"format": "megatron-flux-tuning", "version": 1,
            "gpu": {"name": "NVIDIA Test GPU", "sms": 100}, "tp": 2, "dtype": "bf16",
            "source": "unit test",
            "entries": [{"op": "ag", "n": 512, "k": 256, "m": 1024, "config": config,
                         "tuned": True}]}


def _write(tmp_path, obj, name):
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


def test_removed_knobs_are_gone_from_the_config():
    fields = {f.name for f in dataclasses.fields(GemmConfig)}
    assert REMOVED_FIELDS and not set(REMOVED_FIELDS) & fields


@pytest.mark.parametrize("knob", sorted(REMOVED_FIELDS))
def test_a_removed_knob_loads_only_at_the_value_it_always_had(tmp_path, knob):
    kept = REMOVED_FIELDS[knob]
    table = schema.load_table(_write(tmp_path, _table(dict(CONFIG, **{knob: kept})), "old.json"))
    assert table.entries[0].config == schema.load_table(
        _write(tmp_path, _table(dict(CONFIG)), "new.json")).entries[0].config
    other = (not kept) if isinstance(kept, bool) else kept + 1
    for bad in (other, str(kept), None):
        path = _write(tmp_path, _table(dict(CONFIG, **{knob: bad})), "odd.json")
        with pytest.raises(schema.TuningFileError, match=f"{knob} was removed") as ei:
            schema.load_table(path)
        assert ei.value.field == f"entries[0].config.{knob}" and path in str(ei.value)
    assert GemmConfig.from_dict(dict(CONFIG, **{knob: kept})) == GemmConfig(**CONFIG)
    with pytest.raises(ValueError, match=f"{knob} was removed"):
        GemmConfig.from_dict(dict(CONFIG, **{knob: other}))
