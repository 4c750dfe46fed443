"""Fine-tune Qwen3-TTS to clone voices with PyTorch Lightning and FSDP."""

from importlib import import_module

__version__ = "0.1.0"

# Public names, imported on first use: `import tts_lightning` stays cheap (torch, lightning and
# qwen_tts take seconds to import) while `from tts_lightning import X` works as usual.
_EXPORTS = {
    "build_tiny_pretrained": "tts_lightning.model.tiny",
    "check_pretrained": "tts_lightning.model.pretrained",
    "PretrainedError": "tts_lightning.model.pretrained",
    "Qwen3TTSModule": "tts_lightning.model.module",
    "SpeakerClipsDataModule": "tts_lightning.data.datamodule",
    "WriteError": "tts_lightning.files",
    "UserError": "tts_lightning.errors",
    "CacheEntryError": "tts_lightning.data.codec_cache",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tts_lightning' has no attribute {name!r}")
