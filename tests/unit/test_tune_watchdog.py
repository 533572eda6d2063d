"""The tune's stall watchdog: a rank stuck outside the kernels' bounded waits ends the tune,
saying which entry and rank, with its Python stacks, instead of holding it forever."""

import time

from megatron_flux.tools.tune.watchdog import ProgressWatchdog


def _stuck_in_a_synchronize(seconds):
    time.sleep(seconds)


def _dog(tmp_path, seconds, exits):
    out = open(tmp_path / "stderr.txt", "w+")
    return ProgressWatchdog(seconds, 3, "megatron-flux tune", exit_fn=exits.append, out=out,
                            poll_s=0.01), out


def test_a_stall_ends_the_tune_naming_the_entry_rank_and_where(tmp_path):
    exits = []
    dog, out = _dog(tmp_path, 0.1, exits)
    with dog.watching("rs n=12288 k=3072 m=2048"):
        _stuck_in_a_synchronize(0.5)
    out.seek(0)
    text = out.read()
    assert exits == [3]
    assert "megatron-flux tune (rank 3): rs n=12288 k=3072 m=2048: no progress for 0.1 s" in text
    assert "_stuck_in_a_synchronize" in text  # the stalled thread's stack


def test_progress_keeps_it_quiet_and_zero_disables_it(tmp_path):
    exits = []
    dog, out = _dog(tmp_path, 0.15, exits)
    with dog.watching("ag n=4096 k=4096 m=1024"):
        for _ in range(12):  # 0.6 s in all, never 0.15 s without progress
            time.sleep(0.05)
            dog.progress()
    assert exits == []
    off, _ = _dog(tmp_path, 0, exits)
    with off.watching("ag n=4096 k=4096 m=1024"):
        time.sleep(0.2)
    assert exits == []


def test_the_watch_ends_with_its_entry(tmp_path):
    exits = []
    dog, _ = _dog(tmp_path, 0.1, exits)
    with dog.watching("ag n=4096 k=4096 m=1024"):
        pass
    time.sleep(0.3)  # no progress after the entry: nothing is watching any more
    assert exits == []
