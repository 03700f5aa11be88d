"""Tokenizers for training data and prompts: raw bytes (the default) or a Hugging Face
``tokenizer.json``.

A tokenizer turns a document into ``prefix + body + suffix + [eos]``: ``body`` is the text's
tokens, ``prefix``/``suffix`` are the special tokens its own post-processor adds around a text
(Llama's ``<s>``/``<|begin_of_text|>``, nothing for GPT-2) and ``eos`` is the end-of-text token
that separates packed documents. Bodies are encoded in batches of pieces (`encode_pieces`), so
a long file can be encoded in parts and many documents at once.

Example::

    tok = load_tokenizer("hf_model_dir")     # tokenizer.json (+ tokenizer_config.json)
    ids = tok.encode_document("hello world")  # [..., tok.eos_id]
    tok.decode(ids[:-1])                      # 'hello world'
    load_tokenizer("bytes").vocab_size        # 256
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shardax.data.chat_source import template_files
from shardax.filecheck import decode_utf8, read_json, read_regular
from shardax.filewrite import copy_file, make_dir, replacing, write_text

__all__ = ["BYTES", "TOKENIZER_DIR", "ByteTokenizer", "HFTokenizer", "Tokenizer",
           "load_tokenizer", "read_tokenizer_config", "run_tokenizer", "special_token"]

#: ``--tokenizer`` value of the byte-level tokenizer.
BYTES = "bytes"
#: Where a training run keeps a copy of its Hugging Face tokenizer (`Tokenizer.save`).
TOKENIZER_DIR = "tokenizer"
# Looked up, in this order, when tokenizer_config.json names no eos_token.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
MAX_TOKENIZER_BYTES = 256 * 2**20  # tokenizer.json files of released models: 2-35 MB
_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class Tokenizer:
    """What the data pipeline and ``generate`` need of a tokenizer.

    Subclasses set ``vocab_size`` (ids are in ``[0, vocab_size)``), ``eos_id``, ``prefix`` and
    ``suffix`` (special ids around a document), ``fingerprint`` (changes whenever the ids
    would) and implement `encode_pieces` and `decode`.
    """

    vocab_size: int
    eos_id: int
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    fingerprint: str

    def encode_pieces(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """Token ids of each text, without special tokens."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens of a Hugging Face tokenizer left out unless
        ``skip_special_tokens`` is False); invalid UTF-8 becomes U+FFFD."""
        raise NotImplementedError

    def encode(self, text: str | bytes) -> list[int]:
        """A prompt: ``prefix + body`` (what a model trained on documents saw before it)."""
        return [*self.prefix, *self.encode_pieces([text])[0].tolist()]

    def encode_document(self, text: str | bytes) -> list[int]:
        """A whole training document: ``prefix + body + suffix + [eos]``."""
        return [*self.encode(text), *self.end()]

    def end(self) -> tuple[int, ...]:
        """What follows a document's body: ``suffix``, then ``eos`` unless it already ends so."""
        return self.suffix if self.suffix[-1:] == (self.eos_id,) else (*self.suffix, self.eos_id)

    def save(self, directory: str | Path) -> None:
        """Writes what `load_tokenizer` needs to get this tokenizer back from ``directory``."""

    def special_tokens(self) -> dict[str, tuple[str, int]]:
        """``{"bos_token" | "eos_token" | "pad_token" | "unk_token": (text, id)}``: the special
        tokens this tokenizer has (``eos_token`` always)."""
        raise NotImplementedError

    def export(self, directory: str | Path, model_max_length: int) -> dict[str, int]:
        """Writes the Hugging Face tokenizer files of an exported model into ``directory``
        (``tokenizer.json``, ``tokenizer_config.json`` with the special tokens and any
        ``chat_template``, ``special_tokens_map.json``, and the chat template files as they
        were found: ``chat_template.jinja``, ``additional_chat_templates/``) so that
        ``AutoTokenizer`` loads it (an earlier export's template files that this tokenizer
        lacks are removed: transformers would prefer them to this one's template);
        returns the special ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id`` where
        there is one) for ``config.json`` and ``generation_config.json``."""
        directory = make_dir(directory)
        source = getattr(self, "directory", None)
        ours = template_files(source) if source is not None else []
        for name in template_files(directory):
            if name not in ours and not (directory / name).parent.is_symlink():
                (directory / name).unlink()
        config = self._write_tokenizer_json(directory / "tokenizer.json")
        special = self.special_tokens()
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "clean_up_tokenization_spaces": False, **config,
                  **{k: text for k, (text, _) in special.items()},
                  "model_max_length": model_max_length}
        write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
        write_text(directory / "special_tokens_map.json", json.dumps(
            {k: text for k, (text, _) in special.items()}, indent=2) + "\n")
        return {f"{k}_id": i for k, (_, i) in special.items() if k != "unk_token"}

    def _write_tokenizer_json(self, path: Path) -> dict:
        """Writes ``tokenizer.json``; returns the ``tokenizer_config.json`` entries to keep."""
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens (vocabulary 256); NUL (id 0, never in text) ends a document.

    Example::

        ByteTokenizer().encode_document("hi")   # [104, 105, 0]
    """

    vocab_size, eos_id, fingerprint = 256, 0, "bytes"

    def encode_pieces(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), np.uint8)
                for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def special_tokens(self) -> dict[str, tuple[str, int]]:
        return {"eos_token": (_byte_char(0), 0)}

    def _write_tokenizer_json(self, path: Path) -> dict:
        # The same ids as Hugging Face's byte-level tokenizer with no merges: each byte is the
        # token of GPT-2's byte-to-character table, so id = byte value.
        from tokenizers import Tokenizer as _Tokenizer  # optional: tokenizers (extra "hf")
        from tokenizers import decoders, models, pre_tokenizers

        vocab = {_byte_char(b): b for b in range(256)}
        tok = _Tokenizer(models.BPE(vocab, [], byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([_byte_char(0)])  # NUL ends a document: decoded as nothing
        with replacing(path) as tmp:
            tok.save(str(tmp))
        return {}


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer read from ``tokenizer.json``.

    The end-of-text token is ``eos_token`` of ``tokenizer_config.json`` beside it, else the first
    of ``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ``<eos>``, ``<|eos|>``, ``[SEP]`` in the
    vocabulary. ``vocab_size`` counts added tokens (the largest id + 1). Bytes are decoded as
    UTF-8 (invalid bytes become U+FFFD) before encoding.

    Example::

        tok = HFTokenizer("llama/tokenizer.json")
        tok.prefix, tok.eos_id                   # ((1,), 2) for a Llama 2 tokenizer
    """

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise ValueError("--tokenizer needs the 'tokenizers' package: "
                             "pip install 'shardax[hf]'") from None
        self.path = Path(path)
        self.directory = self.path.parent
        try:  # a regular file only: a FIFO or device is refused, not waited on
            raw = read_regular(self.path, limit=MAX_TOKENIZER_BYTES)
            text = decode_utf8(raw, str(self.path))
            self.config = read_tokenizer_config(self.directory)
        except ValueError as e:
            raise ValueError(f"--tokenizer {e}") from None
        try:
            self._tok = _Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises its own Exception types for bad JSON
            raise ValueError(f"--tokenizer {self.path}: not a Hugging Face tokenizer.json "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") \
                from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.eos_id = self._find_eos(vocab)
        self.prefix, self.suffix = self._specials()
        self.fingerprint = "hf:" + hashlib.sha256(raw).hexdigest()[:16]

    def _find_eos(self, vocab: dict[str, int]) -> int:
        config = self.directory / "tokenizer_config.json"
        try:
            eos = special_token(self.config, "eos_token", config)
        except ValueError as e:
            raise ValueError(f"--tokenizer {e}") from None
        if eos is not None:
            if eos not in vocab:
                raise ValueError(f"--tokenizer: eos_token {eos!r} of {config} is not "
                                 f"in the vocabulary of {self.path}")
            return vocab[eos]
        for name in _EOS_NAMES:
            if name in vocab:
                return vocab[name]
        raise ValueError(
            f"--tokenizer {self.path}: no end-of-text token (no eos_token in "
            f"tokenizer_config.json, none of {list(_EOS_NAMES)} in the vocabulary); add one "
            "to the tokenizer or name it as eos_token in tokenizer_config.json")

    def _specials(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The ids the post-processor puts before and after a text's own tokens."""
        probe = "a"
        bare = self._tok.encode(probe, add_special_tokens=False).ids
        full = self._tok.encode(probe, add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start:start + len(bare)] == bare:
                return tuple(full[:start]), tuple(full[start + len(bare):])
        return (), ()

    def encode_pieces(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t
                 for t in texts]
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        return [np.asarray(e.ids, dtype) for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        if not directory.is_symlink() and directory.resolve() == self.directory.resolve():
            return  # read from there: nothing to do
        make_dir(directory)
        for name in _FILES:
            source = self.directory / name if name != "tokenizer.json" else self.path
            if source.is_file():
                copy_file(source, directory / name)
        for name in template_files(self.directory):
            _copy_into(self.directory / name, directory, name)

    def special_tokens(self) -> dict[str, tuple[str, int]]:
        vocab = self._tok.get_vocab(with_added_tokens=True)
        out = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = special_token(self.config, key, self.directory / "tokenizer_config.json")
            if isinstance(text, str) and text in vocab:
                out[key] = (text, vocab[text])
        out["eos_token"] = (self._tok.id_to_token(self.eos_id), self.eos_id)
        if "bos_token" not in out and self.prefix:  # the token the post-processor puts first
            out["bos_token"] = (self._tok.id_to_token(self.prefix[0]), self.prefix[0])
        return out

    def _write_tokenizer_json(self, path: Path) -> dict:
        if path.is_symlink() or path.resolve() != self.path.resolve():
            copy_file(self.path, path)
            for name in template_files(self.directory):  # chat templates, as they were found
                _copy_into(self.directory / name, path.parent, name)
        # Kept as they are: the chat template, added tokens' flags, the tokenizer's class.
        return {k: v for k, v in self.config.items()
                if k not in ("bos_token", "eos_token", "pad_token", "unk_token",
                             "model_max_length")}


def _byte_char(b: int) -> str:
    """GPT-2's printable character for byte ``b`` (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


def _copy_into(source: Path, root: Path, name: str) -> None:
    """Copies ``source`` to ``root / name`` (``name`` may be in a folder of ``root``), replacing
    a symlink there (file or folder) instead of writing through it to outside ``root``."""
    target = root / name
    make_dir(target.parent)
    copy_file(source, target)


def read_tokenizer_config(directory: str | Path) -> dict:
    """The ``tokenizer_config.json`` of a tokenizer directory as a dict ({} without one): a
    bounded read; a ValueError names the file when it is not a JSON object.

    Example::

        read_tokenizer_config("models/llama").get("eos_token")     # '<|eot_id|>'
    """
    path = Path(directory) / "tokenizer_config.json"
    if not os.path.lexists(path):
        return {}
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a JSON {type(config).__name__}, expected an object such as "
                         '{"eos_token": "</s>", ...}')
    return config


def special_token(config: dict, key: str, path: str | Path) -> str | None:
    """The text of special token ``key`` of a ``tokenizer_config.json`` (``config``, read from
    ``path``): a string or ``{"content": string}``; None when absent or null. Any other value
    is a ValueError naming the file and the key.

    >>> special_token({"eos_token": {"content": "</s>"}}, "eos_token", "tokenizer_config.json")
    '</s>'
    """
    token = config.get(key)
    text = token.get("content") if isinstance(token, dict) else token
    if text is None and not isinstance(token, dict) or isinstance(text, str):
        return text
    kind = ("an object without a string 'content'" if isinstance(token, dict) else
             f"a JSON {type(token).__name__}")
    raise ValueError(f"{path}: {key} is {kind}, expected a string or " '{"content": string}')


def has_tokenizer(directory: str | Path) -> bool:
    """Whether ``directory`` holds a ``tokenizer.json`` of any kind: one that is not a regular
    file (a FIFO, a dangling link) counts, so that reading it refuses it with one line instead
    of the run silently falling back to bytes."""
    return os.path.lexists(Path(directory) / "tokenizer.json")


def load_tokenizer(spec: str | Path = BYTES) -> Tokenizer:
    """The tokenizer ``--tokenizer`` names: ``bytes`` (default), a Hugging Face model directory
    holding ``tokenizer.json`` (``hf:DIR`` works too), or the ``tokenizer.json`` file itself.

    Raises ValueError (one line, naming the path) when it cannot be read.

    Example::

        load_tokenizer("bytes").eos_id           # 0
        load_tokenizer("hf:models/llama").vocab_size
    """
    spec = str(spec)
    if spec in (BYTES, ""):
        return ByteTokenizer()
    path = Path(spec.removeprefix("hf:"))
    if path.is_dir():
        if not has_tokenizer(path):
            raise ValueError(f"--tokenizer {spec}: no tokenizer.json in this directory "
                             "(give a Hugging Face model directory or a tokenizer.json file)")
        path = path / "tokenizer.json"
    elif not os.path.lexists(path):
        raise ValueError(f"--tokenizer {spec}: no such file or directory (give 'bytes', a "
                         "Hugging Face model directory or a tokenizer.json file)")
    return HFTokenizer(path)


def run_tokenizer(out: str | Path, spec: str) -> Tokenizer:
    """The tokenizer of the training run in directory ``out``: the copy it saved in
    ``out/tokenizer`` when there is one (so a run moved or copied elsewhere still decodes),
    else ``spec`` (its ``--tokenizer``).

    Example::

        tok = run_tokenizer("runs/a", config.tokenizer)
    """
    copy = Path(out) / TOKENIZER_DIR
    return load_tokenizer(copy if has_tokenizer(copy) else spec)
