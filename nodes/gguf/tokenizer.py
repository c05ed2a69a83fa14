"""The sentencepiece model of a T5/UMT5 GGUF, rebuilt from its `tokenizer.ggml.*` metadata.

UMT5 (Wan's text encoder) files carry their tokenizer only as GGUF metadata (pieces, scores, types,
normalisation settings, special ids), while ComfyUI's UMT5 tokenizer wants the serialized sentencepiece
`ModelProto` in the state dict (`spiece_model`). The proto is written here with the protobuf wire
format directly (a handful of fields), so no protobuf package is needed. GGUF token types use
sentencepiece's numbering (1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte).
"""
from __future__ import annotations

import struct

import numpy as np

# sentencepiece_model.proto field numbers
_MODEL_PIECES, _MODEL_TRAINER, _MODEL_NORMALIZER = 1, 2, 3
_PIECE_TEXT, _PIECE_SCORE, _PIECE_TYPE = 1, 2, 3
_TRAINER_MODEL_TYPE, _TRAINER_VOCAB_SIZE, _TRAINER_BYTE_FALLBACK = 3, 4, 35
_TRAINER_UNK, _TRAINER_BOS, _TRAINER_EOS, _TRAINER_PAD = 40, 41, 42, 43
_NORM_NAME, _NORM_CHARSMAP, _NORM_DUMMY_PREFIX, _NORM_REMOVE_WS = 1, 2, 3, 4
_UNIGRAM = 1


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1                       # negative ids (-1: none) as two's complement, like protobuf
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(int(value))


def _bytes(field: int, value: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(value)) + value


def _float(field: int, value: float) -> bytes:
    return _varint(field << 3 | 5) + struct.pack("<f", float(value))


def _field(reader, key):
    return reader.get_field(key)


def _scalar(reader, key, default=None):
    f = _field(reader, key)
    if f is None:
        return default
    return f.parts[f.data[-1]][0].item()


def _strings(reader, key) -> list[str] | None:
    f = _field(reader, key)
    if f is None:
        return None
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def _numbers(reader, key) -> list | None:
    f = _field(reader, key)
    if f is None:
        return None
    return [f.parts[i][0].item() for i in f.data]


def spiece_model_from_gguf(reader) -> bytes | None:
    """The serialized sentencepiece ModelProto of a GGUF whose tokenizer.ggml.model is "t5", or None."""
    model = _field(reader, "tokenizer.ggml.model")
    if model is None or bytes(model.parts[model.data[-1]]).decode("utf-8") != "t5":
        return None
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    if not tokens:
        return None
    scores = _numbers(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = _numbers(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    out = bytearray()
    for text, score, kind in zip(tokens, scores, types):
        piece = _bytes(_PIECE_TEXT, text.encode("utf-8")) + _float(_PIECE_SCORE, score)
        if int(kind) != 1:                                   # NORMAL is the default
            piece += _int(_PIECE_TYPE, int(kind))
        out += _bytes(_MODEL_PIECES, piece)
    trainer = _int(_TRAINER_MODEL_TYPE, _UNIGRAM) + _int(_TRAINER_VOCAB_SIZE, len(tokens))
    if any(int(k) == 6 for k in types):
        trainer += _int(_TRAINER_BYTE_FALLBACK, 1)
    for field, key in ((_TRAINER_UNK, "unknown"), (_TRAINER_BOS, "bos"), (_TRAINER_EOS, "eos"),
                       (_TRAINER_PAD, "padding")):
        trainer += _int(field, _scalar(reader, f"tokenizer.ggml.{key}_token_id", -1))
    out += _bytes(_MODEL_TRAINER, trainer)
    normalizer = _bytes(_NORM_NAME, b"nmt_nfkc")        # T5's; the precompiled map below is what applies
    charsmap = _field(reader, "tokenizer.ggml.precompiled_charsmap")
    if charsmap is not None and len(charsmap.data):
        normalizer += _bytes(_NORM_CHARSMAP, np.concatenate([charsmap.parts[i] for i in charsmap.data])
                             .astype(np.uint8).tobytes())
    normalizer += _int(_NORM_DUMMY_PREFIX, bool(_scalar(reader, "tokenizer.ggml.add_space_prefix", True)))
    normalizer += _int(_NORM_REMOVE_WS, bool(_scalar(reader, "tokenizer.ggml.remove_extra_whitespaces", True)))
    out += _bytes(_MODEL_NORMALIZER, normalizer)
    return bytes(out)
