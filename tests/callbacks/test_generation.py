"""generate_codes / decode_codes: the official generation, in the layout training uses."""

import numpy as np
import pytest
import torch

from tts_lightning.model.generation import decode_codes, generate_codes
from tts_lightning.model.loading import build_model
from tts_lightning.model.loss import compute_loss
from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer, load_text_tokenizer
from tts_lightning.model.sequence import SpecialIds, build_sequence, collate, tokenize_text


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    info = check_pretrained(tiny_dir)
    model = build_model(info).eval()
    speaker = torch.randn(1, info.config["talker_config"]["hidden_size"], generator=torch.Generator().manual_seed(3))
    return info, model, load_text_tokenizer(info), speaker


def test_greedy_generation_follows_the_training_layout(tiny):
    """Greedy codes are the argmax of the teacher-forced training logits at every frame and every
    codebook: generation (non-streaming, x-vector speaker slot) and the loss see the same sequence."""
    info, model, tokenizer, speaker = tiny
    ids = SpecialIds.from_config(info.config)
    text_ids = tokenize_text(tokenizer, "Hello there, nice to meet you.")
    max_new = 48  # this speaker and text stop by end-of-speech after 34 frames (checked below)
    (codes,) = generate_codes(
        model,
        [text_ids],
        speaker,
        ["english"],
        max_new_tokens=max_new,
        do_sample=False,
        subtalker_dosample=False,
        repetition_penalty=1.0,
    )
    T = codes.shape[0]
    assert codes.dtype == torch.long and codes.shape[1] == 16 and T >= 2
    assert T < max_new - 1, "generation stopped at the cap: the end-of-speech frame below is not checked"

    batch = collate([build_sequence(ids, text_ids, codes, language="english")], speaker, [0], pad_text_id=ids.tts_pad)
    with torch.no_grad():
        out = compute_loss(model.talker, batch)
    logits = out.talker_logits.clone()  # (T + 1, V): frames 0..T-1, then eos
    vocab = logits.shape[1]
    allowed = torch.ones(vocab, dtype=torch.bool)
    allowed[vocab - 1024 :] = False
    allowed[ids.codec_eos] = True
    logits[:, ~allowed] = -float("inf")
    logits[:2, ids.codec_eos] = -float("inf")  # generation forbids eos at its first two steps
    assert torch.equal(logits[:T].argmax(-1), codes[:, 0])
    assert int(logits[T].argmax()) == ids.codec_eos  # the loss's eos target is where generation stopped
    assert torch.equal(out.predictor_predictions, codes[:, 1:])


def test_seeded_sampling_is_reproducible_and_leaves_the_rng_alone(tiny):
    info, model, tokenizer, speaker = tiny
    text_ids = [tokenize_text(tokenizer, t) for t in ("Good morning.", "See you soon.")]
    speakers = speaker.expand(2, -1)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = generate_codes(model, text_ids, speakers, max_new_tokens=10, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    again = generate_codes(model, text_ids, speakers, max_new_tokens=10, seed=7)
    other = generate_codes(model, text_ids, speakers, max_new_tokens=10, seed=8)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(first, other))
    with pytest.raises(ValueError, match="speaker_embeddings"):
        generate_codes(model, text_ids, speaker, max_new_tokens=4)


def test_weights_dtype_not_module_dtype(tiny, monkeypatch):
    """bf16 weights whose module reports float32 (as under FSDP mixed precision): the official
    generate fails on the speaker embedding's dtype; generate_codes does not."""
    info, _, tokenizer, speaker = tiny
    model = build_model(info).eval().to(torch.bfloat16)
    monkeypatch.setattr(type(model.talker), "dtype", property(lambda self: torch.float32))
    text_ids = [tokenize_text(tokenizer, "Hello.")]
    prompt = {"ref_spk_embedding": [speaker[0]], "x_vector_only_mode": [True], "icl_mode": [False], "ref_code": None}
    with pytest.raises(RuntimeError, match="dtype|BFloat16|Float"):
        model.generate(
            input_ids=[torch.tensor([text_ids[0]])],
            voice_clone_prompt=prompt,
            languages=["auto"],
            non_streaming_mode=True,
            max_new_tokens=4,
        )
    (codes,) = generate_codes(model, text_ids, speaker, max_new_tokens=4, seed=0)
    assert codes.shape[1] == 16 and codes.shape[0] >= 2


def test_decode_codes_gives_24khz_float32_one_row_at_a_time(tiny):
    """Each row is decoded alone (a sampling round's speakers x texts would otherwise hold activations
    for all rows, padded to the longest): the tokenizer sees one row per call, as many calls as rows."""
    info, model, tokenizer, speaker = tiny
    (codes,) = generate_codes(model, [tokenize_text(tokenizer, "Hello.")], speaker, max_new_tokens=6, seed=0)
    empty = torch.zeros(0, 16, dtype=torch.long)
    speech_tokenizer = load_speech_tokenizer(info)
    batches = []
    decode = speech_tokenizer.decode

    def recorded(rows):
        batches.append([r["audio_codes"].shape[0] for r in rows])
        return decode(rows)

    speech_tokenizer.decode = recorded
    wav, nothing, shorter = decode_codes(speech_tokenizer, [codes, empty, codes[:3]])
    assert wav.dtype == np.float32 and wav.shape == (codes.shape[0] * 1920,) and np.abs(wav).max() > 0
    assert nothing.shape == (0,) and shorter.shape == (3 * 1920,)
    assert batches == [[codes.shape[0]], [3]]


def test_xvector_streaming_layout_generates_as_generate_voice_clone(tiny):
    """``data.streaming`` without ICL: the codes of `generate_voice_clone(x_vector_only_mode=True,
    non_streaming_mode=False)` on the same weights, speaker embedding, seed and texts."""
    from qwen_tts import Qwen3TTSModel
    from qwen_tts.inference.qwen3_tts_model import VoiceClonePromptItem

    from tts_lightning.model.layouts import SequenceLayout

    info, model, tokenizer, speaker = tiny
    texts = ["Good morning.", "See you soon, my friend."]
    text_ids = [tokenize_text(tokenizer, t) for t in texts]
    layout = SequenceLayout("xvector", streaming=True)
    ours = generate_codes(model, text_ids, speaker.expand(2, -1), max_new_tokens=8, seed=4, layout=layout)
    official, generate, recorded = Qwen3TTSModel(model, tokenizer), model.generate, []
    model.load_speech_tokenizer(load_speech_tokenizer(info))  # generate_voice_clone decodes
    model.generate = lambda *a, **kw: recorded.append(generate(*a, **kw)[0]) or (recorded[-1], None)
    try:
        item = VoiceClonePromptItem(None, speaker[0], x_vector_only_mode=True, icl_mode=False, ref_text=None)
        torch.manual_seed(4)
        official.generate_voice_clone(texts, ["auto"] * 2, voice_clone_prompt=[item] * 2, max_new_tokens=8)
    finally:
        del model.generate  # the class's generate again
        model.load_speech_tokenizer(None)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(ours, recorded[0]))
    default = generate_codes(model, text_ids, speaker.expand(2, -1), max_new_tokens=8, seed=4)
    assert not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(ours, default))  # another layout
    with pytest.raises(ValueError, match="icl layout needs one reference per row"):
        generate_codes(model, text_ids, speaker.expand(2, -1), max_new_tokens=4, layout=SequenceLayout("icl"))


def test_rows_beyond_a_generate_call_go_to_the_next_call(tiny, monkeypatch):
    """`GENERATION_ROWS` rows per ``generate`` call (the KV cache grows with the rows): three rows at
    two per call are the first two rows' call, seeded as asked, then the third's, seeded seed + 2."""
    from tts_lightning.model import generation

    info, model, tokenizer, speaker = tiny
    texts = [tokenize_text(tokenizer, t) for t in ("Hello.", "Good morning.", "See you soon.")]
    speakers = speaker.repeat(3, 1) + torch.arange(3.0)[:, None]  # three voices
    batches = []
    generate = model.generate

    def recorded(*args, **kwargs):
        batches.append(len(kwargs["input_ids"]))
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", recorded)
    monkeypatch.setattr(generation, "GENERATION_ROWS", 2)
    together = generate_codes(model, texts, speakers, max_new_tokens=6, seed=5)
    assert batches == [2, 1]
    monkeypatch.setattr(generation, "GENERATION_ROWS", 16)
    first = generate_codes(model, texts[:2], speakers[:2], max_new_tokens=6, seed=5)
    third = generate_codes(model, texts[2:], speakers[2:], max_new_tokens=6, seed=7)
    assert len(together) == 3 and all(torch.equal(a, b) for a, b in zip(together, [*first, *third], strict=True))
