"""The tests' launcher (tests/launcher.py) when its zygote dies: a CI run once lost a zygote (the
machine short of memory) and every later fork on that worker failed. Now the dead zygote's running
children are reported at once, and the next fork starts a fresh zygote."""

import os
import signal
import time

from launcher import Zygote


def test_a_dead_zygote_is_reported_and_replaced(tmp_path):
    zygote = Zygote()
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out, err = str(tmp_path / "sleep.out"), str(tmp_path / "sleep.err")
        sleeper = zygote.fork(["-c", "import time; time.sleep(120)"], env, tmp_path, out, err)
        assert sleeper.poll() is None and not sleeper.lost
        assert zygote._proc is not None
        zygote._proc.kill()  # as the kernel's OOM killer would
        zygote._proc.wait()
        os.kill(sleeper.pid, signal.SIGKILL)  # its child ends; init reaps it, nobody writes its status
        start = time.monotonic()
        assert sleeper.wait(timeout=30) == -signal.SIGKILL and sleeper.lost
        assert time.monotonic() - start < 10  # reported, not waited for until the test's timeout

        out, err = str(tmp_path / "ok.out"), str(tmp_path / "ok.err")
        forked = zygote.fork(["-c", "print('forked again')"], env, tmp_path, out, err)
        assert forked.wait(timeout=120) == 0 and not forked.lost
        assert open(out).read() == "forked again\n"
    finally:
        zygote.close()
