"""The wheels benchmarks/gpu_check.sh needs on the GPU machine's image (Python 3.12, its own torch, no
registry): every package the project needs at run time that the image lacks or holds at a version
qwen-tts cannot use, found by walking the wheels' own requirements (not a hand-kept list).

    python benchmarks/gpu_wheels.py          # fills .whl/ (git-ignored), prints what and why

`IMAGE` is the image's package list as the device tool's KINDS.md gave it (2026-11-17); `PINNED` are
the versions qwen-tts 0.1.1 needs where the image's differ. gpu_check.py's preflight imports every
module the run needs and names any still missing.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".whl"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
IMAGE = set(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)
PINNED = {  # qwen-tts 0.1.1's pins, where the image holds newer releases it cannot run with
    "transformers": "4.57.3",
    "tokenizers": "0.22.1",
    "huggingface-hub": "0.36.0",
    "accelerate": "1.12.0",
}
# What the run imports at the top: the project's run-time requirements, qwen-tts and its own.
ROOTS = ["qwen-tts", "jsonargparse", "docstring-parser", "typeshed-client", "soundfile", "librosa", "sox", "torchao"]
SKIP = {"gradio", "onnxruntime"}  # qwen-tts's demo UI and ONNX export: never imported by training


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


TARGET = {  # the image's interpreter, for the requirements' environment markers
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def requirements(wheel: Path) -> list[str]:
    """The run-time requirements of ``wheel`` on the image's Python (3.12, Linux), without extras."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    found = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line[len("Requires-Dist:") :].strip())
            if requirement.marker is None or requirement.marker.evaluate(TARGET):
                found.append(normalize(requirement.name))
    return found


def download(spec: str) -> Path:
    """The wheel of ``spec``; a version with no wheel for the image (sdist only) falls back to the
    newest wheel of that package."""
    try:
        return _download(spec)
    except subprocess.CalledProcessError:
        name = re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0]
        if name == spec or normalize(name) in PINNED:
            raise
        return _download(name)


def _download(spec: str) -> Path:
    before = set(WHEELS.glob("*.whl"))
    args = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    platforms = [f"--platform={p}" for p in PLATFORMS]
    cmd = [sys.executable, "-m", "pip", "download", "-q", *args, *platforms, "-d", str(WHEELS), spec]
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    new = set(WHEELS.glob("*.whl")) - before
    name = normalize(re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0])
    matching = [w for w in new | before if normalize(w.name.split("-")[0]) == name]
    return max(matching, key=lambda w: w.stat().st_mtime)


def pinned(name: str) -> str:
    """``name`` at qwen-tts's pin, else at the version this project's environment runs (what CI tests)."""
    from importlib.metadata import PackageNotFoundError, version

    if name in PINNED:
        return f"{name}=={PINNED[name]}"
    try:
        return f"{name}=={version(name)}"
    except PackageNotFoundError:
        return name


def main() -> int:
    WHEELS.mkdir(exist_ok=True)
    exclude = REPO / ".git" / "info" / "exclude"  # the wheels travel to the device, never into git
    exclude.parent.mkdir(parents=True, exist_ok=True)
    if not exclude.is_file() or "/.whl/" not in exclude.read_text():
        with exclude.open("a") as f:
            f.write("/.whl/\n")
    queue = [pinned(n) for n in (*ROOTS, *PINNED)]
    seen: set[str] = set()
    while queue:
        spec = queue.pop(0)
        name = normalize(re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0])
        if name in seen or name in SKIP:
            continue
        seen.add(name)
        wheel = download(spec)
        print(f"{wheel.name}  ({'pinned for qwen-tts' if name in PINNED else 'missing on the image'})")
        for need in requirements(wheel):
            if need not in seen and need not in SKIP and (need not in IMAGE or need in PINNED):
                queue.append(pinned(need))
    size = sum(w.stat().st_size for w in WHEELS.glob("*.whl"))
    print(f"{len(seen)} wheels, {size / 2**20:.1f} MiB in {WHEELS} (carry it: the device tool's limit is 64 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
