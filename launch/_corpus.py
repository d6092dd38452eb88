"""Text, tokenizer and packed token sequences for launch/train.py.

Default (no download): CPython's own documentation text (``pydoc_data.topics``: the language reference and
library topics that ``help()`` shows, about 466 KB of English) and a byte-level tokenizer (UTF-8 bytes plus
three special ids). ``--dataset`` reads a Hugging Face dataset by name, a ``save_to_disk`` folder, or local
.txt/.json/.jsonl/.parquet/.csv files; ``--tokenizer`` takes any Hugging Face tokenizer instead of bytes.

``random_tokens`` instead draws uniform random ids (seeded) over a whole vocabulary: the e2e benchmark anchors
(shared/BENCHMARKS.md) trained on such batches.

Documents are tokenized, joined with an end-of-text id and cut into sequences of exactly ``seq_len`` tokens
(packing: no padding, so every token trains). The held-out split is the last ``eval_fraction`` of the
documents, so no eval sequence shares text with a training one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; 256 = pad, 257 = beginning, 258 = end of text. Needs no file."""

    pad_token_id, bos_token_id, eos_token_id = 256, 257, 258
    vocab_size = 259
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer behind the same four attributes as ByteTokenizer."""

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        self.name = name_or_path
        self.vocab_size = len(self.tokenizer)
        self.eos_token_id = self.tokenizer.eos_token_id
        if self.eos_token_id is None:
            raise ValueError(f"tokenizer {name_or_path!r} has no eos token; packing needs one to separate documents")
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = self.eos_token_id if pad is None else pad
        self.bos_token_id = self.tokenizer.bos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)


def build_tokenizer(name: str | None):
    return ByteTokenizer() if name in (None, "bytes") else HFTokenizer(name)


def pydoc_documents() -> list[str]:
    """CPython's documentation topics, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


_LOCAL_FORMATS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def dataset_documents(name_or_path: str, column: str = "text", split: str = "train",
                      max_documents: int | None = None) -> list[str]:
    """The ``column`` strings of a Hugging Face dataset (hub name, ``save_to_disk`` folder or local files)."""
    import datasets

    name_or_path = os.path.expanduser(name_or_path)
    if os.path.isdir(name_or_path) and os.path.exists(os.path.join(name_or_path, "dataset_info.json")):
        loaded = datasets.load_from_disk(name_or_path)
        data = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    elif os.path.isfile(name_or_path):
        ext = os.path.splitext(name_or_path)[1].lower()
        if ext not in _LOCAL_FORMATS:
            raise ValueError(f"--dataset {name_or_path!r}: unknown file type {ext!r} "
                             f"(expected one of {sorted(_LOCAL_FORMATS)}, a save_to_disk folder or a hub name)")
        data = datasets.load_dataset(_LOCAL_FORMATS[ext], data_files=name_or_path, split=split)
    elif (os.path.isabs(name_or_path) or name_or_path.startswith((".", "~"))) and not os.path.exists(name_or_path):
        raise FileNotFoundError(f"--dataset {name_or_path!r}: no such file or folder (a local file, a save_to_disk "
                                "folder, a folder of data files, or a Hugging Face hub name)")
    else:
        try:
            data = datasets.load_dataset(name_or_path, split=split)
        except Exception as err:  # datasets' own errors do not say which option they came from
            raise RuntimeError(f"--dataset {name_or_path!r}: the datasets library could not load it "
                               f"({type(err).__name__}: {err})") from err
    if column not in data.column_names:
        raise ValueError(f"--dataset {name_or_path!r} has no text column {column!r} (columns: {data.column_names}); "
                         "choose one with --text-column")
    if max_documents is not None:
        data = data.select(range(min(max_documents, len(data))))
    return [t for t in data[column] if t]


@dataclass
class PackedCorpus:
    train: list[dict]        # {"input_ids": [seq_len ints]}
    eval: list[dict]
    tokens: int              # tokens in both splits
    source: str


def pack(documents: list[str], tokenizer, seq_len: int, eval_fraction: float, source: str) -> PackedCorpus:
    """Tokenize, join with eos and cut into seq_len sequences; the last eval_fraction of documents is held out."""
    if seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {seq_len}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {eval_fraction}")
    if len(documents) < 2:
        raise ValueError(f"{source}: need at least 2 documents (one to train on, one held out), got {len(documents)}")
    num_eval = max(1, round(len(documents) * eval_fraction))

    def sequences(docs: list[str]) -> list[dict]:
        stream: list[int] = []
        for doc in docs:
            stream.extend(tokenizer.encode(doc))
            stream.append(tokenizer.eos_token_id)
        return [{"input_ids": stream[i:i + seq_len]} for i in range(0, len(stream) - seq_len + 1, seq_len)]

    train, held_out = sequences(documents[:-num_eval]), sequences(documents[-num_eval:])
    if not train or not held_out:
        raise ValueError(f"{source}: too little text for --seq-len {seq_len} "
                         f"({len(train)} train and {len(held_out)} eval sequences)")
    return PackedCorpus(train, held_out, (len(train) + len(held_out)) * seq_len, source)


def with_tensor_rows(corpus: PackedCorpus) -> PackedCorpus:
    """The same corpus with each row's ids as one int64 tensor: converted once here, where a list of ints would be
    converted by the collator at every batch (on the H200 host that was 1.9 ms of a 72 ms e2e mixtral step, for 4 x
    2048 ids, spent while the GPU waited for the next forward)."""
    import torch

    def rows(split: list[dict]) -> list[dict]:
        return [{**row, "input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long)} for row in split]

    return PackedCorpus(rows(corpus.train), rows(corpus.eval), corpus.tokens, corpus.source)


def random_tokens(vocab_size: int, seq_len: int, num_train: int, num_eval: int, seed: int) -> PackedCorpus:
    """``num_train`` + ``num_eval`` sequences of ``seq_len`` ids drawn uniformly from [0, vocab_size) by a
    generator seeded with ``seed`` (the same data in every process and variant)."""
    import torch

    if vocab_size < 2 or seq_len < 2 or num_train < 1 or num_eval < 1:
        raise ValueError(f"random_tokens: need vocab_size >= 2, seq_len >= 2, num_train >= 1 and num_eval >= 1, "
                         f"got {vocab_size}, {seq_len}, {num_train}, {num_eval}")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_train + num_eval, seq_len), generator=generator).tolist()
    rows = [{"input_ids": row} for row in ids]
    return PackedCorpus(rows[:num_train], rows[num_train:], (num_train + num_eval) * seq_len,
                        f"random tokens (uniform over {vocab_size} ids, seed {seed})")
