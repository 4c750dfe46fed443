"""Runs several `tts-lightning` commands one after another in this one process, through the entry
point the console script calls (`tts_lightning.__main__.main`), so that the README test pays the
interpreter start and the imports (~12 s of CPU) once per group of commands, not once per command.

    python readme_runner.py '[["plan", "--model", "1.7b"], ["export", ...]]'

Only for commands that run in their own process (the tools: prepare, plan, export, synthesize,
evaluate); `fit`, `predict` and `ray-fit` start other processes from their own command line and
run alone. After each command a marker line gives its exit status; a failing command does not stop
the ones after it (the test reports each command on its own)."""

import json
import sys
import traceback

from tts_lightning.__main__ import main

MARKER = "@@readme-runner "

for argv in json.loads(sys.argv[1]):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse and the tools exit with a status
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    print(MARKER + json.dumps({"argv": argv, "code": code}), flush=True)
