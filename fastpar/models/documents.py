"""Packed documents: which document each token of a batch belongs to, for the attention and the
positions of the forward that is running (a context, not a block input; re-exported from
``fastpar.ops.documents``).

    docs = Documents.of(doc_ids)                 # doc_ids [B, S]: a row's document index
    with documents(docs):                        # every block's forward inside reads it
        out = model(x)

docs/packing.md describes the ids, the positions and how a pipeline enters the context."""

from fastpar.ops.documents import Documents, current, document_starts, documents, valid_targets

__all__ = ["Documents", "current", "document_starts", "documents", "valid_targets"]
