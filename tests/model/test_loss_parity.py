"""The module's loss equals the NLL the official generation path assigns to the same codes.

Forced through `Qwen3TTSForConditionalGeneration.generate` step by step (see forced_generation.py),
for a padded batch of two clips of different lengths; and the same helper shows that the upstream
recipe's alignment does not match it.
"""

import pytest
import torch
import torch.nn.functional as F

from forced_generation import official_forced_nll
from tts_lightning.data.audio import load_audio
from tts_lightning.data.demo import demo_dir
from tts_lightning.model.loss import (
    code_predictor_inputs,
    code_predictor_logits,
    compute_loss,
    talker_hidden_states,
)
from tts_lightning.model.pretrained import build_model, check_pretrained, load_speech_tokenizer, load_text_tokenizer
from tts_lightning.model.sequence import IGNORE_INDEX, SpecialIds, build_sequence, collate, tokenize_text

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_dir):
    info = check_pretrained(tiny_dir)
    model = build_model(info).eval()
    tokenizer, speech = load_text_tokenizer(info), load_speech_tokenizer(info)
    ids = SpecialIds.from_config(info.config)
    examples = []
    # Two real clips of different lengths, cut short to keep the step-by-step path quick.
    for clip, frames, language in (("alice/alice_000", 9, "english"), ("bob/bob_003", 14, "auto")):
        path = demo_dir() / "clips" / clip
        codes = speech.encode(load_audio(path.with_suffix(".flac")).numpy(), sr=24_000).audio_codes[0][:frames]
        text_ids = tokenize_text(tokenizer, path.with_suffix(".txt").read_text().strip())
        examples.append((text_ids, codes, language))
    generator = torch.Generator().manual_seed(0)
    speakers = torch.randn(2, info.config["talker_config"]["hidden_size"], generator=generator) * 2
    sequences = [build_sequence(ids, t, c, language=lang) for t, c, lang in examples]
    batch = collate(sequences, speakers, [0, 1], pad_text_id=ids.tts_pad)
    official = [official_forced_nll(model, t, c, speakers[b], language=lang)
                for b, (t, c, lang) in enumerate(examples)]
    return model, batch, official


def test_batch_is_padded(setup):
    _, batch, _ = setup
    assert (batch.attention_mask.sum(1)[0] != batch.attention_mask.sum(1)[1]).item()


def test_module_loss_equals_official_generation_nll(setup):
    model, batch, official = setup
    with torch.no_grad():
        out = compute_loss(model.talker, batch)
    for b, (talker_nll, predictor_nll) in enumerate(official):
        ours_talker = out.talker_nll[out.talker_example == b]
        ours_predictor = out.predictor_nll[out.predictor_example == b]
        assert ours_talker.shape == talker_nll.shape  # every frame's code 0, then eos
        assert ours_predictor.shape == predictor_nll.shape  # all 15 codebooks of every frame
        torch.testing.assert_close(ours_talker, talker_nll, atol=TOLERANCE, rtol=0)
        for j in range(predictor_nll.shape[1]):  # each codebook on its own
            torch.testing.assert_close(ours_predictor[:, j], predictor_nll[:, j], atol=TOLERANCE, rtol=0)
    all_talker = torch.cat([t for t, _ in official])
    all_predictor = torch.cat([p for _, p in official])
    torch.testing.assert_close(out.talker_loss, all_talker.mean(), atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(out.code_predictor_loss, all_predictor.mean(), atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(out.loss, all_talker.mean() + 0.3 * all_predictor.mean(), atol=TOLERANCE, rtol=0)


def _upstream_alignment_nll(talker, batch):
    """The official recipe's alignment, on the same hidden states: talker labels shifted a second
    time (position p scored against the target of p+1), and the code predictor fed the hidden
    state of the position that has already seen the frame it predicts."""
    hidden = talker_hidden_states(talker, batch)
    logits = talker.codec_head(hidden).float()
    twice = batch.labels[:, 1:]
    mask = twice != IGNORE_INDEX
    talker_nll = F.cross_entropy(logits[:, :-1][mask], twice[mask], reduction="none")
    example, frame = batch.frame_mask.nonzero(as_tuple=True)
    late_hidden = hidden[example, batch.frame_positions[example, frame] + 1]
    codes = batch.codes[example, frame]
    predictor = code_predictor_logits(talker, code_predictor_inputs(talker, late_hidden, codes)).float()
    predictor_nll = F.cross_entropy(predictor.flatten(0, 1), codes[:, 1:].flatten(), reduction="none")
    return talker_nll, mask.nonzero()[:, 0], predictor_nll.view(-1, 15), example


def test_upstream_alignment_disagrees_with_generation(setup):
    model, batch, official = setup
    with torch.no_grad():
        talker_nll, talker_example, predictor_nll, predictor_example = _upstream_alignment_nll(model.talker, batch)
    for b, (official_talker, official_predictor) in enumerate(official):
        upstream_talker = talker_nll[talker_example == b]
        n = min(len(upstream_talker), len(official_talker))
        assert (upstream_talker[:n] - official_talker[:n]).abs().mean() > 0.05
        upstream_predictor = predictor_nll[predictor_example == b]
        assert (upstream_predictor - official_predictor).abs().mean() > 0.05
