"""The samples callback's comparison figure: a generated clip's mel spectrogram beside the real
reference, with time and frequency axes, in a real TensorBoard event file."""

import io
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.tensorboard import SummaryWriter

from tts_lightning.callbacks.figures import comparison_figure, log_comparisons
from tts_lightning.data.audio import load_audio

CLIPS = Path(__file__).resolve().parents[2] / "tts_lightning" / "demo" / "clips"


def test_comparison_figure_has_axes_and_lands_in_the_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    real = load_audio(CLIPS / "alice" / "alice_000.flac", 24_000).numpy().reshape(-1)  # a real voice
    generated = np.random.default_rng(0).normal(0.0, 0.1, 36_000).astype(np.float32)  # 1.5 s of noise

    fig = comparison_figure(generated, real, "alice, step 7, similarity 0.612")
    gen_ax, real_ax = fig.axes[:2]  # then the colour bars
    for ax, audio in ((gen_ax, generated), (real_ax, real)):
        assert ax.get_xlabel() == "time (s)" and ax.get_ylabel() == "frequency (Hz)"
        assert abs(ax.get_xlim()[1] - len(audio) / 24_000) < 256 / 24_000  # to one hop
        assert ax.get_ylim() == (0.0, 12_000.0)
    assert "step 7" in fig._suptitle.get_text() and "similarity 0.612" in fig._suptitle.get_text()
    alone = comparison_figure(generated, None, "no reference")
    assert len(alone.axes) == 2  # one panel and its colour bar

    writer = SummaryWriter(str(tmp_path))
    rows, wavs = [("alice", 0), ("alice", 1)], [generated, np.zeros(0, np.float32)]  # an empty one is skipped
    log_comparisons(writer, "spectrograms_vs_real", rows, wavs, ["Hello.", "Bye."], {"alice": real}, {}, 7)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    acc.Reload()
    assert acc.Tags()["images"] == ["spectrograms_vs_real/alice/0"]
    (event,) = acc.Images("spectrograms_vs_real/alice/0")
    assert event.step == 7 and event.width == 800 and event.height == 256  # two panels, 10 x 3.2 in at 80 dpi
    pixels = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
    assert pixels.shape == (256, 800, 3) and pixels.std() > 20  # a drawn picture, not a blank canvas
