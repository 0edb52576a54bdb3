"""Packed documents: which document each token of a batch belongs to, for the attention and the
positions of the forward that is running.

    docs = Documents.of(doc_ids)                 # doc_ids [B, S]: a row's document index
    with documents(docs):                        # every block's forward inside reads it
        out = model(x)

A batch of packed rows carries ``doc_ids`` [B, S] (int64): in each row, the index of the
document each position belongs to, non-decreasing along the row (a document is one contiguous
run of equal ids; ids need not start at 0). Attention then stops at document boundaries
(a query sees the keys of its own document at or before it: ``fastpar.ops.documents.document_attention``), and
with ``reset_positions`` the positions restart at 0 at each document start (RoPE and learned
positions, as Megatron's ``reset_position_ids``).

The context lives in ``fastpar.ops.documents`` (below the MoE layers, which read its
``valid`` mask); this module re-exports it for the models. The documents of the running
micro-batch are a context (``documents(docs)``), not a block
input: every pipeline stage reads the micro-batch's documents from the data (every rank draws
the same global batch), so nothing extra travels between stages and blocks keep their
one-tensor signature; ``PipelineEngine`` enters the context around each forward and
recomputation (``context=``). The ids are those of whole rows (all ``S`` positions, also under
context parallelism, where each rank picks its chunks' from them).
"""

from fastpar.ops.documents import Documents, current, document_starts, documents, valid_targets

__all__ = ["Documents", "current", "document_starts", "documents", "valid_targets"]
