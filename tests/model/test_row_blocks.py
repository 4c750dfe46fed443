"""The text embedding as row blocks (`tts_lightning.model.row_blocks`): the values and gradients of
one `nn.Embedding`, read from the checkpoint as row slices, and read back in the official layout."""

import pytest
import torch
from safetensors import safe_open
from torch import nn

from tts_lightning import Qwen3TTSModule
from tts_lightning.errors import ConfigError
from tts_lightning.model.lora import MergedWeights
from tts_lightning.model.row_blocks import RowBlockEmbedding, official_layout, split_text_embedding

TEXT = "talker.model.text_embedding"


@pytest.mark.parametrize("blocks", [1, 3, 8])
def test_forward_and_gradient_are_those_of_one_embedding(blocks):
    torch.manual_seed(0)
    plain = nn.Embedding(1001, 24)  # 1001 rows: blocks of unequal size
    split = RowBlockEmbedding(1001, 24, blocks)
    for block, (start, stop) in zip(split.blocks, split.bounds()):
        block.weight.data.copy_(plain.weight.data[start:stop])
    # every block's first and last rows, repeated ids (gradients summed), and a 2-D batch
    edges = [i for s, e in split.bounds() for i in (s, e - 1)]
    ids = torch.tensor([edges + [5, 5, 1000, 0, 499] * 3]).repeat(2, 1)
    ids[1] = ids[1].flip(0)
    grad = torch.randn(*ids.shape, 24)
    out_plain, out_split = plain(ids), split(ids)
    assert torch.equal(out_plain, out_split)
    out_plain.backward(grad)
    out_split.backward(grad)
    joined = torch.cat([b.weight.grad for b in split.blocks])
    assert torch.equal(plain.weight.grad, joined)
    assert len(split.blocks) == blocks and sum(split.rows) == 1001


def test_the_module_reads_row_slices_and_gives_back_the_official_layout(tiny_dir):
    module = Qwen3TTSModule(str(tiny_dir), speakers=["alice"], text_embedding_blocks=5)
    module.configure_model()
    embedding = module.model.talker.model.text_embedding
    assert isinstance(embedding, RowBlockEmbedding) and len(embedding.blocks) == 5
    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        official = f.get_tensor(f"{TEXT}.weight").float()
    for block, (start, stop) in zip(embedding.blocks, embedding.bounds()):
        assert torch.equal(block.weight, official[start:stop])
    # what copy_model and the samples callback read: the official key, joined
    merged = MergedWeights(module.model)
    assert f"{TEXT}.weight" in list(merged) and not any(".blocks." in k and TEXT in k for k in merged)
    assert torch.equal(merged[f"{TEXT}.weight"], official)
    # a state dict in the official layout (a checkpoint from before the split) loads into the blocks
    state = {k: v.clone() for k, v in module.model.state_dict().items() if not k.startswith(f"{TEXT}.")}
    state[f"{TEXT}.weight"] = official.flip(0)
    assert not module.model.load_state_dict(state, strict=True).missing_keys
    assert torch.equal(torch.cat([b.weight for b in embedding.blocks]), official.flip(0))


def test_bad_block_counts_are_refused(tiny_dir):
    with pytest.raises(ConfigError, match="model.text_embedding_blocks"):
        Qwen3TTSModule(str(tiny_dir), speakers=["alice"], text_embedding_blocks=0)


def test_split_keeps_real_values_and_official_layout_orders_keys():
    model = nn.Module()
    model.talker = nn.Module()
    model.talker.model = nn.Module()
    model.talker.model.text_embedding = plain = nn.Embedding(10, 3)
    split = split_text_embedding(model, 3)
    assert torch.equal(torch.cat([b.weight for b in split.blocks]), plain.weight)
    keys = ["a", *(f"model.{TEXT}.blocks.{i}.weight" for i in (0, 2, 10, 1)), "b"]
    assert official_layout(keys) == ["a", f"model.{TEXT}.weight", "b"]
