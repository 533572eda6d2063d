"""The hardware-queue probe (:mod:`megatron_flux.comm.queues`) against the setting it detects:
``CUDA_DEVICE_MAX_CONNECTIONS=1`` from the start gives one queue; unset, or set once CUDA has
initialised, several. Each case is its own process (the variable counts only at start)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

_PROBE = """
import os, sys, time, torch
from megatron_flux.comm.queues import hardware_queues
torch.cuda.is_available()
if sys.argv[1] == "late":
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
t0 = time.perf_counter()
print(hardware_queues(torch.device("cuda", 0)), round(time.perf_counter() - t0, 3))
"""


@pytest.mark.parametrize("setting, expected", [("1", "one"), ("unset", "several"),
                                               ("late", "several")])
def test_hardware_queues_tells_one_queue_from_several(setting, expected):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    if setting == "1":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    out = subprocess.run([sys.executable, "-c", _PROBE, setting], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    answer, seconds = out.stdout.split()
    assert answer == expected, (setting, out.stdout)
    assert float(seconds) < 5.0  # the probe never holds a stream
