"""Token data for ``fastpar.train``: token streams and their mini-batches
(``fastpar.data.tokens``), packed documents and theirs (``fastpar.data.documents``)."""

from __future__ import annotations

from fastpar.data.documents import (
    EOS_TOKENS,
    IGNORE_INDEX,
    Corpus,
    document_batch,
    eos_starts,
    index_file,
    load_documents,
    tokenizer_eos_id,
)
from fastpar.data.tokens import (
    BIN_DTYPES,
    HF_HINT,
    UINT16_MAX,
    Tokens,
    bin_dtype,
    check_bin_width,
    check_token_ids,
    embedded_corpus,
    encode_text,
    global_batch,
    load_tokenizer,
    load_tokens,
    require_tokenizers,
    text_chunks,
    tokenizer_vocab_size,
)

__all__ = [
    "BIN_DTYPES",
    "EOS_TOKENS",
    "HF_HINT",
    "IGNORE_INDEX",
    "UINT16_MAX",
    "Corpus",
    "Tokens",
    "bin_dtype",
    "check_bin_width",
    "check_token_ids",
    "document_batch",
    "embedded_corpus",
    "encode_text",
    "eos_starts",
    "global_batch",
    "index_file",
    "load_documents",
    "load_tokenizer",
    "load_tokens",
    "require_tokenizers",
    "text_chunks",
    "tokenizer_eos_id",
    "tokenizer_vocab_size",
]
