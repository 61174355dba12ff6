"""The service layer (xLLM §3, BAT §5): several engine instances behind one front end that is itself an Engine.

``core/`` is what both wings share: the router, the global KV index, the heartbeat, recovery, restart, the front
end's life cycle, Ray. ``llm/`` is the LLM wing (``serve llm --instances N``: engine instances, the exactly-once
token stream, admission, PD disaggregation); ``gr/`` the GR wing (``serve [retrieval|ranking] --instances N``:
retrieval and ranking instances, state broadcasts, BAT's HRCS item-KV placement and KV-cache workers). Every message
between a front end and its instances is a dataclass of ``wire.py``.
"""
