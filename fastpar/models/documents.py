"""Packed documents: which document each token of a batch belongs to, for the attention and the
positions of the forward that is running (a context, ``with documents(Documents.of(doc_ids)):``,
not a block input; re-exported from ``fastpar.ops.documents``). The ids, the positions and how a
pipeline enters the context: docs/packing.md."""

from fastpar.ops.documents import Documents, current, document_starts, documents, valid_targets

__all__ = ["Documents", "current", "document_starts", "documents", "valid_targets"]
