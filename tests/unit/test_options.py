"""FluxOptions: one object for every runtime setting; the environment gives only its defaults."""

import argparse

import pytest

from megatron_flux.options import ENV, FluxOptions, get_options, on_options_change, set_options


def test_defaults_and_every_variable_of_the_environment():
    assert FluxOptions.from_env({}) == FluxOptions()
    env = {ENV["column_dgrad"]: "fused", ENV["column_regather"]: "copy_engine",
           ENV["reserved_sms"]: "8", ENV["max_spins"]: "1000", ENV["error_check_interval"]: "4",
           ENV["direct_launch"]: "0", ENV["host_descriptors"]: "0", ENV["auto_margin"]: "0.05"}
    assert FluxOptions.from_env(env) == FluxOptions(
        column_dgrad="fused", column_regather="copy_engine", reserved_sms=8, max_spins=1000,
        error_check_interval=4, direct_launch=False, host_descriptors=False, auto_margin=0.05)
    assert set(ENV) == {f.name for f in __import__("dataclasses").fields(FluxOptions)}


@pytest.mark.parametrize("field,raw", [("direct_launch", "yes"), ("host_descriptors", "2"),
                                       ("reserved_sms", "x"), ("max_spins", "0"),
                                       ("auto_margin", "1"), ("column_dgrad", "cublas")])
def test_a_bad_value_names_its_variable(field, raw):
    with pytest.raises(ValueError, match=ENV[field]):
        FluxOptions.from_env({ENV[field]: raw})


def test_megatron_flags_override_the_environment_and_replace_keeps_what_is_not_given():
    base = FluxOptions.from_env({ENV["column_dgrad"]: "fused", ENV["max_spins"]: "99"})
    args = argparse.Namespace(flux_column_dgrad=None, flux_column_regather="copy_engine")
    opts = FluxOptions.from_args(args, base)
    assert (opts.column_dgrad, opts.column_regather, opts.max_spins) == ("fused", "copy_engine", 99)
    assert base.replace(max_spins=None) == base


def test_set_options_tells_the_listeners_and_none_goes_back_to_the_environment(monkeypatch):
    seen = []
    on_options_change(seen.append)
    try:
        set_options(FluxOptions(max_spins=5))
        assert get_options().max_spins == 5 and seen[-1].max_spins == 5
        monkeypatch.setenv(ENV["max_spins"], "77")
        set_options(None)
        assert get_options().max_spins == 77 and seen[-1].max_spins == 77
        with pytest.raises(TypeError):
            set_options({"max_spins": 5})
    finally:
        monkeypatch.delenv(ENV["max_spins"])
        set_options(None)
