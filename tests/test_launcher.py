"""The tests' launcher (tests/launcher.py) when its zygote dies: a CI run once lost a zygote (the
machine short of memory), and the test whose commands it had forked waited for exit statuses that
never came. Now a command whose zygote died is reported at once (and stopped), and the next fork
starts a fresh zygote."""

import os
import signal
import time
from pathlib import Path

from launcher import Zygote


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_dead_zygote_is_reported_and_replaced(tmp_path):
    zygote = Zygote()
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out, err = str(tmp_path / "sleep.out"), str(tmp_path / "sleep.err")
        sleeper = zygote.fork(["-c", "import time; time.sleep(120)"], env, tmp_path, out, err)
        assert sleeper.poll() is None and not sleeper.lost
        assert zygote._proc is not None
        zygote._proc.kill()  # as the kernel's OOM killer would; its child runs on, an orphan
        zygote._proc.wait()
        start = time.monotonic()
        assert sleeper.wait(timeout=30) == -signal.SIGKILL and sleeper.lost
        assert time.monotonic() - start < 5  # reported at once, not waited for until the test's timeout
        deadline = time.monotonic() + 10
        while not _gone(sleeper.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(sleeper.pid)  # the orphan is stopped, not left running unseen

        out, err = str(tmp_path / "ok.out"), str(tmp_path / "ok.err")
        forked = zygote.fork(["-c", "print('forked again')"], env, tmp_path, out, err)
        assert forked.wait(timeout=120) == 0 and not forked.lost
        assert Path(out).read_text() == "forked again\n"
    finally:
        zygote.close()
