"""The sequence builder lays out exactly the prefill that official generation builds."""

import pytest
import torch

from tts_lightning.model.loading import build_model
from tts_lightning.model.pretrained import check_pretrained, load_text_tokenizer
from tts_lightning.model.sequence import (
    SpecialIds,
    assistant_text,
    build_sequence,
    collate,
    embed_batch,
    tokenize_text,
    tokenize_texts,
)


class _Captured(Exception):
    pass


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_dir):
    info = check_pretrained(tiny_dir)
    return build_model(info).eval(), load_text_tokenizer(info), SpecialIds.from_config(info.config)


def official_prefill(model, text_ids, speaker_embedding, language):
    """Run `Qwen3TTSForConditionalGeneration.generate` until it hands its prefill to the talker."""
    captured = {}

    def capture(**kwargs):
        captured.update(kwargs)
        raise _Captured

    model.talker.generate = capture
    try:
        model.generate(
            input_ids=[torch.tensor([text_ids])],
            languages=[language],
            non_streaming_mode=True,
            voice_clone_prompt={
                "ref_spk_embedding": [speaker_embedding],
                "x_vector_only_mode": [True],
                "icl_mode": [False],
                "ref_code": None,
            },
        )
    except _Captured:
        pass
    finally:
        del model.talker.generate
    return captured["inputs_embeds"]


@pytest.mark.parametrize("language", ["Auto", "English", "german"])
def test_prefill_equals_generation(model_and_tokenizer, language):
    model, tokenizer, ids = model_and_tokenizer
    text_ids = tokenize_text(tokenizer, "Hello world, this is a test.")
    speaker = torch.randn(model.config.talker_config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    expected = official_prefill(model, text_ids, speaker, language)
    sequence = build_sequence(ids, text_ids, None, language=language)
    with torch.no_grad():
        ours = embed_batch(model.talker, collate([sequence], speaker[None], [0], pad_text_id=ids.tts_pad))
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    # The speaker slot moves one place with an explicit language.
    assert sequence.speaker_position == (6 if language == "Auto" else 7)


def test_frames_follow_the_prefill(model_and_tokenizer):
    _, tokenizer, ids = model_and_tokenizer
    text_ids = tokenize_text(tokenizer, "Hi.")
    codes = torch.randint(0, 256, (5, 16))
    seq = build_sequence(ids, text_ids, codes)
    L = seq.prefill_length
    assert seq.labels[L - 1 : L + 4].tolist() == codes[:, 0].tolist()  # codec_bos position predicts frame 0
    assert seq.labels[L + 4].item() == ids.codec_eos and (seq.labels[: L - 1] == -100).all()
    assert torch.equal(seq.codec_ids[L:], codes) and (seq.text_ids[L:] == ids.tts_pad).all()


def test_unknown_language_is_named(model_and_tokenizer):
    _, tokenizer, ids = model_and_tokenizer
    with pytest.raises(ValueError, match="'klingon' is not supported"):
        build_sequence(ids, tokenize_text(tokenizer, "Hi."), None, language="klingon")


def test_texts_tokenised_together_equal_one_by_one(model_and_tokenizer):
    """setup() tokenises every transcript in one batch call: the ids must be each text's own."""
    _, tokenizer, _ = model_and_tokenizer
    texts = ["Hi.", "Grüße aus Köln, 3.5 km entfernt!", "你好，世界。", "A much longer sentence, " * 12, "  spaced  "]
    assert tokenize_texts(tokenizer, texts) == [tokenizer(assistant_text(t))["input_ids"] for t in texts]
    assert tokenize_texts(tokenizer, []) == []
    with pytest.raises(ValueError, match="tokenised to 8 ids"):
        tokenize_texts(tokenizer, ["Hi.", ""])
