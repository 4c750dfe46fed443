"""The module's loss equals the NLL the official generation path assigns to the same codes.

Forced through `Qwen3TTSForConditionalGeneration.generate` step by step (see forced_generation.py),
for a padded batch of two clips of different lengths; and the same helper shows that the upstream
recipe's alignment does not match it.
"""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from forced_generation import official_forced_nll

from tts_lightning import SpeakerClipsDataModule
from tts_lightning.data.demo import demo_dir
from tts_lightning.model.loading import build_model
from tts_lightning.model.loss import (
    code_predictor_inputs,
    code_predictor_logits,
    compute_loss,
    talker_hidden_states,
)
from tts_lightning.model.pretrained import check_pretrained, load_text_tokenizer
from tts_lightning.model.sequence import IGNORE_INDEX, tokenize_text

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    """A batch from the real data module: two demo clips of different lengths, padded together."""
    root = tmp_path_factory.mktemp("parity")
    lines = []
    for clip, speaker, language in (("alice/alice_000", "alice", "english"), ("bob/bob_003", "bob", "auto")):
        src = demo_dir() / "clips" / clip
        shutil.copy(src.with_suffix(".flac"), root / f"{speaker}.flac")
        text = src.with_suffix(".txt").read_text().strip()
        lines.append(json.dumps({"audio": f"{speaker}.flac", "text": text, "speaker": speaker, "language": language}))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    data = SpeakerClipsDataModule(
        pretrained=str(tiny_dir),
        train_manifest=str(root / "train.jsonl"),
        val_fraction=0.0,
        batch_size=2,
        max_frames_per_batch=None,
        seed=0,
    )
    data.prepare_data()
    data.setup("fit")
    (batch,) = list(data.train_dataloader())

    info = check_pretrained(tiny_dir)
    model = build_model(info).eval()
    tokenizer = load_text_tokenizer(info)
    speakers = data.speaker_embeddings()
    official = []
    for b in range(len(batch)):
        index = int(batch.speaker_index[b])
        name = data.speaker_names[index]
        record = next(json.loads(line) for line in lines if json.loads(line)["speaker"] == name)
        codes = batch.codes[b, batch.frame_mask[b]]
        text_ids = tokenize_text(tokenizer, record["text"])
        official.append(official_forced_nll(model, text_ids, codes, speakers[index], language=record["language"]))
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
