"""Tokenizers loaded once per process and content.

transformers 5 reads a fast tokenizer's ``tokenizer.json`` back into Python and rebuilds the Rust
model from it: about 0.8 s for the 151k-token Qwen2 vocabulary, paid by every pipeline load, text
processor and model build that names the same tokenizer. Here the first load of a folder's content
is kept (keyed by a hash of its files: the slots of a checkpoint and the checkpoints built from one
vocabulary share an entry, and a rewritten folder loads afresh) and each caller gets a shallow copy:
Python attributes such as ``model_max_length`` are the copy's own, the Rust backend is shared, which is
why ``TextProcessor`` serializes encoding with one lock per process rather than one per processor.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

__all__ = ["load_tokenizer", "pipeline_tokenizers"]

# A Qwen2 tokenizer holds about 150 MB; a serving process needs one or two.
_MAX_KEPT = 8
_LOADED: OrderedDict[str, Any] = OrderedDict()
_LOADED_LOCK = threading.Lock()


def _content_key(folder: Path) -> str:
    """A hash of the folder's files, names and bytes (a few ms for a 5 MB tokenizer.json)."""
    digest = hashlib.sha256()
    for entry in sorted(folder.iterdir()):
        if entry.is_file():
            digest.update(entry.name.encode() + b"\0" + entry.read_bytes() + b"\0")
    return digest.hexdigest()


def load_tokenizer(folder: str | Path) -> Any:
    """``AutoTokenizer.from_pretrained(folder, local_files_only=True)``, loaded once per process and content.

    Returns a shallow copy of the kept tokenizer: set its attributes freely; its backend is shared."""
    folder = Path(folder)
    key = _content_key(folder)
    with _LOADED_LOCK:
        tokenizer = _LOADED.get(key)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            _LOADED[key] = tokenizer
            while len(_LOADED) > _MAX_KEPT:
                _LOADED.popitem(last=False)
        _LOADED.move_to_end(key)
        return copy.copy(tokenizer)


def pipeline_tokenizers(local_dir: str | Path) -> dict[str, Any]:
    """Component name -> tokenizer for every transformers tokenizer a pipeline directory's
    ``model_index.json`` lists (to pass to the pipeline's ``from_pretrained``)."""
    index = json.loads((Path(local_dir) / "model_index.json").read_text())
    return {
        name: load_tokenizer(Path(local_dir) / name)
        for name, spec in index.items()
        if isinstance(spec, list) and len(spec) == 2 and spec[0] == "transformers"
        and isinstance(spec[1], str) and "Tokenizer" in spec[1]
    }
