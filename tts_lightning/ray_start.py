"""Start or join Ray for `ray-fit` and `prepare --ray.num_workers`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def start_ray(address: str, num_cpus: int, env_vars: dict[str, str] | None = None, **init: Any) -> bool:
    """`ray.init` unless Ray already runs in this process; whether this call started it (its
    caller shuts it down). ``address`` ``local``: a one-machine cluster of at least ``num_cpus``
    CPUs (the machine's, if more), without the dashboard, whose workers import this package from
    where the driver does (its folder first on their PYTHONPATH); else the cluster to join
    (``auto``, an address). ``env_vars`` go to every worker; ``init``: more of `ray.init`'s options."""
    import ray

    if ray.is_initialized():
        return False
    env = dict(env_vars or {})
    if address == "local":
        init = {"include_dashboard": False, **init, "num_cpus": max(os.cpu_count() or 1, num_cpus)}
        root = str(Path(__file__).resolve().parents[1])  # the folder that holds tts_lightning
        path = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env.setdefault("PYTHONPATH", os.pathsep.join(dict.fromkeys(path)))
    if env:
        init["runtime_env"] = {"env_vars": env}
    ray.init(address=address, **init)
    return True
