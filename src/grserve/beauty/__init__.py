"""The Amazon Beauty recipe: a dataset with ready SIDs → a trained GR decoder → ``grserve bench quality
--dataset beauty`` against the published table (docs/offline-eval.md).

    data       the bundled data (tiger-cf folder layout, checksummed) and its leave-one-out split
    artifacts  the cached catalog + model under .grserve-cache/beauty, rebuilt only when stale; ``BEAUTY_RECIPE``
"""
