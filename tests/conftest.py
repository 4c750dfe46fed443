import os

# Small machines: torch's default thread pool makes tiny models run at random speeds (0.5-15 s per
# generate call on 2 cores); one thread per process is steady. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from tts_lightning import build_tiny_pretrained

    return build_tiny_pretrained(tmp_path_factory.mktemp("tiny") / "base", seed=0)


@pytest.fixture(scope="session")
def tiny_custom_voice_dir(tmp_path_factory):
    from tts_lightning import build_tiny_pretrained

    return build_tiny_pretrained(
        tmp_path_factory.mktemp("tiny") / "custom_voice", seed=0, model_type="custom_voice"
    )
