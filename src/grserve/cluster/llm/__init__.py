"""The LLM wing of the cluster (``serve llm --instances N``, xLLM §3): engine instances, PD disaggregation."""
