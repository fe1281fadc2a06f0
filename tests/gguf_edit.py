"""Edit a GGUF file with llama.cpp's own gguf-py: copy every key and tensor, changing what is asked.

Used to make a target whose vocabulary is wider than its draft's, as the standard Qwen2.5 7B/14B/32B targets
(152,064 logits) are beside their 0.5B/1.5B drafts (151,936).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def pad_vocab(src: Path, dst: Path, extra: int, rows_of: list[int] | None = None) -> Path:
    """A copy of src with `extra` unused tokens appended, and zero rows for them in the embedding (and output)
    matrices: the model computes what it did, and the new ids get logit 0. With rows_of, the new ids take
    those tokens' rows instead (in turn), so they get those tokens' logits."""
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value, vtype = f.contents(), f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
        if name == "tokenizer.ggml.tokens":
            value = value + [f"<pad{i}>" for i in range(extra)]
        elif name == "tokenizer.ggml.token_type":
            value = value + [5] * extra  # UNUSED
        elif name == "tokenizer.ggml.scores":
            value = value + [0.0] * extra
        elif name == f"{arch}.vocab_size":
            value = n_vocab + extra
        w.add_key_value(name, value, vtype, sub)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.name in ("token_embd.weight", "output.weight"):
            new = (data[[rows_of[i % len(rows_of)] for i in range(extra)]] if rows_of
                   else np.zeros((extra, data.shape[1]), dtype=data.dtype))
            data = np.concatenate([data, new])
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)  # quantized rows travel as their bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def kept(name: str, make) -> Path:
    """A test model made once per machine and kept: $LOCALSPEC_HOME/test-models/NAME, written by make(path) the
    first time (to a temporary name, then moved), with a fixed mtime. Its exact-mode verdicts and costs, keyed by
    path, size and mtime, are then measured once per machine too, not in every run."""
    import os

    from localspec.store import registry

    path = registry.home() / "test-models" / name
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        make(tmp)
        os.utime(tmp, (1_700_000_000, 1_700_000_000))
        os.replace(tmp, path)
    return path


def shadowed(smol: Path) -> Path:
    """SmolLM2 64 tokens wider, its new ids repeating the rows of common words: a target that puts real
    probability where its draft (SmolLM2 itself) has no token, so p differs from q on every host."""
    from localspec.core.model import Model, ModelConfig

    def make(dst: Path) -> None:
        vocab = Model(smol, ModelConfig(n_ctx=64), vocab_only=True)
        common = vocab.tokenize(" the a and was he she it of to in. , lighthouse keeper sea light night",
                                add_special=False, parse_special=False)
        vocab.close()
        pad_vocab(smol, dst, 64, rows_of=common)

    return kept(f"{smol.stem}-shadow64.gguf", make)
