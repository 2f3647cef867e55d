"""Build the bundled training assets: a small English corpus and a byte-level BPE tokenizer.

    python scripts/make_assets.py

The corpus is gathered locally, from the docstrings of Python's standard library, so nothing is
downloaded. It is written as JSON lines with a "text" field (what torchtitan's `c4_test` loader
reads from `--training.dataset_path`), and the tokenizer (vocab 2048, the Llama4 debug flavors'
vocab size) as tokenizer.json + tokenizer_config.json (what `--model.hf_assets_path` reads).
"""

import importlib
import inspect
import json
import pkgutil
import re
import warnings
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parent.parent / "torchtitan_fp8_moe" / "assets"
VOCAB_SIZE = 2048
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CORPUS_CHARS = 1_500_000
# Documented, stable, import-safe stdlib packages; sorted walk, so the corpus is reproducible
# for a given Python version.
ROOTS = [
    "argparse",
    "asyncio",
    "collections",
    "concurrent",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "fractions",
    "functools",
    "http",
    "importlib",
    "inspect",
    "json",
    "logging",
    "multiprocessing",
    "pathlib",
    "pickle",
    "statistics",
    "string",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib",
    "xml",
    "zipfile",
]


def _modules():
    for root in ROOTS:
        package = importlib.import_module(root)
        yield package
        for info in sorted(
            pkgutil.walk_packages(getattr(package, "__path__", []), root + "."),
            key=lambda i: i.name,
        ):
            if "test" in info.name or "__main__" in info.name:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    yield importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - a module that does not import adds no text
                continue


def _docstrings():
    seen = set()
    for module in _modules():
        objects = [module] + [
            obj
            for _, obj in sorted(vars(module).items())
            if inspect.isclass(obj) or inspect.isfunction(obj)
        ]
        for obj in objects:
            doc = inspect.getdoc(obj)
            if doc and doc not in seen and len(doc) > 80:
                seen.add(doc)
                yield re.sub(r"\n{3,}", "\n\n", doc)


def main() -> None:
    texts, total = [], 0
    for doc in _docstrings():
        texts.append(doc)
        total += len(doc)
        if total >= CORPUS_CHARS:
            break
    corpus_dir = ASSETS / "corpus"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    with open(corpus_dir / "train.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer_dir = ASSETS / "tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}, indent=1) + "\n"
    )
    print(
        f"corpus: {len(texts)} documents, {total} characters; "
        f"tokenizer: vocab {tokenizer.get_vocab_size()}; written to {ASSETS}"
    )


if __name__ == "__main__":
    main()
