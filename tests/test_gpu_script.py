"""scripts/gpu: the synthetic-model writer behind the GPU measurement (tier 2: llama.cpp and the real Qwen
tokenizer, no download).

synth.py writes, from the shipped description of the Qwen2.5-Coder pair, GGUF files whose metadata and tensor
layout are the real files' and whose weights are random. Here a one-block copy of the 0.5B is written: its
metadata, tensor names, shapes and types, read back by describe.py, must equal the description's, and llama.cpp
must load it through localspec (tokenizer included), decode finite logits and draft with it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

GPU = Path(__file__).resolve().parents[1] / "scripts" / "gpu"
sys.path.insert(0, str(GPU))
import describe  # noqa: E402
import synth  # noqa: E402

N_VOCAB = 151936
TEXT = "def fibonacci(n):\n    return n"
TOKENS = [750, 75698, 1445, 982, 262, 470, 308]  # TEXT through the real Qwen2.5-Coder tokenizer


@pytest.fixture(scope="module")
def desc() -> dict:
    return synth.load_description()


@pytest.fixture(scope="module")
def small(desc, tmp_path_factory) -> Path:
    return synth.write(desc, "draft", tmp_path_factory.mktemp("synth") / "draft-1-block.gguf", layers=1)


def _padded(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@pytest.mark.parametrize("role,blocks,n_embd", [("target", 28, 1536), ("draft", 24, 896)])
def test_description_is_the_real_file(desc, role, blocks, n_embd):
    """The described header and tensors add up to exactly the real file's size: shapes and types are right."""
    model = desc["models"][role]
    meta = {k: v for k, _, _, v in synth.metadata(desc, role)}
    assert meta["qwen2.block_count"] == blocks and meta["qwen2.embedding_length"] == n_embd
    assert len(meta["tokenizer.ggml.tokens"]) == N_VOCAB and meta["tokenizer.ggml.eos_token_id"] == 151645
    per_block = {n.split(".", 2)[2] for n, _, _ in model["tensors"] if n.startswith("blk.0.")}
    assert len(model["tensors"]) == 2 + (1 if "output_norm.weight" in {t[0] for t in model["tensors"]} else 0) \
        + blocks * len(per_block)
    data = sum(_padded(synth.nbytes(shape, qtype), model["alignment"]) for _, shape, qtype in model["tensors"])
    assert model["data_offset"] + data == model["size"]


@pytest.mark.slow  # 8-10 s (gguf's reader over a 151k-token vocabulary): in the slow tier, which CI runs
def test_written_file_has_the_described_metadata_and_tensors(desc, small):
    """Read back by describe.py (gguf's reader): every key with its type and value, every tensor's name, shape
    and type, in order, as described; only block_count and the blocks beyond the first differ."""
    back = describe.describe_file(small)
    model = desc["models"]["draft"]
    expected = [[k, t.name, s.name if s else None, 1 if k == "qwen2.block_count" else v]
                for k, t, s, v in synth.metadata(desc, "draft")]
    assert back["metadata"] == expected
    assert back["tensors"] == [t for t in model["tensors"] if not t[0].startswith("blk.") or t[0].startswith("blk.0.")]
    assert back["alignment"] == model["alignment"]


def test_synthetic_model_loads_and_decodes_in_localspec(desc, small):
    import localspec
    from localspec.core.model import Model

    vocab = Model(small, vocab_only=True)
    try:
        assert vocab.n_vocab == N_VOCAB and vocab.bos == 151643 and vocab.eos == 151645
        assert vocab.tokenize(TEXT) == TOKENS
        template = next(v for k, _, _, v in synth.metadata(desc, "draft") if k == "tokenizer.chat_template")
        assert vocab.chat_template() == template
    finally:
        vocab.close()
    with localspec.load(target=small, draft=small, n_ctx=256, n_threads=2, memory_check=False) as llm:
        rows = np.array(llm.target.decode(TOKENS, logits="all"))
        assert rows.shape == (len(TOKENS), N_VOCAB) and np.isfinite(rows).all() and rows.std() > 0
        llm.target.truncate(0)
        r = llm.generate(TOKENS, max_tokens=8, temperature=0, drafter="model", k=3, p_min=0.0)
        assert len(r.tokens) == 8 and r.stats.drafted > 0


@pytest.mark.qwen
@pytest.mark.slow  # writes the whole 0.5B file, ~400 MB of random weights (~3 s): the slow tier, which CI runs
def test_full_synthetic_header_is_byte_identical_to_the_real_file(desc, qwen_paths, tmp_path):
    """Written whole, the synthetic 0.5B differs from the real file in its weights only."""
    real = qwen_paths[1]
    model = desc["models"]["draft"]
    assert real.name == model["file"]
    path = synth.write(desc, "draft", tmp_path / synth.synthetic_name(desc, "draft"))
    assert path.stat().st_size == real.stat().st_size == model["size"]
    with open(path, "rb") as a, open(real, "rb") as b:
        assert a.read(model["data_offset"]) == b.read(model["data_offset"])
