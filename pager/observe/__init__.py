"""Layer 3, observation: counters (`stats`), a model's snapshot, report and
reset (`views`), system lines and the link's peak (`report`) and the
Perfetto trace (`trace`)."""
