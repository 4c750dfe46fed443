"""Speaking rate on real speech (the shipped demo clips, time-stretched with torchaudio) and
end-of-speech failures counted on the tiny model through the official generation path."""

import numpy as np
import pytest
import torch
import torchaudio
from transformers import LogitsProcessor, LogitsProcessorList

from tts_lightning.data.audio import load_audio
from tts_lightning.data.demo import demo_dir
from tts_lightning.metrics.speech import (
    frame_limit,
    hit_frame_limit,
    max_new_tokens_for,
    seconds_per_character,
    speaking_rate_ratio,
    speech_seconds,
    text_characters,
)

SR = 24_000


def demo_clip(name="alice", i=1):
    path = demo_dir() / "clips" / name / f"{name}_{i:03d}.flac"
    return load_audio(path, SR).numpy(), path.with_suffix(".txt").read_text().strip()


def time_stretch(wav: np.ndarray, longer_by: float) -> np.ndarray:
    """Same pitch, ``longer_by`` times the duration (torchaudio's phase vocoder)."""
    n_fft, hop = 1024, 256
    window = torch.hann_window(n_fft)
    spec = torch.stft(torch.from_numpy(wav), n_fft, hop, window=window, return_complex=True)
    stretch = torchaudio.transforms.TimeStretch(hop_length=hop, n_freq=n_fft // 2 + 1, fixed_rate=1 / longer_by)
    out = torch.istft(stretch(spec[None])[0], n_fft, hop, window=window)
    return out.numpy()


@pytest.mark.parametrize("longer_by", [1.25, 0.8])
def test_speaking_rate_ratio_of_time_stretched_speech(longer_by):
    wav, text = demo_clip()
    own = seconds_per_character([wav], [text], SR)
    assert speaking_rate_ratio(wav, text, SR, own) == pytest.approx(1.0, abs=1e-9)
    stretched = time_stretch(wav, longer_by)
    assert speaking_rate_ratio(stretched, text, SR, own) == pytest.approx(longer_by, rel=0.05)


def test_silence_around_speech_does_not_count():
    wav, text = demo_clip("bob", 2)
    pad = np.zeros(SR, dtype=np.float32)
    padded = np.concatenate([pad, wav, pad, pad])
    assert speech_seconds(padded, SR) == pytest.approx(speech_seconds(wav, SR), abs=0.021)
    assert speech_seconds(wav, SR) < len(wav) / SR  # the clip's own edges are trimmed too
    assert speech_seconds(np.zeros(SR), SR) == 0.0 and speech_seconds(np.zeros(0), SR) == 0.0
    # The two demo speakers' paces are measured on their real clips (bob speaks slower: 150 wpm).
    paces = {}
    for name in ("alice", "bob"):
        clips = [demo_clip(name, i) for i in range(4)]
        paces[name] = seconds_per_character([w for w, _ in clips], [t for _, t in clips], SR)
    assert 0.04 < paces["alice"] < paces["bob"] < 0.12, paces


def test_frame_limit_follows_text_and_pace():
    assert text_characters("Hi, it's 5 o'clock!") == 12
    text = "The morning train was late again."  # 27 characters
    assert frame_limit(text, 0.08) == int(np.ceil(3.0 * 27 * 0.08 * 12.5))  # 81
    assert frame_limit(text, 0.16) > frame_limit(text, 0.08)  # a slower speaker gets more room
    assert frame_limit("Hi.", 0.08) == 25  # at least 2 s
    assert frame_limit(text, 0.08, max_frames=40) == 40
    assert hit_frame_limit(81, 81) and not hit_frame_limit(80, 81)
    assert max_new_tokens_for(81) == 82  # the official generation returns one frame per token but the last


class ForbidEos(LogitsProcessor):
    def __init__(self, eos: int):
        self.eos = eos

    def __call__(self, input_ids, scores):
        scores[:, self.eos] = float("-inf")
        return scores


class ForceEos(LogitsProcessor):
    """eos as soon as generation allows it (the official code forbids it for the first 2 steps)."""

    def __init__(self, eos: int):
        self.eos = eos

    def __call__(self, input_ids, scores):
        if torch.isfinite(scores[:, self.eos]).all():
            scores[:, : self.eos] = float("-inf")
            scores[:, self.eos + 1 :] = float("-inf")
        return scores


def test_end_of_speech_failure_is_counted_when_the_model_cannot_stop(tiny_dir):
    """The tiny model through the official generation path: a logits processor on the talker that
    forbids ``codec_eos`` makes every generation run to its limit (a failure); one that makes it stop
    gives no failure."""
    from tts_lightning.model.generation import generate_codes
    from tts_lightning.model.loading import build_model
    from tts_lightning.model.pretrained import check_pretrained, load_text_tokenizer
    from tts_lightning.model.sequence import tokenize_text

    info = check_pretrained(tiny_dir)
    model = build_model(info).eval()
    talker = model.talker
    eos = model.config.talker_config.codec_eos_token_id
    texts = ["Hello there.", "The morning train was late again."]
    limits = [frame_limit(t, 0.02, min_frames=6) for t in texts]
    ids = [tokenize_text(load_text_tokenizer(info), t) for t in texts]
    torch.manual_seed(0)
    embeddings = torch.randn(len(texts), talker.config.hidden_size)

    def run(processor):
        original = talker.generate

        def generate(*args, **kwargs):
            kwargs["logits_processor"] = LogitsProcessorList([processor])
            return original(*args, **kwargs)

        talker.generate = generate
        try:
            return [
                generate_codes(model, [i], e[None], max_new_tokens=max_new_tokens_for(limit), seed=0)[0]
                for i, e, limit in zip(ids, embeddings, limits)
            ]
        finally:
            del talker.generate

    endless = run(ForbidEos(eos))
    assert [c.shape[0] for c in endless] == limits
    assert all(hit_frame_limit(c.shape[0], limit) for c, limit in zip(endless, limits))
    stopped = run(ForceEos(eos))
    assert [c.shape[0] for c in stopped] == [2, 2]  # eos at the first step it is allowed
    assert not any(hit_frame_limit(c.shape[0], limit) for c, limit in zip(stopped, limits))
