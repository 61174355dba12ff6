"""Training a decoder-only GR model from item sequences and a SID catalog (offline; nothing serving imports it).

    forward    the training forward: ``Decoder.forward`` over padded rows, with dropout
    losses     next-token cross-entropy over the vocabulary, the SID level, or the catalog's allowed codes
    train      ``train_gr``: windows, batches, AdamW + cosine schedule, best epoch by validation NLL, time budget
    tokenizer  the model directory's HF tokenizer: one added token per SID code (``<a_N>``, ``<b_N>``, ...)
    files      ``file_sha256``: the digest a trained model records of its catalog, and datasets of their files

Used by the MovieLens recipe (``grserve.movielens``: SIDs built from item text) and the Amazon Beauty recipe
(``grserve.beauty``: ready SIDs).
"""
