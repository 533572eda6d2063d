"""Every shipped launcher and model config starts on Megatron's own argument checks.

Each launcher (``examples/pretrain_*.sh``) prints its exact command with ``FLUX_DRY_RUN=1``; for
every launcher x config x TP size x flag on/off x iteration count, ``megatron_startup.py`` runs
Megatron 0.19's start-up on it: argument parsing and validation, megatron-flux's checks, the model
and pretrain configs, and the learning-rate scheduler (its ``lr_warmup_steps < lr_decay_steps``
assert once stopped the README's main command). megatron-core 0.19 needs Python 3.12 to install,
so it comes as its wheel: ``$MEGATRON_FLUX_TEST_MCORE_WHEEL`` (``.ci/run`` downloads it), else
``.whl/megatron_core-0.19*.whl`` in the checkout; without either the test skips and says so.
"""

import glob
import json
import os
import subprocess
import sys
import zipfile

import pytest

from helpers import paths

REPO = str(paths.REPO)
LAUNCHERS = sorted(glob.glob(os.path.join(REPO, "examples", "pretrain_*.sh")))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.json")))


def _mcore_wheel():
    wheel = os.environ.get("MEGATRON_FLUX_TEST_MCORE_WHEEL")
    if wheel:
        return wheel
    found = sorted(glob.glob(os.path.join(REPO, ".whl", "megatron_core-0.19*.whl")))
    return found[-1] if found else None


@pytest.fixture(scope="module")
def mcore(tmp_path_factory):
    wheel = _mcore_wheel()
    if wheel is None or not os.path.exists(wheel):
        pytest.skip("no megatron-core 0.19 wheel ($MEGATRON_FLUX_TEST_MCORE_WHEEL or "
                    ".whl/megatron_core-0.19*.whl)")
    out = tmp_path_factory.mktemp("mcore019")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(out)
    return str(out)


def dry_run(launcher, env):
    """``(environment, argv)`` of the launcher's training command."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("FLUX_", "MODEL_CONFIG", "TRAIN_ITERS", "NPROC"))}
    full.update(env, FLUX_DRY_RUN="1")
    lines = subprocess.run(["bash", launcher], env=full, check=True, capture_output=True,
                           text=True, cwd=REPO).stdout.splitlines()
    assigned = dict(line[4:].split("=", 1) for line in lines if line.startswith("ENV "))
    return assigned, [line for line in lines if not line.startswith("ENV ")]


def cases():
    out = []
    for launcher in LAUNCHERS:
        for config in [None] + CONFIGS:
            for tp in ("2", "4"):
                for overlap in ("1", "0"):
                    for iters in (None, "2"):
                        env = {"NPROC": tp, "FLUX_TP_OVERLAP": overlap}
                        if config:
                            env["MODEL_CONFIG"] = os.path.relpath(config, REPO)
                        if iters:
                            env["TRAIN_ITERS"] = iters
                        out.append((os.path.basename(launcher), env, *dry_run(launcher, env)))
    return out


def test_the_launchers_print_their_command():
    assert len(LAUNCHERS) >= 2 and len(CONFIGS) >= 3
    env, argv = dry_run(os.path.join(REPO, "examples", "pretrain_llama.sh"), {})
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "WORLD_SIZE": "2"}
    assert argv[:2] == ["--model-config", os.path.join(REPO, "configs/llama3_8b_16l.json")]
    assert "--flux-tp-overlap" in argv and "--sequence-parallel" in argv


def test_every_launcher_and_config_passes_megatrons_startup_checks(mcore, tmp_path):
    todo = cases()
    path = tmp_path / "cases.json"
    path.write_text(json.dumps([{"env": env, "argv": argv} for _, _, env, argv in todo]))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "helpers", "megatron_startup.py"),
                           mcore, str(path)], capture_output=True, text=True, timeout=900,
                          cwd=REPO)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(todo), proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = [f"{name} {knobs}: {r['error'].splitlines()[0] if r['error'] else ''}\n{r['error'][-1500:]}"
              for (name, knobs, _, _), r in zip(todo, results) if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(todo)} launches fail at start-up:\n" + "\n".join(failed[:4])
