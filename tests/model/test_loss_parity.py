"""The module's loss equals the NLL the official generation path assigns to the same codes.

Forced through `Qwen3TTSForConditionalGeneration.generate` step by step (see forced_generation.py),
for a padded batch of four clips of different lengths (two with a language tag, two "auto"), in
every layout the data module offers (x-vector and ICL, non-streaming and streaming); and the same
helper shows that the upstream recipe's alignment does not match it.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from forced_generation import official_forced_nll
from qwen_tts import Qwen3TTSModel

from tts_lightning import SpeakerClipsDataModule
from tts_lightning.data.codec_cache import load_codes
from tts_lightning.data.demo import demo_dir
from tts_lightning.model.layouts import SequenceLayout, build_layout_sequence, reference_text_ids
from tts_lightning.model.loading import build_model
from tts_lightning.model.loss import (
    code_predictor_inputs,
    code_predictor_logits,
    compute_loss,
    talker_hidden_states,
)
from tts_lightning.model.pretrained import check_pretrained, load_text_tokenizer
from tts_lightning.model.sequence import IGNORE_INDEX, SpecialIds, collate

TOLERANCE = 1e-4
CLIPS = (
    ("alice/alice_000", "alice", "english"),
    ("alice/alice_001", "alice", "auto"),
    ("bob/bob_003", "bob", "auto"),
    ("bob/bob_000", "bob", "english"),
)
LAYOUTS = [("xvector", False), ("xvector", True), ("icl", False), ("icl", True)]
# The rows a new layout is proven on (forcing generation costs ~1 s a clip): one with a language tag,
# one "auto", one of each speaker; the default layout is proven on all four.
CHECKED = {"alice_000.flac", "bob_003.flac"}


@pytest.fixture(scope="module")
def built(tiny_dir, tmp_path_factory):
    """built(layout, streaming) -> (model, batch, {row: official NLL}): one batch of the four clips
    from the real data module, and what the official generation path assigns to the codes of each
    row (`CHECKED` rows only, but for the default layout), the ICL prompt built from the reference
    clip the data module chose. Cached per layout."""
    root = tmp_path_factory.mktemp("parity")
    records = {}
    for clip, speaker, language in CLIPS:
        src = demo_dir() / "clips" / clip
        name = Path(clip).name
        shutil.copy(src.with_suffix(".flac"), root / f"{name}.flac")
        text = src.with_suffix(".txt").read_text().strip()
        records[f"{name}.flac"] = {"audio": f"{name}.flac", "text": text, "speaker": speaker, "language": language}
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    info = check_pretrained(tiny_dir)
    model = build_model(info).eval()
    tokenizer = load_text_tokenizer(info)
    cache: dict = {}

    def get(layout: str, streaming: bool):
        if (layout, streaming) in cache:
            return cache[layout, streaming]
        data = SpeakerClipsDataModule(
            pretrained=str(tiny_dir),
            train_manifest=str(root / "train.jsonl"),
            val_fraction=0.0,
            batch_size=4,
            max_frames_per_batch=None,
            seed=0,
            layout=layout,
            streaming=streaming,
        )
        data.prepare_data()
        data.setup("fit")
        (batch,) = list(data.train_dataloader())
        items = data.train_dataset.items
        speakers = data.speaker_embeddings()
        official = {}
        for b in range(len(batch)):
            codes = batch.codes[b, batch.frame_mask[b]]
            (item,) = [it for it in items if torch.equal(load_codes(it.codes), codes)]
            record = records[Path(item.key).name]
            if (layout, streaming) != ("xvector", False) and record["audio"] not in CHECKED:
                continue
            text_ids = tokenizer(Qwen3TTSModel._build_assistant_text(None, record["text"]))["input_ids"]
            icl = {}
            if layout == "icl":
                ref = records[Path(item.reference.key).name]
                assert ref["speaker"] == record["speaker"] and ref is not record  # another clip of the speaker
                ref_item = next(it for it in items if it.key == item.reference.key)
                icl = dict(
                    ref_ids=tokenizer(Qwen3TTSModel._build_ref_text(None, ref["text"]))["input_ids"],
                    ref_code=load_codes(ref_item.codes),
                )
            official[b] = official_forced_nll(
                model,
                text_ids,
                codes,
                speakers[item.speaker_index],
                language=record["language"],
                non_streaming_mode=not streaming,
                **icl,
            )
        cache[layout, streaming] = model, batch, official
        return cache[layout, streaming]

    get.tokenizer = tokenizer
    return get


@pytest.mark.parametrize(
    "layout, streaming", LAYOUTS, ids=[f"{a}-{'streaming' if s else 'non_streaming'}" for a, s in LAYOUTS]
)
def test_module_loss_equals_official_generation_nll(built, layout, streaming):
    model, batch, official = built(layout, streaming)
    assert len(batch) == 4 and len(set(batch.attention_mask.sum(1).tolist())) > 1  # padded
    with torch.no_grad():
        out = compute_loss(model.talker, batch)
    assert len(official) == (4 if (layout, streaming) == ("xvector", False) else 2)
    for b, (talker_nll, predictor_nll) in official.items():
        ours_talker = out.talker_nll[out.talker_example == b]
        ours_predictor = out.predictor_nll[out.predictor_example == b]
        assert ours_talker.shape == talker_nll.shape  # every frame's code 0, then eos
        assert ours_predictor.shape == predictor_nll.shape  # all 15 codebooks of every frame
        torch.testing.assert_close(ours_talker, talker_nll, atol=TOLERANCE, rtol=0)
        for j in range(predictor_nll.shape[1]):  # each codebook on its own
            torch.testing.assert_close(ours_predictor[:, j], predictor_nll[:, j], atol=TOLERANCE, rtol=0)
    if len(official) == len(batch):  # the batch's losses: the means over every target of every row
        all_talker = torch.cat([official[b][0] for b in sorted(official)])
        all_predictor = torch.cat([official[b][1] for b in sorted(official)])
        torch.testing.assert_close(out.talker_loss, all_talker.mean(), atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(out.code_predictor_loss, all_predictor.mean(), atol=TOLERANCE, rtol=0)
        expected = all_talker.mean() + 0.3 * all_predictor.mean()
        torch.testing.assert_close(out.loss, expected, atol=TOLERANCE, rtol=0)
    if (layout, streaming) != ("xvector", False):
        # Not vacuous: the same targets cost clearly different amounts under the default layout.
        _, default_batch, default_official = built("xvector", False)
        for b in official:
            codes = batch.codes[b, batch.frame_mask[b]]
            (d,) = [
                i
                for i in range(len(default_batch))
                if torch.equal(default_batch.codes[i, default_batch.frame_mask[i]], codes)
            ]
            assert (official[b][0] - default_official[d][0]).abs().mean() > 0.05


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


def test_upstream_alignment_disagrees_with_generation(built):
    model, batch, official = built("xvector", False)
    with torch.no_grad():
        talker_nll, talker_example, predictor_nll, predictor_example = _upstream_alignment_nll(model.talker, batch)
    for b, (official_talker, official_predictor) in official.items():
        upstream_talker = talker_nll[talker_example == b]
        n = min(len(upstream_talker), len(official_talker))
        assert (upstream_talker[:n] - official_talker[:n]).abs().mean() > 0.05
        upstream_predictor = predictor_nll[predictor_example == b]
        assert (upstream_predictor - official_predictor).abs().mean() > 0.05


# The branches the demo batch does not reach: an ICL prompt whose text is shorter than the
# reference's frames (the usual case with a real tokenizer: text runs ahead of nothing), and a
# streaming text longer than the frames (text left unread when eos comes).
EDGE_CASES = {
    "icl-streaming-short-text": ("icl", ["Hi.", "Yes, go."], 8),
    "xvector-streaming-long-text": ("xvector", ["Zyx qwv, 123 jkl! Vox pop quiz.", "Go."], 3),
}


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_streaming_edge_cases_equal_official_generation_nll(built, case):
    layout, texts, max_frames = EDGE_CASES[case]
    model, batch, _ = built("xvector", False)
    tokenizer = built.tokenizer
    ids = SpecialIds.from_config(model.config)
    clips = [batch.codes[b, batch.frame_mask[b]] for b in range(len(batch))]
    reference = torch.cat(clips[:2])  # longer than any text here
    rows, official, content = [], [], []
    for b, text in enumerate(texts):
        codes = clips[b][:max_frames]  # fewer frames than text tokens when cut
        text_ids = tokenizer(Qwen3TTSModel._build_assistant_text(None, text))["input_ids"]
        ref_ids = tokenizer(Qwen3TTSModel._build_ref_text(None, "Hi."))["input_ids"]
        content.append(len(text_ids[3:-5]))
        ref = (reference_text_ids(tokenizer, ["Hi."])[0], reference) if layout == "icl" else None
        rows.append(build_layout_sequence(ids, text_ids, codes, layout=SequenceLayout(layout, True), reference=ref))
        icl = dict(ref_ids=ref_ids, ref_code=reference) if layout == "icl" else {}
        official.append(
            official_forced_nll(model, text_ids, codes, batch.speaker_embedding[b], non_streaming_mode=False, **icl)
        )
    if layout == "icl":
        assert len(ref_ids[3:-2]) + max(content) + 1 < reference.shape[0] + 1  # text ends first
    else:
        assert content[0] > rows[0].codes.shape[0]  # text left when eos comes
    padded = collate(rows, batch.speaker_embedding[: len(rows)], [0, 1], pad_text_id=ids.tts_pad)
    with torch.no_grad():
        out = compute_loss(model.talker, padded)
    for b, (talker_nll, predictor_nll) in enumerate(official):
        torch.testing.assert_close(out.talker_nll[out.talker_example == b], talker_nll, atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(out.predictor_nll[out.predictor_example == b], predictor_nll, atol=TOLERANCE, rtol=0)
